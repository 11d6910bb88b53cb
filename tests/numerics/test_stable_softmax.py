"""StableSoftmax: property tests over nasty logits, masks and dtypes; the layer."""

import math

import keras
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from keras import ops

import keras_nanguard as ng
from tests.helpers import grad

DTYPES = ["float32", "float16", "bfloat16"]
# Tolerance on "rows sum to 1" per dtype (the output is in that dtype).
SUM_TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}

values = st.one_of(
    st.floats(-60, 60, width=32),
    st.sampled_from([0.0, 1e4, -1e4, 1.2e5, -1.2e5, 1e30, -1e30, math.inf, -math.inf]),
)


@st.composite
def cases(draw):
    rows = draw(st.integers(1, 5))
    cols = draw(st.integers(2, 7))
    x = np.array(
        draw(st.lists(values, min_size=rows * cols, max_size=rows * cols)), "float32"
    ).reshape(rows, cols)
    mask = None
    if draw(st.booleans()):
        mask = np.array(
            draw(st.lists(st.booleans(), min_size=rows * cols, max_size=rows * cols))
        ).reshape(rows, cols)
        if draw(st.booleans()):
            mask[0] = False  # an empty row
    return x, mask, draw(st.sampled_from(DTYPES))


def _np(x):
    return np.asarray(ops.convert_to_numpy(ops.cast(x, "float32")))


def _expected_rows(x, mask):
    """Which rows can hold probability (some allowed entry above -inf)."""
    allowed = np.ones_like(x, bool) if mask is None else mask
    return (allowed & (x > -np.inf)).any(axis=-1)


SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@SETTINGS
@given(cases(), st.sampled_from([None, 30.0]))
def test_probabilities_are_finite_and_rows_sum_to_one(case, soft_cap):
    x, mask, dtype = case
    layer = ng.StableSoftmax(soft_cap=soft_cap, dtype=dtype)
    out = layer(ops.cast(x, dtype), mask=mask)
    assert keras.backend.standardize_dtype(out.dtype) == dtype
    p = _np(out)
    assert np.isfinite(p).all() and (p >= 0).all()
    if mask is not None:
        assert (p[~mask] == 0).all()
    x_in = _np(ops.cast(x, dtype))  # e.g. -1.2e5 is -inf in float16
    live = _expected_rows(np.clip(x_in, -30, 30) if soft_cap else x_in, mask)
    np.testing.assert_allclose(p.sum(-1), np.where(live, 1.0, 0.0), atol=SUM_TOL[dtype])


@SETTINGS
@given(cases(), st.sampled_from([0.0, 0.01]))
def test_log_probs_are_finite_and_gradients_too(case, min_prob):
    x, mask, _ = case
    layer = ng.StableSoftmax(log_probs=True, min_prob=min_prob)
    logp = _np(layer(x, mask=mask))
    assert np.isfinite(logp).all()  # masked entries: the most negative float
    allowed = (np.ones_like(x, bool) if mask is None else mask) & (x > -np.inf)
    if min_prob > 0:
        assert (logp[allowed] >= math.log(min_prob) - 1e-5).all()
    probs = ng.StableSoftmax(min_prob=min_prob)
    w = np.random.default_rng(0).standard_normal(x.shape).astype("float32")
    assert np.isfinite(grad(lambda t: probs(t, mask=mask), x, w)).all()
    # Only allowed entries carry gradient into a loss on log-probs.
    assert np.isfinite(grad(lambda t: layer(t, mask=mask), x, w * allowed)).all()


@SETTINGS
@given(st.lists(st.floats(-80, 80, width=32), min_size=6, max_size=6))
def test_equals_keras_softmax_where_that_is_finite(row):
    x = np.array(row, "float32").reshape(2, 3)
    ours = _np(ng.StableSoftmax()(x))
    theirs = _np(ops.softmax(x))
    np.testing.assert_allclose(ours, theirs, atol=1e-6)
    np.testing.assert_allclose(
        _np(ng.StableSoftmax(log_probs=True)(x)), _np(ops.log_softmax(x)), atol=1e-5
    )


def test_the_failures_keras_softmax_has():
    inf, nan_free = math.inf, ng.StableSoftmax()
    cases = {
        "one +inf logit": np.array([[0.0, inf, 0.0]], "float32"),
        "an all -inf row": np.array([[-inf, -inf, -inf]], "float32"),
    }
    for x in cases.values():
        assert not np.isfinite(_np(ops.softmax(x))).all()
        assert np.isfinite(_np(nan_free(x))).all()
        assert np.isfinite(grad(nan_free, x)).all()
    np.testing.assert_array_equal(_np(nan_free(cases["one +inf logit"])), [[0, 1, 0]])
    # float16 overflow: 1.2e5 is inf in float16; computed in float32 instead.
    x16 = ops.cast(np.array([[1.2e5, 0.0]], "float32"), "float16")
    assert np.isfinite(_np(ng.StableSoftmax(dtype="float16")(x16))).all()


def test_options_soft_cap_hard_cap_temperature_min_prob():
    x = np.array([[1e6, 0.0, -1e6]], "float32")
    soft = _np(ng.StableSoftmax(soft_cap=2.0)(x))
    e = np.exp([2.0, 0.0, -2.0])
    np.testing.assert_allclose(soft, [e / e.sum()], rtol=1e-5)
    hard = _np(ng.StableSoftmax(hard_cap=1.0)(x))
    e = np.exp([1.0, 0.0, -1.0])
    np.testing.assert_allclose(hard, [e / e.sum()], rtol=1e-5)
    warm = _np(ng.StableSoftmax(temperature=2.0)(np.array([[2.0, 0.0]], "float32")))
    np.testing.assert_allclose(
        warm, [[1 / (1 + math.exp(-1)), 1 / (1 + math.exp(1))]], rtol=1e-6
    )
    floored = _np(
        ng.StableSoftmax(min_prob=0.1)(np.array([[100.0, 0.0, 0.0]], "float32"))
    )
    np.testing.assert_allclose(floored, [[0.8, 0.1, 0.1]], rtol=1e-6)
    masked = _np(
        ng.StableSoftmax(min_prob=0.1)(
            np.zeros((1, 3), "float32"), mask=np.array([[True, True, False]])
        )
    )
    np.testing.assert_allclose(masked, [[0.5, 0.5, 0.0]], rtol=1e-6)


def test_nan_logits_propagate_or_are_masked():
    x = np.array([[np.nan, 1.0, 0.0], [1.0, 0.0, 0.0]], "float32")
    honest = _np(ng.StableSoftmax()(x))
    assert np.isnan(honest[0]).all() and np.isfinite(honest[1]).all()
    honest_log = _np(ng.StableSoftmax(log_probs=True)(x))
    assert np.isnan(honest_log[0]).all() and np.isfinite(honest_log[1]).all()
    masked = _np(ng.StableSoftmax(nan_logits="mask")(x))
    np.testing.assert_allclose(
        masked[0], [0, 1 / (1 + math.e**-1), 1 / (1 + math.e)], rtol=1e-6
    )


def test_other_axis_and_broadcast_mask():
    x = np.random.default_rng(0).standard_normal((2, 4, 3)).astype("float32")
    out = _np(
        ng.StableSoftmax(axis=1)(x, mask=np.array([[True], [True], [False], [True]]))
    )
    np.testing.assert_allclose(out.sum(axis=1), np.ones((2, 3)), rtol=1e-6)
    assert (out[:, 2] == 0).all()
    both = _np(ng.StableSoftmax(axis=(1, 2))(x))
    np.testing.assert_allclose(both.sum(axis=(1, 2)), np.ones(2), rtol=1e-6)


@pytest.mark.backend_free
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"soft_cap": 0.0},
            ValueError,
            r"`soft_cap` must be a finite number > 0.*soft_cap=0.0",
        ),
        ({"hard_cap": -1}, ValueError, r"hard_cap=-1"),
        ({"soft_cap": 1.0, "hard_cap": 1.0}, ValueError, r"not both"),
        ({"temperature": 0}, ValueError, r"`temperature` must be a finite number > 0"),
        ({"min_prob": -0.1}, ValueError, r"min_prob=-0.1"),
        ({"nan_logits": "zero"}, ValueError, r"nan_logits='zero'"),
        ({"axis": 1.5}, TypeError, r"axis=1.5"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ng.StableSoftmax(**kwargs)


def test_bad_arguments_at_build():
    with pytest.raises(
        ValueError, match=r"`axis` is out of range.*axis=2, input_shape=\(3, 4\)"
    ):
        ng.StableSoftmax(axis=2)(np.zeros((3, 4), "float32"))
    with pytest.raises(
        ValueError, match=r"`min_prob` must be < 1/n for n=4.*min_prob=0.25"
    ):
        ng.StableSoftmax(min_prob=0.25)(np.zeros((3, 4), "float32"))


def test_mixed_precision_and_keras_file_round_trip(tmp_path):
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((5,))
    logits = keras.layers.Dense(4)(inputs)
    probs = ng.StableSoftmax(soft_cap=20.0, min_prob=0.01, name="policy")(logits)
    model = keras.Model(inputs, probs)
    x = np.random.default_rng(0).standard_normal((3, 5)).astype("float32")
    out = model(x)
    assert keras.backend.standardize_dtype(out.dtype) == "float16"
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    layer = loaded.get_layer("policy")
    assert isinstance(layer, ng.StableSoftmax)
    assert layer.get_config() == model.get_layer("policy").get_config()
    np.testing.assert_array_equal(_np(loaded(x)), _np(out))


def test_trains_inside_a_model_with_extreme_logits():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(3, kernel_initializer=keras.initializers.Constant(1e6)),
            ng.StableSoftmax(log_probs=True),
        ]
    )
    # Cross-entropy from log-probabilities: finite even with huge logits.
    model.compile(
        optimizer=ng.SafeOptimizer(keras.optimizers.SGD(1e-9)),
        loss=lambda y, logp: -ops.sum(y * logp, axis=-1),
    )
    x = np.ones((8, 3), "float32")
    y = keras.utils.to_categorical(np.arange(8) % 3, 3)
    history = model.fit(x, y, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert model.optimizer.counters()["skipped_steps"] == 0


@pytest.mark.backend_free
def test_log_probs_must_be_a_bool():
    with pytest.raises(TypeError, match=r"`log_probs` must be True or False.*'no'"):
        ng.StableSoftmax(log_probs="no")


def test_a_mask_of_the_wrong_shape_gets_a_clear_error():
    logits = np.zeros((2, 3), "float32")
    with pytest.raises(ValueError, match=r"mask.*broadcastable.*mask.shape=\(2, 4\)"):
        ng.StableSoftmax()(logits, mask=np.ones((2, 4), bool))
