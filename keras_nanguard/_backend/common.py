"""Pieces the backend modules share: Keras-ops code with no backend branch."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

Tensor = Any


def raw(x: Any) -> Tensor:
    """The backend tensor, without keras.ops's per-call dispatch cost."""
    if isinstance(x, keras.Variable):
        return x.value
    return x if ops.is_tensor(x) else ops.convert_to_tensor(x)


# Tensors this small are reduced together, one segment each (norms and
# finiteness): a reduction per tensor is a kernel per tensor, and on a small
# model the kernels are the step's cost (two LSTMs and Adam under JAX: 40
# fusions plain, 140 with a reduction per tensor, 90 so). Their entries are
# copied once into the joint vector; a large tensor is reduced alone. A
# segment's float32 sum may be sequential: its relative error stays below
# 4096 * 2**-24 (2.4e-4), a norm's below half that.
SMALL_TENSOR = 1 << 12


def joint_groups(values: Sequence[Tensor]) -> tuple[list[int], list[int]]:
    """The indices of the small tensors (known shape, float32 or narrower),
    reduced together, and of the others, each reduced alone."""

    def joins(v: Tensor) -> bool:
        shape = tuple(v.shape)
        if not all(isinstance(d, int) for d in shape):
            return False  # a shape known only when it runs
        itemsize = np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
        return itemsize <= 4 and int(np.prod(shape)) <= SMALL_TENSOR

    small = [i for i, v in enumerate(values) if joins(v)]
    if len(small) < 2:
        return [], list(range(len(values)))
    chosen = set(small)
    return small, [i for i in range(len(values)) if i not in chosen]


def per_tensor(
    values: Sequence[Tensor],
    alone: Callable[[Tensor], Any],
    together: Callable[[list[Tensor]], list[Any]],
) -> list[Any]:
    """One result per tensor: `alone` of each large one, `together` of the
    small ones (`joint_groups`), which gives theirs in order."""
    small, rest = joint_groups(values)
    out: list[Any] = [None] * len(values)
    for i in rest:
        out[i] = alone(values[i])
    if small:
        for i, found in zip(small, together([values[i] for i in small]), strict=True):
            out[i] = found
    return out


def segment_ids(values: Sequence[Tensor]) -> np.ndarray:
    """The segment of each entry of the joint vector of `values`."""
    sizes = [int(np.prod(tuple(v.shape))) for v in values]
    return np.repeat(np.arange(len(values), dtype="int32"), sizes)


def restore_by_assign(
    ok: Tensor, state: list, backup: list, scales: list | None = None
) -> None:
    """`restore_unless` for variables: `v.assign(where(ok, v, old))`, with
    an update scaled where `scales` says (one select, which XLA fuses)."""
    for v, old, scale in zip(state, backup, scales or [None] * len(state), strict=True):
        new = v.value
        if scale is not None:
            new = ops.where(scale >= 1.0, new, bounded(old, new, scale))
        v.assign(ops.where(ok, new, old))


def bounded(old: Tensor, new: Tensor, scale: Tensor) -> Tensor:
    """`new * scale + old * (1 - scale)`, in the dtype of `new`. Not `old +
    (new - old) * scale`: XLA would share `new - old` with the update's sum
    of squares (`update_sums`) and write it out, 12 more bytes per entry."""
    scale = ops.cast(scale, new.dtype)
    return new * scale + old * (1 - scale)


def update_sums(old: list[Tensor], new: list[Tensor]) -> tuple[Tensor, Tensor]:
    """`update_sums` in Keras ops (TensorFlow fuses nothing more)."""
    d = [
        ops.sum(ops.square(ops.cast(n, "float32") - ops.cast(o, "float32")))
        for o, n in zip(old, new, strict=True)
    ]
    w = [ops.sum(ops.square(ops.cast(o, "float32"))) for o in old]
    return ops.stack(d), ops.stack(w)


def careful_softmax_parts(
    x: Tensor, axis: int | tuple[int, ...], log: bool, m: Tensor | None = None
) -> Tensor:
    """(Log-)softmax of logits with +-inf, in Keras ops: a row with +inf
    logits shares the probability among them, a row with no finite maximum
    (all -inf) gives 0 (log: -inf), with no NaN in value or gradient. `m`:
    the rows' maxima, when already known."""
    if m is None:
        m = ops.max(x, axis=axis, keepdims=True)
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


def numpy_grads(grads: Sequence[Any]) -> list[np.ndarray | None]:
    return [None if g is None else np.asarray(ops.convert_to_numpy(g)) for g in grads]


def no_frozen(value: Any) -> Any:
    return value


def plain_step(
    run: Callable[..., None], inner: Any, grads: list, variables: list
) -> None:
    """`run_step` where one process holds the whole step (JAX, torch, and
    TensorFlow outside `tf.distribute`): under a `keras.distribution` JAX's
    step is one SPMD program whose gradients are already global, so every
    device decides alike."""
    run(grads, variables, None)


def in_replica() -> bool:
    return False


def assign_block(variable: Any, row: Any, col: int, values: Any) -> None:
    """`assign_block` as a scatter of the entries (no host read)."""
    from keras import ops

    k = int(values.shape[0])
    zeros = ops.zeros((k,), "int32")
    cols = ops.arange(col, col + k, dtype="int32")
    at = ops.stack([zeros + ops.cast(row, "int32"), cols], axis=1)
    variable.assign(ops.scatter_update(variable.value, at, values))


def host_constant(
    key: Hashable, values: Callable[[], np.ndarray], like: Any, cache: dict
) -> np.ndarray:
    """`constant_table` where a NumPy array is a constant of the trace."""
    if key not in cache:
        cache[key] = values()
    return cache[key]


def record_rows(record: Callable[[Any, Any], None], codes: Any, over: Any) -> None:
    """`record_rows` where one process holds the whole step."""
    record(codes, over)
