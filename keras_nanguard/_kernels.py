"""Kernels behind `ops`, SafeOptimizer's step and StableSoftmax.

The global norm with per-tensor finiteness, per-tensor finiteness flags, and
(log-)softmax of logits that may hold infinities. Each is pure, has no branch
on a device value and no host read; each backend's fast path is in
`_backend`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_nanguard._backend import current as backend

Tensor = Any

# Powers of two: scaling by them is exact and cannot be simplified away.
_TINY = 2.0**-64
_HUGE = 2.0**64


# Finite codes for the non-finite values a report variable holds (a norm of
# NaN gradients, a figure not measured): every variable of a SafeOptimizer
# stays finite, so that a health check over `optimizer.variables` passes and
# JAX's multi-process `device_put` sees equal initial values on every process.
# No finite float32 reaches them: a value past them is already inf.
FLOAT32_MAX = float(np.finfo("float32").max)
NAN_CODE = -FLOAT32_MAX
NEG_INF_CODE = float(np.nextafter(np.float32(-FLOAT32_MAX), np.float32(0)))


def state_variable(
    optimizer: keras.optimizers.Optimizer,
    name: str,
    shape: tuple = (),
    dtype: str = "float32",
    initial: float = 0.0,
) -> keras.Variable:
    """A new bookkeeping variable of `optimizer` (a counter, the flight
    recorder's rows, the clipping's statistics): `shape` and `dtype`, every
    element `initial`, each replica's own (`aggregation="none"`)."""
    return optimizer.add_variable(
        shape=shape,
        dtype=dtype,
        initializer=keras.initializers.Constant(initial),
        aggregation="none",
        name=name,
    )


def to_finite(x: Tensor) -> Tensor:
    """`x` as float32 with NaN, +inf and -inf as finite codes (`from_finite`
    reads them back): `NAN_CODE`, `FLOAT32_MAX` and `NEG_INF_CODE`."""
    x = ops.cast(x, "float32")
    return ops.where(ops.isnan(x), NAN_CODE, ops.clip(x, NEG_INF_CODE, FLOAT32_MAX))


def decode_finite(x: Tensor) -> Tensor:
    """`from_finite` on the device: a tensor with the codes as NaN and inf."""
    return ops.where(
        x == NAN_CODE,
        np.float32(np.nan),
        ops.where(
            x == FLOAT32_MAX,
            np.float32(np.inf),
            ops.where(x == NEG_INF_CODE, np.float32(-np.inf), x),
        ),
    )


def from_finite(x: Any) -> np.ndarray:
    """What `to_finite` coded, on the host: the codes as NaN, +inf, -inf."""
    x = np.array(x, "float32")  # a copy, decoded in place
    x[x == NAN_CODE] = np.nan
    x[x == FLOAT32_MAX] = np.inf
    x[x == NEG_INF_CODE] = -np.inf
    return x


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


def _sums_of_squares(values: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Per tensor, the float32 sums of squares of `v` and of `v * 2**-64`.

    The second sum never overflows while the first does (a norm above
    ~1.8e19), so together they give the norm of any tensor whose norm is
    within float32's range, with no branch, reading each tensor once (each
    backend's fused form: `_backend`).
    """
    return backend.sums_of_squares(values)


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
    norm, finite, _ = norms_and_finite(tensors)
    return norm, finite


def norms_and_finite(tensors: Sequence[Tensor | None]) -> tuple[Tensor, Tensor, Tensor]:
    """`norm_and_finite`, and each tensor's float32 sum of squares (inf
    where it overflows), from the same pass."""
    values = present(tensors)
    if not values:
        zero = ops.convert_to_tensor(0.0, "float32")
        return zero, ops.ones((0,), "bool"), ops.zeros((0,), "float32")
    sq, sq_tiny = _sums_of_squares(values)
    total = ops.sum(sq)
    norm = ops.where(
        ops.isfinite(total), ops.sqrt(total), _HUGE * ops.sqrt(ops.sum(sq_tiny))
    )
    return norm, ops.isfinite(sq_tiny), sq


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
    return backend.finite_flags(values)


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
    return backend.softmax_parts(x, axis, log)
