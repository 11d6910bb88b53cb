"""Small numerics on `keras.ops`, shared by the whole package.

Every function here is pure, works on the TensorFlow, JAX and PyTorch
backends, runs inside compiled functions (`tf.function`, XLA, `jax.jit`) and
never reads a value back to the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
from keras import ops

Tensor = Any


def _dense_values(x: Tensor) -> Tensor:
    # A TensorFlow `IndexedSlices` gradient (from an Embedding) holds its
    # numbers in `.values`; finiteness and norms are read from those.
    if hasattr(x, "values") and hasattr(x, "indices") and hasattr(x, "dense_shape"):
        return x.values
    return x


def _present(tensors: Sequence[Tensor | None]) -> list[Tensor]:
    return [_dense_values(t) for t in tensors if t is not None]


def _sums_of_squares(values: list[Tensor]) -> Tensor:
    """float32 sum of squares of each tensor, as a vector: one fused pass each."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        # L2Loss is one fused kernel; square-then-sum allocates a temporary.
        return tf.stack([2.0 * tf.nn.l2_loss(tf.cast(v, "float32")) for v in values])
    if backend == "torch":
        import torch

        # One fused multi-tensor kernel for all of them.
        norms = torch._foreach_norm([_raw(v).float() for v in values])
        return torch.stack(norms) ** 2
    return ops.stack([ops.sum(ops.square(ops.cast(v, "float32"))) for v in values])


def _sums(values: list[Tensor]) -> Tensor:
    """The float32 sum of each tensor, as a vector: finite exactly when all
    entries are finite, unless the sum itself overflows."""
    if keras.backend.backend() == "torch":
        import torch

        return torch.stack([_raw(v).float().sum() for v in values])
    return ops.stack([ops.sum(ops.cast(v, "float32")) for v in values])


def _raw(x: Tensor) -> Tensor:
    # The backend tensor, without keras.ops's per-call dispatch cost.
    if isinstance(x, keras.Variable):
        return x.value
    return x if ops.is_tensor(x) else ops.convert_to_tensor(x)


def norm_parts(tensors: Sequence[Tensor | None]) -> tuple[Tensor, Tensor, Tensor]:
    """Global L2 norm of `tensors` as `scale * rel`, plus per-tensor finiteness.

    The healthy path is one fused pass per tensor: the float32 sum of squares.
    Only when a sum of squares is `+inf` (an infinite entry, or finite entries
    above ~1.8e19 whose squares overflow float32) does a second branch run,
    which rescales by the largest magnitude so that large but finite tensors
    still get a finite `rel` and are not mistaken for infinite ones.

    Returns:
        `(scale, rel, finite)`: float32 scalars `scale` and `rel` with
        `norm = scale * rel` (`scale` is 1 on the healthy path), and a bool
        vector with one entry per non-`None` tensor, `True` where every entry
        of that tensor is finite.
    """
    values = _present(tensors)
    if not values:
        one = ops.convert_to_tensor(1.0, "float32")
        return one, ops.convert_to_tensor(0.0, "float32"), ops.ones((0,), "bool")
    sq = _sums_of_squares(values)

    def healthy():
        return (
            ops.convert_to_tensor(1.0, "float32"),
            ops.sqrt(ops.sum(sq)),
            ops.isfinite(sq),
        )

    def rescaled():
        finite = ops.stack([ops.all(ops.isfinite(v)) for v in values])
        maxabs = ops.stack(
            [
                ops.max(ops.where(ops.isfinite(v), ops.abs(v), 0))
                for v in (ops.cast(v, "float32") for v in values)
            ]
        )
        scale = ops.maximum(ops.max(maxabs), 1e-30)
        rel_sq = ops.stack(
            [ops.sum(ops.square(ops.cast(v, "float32") / scale)) for v in values]
        )
        return scale, ops.sqrt(ops.sum(rel_sq)), finite

    return ops.cond(ops.any(ops.isinf(sq)), rescaled, healthy)


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
    scale, rel, _ = norm_parts(tensors)
    return scale * rel


def finite_flags(tensors: Sequence[Tensor]) -> Tensor:
    """One bool per tensor: `True` where every entry of it is finite.

    The healthy path is one read per tensor with no temporary: a float32 sum
    is finite exactly when no entry is NaN or inf, unless the sum overflows.
    Only when some sum is not finite does a second branch check entry by entry,
    so an overflowing sum of finite values is not mistaken for a NaN.
    """
    values = _present(tensors)
    if not values:
        return ops.ones((0,), "bool")
    sums = ops.isfinite(_sums(values))

    def exact():
        return ops.stack([ops.all(ops.isfinite(v)) for v in values])

    return ops.cond(ops.all(sums), lambda: sums, exact)


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
    return ops.all(finite_flags(floats))


def _is_float(x: Tensor) -> bool:
    return keras.backend.is_float_dtype(keras.backend.standardize_dtype(x.dtype))
