"""The public face: what `import keras_nanguard` offers, and nothing loose."""

import importlib.metadata

import pytest

import keras_nanguard as ng

pytestmark = pytest.mark.backend_free  # imports and names only


def test_ops_is_a_real_module():
    from keras_nanguard.ops import global_norm, safe_log, stable_log_softmax

    assert ng.ops.safe_log is safe_log
    assert callable(global_norm) and callable(stable_log_softmax)
    assert sorted(ng.ops.__all__) == [
        "all_finite",
        "global_norm",
        "policy_log_prob",
        "safe_div",
        "safe_log",
        "safe_norm",
        "safe_sqrt",
        "stable_log_softmax",
    ]


def test_names_users_meet_are_exported():
    assert ng.Incident.__name__ == "Incident"
    assert "log_of_zero" in ng.CAUSES
    for name in ng.__all__:
        assert hasattr(ng, name), name


def test_one_version_source():
    assert ng.__version__ == importlib.metadata.version("keras-nanguard")
