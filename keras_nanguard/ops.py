"""Small numerics on `keras.ops`, shared by the whole package.

Every function here is pure, works on the TensorFlow, JAX and PyTorch
backends, runs inside compiled functions (`tf.function`, XLA, `jax.jit`) and
never reads a value back to the host (on TensorFlow, `stable_log_softmax`
branches inside the graph to use the fused kernel when every row is finite).

Import them as `from keras_nanguard.ops import safe_log, global_norm` or use
`keras_nanguard.ops.safe_log`. The backend-specific kernels under them are in
`_kernels.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_nanguard import _kernels

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
    norm, _ = _kernels.norm_and_finite(tensors)
    return norm


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
    floats = [v for v in _kernels.present(tensors) if _kernels.is_float(v)]
    if not floats:
        return ops.convert_to_tensor(True)
    return ops.all(_kernels.finite_flags(floats))


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
    return _kernels.softmax_parts(x, axis, log=True)


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
