"""Backend-specific kernels behind `ops`, SafeOptimizer's step and StableSoftmax.

The global norm with per-tensor finiteness, per-tensor finiteness flags, and
(log-)softmax of logits that may hold infinities. Each is pure, has no branch
on a device value and no host read, and keeps each backend's fast path in
one named place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

Tensor = Any

# Powers of two: scaling by them is exact and cannot be simplified away.
_TINY = 2.0**-64
_HUGE = 2.0**64


def dense_values(x: Tensor) -> Tensor:
    # A TensorFlow `IndexedSlices` gradient (from an Embedding) holds its
    # numbers in `.values`; finiteness and norms are read from those.
    if hasattr(x, "values") and hasattr(x, "indices") and hasattr(x, "dense_shape"):
        return x.values
    return x


def present(tensors: Sequence[Tensor | None]) -> list[Tensor]:
    return [dense_values(t) for t in tensors if t is not None]


def is_float(x: Tensor) -> bool:
    return keras.backend.is_float_dtype(keras.backend.standardize_dtype(x.dtype))


def _raw(x: Tensor) -> Tensor:
    # The backend tensor, without keras.ops's per-call dispatch cost.
    if isinstance(x, keras.Variable):
        return x.value
    return x if ops.is_tensor(x) else ops.convert_to_tensor(x)


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


def norm_and_finite(tensors: Sequence[Tensor | None]) -> tuple[Tensor, Tensor]:
    """Global L2 norm of `tensors` and per-tensor finiteness, in one pass.

    No branch and no host read: the float32 sum of squares, and beside it
    (same pass) the sum of squares of the values scaled by 2**-64, which
    takes over when the first overflows. A tensor counts as finite when all
    its entries are and its own norm is within float32's range (~3.4e38).

    Returns:
        `(norm, finite)`: a float32 scalar (NaN or inf when an entry is), and
        a bool vector with one entry per non-`None` tensor.
    """
    values = present(tensors)
    if not values:
        return ops.convert_to_tensor(0.0, "float32"), ops.ones((0,), "bool")
    sq, sq_tiny = _sums_of_squares(values)
    total = ops.sum(sq)
    norm = ops.where(
        ops.isfinite(total), ops.sqrt(total), _HUGE * ops.sqrt(ops.sum(sq_tiny))
    )
    return norm, ops.isfinite(sq_tiny)


def finite_flags(tensors: Sequence[Tensor]) -> Tensor:
    """One bool per tensor: `True` where every entry of it is finite.

    One read per tensor, no branch, no host read, exact. Not a maximum:
    fused max reductions may drop NaN (TensorFlow's; XLA:CPU's since its
    YNNPACK fusions, jax 0.10: the largest magnitude of 4096 ones and one
    NaN comes out 1.0). Sums propagate NaN: JAX sums `v - v`, torch takes
    one multi-tensor norm, a float64 sum of squares (squares of narrower
    floats cannot overflow it); TensorFlow reduces `is_finite`.
    """
    values = present(tensors)
    if not values:
        return ops.ones((0,), "bool")
    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        # One multi-tensor kernel for all of them (torch's largest-magnitude
        # norm is 8x slower on CPU). float64 values, whose squares could
        # overflow even float64, take the largest magnitude.
        raw = [_raw(v) for v in values]
        narrow = [v for v in raw if v.dtype != torch.float64]
        wide = [v for v in raw if v.dtype == torch.float64]
        sums = iter(torch._foreach_norm(narrow, 2, torch.float64) if narrow else ())
        maxabs = iter(torch._foreach_norm(wide, float("inf")) if wide else ())
        norms = [next(maxabs if v.dtype == torch.float64 else sums) for v in raw]
        return torch.isfinite(torch.stack(norms))
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in values])
    # A sum of `v - v`: NaN exactly when an entry is NaN or inf, else 0 (it
    # cannot overflow). One read, the bytes of a maximum; `all(isfinite)`
    # and `v * 0` cost XLA:CPU 2 and 4 more bytes per entry (a mask, a
    # broadcast zero). XLA folds `v - v` to 0 for floats only under fast
    # math, which folds every finiteness check away (isfinite included).
    return ops.isfinite(ops.stack([ops.sum(x - x) for x in map(_raw, values)]))


def softmax_parts(x: Tensor, axis: int | tuple[int, ...], log: bool) -> Tensor:
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
