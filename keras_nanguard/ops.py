"""Small numerics on `keras.ops`, shared by the whole package.

Every function here is pure, works on the TensorFlow, JAX and PyTorch
backends, runs inside compiled functions (`tf.function`, XLA, `jax.jit`) and
never reads a value back to the host (on TensorFlow, `stable_log_softmax`
branches inside the graph to use the fused kernel when every row is finite).

Import them as `from keras_nanguard.ops import safe_log, global_norm` or use
`keras_nanguard.ops.safe_log`. Names starting with `_` are SafeOptimizer's
building blocks, not API.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

Tensor = Any

__all__ = [
    "all_finite",
    "global_norm",
    "policy_log_prob",
    "safe_div",
    "safe_log",
    "safe_norm",
    "safe_sqrt",
    "stable_log_softmax",
]


def _dense_values(x: Tensor) -> Tensor:
    # A TensorFlow `IndexedSlices` gradient (from an Embedding) holds its
    # numbers in `.values`; finiteness and norms are read from those.
    if hasattr(x, "values") and hasattr(x, "indices") and hasattr(x, "dense_shape"):
        return x.values
    return x


def _present(tensors: Sequence[Tensor | None]) -> list[Tensor]:
    return [_dense_values(t) for t in tensors if t is not None]


# Powers of two: scaling by them is exact and cannot be simplified away.
_TINY = 2.0**-64
_HUGE = 2.0**64


def _sums_of_squares(values: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Per tensor, the float32 sums of squares of `v` and of `v * 2**-64`.

    The second sum never overflows while the first does (a norm above
    ~1.8e19), so together they give the norm of any tensor whose norm is
    within float32's range, with no branch, reading each tensor once.
    """
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        # L2Loss is one fused kernel; square-then-sum allocates a temporary.
        f32 = [tf.cast(v, "float32") for v in values]
        return (
            tf.stack([2.0 * tf.nn.l2_loss(v) for v in f32]),
            tf.stack([2.0 * tf.nn.l2_loss(v * _TINY) for v in f32]),
        )
    if backend == "torch":
        import torch

        # One multi-tensor kernel; a float64 accumulator cannot overflow, so
        # one sum serves both (the second is the first, rescaled).
        norms = torch._foreach_norm([_raw(v) for v in values], 2, torch.float64)
        sq = torch.stack(norms) ** 2
        return sq.float(), (sq * _TINY**2).float()
    import jax

    def both(v: Tensor) -> tuple[Tensor, Tensor]:
        # One variadic reduction: XLA reads `v` once for both sums (two
        # reductions are two passes on some XLA backends).
        v = v.astype("float32")
        small = v * _TINY
        return jax.lax.reduce(
            (v * v, small * small),
            (jax.numpy.float32(0), jax.numpy.float32(0)),
            lambda a, b: (a[0] + b[0], a[1] + b[1]),
            tuple(range(v.ndim)),
        )

    sums = [both(_raw(v)) for v in values]
    return ops.stack([a for a, _ in sums]), ops.stack([b for _, b in sums])


def _raw(x: Tensor) -> Tensor:
    # The backend tensor, without keras.ops's per-call dispatch cost.
    if isinstance(x, keras.Variable):
        return x.value
    return x if ops.is_tensor(x) else ops.convert_to_tensor(x)


def _norm_and_finite(tensors: Sequence[Tensor | None]) -> tuple[Tensor, Tensor]:
    """Global L2 norm of `tensors` and per-tensor finiteness, in one pass.

    No branch and no host read: the float32 sum of squares, and beside it
    (same pass) the sum of squares of the values scaled by 2**-64, which
    takes over when the first overflows. A tensor counts as finite when all
    its entries are and its own norm is within float32's range (~3.4e38).

    Returns:
        `(norm, finite)`: a float32 scalar (NaN or inf when an entry is), and
        a bool vector with one entry per non-`None` tensor.
    """
    values = _present(tensors)
    if not values:
        return ops.convert_to_tensor(0.0, "float32"), ops.ones((0,), "bool")
    sq, sq_tiny = _sums_of_squares(values)
    total = ops.sum(sq)
    norm = ops.where(
        ops.isfinite(total), ops.sqrt(total), _HUGE * ops.sqrt(ops.sum(sq_tiny))
    )
    return norm, ops.isfinite(sq_tiny)


def global_norm(tensors: Sequence[Tensor | None]) -> Tensor:
    r"""Global L2 norm of a list of tensors, in float32, without overflow.

    .. math:: \|g\| = \sqrt{\sum_i \sum_j g_{ij}^2}

    Squares are summed in float32 whatever the input dtype. When the sum of
    squares would overflow but every entry is finite, the norm is computed on
    rescaled values, so it is exact up to rounding and `inf` only if the norm
    itself exceeds the float32 range. `None` entries are ignored; the result
    is NaN or inf as soon as any entry is.

    Args:
        tensors: list of tensors (or `None`).

    Returns:
        A float32 scalar tensor.

    Example:

    >>> from keras import ops
    >>> import keras_nanguard as ng
    >>> float(ng.ops.global_norm([ops.array([3.0]), ops.array([4.0])]))
    5.0
    >>> f"{float(ng.ops.global_norm([ops.array([3e30, 4e30])])):.3g}"  # no overflow
    '5e+30'
    """
    norm, _ = _norm_and_finite(tensors)
    return norm


def _finite_flags(tensors: Sequence[Tensor]) -> Tensor:
    """One bool per tensor: `True` where every entry of it is finite.

    One read per tensor, no branch, no host read, exact: the largest
    magnitude is finite exactly when every entry is (NaN propagates through
    the maximum; a sum could overflow on finite values).
    """
    values = _present(tensors)
    if not values:
        return ops.ones((0,), "bool")
    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        # One multi-tensor kernel for all of them.
        maxabs = torch._foreach_norm([_raw(v) for v in values], float("inf"))
        return torch.isfinite(torch.stack(maxabs))
    if backend == "tensorflow":
        import tensorflow as tf

        # TF's max reductions may drop NaN; is_finite does not.
        return tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in values])
    return ops.isfinite(ops.stack([ops.max(ops.abs(v)) for v in values]))


def all_finite(tensors: Sequence[Tensor | None] | Tensor) -> Tensor:
    """`True` when every entry of every tensor is finite (no NaN, no inf).

    Integer and boolean tensors are always finite. `None` entries are ignored.

    Args:
        tensors: a tensor, or a list of tensors (or `None`).

    Returns:
        A boolean scalar tensor.

    Example:

    >>> from keras import ops
    >>> import keras_nanguard as ng
    >>> bool(ng.ops.all_finite([ops.array([1.0, 2.0])]))
    True
    >>> bool(ng.ops.all_finite(ops.array([1.0, float("inf")])))
    False
    >>> bool(ng.ops.all_finite(ops.array([3e38, 3e38])))  # the sum overflows
    True
    """
    if not isinstance(tensors, list | tuple):
        tensors = [tensors]
    floats = [v for v in _present(tensors) if _is_float(v)]
    if not floats:
        return ops.convert_to_tensor(True)
    return ops.all(_finite_flags(floats))


def _is_float(x: Tensor) -> bool:
    return keras.backend.is_float_dtype(keras.backend.standardize_dtype(x.dtype))


# ----------------------------------------------------------- safe arithmetic
def safe_log(x: Tensor, eps: float | None = None) -> Tensor:
    r"""`log(max(x, eps))`: finite value and finite gradient at and below 0.

    .. math:: \mathrm{safe\_log}(x) = \log(\max(x, \epsilon))

    The gradient is `1/x` above `eps` and 0 below it (the log of a
    probability that underflowed to 0 no longer yields `-inf` and NaN
    gradients). Prefer log-space computations (`stable_log_softmax`) where
    you can: they lose nothing.

    Args:
        x: tensor.
        eps: the floor. Defaults to `keras.backend.epsilon()` (1e-7).

    Returns:
        A tensor like `x`.

    Example:

    >>> import keras_nanguard as ng
    >>> [round(float(v), 3) for v in ng.ops.safe_log([0.0, 1.0])]
    [-16.118, 0.0]
    """
    x = ops.convert_to_tensor(x)
    eps = keras.backend.epsilon() if eps is None else eps
    return ops.log(ops.maximum(x, ops.cast(eps, x.dtype)))


def safe_div(x: Tensor, y: Tensor, eps: float = 0.0) -> Tensor:
    """`x / y`, with 0 where `y == 0` (or `|y|` floored at `eps`), finite gradients.

    With `eps=0` the result is 0 wherever `y` is 0 (like `tf.math.divide_no_nan`)
    and the gradients there are 0, not NaN; near 0 the true gradient
    `-x / y**2` can still overflow (at `|y| < ~1e-19`). With `eps > 0` the
    denominator's magnitude is floored at `eps`, keeping its sign (0 counts as
    positive), which bounds both the value and the gradient.

    Args:
        x: numerator.
        y: denominator.
        eps: float >= 0. Defaults to 0.

    Returns:
        A tensor broadcast from `x` and `y`.

    Example:

    >>> import keras_nanguard as ng
    >>> [float(v) for v in ng.ops.safe_div([1.0, 1.0], [0.0, 4.0])]
    [0.0, 0.25]
    """
    if eps < 0:
        raise ValueError(f"`eps` must be >= 0. Received: eps={eps}")
    x = ops.convert_to_tensor(x)
    y = ops.convert_to_tensor(y, dtype=x.dtype)
    if eps > 0:
        sign = ops.where(y < 0, -1.0, 1.0)
        return x / (sign * ops.maximum(ops.abs(y), ops.cast(eps, y.dtype)))
    zero = ops.equal(y, 0)
    # Double `where`: the unselected branch must not be x/0 either, or its
    # gradient (0 * inf) is NaN.
    return ops.where(
        zero, ops.zeros_like(x / ops.ones_like(y)), x / ops.where(zero, 1, y)
    )


def safe_sqrt(x: Tensor) -> Tensor:
    r"""`sqrt(max(x, 0))` with a finite gradient at 0 (where `sqrt'` is infinite).

    The value is exact (0 at 0); the gradient is :math:`1/(2\sqrt{x})` for
    `x > 0` and 0 for `x <= 0`.

    Example:

    >>> import keras_nanguard as ng
    >>> [float(v) for v in ng.ops.safe_sqrt([0.0, 4.0, -1.0])]
    [0.0, 2.0, 0.0]
    """
    x = ops.convert_to_tensor(x)
    positive = x > 0
    return ops.where(positive, ops.sqrt(ops.where(positive, x, ops.ones_like(x))), 0)


def safe_norm(
    x: Tensor, axis: int | tuple[int, ...] | None = None, keepdims: bool = False
) -> Tensor:
    """L2 norm with a finite (zero) gradient at the zero vector.

    For weight normalisation `v * g / norm(v)` use it with `safe_div`: a
    kernel column that reaches 0 then yields 0, not NaN.

    Example:

    >>> import keras_nanguard as ng
    >>> float(ng.ops.safe_norm([3.0, 4.0]))
    5.0
    """
    x = ops.convert_to_tensor(x)
    return safe_sqrt(ops.sum(ops.square(x), axis=axis, keepdims=keepdims))


# -------------------------------------------------------------- log-softmax
def _softmax_parts(x: Tensor, axis: int | tuple[int, ...], log: bool) -> Tensor:
    """Softmax (or log-softmax) of float32 logits that may hold +-inf.

    A row with +inf logits shares the probability among them; a row with no
    finite maximum (all -inf, i.e. fully masked) gives 0 (log: -inf); -inf
    entries give 0 (log: -inf). NaN logits make their row NaN. Under XLA
    (JAX) this careful form fuses into one softmax-like kernel and always
    runs; on TensorFlow the backend's fused kernel runs whenever every row's
    maximum is finite, and the careful form otherwise; torch has its own
    form around its fused kernel, with no branch on a device value.
    """
    backend = keras.backend.backend()
    if backend == "torch" and isinstance(axis, int):
        return _torch_softmax_parts(x, axis, log)
    m = ops.max(x, axis=axis, keepdims=True)

    def careful():
        pos_inf = ops.isinf(m) & (m > 0)
        m_safe = ops.where(ops.isfinite(m), m, 0.0)
        # In a row with +inf logits, those become 0 and the rest -inf, so
        # exp/sum shares the probability among them; the gradient there is 0
        # (the unselected branch has no inf/NaN for it to multiply by 0).
        z = ops.where(
            pos_inf,
            ops.where(x == np.inf, 0.0, -np.inf),
            x - ops.stop_gradient(m_safe),
        )
        s = ops.sum(ops.exp(z), axis=axis, keepdims=True)
        s_safe = ops.where(s == 0, 1.0, s)  # a NaN sum stays NaN
        return z - ops.log(s_safe) if log else ops.exp(z) / s_safe

    if backend in ("jax", "torch"):
        return careful()
    fused = ops.log_softmax if log else ops.softmax
    return ops.cond(ops.all(ops.isfinite(m)), lambda: fused(x, axis=axis), careful)


def _torch_softmax_parts(x: Tensor, axis: int, log: bool) -> Tensor:
    """torch: the fused (log-)softmax on logits made safe by selects, with no
    host read. Rows with +inf logits share among them; fully masked rows
    (all -inf) run on zeros, so their gradient is 0, and give 0 (log: -inf)."""
    import torch

    m = torch.amax(x, dim=axis, keepdim=True)
    pos_inf = torch.isposinf(m)
    masked = torch.isneginf(m)
    z = torch.where(
        pos_inf,
        torch.where(torch.isposinf(x), 0.0, -torch.inf),
        torch.where(masked, 0.0, x),
    )
    out = torch.log_softmax(z, axis) if log else torch.softmax(z, axis)
    return torch.where(masked, -torch.inf if log else 0.0, out)


def stable_log_softmax(
    logits: Tensor, axis: int | tuple[int, ...] = -1, mask: Tensor | None = None
) -> Tensor:
    r"""Log-probabilities from logits, computed in float32 without overflow.

    .. math:: \log p_i = x_i - \log\sum_j e^{x_j}

    Never NaN for finite or infinite logits; gradients are finite. Masked
    entries (`mask` False) and `-inf` logits get probability 0, so their
    log-probability is `-inf`; a row with several `+inf` logits shares the
    probability among them. Use `policy_log_prob` for the log-probability of
    chosen actions and the entropy, which stay finite.

    Args:
        logits: float tensor (any float dtype; computed in float32).
        axis: the class axis (int or tuple). Defaults to -1.
        mask: optional bool tensor broadcastable to `logits`, True = allowed.

    Returns:
        A float32 tensor like `logits`.

    Example:

    >>> import numpy as np, keras_nanguard as ng
    >>> logp = ng.ops.stable_log_softmax(np.array([[0.0, -120.0]]))
    >>> [round(float(v), 2) for v in logp[0]]   # log(softmax) would give -inf
    [0.0, -120.0]
    """
    x = ops.cast(ops.convert_to_tensor(logits), "float32")
    if mask is not None:
        x = ops.where(ops.cast(mask, "bool"), x, -np.inf)
    return _softmax_parts(x, axis, log=True)


def policy_log_prob(
    logits: Tensor,
    actions: Tensor,
    *,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""`log pi(a|s)` of the taken actions and the policy entropy, both finite.

    .. math:: \log\pi(a|s) = x_a - \log\sum_j e^{x_j}, \qquad
              H = -\sum_j \pi_j \log \pi_j

    For a categorical policy over the last axis of `logits`. Taking the log of
    the whole softmax and then gathering (`log(probs)[a]`) gives NaN
    gradients as soon as any probability underflows to 0 (0 * inf in
    backward), and an entropy bonus `-sum(p * log p)` is NaN for the same
    reason; here terms with `p == 0` contribute exactly 0. Masked actions
    (`mask` False) have probability 0.

    Args:
        logits: `(batch, n_actions)` float tensor.
        actions: `(batch,)` integer tensor of taken actions.
        mask: optional `(batch, n_actions)` bool tensor, True = allowed.

    Returns:
        `(log_prob, entropy)`, two float32 `(batch,)` tensors.

    Example:

    >>> import numpy as np, keras_nanguard as ng
    >>> logits = np.array([[0.0, -200.0], [1.0, 1.0]], "float32")
    >>> logp, h = ng.ops.policy_log_prob(logits, np.array([1, 0]))
    >>> [round(float(v), 3) for v in logp], [round(float(v), 3) + 0.0 for v in h]
    ([-200.0, -0.693], [0.0, 0.693])
    """
    logp = stable_log_softmax(logits, axis=-1, mask=mask)
    actions = ops.cast(ops.convert_to_tensor(actions), "int32")
    taken = ops.take_along_axis(logp, ops.expand_dims(actions, -1), axis=-1)[..., 0]
    p = ops.exp(logp)
    possible = p > 0
    plogp = ops.where(possible, p * ops.where(possible, logp, 0.0), 0.0)
    return taken, -ops.sum(plogp, axis=-1)
