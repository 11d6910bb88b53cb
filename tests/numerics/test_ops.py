"""keras_nanguard.ops: values and gradients at the edges (0, tiny, huge, inf)."""

import math

import keras
import numpy as np
import pytest
from keras import ops

import keras_nanguard as ng
from tests.helpers import grad


def _np(x):
    return np.asarray(ops.convert_to_numpy(x))


EDGES = np.array([0.0, 1e-45, 1e-30, 1e-7, 1.0, 1e30, 3e38], dtype="float32")


def test_safe_log_values_and_gradients():
    eps = keras.backend.epsilon()
    v = _np(ng.ops.safe_log(EDGES))
    np.testing.assert_allclose(v, np.log(np.maximum(EDGES, eps)), rtol=1e-6)
    g = grad(ng.ops.safe_log, EDGES)
    assert np.isfinite(g).all()
    assert g[0] == 0 and g[1] == 0  # below eps: flat
    # (1/3e38 is a denormal that CPUs may flush to zero: not compared.)
    np.testing.assert_allclose(g[4:6], 1 / EDGES[4:6].astype("float64"), rtol=1e-6)
    # The case that breaks plain log: a probability that underflowed to 0.
    assert not np.isfinite(grad(ops.log, np.array([0.0], "float32"))).all()


def test_safe_div_by_zero_is_zero_with_zero_gradients():
    x = np.array([1.0, -2.0, 3.0, 0.0], "float32")
    y = np.array([0.0, 4.0, 1e-10, 0.0], "float32")
    np.testing.assert_allclose(
        _np(ng.ops.safe_div(x, y)), [0.0, -0.5, 3e10, 0.0], rtol=1e-6
    )
    gx = grad(lambda t: ng.ops.safe_div(t, y), x)
    gy = grad(lambda t: ng.ops.safe_div(x, t), y)
    assert np.isfinite(gx).all() and np.isfinite(gy).all()
    assert gx[0] == 0 and gy[0] == 0 and gy[3] == 0
    np.testing.assert_allclose(gx[1], 0.25)
    np.testing.assert_allclose(gy[1], 2.0 / 16.0)
    # With eps the denominator is floored, sign kept.
    np.testing.assert_allclose(
        _np(ng.ops.safe_div(x, y, eps=1e-3)), [1e3, -0.5, 3e3, 0.0], rtol=1e-6
    )
    # A tiny (not zero) denominator: x / y**2 overflows without eps, not with.
    tiny = np.array([1e-30], "float32")
    assert not np.isfinite(
        grad(lambda t: ng.ops.safe_div(np.ones(1, "float32"), t), tiny)
    ).all()
    assert np.isfinite(grad(lambda t: ng.ops.safe_div(x, t, eps=1e-3), y)).all()
    assert np.isfinite(
        grad(lambda t: ng.ops.safe_div(np.ones(1, "float32"), t, eps=1e-3), tiny)
    ).all()
    with pytest.raises(ValueError, match="eps=-1"):
        ng.ops.safe_div(x, y, eps=-1)


def test_safe_sqrt_at_zero():
    x = np.array([0.0, -1.0, 1e-30, 4.0, 1e38], "float32")
    np.testing.assert_allclose(
        _np(ng.ops.safe_sqrt(x)), [0.0, 0.0, 1e-15, 2.0, 1e19], rtol=1e-6
    )
    g = grad(ng.ops.safe_sqrt, x)
    assert np.isfinite(g).all()
    assert g[0] == 0 and g[1] == 0
    np.testing.assert_allclose(g[3], 0.25)
    assert not np.isfinite(grad(ops.sqrt, np.array([0.0], "float32"))).all()


def test_safe_norm_of_the_zero_vector_has_a_zero_gradient():
    zero = np.zeros((3, 4), "float32")
    np.testing.assert_array_equal(_np(ng.ops.safe_norm(zero, axis=0)), np.zeros(4))
    g = grad(lambda t: ng.ops.safe_norm(t, axis=0), zero)
    np.testing.assert_array_equal(g, np.zeros((3, 4)))
    x = np.array([[3.0, 0.0], [4.0, 0.0]], "float32")
    np.testing.assert_allclose(
        _np(ng.ops.safe_norm(x, axis=0, keepdims=True)), [[5.0, 0.0]]
    )
    np.testing.assert_allclose(
        grad(lambda t: ng.ops.safe_norm(t, axis=0), x),
        [[0.6, 0.0], [0.8, 0.0]],
        rtol=1e-6,
    )
    # Weight normalisation that reaches a zero column: finite, not NaN.
    w = np.array([[1.0, 0.0], [1.0, 0.0]], "float32")
    wn = lambda t: ng.ops.safe_div(t, ng.ops.safe_norm(t, axis=0, keepdims=True))  # noqa: E731
    assert np.isfinite(_np(wn(w))).all() and np.isfinite(grad(wn, w)).all()


@pytest.mark.parametrize(
    ("logits", "expected"),
    [
        ([[0.0, -120.0]], [[0.0, -120.0]]),
        ([[1e30, 0.0]], [[0.0, -1e30]]),
        ([[0.0, -np.inf]], [[0.0, -np.inf]]),
        ([[np.inf, np.inf, 0.0]], [[-math.log(2), -math.log(2), -np.inf]]),
        ([[-np.inf, -np.inf]], [[-np.inf, -np.inf]]),
    ],
)
def test_stable_log_softmax_edges(logits, expected):
    x = np.array(logits, "float32")
    np.testing.assert_allclose(_np(ng.ops.stable_log_softmax(x)), expected, rtol=1e-6)
    assert np.isfinite(
        grad(ng.ops.stable_log_softmax, x, upstream=np.isfinite(expected))
    ).all()


def test_stable_log_softmax_mask_and_float16():
    x = np.array([[2.0, 1.0, 0.0]], "float16")
    mask = np.array([[True, False, True]])
    out = _np(ng.ops.stable_log_softmax(x, mask=mask))
    assert out.dtype == np.float32
    np.testing.assert_allclose(
        np.exp(out), [[1 / (1 + math.exp(-2)), 0, 1 / (1 + math.exp(2))]], rtol=1e-3
    )


def test_policy_log_prob_is_finite_where_log_of_probs_is_not():
    logits = np.array([[0.0, -200.0, 5.0], [1.0, 1.0, 1.0]], "float32")
    actions = np.array([1, 2])
    logp, entropy = ng.ops.policy_log_prob(logits, actions)
    np.testing.assert_allclose(_np(logp), [-205.0067, -math.log(3)], rtol=1e-5)
    assert np.isfinite(_np(entropy)).all()
    np.testing.assert_allclose(_np(entropy)[1], math.log(3), rtol=1e-6)

    def loss(t):
        lp, h = ng.ops.policy_log_prob(t, actions)
        return -lp - 0.01 * h

    assert np.isfinite(grad(loss, logits)).all()

    # The usual hand-written loss: gather from log(softmax): NaN gradient,
    # and an entropy bonus -sum(p log p) that is NaN outright.
    def naive(t):
        p = ops.softmax(t)
        lp = ops.take_along_axis(ops.log(p), ops.expand_dims(actions, -1), axis=-1)
        return -lp - 0.01 * ops.sum(-p * ops.log(p), axis=-1, keepdims=True)

    assert not np.isfinite(grad(naive, logits)).all()


def test_policy_log_prob_with_a_mask():
    logits = np.array([[0.0, 0.0, 0.0]], "float32")
    mask = np.array([[True, False, True]])
    logp, entropy = ng.ops.policy_log_prob(logits, np.array([0]), mask=mask)
    np.testing.assert_allclose(_np(logp), [-math.log(2)], rtol=1e-6)
    np.testing.assert_allclose(_np(entropy), [math.log(2)], rtol=1e-6)


def test_global_norm_and_all_finite():
    big = np.full((1000,), 1e20, "float32")  # squares overflow float32
    np.testing.assert_allclose(
        float(ng.ops.global_norm([big, None])), 1e20 * math.sqrt(1000), rtol=1e-5
    )
    assert math.isinf(float(ng.ops.global_norm([np.array([np.inf, 1.0], "float32")])))
    assert math.isnan(float(ng.ops.global_norm([np.array([np.nan], "float32")])))
    assert bool(ng.ops.all_finite([big, np.array([1, 2])]))
    assert not bool(ng.ops.all_finite([big, np.array([1.0, np.nan], "float32")]))
    assert bool(ng.ops.all_finite(np.array([3e38, 3e38], "float32")))  # sum overflows


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_all_finite_is_exact_at_each_dtypes_edges(dtype):
    # 4096 entries and more: XLA:CPU's fused max reduction drops NaN there.
    if (
        dtype == "float64"
        and keras.backend.standardize_dtype(ops.convert_to_tensor(np.zeros(1)).dtype)
        != "float64"
    ):
        pytest.skip("this backend holds float64 arrays as float32 (JAX without x64)")
    top = np.finfo(dtype).max  # its square overflows even float64 for float64
    full = np.full((4096,), top, dtype)
    assert bool(ng.ops.all_finite([full, -full]))
    for bad in (np.nan, np.inf, -np.inf):
        x = full.copy()
        x[4000] = bad
        assert not bool(ng.ops.all_finite([np.ones(3, "float32"), x]))


def test_small_tensors_reduced_together_keep_their_own_flags_and_norms():
    # Tensors of up to 4,096 entries are reduced in one joint vector (a
    # segment each); each keeps its own flag and sum of squares, next to a
    # large one reduced alone, float16 and float32 mixed.
    from keras_nanguard import _kernels

    rng = np.random.default_rng(0)
    values = [
        rng.normal(size=(3, 4)).astype("float32"),
        np.array([1.0, np.inf], "float32"),
        rng.normal(size=(5000,)).astype("float32"),  # alone
        np.array([2.0, np.nan, 1.0], "float16"),
        rng.normal(size=(7,)).astype("float16"),
        np.full((4096,), 1e20, "float32"),  # small; its sum of squares overflows
    ]
    flags = _np(_kernels.finite_flags([ops.convert_to_tensor(v) for v in values]))
    assert flags.tolist() == [True, False, True, False, True, True]
    norm, finite, squares = _kernels.norms_and_finite(
        [ops.convert_to_tensor(v) for v in values]
    )
    assert _np(finite).tolist() == [True, False, True, False, True, True]
    expected = [float(np.sum(v.astype("float64") ** 2)) for v in values]
    got = _np(squares)
    np.testing.assert_allclose(got[[0, 2, 4]], np.array(expected)[[0, 2, 4]], rtol=1e-5)
    assert math.isinf(got[1]) and math.isnan(got[3]) and math.isinf(got[5])
    assert not math.isfinite(float(norm))
    ok = [values[i] for i in (0, 2, 4, 5)]
    np.testing.assert_allclose(
        float(ng.ops.global_norm(ok)),
        math.sqrt(sum(float(np.sum(v.astype("float64") ** 2)) for v in ok)),
        rtol=1.2e-4,  # a segment's float32 sum may be sequential
    )
