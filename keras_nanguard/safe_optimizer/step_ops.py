"""Backend-specific pieces of SafeOptimizer's guarded step: the rollback
snapshot, the conditional restore, TensorFlow's out-of-place updates, and
small tensor helpers. Each backend's path stays in one named function."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
from keras import ops


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

    On torch the values are copied, into `buffers` when given: reusing the
    same buffers each step is several times faster than fresh clones (no
    allocation, no page faults), at the price of holding them between steps.
    """
    backend = keras.backend.backend()
    if backend == "torch":
        values = [v.value.detach() for v in variables]
        if buffers is None:
            return [t.clone() for t in values]
        import torch

        with torch.no_grad():
            torch._foreach_copy_(buffers, values)
        return buffers

    if backend == "tensorflow":
        import tensorflow as tf

        # A read is a copy-on-write snapshot: the buffer is copied only if
        # the variable is then written in place while the snapshot is alive.
        return [tf.identity(v.value) for v in variables]
    return [v.value for v in variables]  # JAX arrays are immutable.


@contextlib.contextmanager
def out_of_place_updates(inner: keras.optimizers.Optimizer) -> Iterator[None]:
    """TensorFlow: `inner`'s `assign_add`/`assign_sub` compute out of place
    for the length of one step (its trace, in a compiled step).

    While the rollback snapshot holds a reference to a variable's buffer,
    TensorFlow copies that buffer before any in-place update (copy-on-write):
    one extra copy of the weights per step. Computing `variable + value` and
    assigning it swaps buffers instead. Sparse updates (`IndexedSlices`) keep
    the inner optimizer's own path. Other backends: nothing changes.
    """
    if keras.backend.backend() != "tensorflow" or "assign_add" in vars(inner):
        yield
        return
    cls = type(inner)

    def assign_add(variable: Any, value: Any) -> None:
        if hasattr(value, "indices"):
            return cls.assign_add(inner, variable, value)
        return inner.assign(variable, variable + ops.cast(value, variable.dtype))

    def assign_sub(variable: Any, value: Any) -> None:
        if hasattr(value, "indices"):
            return cls.assign_sub(inner, variable, value)
        return inner.assign(variable, variable - ops.cast(value, variable.dtype))

    inner.assign_add, inner.assign_sub = assign_add, assign_sub
    try:
        yield
    finally:
        del inner.assign_add, inner.assign_sub


def restore_unless(ok: Any, state: list, backup: list) -> None:
    """Writes `backup` back into `state` (variables, or torch tensors such as
    module buffers) unless `ok`: a select on the device, with no branch and
    no host read (a branch on XLA:GPU or TensorFlow's GPU graphs copies the
    predicate to the host and waits for it)."""
    if keras.backend.backend() == "torch":
        import torch

        ok = torch.as_tensor(ok)
        with torch.no_grad():
            for t, old in zip(state, backup, strict=True):
                t = t.value if isinstance(t, keras.Variable) else t
                torch.where(ok, t, old, out=t)
        return
    for v, old in zip(state, backup, strict=True):
        v.assign(ops.where(ok, v.value, old))


def torch_compiling() -> bool:
    """Whether torch is compiling the code running now (`torch.compile`)."""
    if keras.backend.backend() != "torch":
        return False
    import torch

    return torch.compiler.is_compiling()


def executing_eagerly(probe: keras.Variable) -> bool:
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly()
    if backend == "jax":
        import jax

        return not isinstance(ops.convert_to_tensor(probe), jax.core.Tracer)
    if backend == "torch":
        import torch

        return not torch.compiler.is_compiling()
    return True
