"""Each argument of a public class is declared once, in its signature: the
attributes, `get_config`, the checks and the documented defaults agree."""

import ast
import inspect
import re

import keras
import numpy as np
import pytest

import keras_nanguard as ng
from keras_nanguard.nan_guard.callback import ARGUMENTS as GUARD_ARGUMENTS
from keras_nanguard.safe_optimizer.optimizer import ARGUMENTS as OPTIMIZER_ARGUMENTS

CLASSES = [
    (ng.SafeOptimizer, OPTIMIZER_ARGUMENTS, {"optimizer", "name"}),
    (ng.NaNGuard, GUARD_ARGUMENTS, set()),
]


def _documented_defaults(cls):
    """`name: Defaults to X.` from the docstring's Args, X as a Python value."""
    args = cls.__doc__.split("Args:")[1].split("Example")[0]
    entries = re.split(r"\n {8}(?=\w+:)", args)
    found = {}
    for entry in entries:
        name = entry.strip().split(":")[0]
        said = re.search(r"Defaults\s+to\s+`?(.+?)`?\.(\s|$)", entry, re.S)
        if said:
            found[name] = said.group(1)
    return found


@pytest.mark.parametrize(
    "cls, spec, others", CLASSES, ids=["SafeOptimizer", "NaNGuard"]
)
def test_every_keyword_but_the_wrapped_ones_is_declared_with_a_check(cls, spec, others):
    keywords = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    assert set(spec.names) == keywords - others


@pytest.mark.parametrize(
    "cls, spec, others", CLASSES, ids=["SafeOptimizer", "NaNGuard"]
)
def test_the_docstring_states_the_signature_defaults(cls, spec, others):
    documented = _documented_defaults(cls)
    for name, default in spec.defaults.items():
        said = documented[name]
        if said == "an automatic name":
            continue
        value = ast.literal_eval(said)
        assert value == default and type(value) is type(default), name


@pytest.mark.backend_free
def test_safe_optimizer_attributes_and_config_are_the_checked_arguments():
    opt = ng.SafeOptimizer(
        keras.optimizers.SGD(0.1), min_lr_scale=1, spike_factor=np.float32(5)
    )
    assert type(opt.min_lr_scale) is float and opt.min_lr_scale == 1.0
    assert type(opt.spike_factor) is float and opt.spike_factor == 5.0
    config = opt.get_config()
    for name in OPTIMIZER_ARGUMENTS.names:
        assert config[name] == getattr(opt, name), name
    assert set(config) == set(OPTIMIZER_ARGUMENTS.names) | {
        "attached",
        "name",
        "optimizer",
    }


@pytest.mark.backend_free
def test_a_setting_set_on_the_optimizer_is_checked_and_a_fixed_one_refused():
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1))
    opt.spike_window = 64
    assert opt.spike_window == 64 and opt.get_config()["spike_window"] == 64
    with pytest.raises(
        ValueError, match=r"`spike_window` must be .*Received: spike_window=1"
    ):
        opt.spike_window = 1
    assert opt.spike_window == 64
    with pytest.raises(AttributeError, match="`probe_every` is set when"):
        opt.probe_every = 4
    assert opt.probe_every == 16


def test_a_guard_attribute_set_after_construction_is_checked_when_fit_begins():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    guard = ng.NaNGuard(verbose=0)
    guard.patience = -1
    with pytest.raises(ValueError, match=r"`patience` must be .*Received: patience=-1"):
        model.fit(np.ones((4, 2)), np.ones((4, 1)), callbacks=[guard], verbose=0)
    guard.patience = 2
    model.fit(np.ones((4, 2)), np.ones((4, 1)), callbacks=[guard], verbose=0)
    assert guard.get_config()["patience"] == 2
