"""Pieces of SafeOptimizer's guarded step: the rollback snapshot, the
conditional restore, TensorFlow's out-of-place updates, and small tensor
helpers (each backend's part is in `_backend`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
from keras import ops

from keras_nanguard import _rates as rates
from keras_nanguard._backend import current as backend


def is_float_variable(v: keras.Variable) -> bool:
    return keras.backend.is_float_dtype(v.dtype)


def first_false(flags: Any) -> Any:
    # Index of the first False in a bool vector (0 when all are True).
    return ops.argmin(ops.cast(flags, "int32"))


def shift_in(history: Any, bit: Any, width: int) -> Any:
    """`history`, a bit mask of the last `width` outcomes (bit 0 the latest,
    `width` <= 31), with `bit` shifted in: the oldest is dropped before the
    shift, so the int32 never overflows."""
    return ops.bitwise_and(history, (1 << (width - 1)) - 1) * 2 + bit


def scale(g: Any, factor: Any) -> Any:
    if hasattr(g, "indices") and hasattr(g, "dense_shape"):  # tf.IndexedSlices
        return type(g)(
            g.values * ops.cast(factor, g.values.dtype), g.indices, g.dense_shape
        )
    return g * ops.cast(factor, g.dtype)


def snapshot(variables: list[keras.Variable], buffers: list | None = None) -> list:
    """The values of `variables` now, unaffected by later in-place updates.

    On torch the values are copied, into `buffers` when given (see
    `_backend.torch.copy_values`); TensorFlow takes copy-on-write reads, JAX
    arrays are immutable.
    """
    return backend.copy_values([v.value for v in variables], buffers)


@contextlib.contextmanager
def out_of_place_updates(inner: keras.optimizers.Optimizer) -> Iterator[None]:
    """TensorFlow: `inner`'s `assign_add`/`assign_sub` (each sub-optimizer's
    of a MultiOptimizer, which make its updates) compute out of place for
    the length of one step (its trace, in a compiled step).

    While the rollback snapshot holds a reference to a variable's buffer,
    TensorFlow copies that buffer before any in-place update (copy-on-write):
    one extra copy of the weights per step. Computing `variable + value` and
    assigning it swaps buffers instead. Sparse updates (`IndexedSlices`) keep
    the inner optimizer's own path. Other backends: nothing changes.
    """
    if not backend.COPIES_ON_WRITE:
        yield
        return
    owners = [
        o for o in rates.rate_owners(inner).values() if "assign_add" not in vars(o)
    ]
    for owner in owners:
        _patch(owner)
    try:
        yield
    finally:
        for owner in owners:
            del owner.assign_add, owner.assign_sub


def _patch(optimizer: keras.optimizers.Optimizer) -> None:
    cls = type(optimizer)

    def assign_add(variable: Any, value: Any) -> None:
        if hasattr(value, "indices"):
            return cls.assign_add(optimizer, variable, value)
        return optimizer.assign(variable, variable + ops.cast(value, variable.dtype))

    def assign_sub(variable: Any, value: Any) -> None:
        if hasattr(value, "indices"):
            return cls.assign_sub(optimizer, variable, value)
        return optimizer.assign(variable, variable - ops.cast(value, variable.dtype))

    optimizer.assign_add, optimizer.assign_sub = assign_add, assign_sub


def restore_unless(
    ok: Any, state: list, backup: list, scales: list | None = None
) -> None:
    """Writes `backup` back into `state` (variables, or torch tensors such as
    module buffers) unless `ok`: a select on the device, with no branch and
    no host read (a branch on XLA:GPU or TensorFlow's GPU graphs copies the
    predicate to the host and waits for it). An entry of `scales` below 1
    scales that variable's accepted update (the update bound)."""
    backend.restore_unless(ok, state, backup, scales)


def initial_moments(inner: keras.optimizers.Optimizer) -> dict[int, float]:
    """By id, the value each of `inner`'s float variables but its learning
    rate starts from (a host read, once, when it is built): those a moment
    reset puts back. A variable that does not start from one value (none of
    Keras's) is left out."""
    lrs = {id(v) for v in rates.rate_variables(inner)}
    found: dict[int, float] = {}
    for v in inner.variables:
        if id(v) in lrs or not is_float_variable(v):
            continue
        values = backend.eager_read(v)
        if values.size and (values == values.flat[0]).all():
            found[id(v)] = float(values.flat[0])
    return found


def torch_compiling() -> bool:
    """Whether torch is compiling the code running now (`torch.compile`)."""
    return backend.compiling()


def executing_eagerly(probe: keras.Variable) -> bool:
    """Whether the step runs eagerly (not traced by `tf.function`, `jax.jit`
    or `torch.compile`)."""
    return backend.executing_eagerly(probe)
