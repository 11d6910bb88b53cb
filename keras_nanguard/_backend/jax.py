"""The JAX backend's side of keras_nanguard (see `interface.Backend`)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np
from keras import ops

from keras_nanguard._backend import common

Tensor = Any

NAME = "jax"
ASYNC_BATCH_END = True
STATELESS_TRAIN_STEP = True
COPIES_ON_WRITE = False  # arrays are immutable: an assign makes a new one
REUSES_DEVICE_BUFFERS = False

frozen = common.no_frozen
restore_unless = common.restore_by_assign
constant_table = common.host_constant
run_step = common.plain_step
record_rows = common.record_rows
in_replica = common.in_replica


def assign_block(
    variable: keras.Variable, row: Tensor, col: int, values: Tensor
) -> None:
    # A dynamic-update-slice: in place in a donated step (a scatter of the
    # entries copied the whole buffer there).
    buffer = variable.value
    variable.assign(
        jax.lax.dynamic_update_slice(
            buffer,
            values[None].astype(buffer.dtype),
            (jnp.asarray(row, "int32"), jnp.int32(col)),
        )
    )


def host_view(value: Tensor) -> np.ndarray:
    return np.asarray(value)


def device_copy(value: Tensor) -> Tensor:
    return jnp.array(value, copy=True)  # a new buffer: the step donates its own


@jax.jit
def _copies(values: list[Tensor]) -> list[Tensor]:
    return [jnp.copy(v) for v in values]  # outputs are new buffers


def eager_read(variable: keras.Variable) -> np.ndarray:
    return np.array(ops.convert_to_numpy(variable.value))


def device_copies(values: list[Tensor]) -> list[Tensor]:
    # One dispatch for all: a copy each costs a dispatch each (51 for two
    # small LSTMs and Adam, 4x the time).
    return _copies(list(values)) if values else []


def start_host_copies(values: list[Tensor]) -> list[Tensor]:
    copies = device_copies(values)
    for c in copies:
        c.copy_to_host_async()
    return copies


def device_room(variables: list[keras.Variable], need: int) -> bool:
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return True  # CPU
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return need < free - stats["bytes_limit"] // 4


def held_value(variable: keras.Variable) -> Tensor:
    return variable.value  # immutable: an assign makes a new array


def copy_values(values: list[Tensor], buffers: list | None) -> list:
    return list(values)  # immutable


def copy_into(buffers: list[Tensor], values: list[Tensor]) -> None:
    raise TypeError("JAX arrays are immutable: a device snapshot is not reused")


def assignable(value: Tensor, variable: keras.Variable) -> Tensor:
    if isinstance(value, np.ndarray):
        held = variable.value
        if held.is_fully_addressable:
            return value
        # Across processes: each process places its own part of the host
        # value, with no collective (`device_put` of a host array checks
        # that every process passes the same one, NaN never equal to itself).
        return jax.make_array_from_callback(
            value.shape, held.sharding, lambda index: value[index]
        )
    # JAX keeps an assigned array as is, and the next step donates it: a
    # device snapshot lends a copy, jitted to keep its sharding (Keras then
    # places it as it is).
    return _copies([value])[0]


def sync_state(model: keras.Model) -> None:
    if hasattr(model, "jax_state_sync"):
        model.jax_state_sync()


def live_value(variable: keras.Variable, model: Any) -> Tensor | None:
    # Between two steps of an epoch, Keras's trainer holds the state the
    # last step returned in `model._jax_state` (for `jax_state_sync`), the
    # variables emptied. Read from there: a sync would assign every
    # variable of the model at every step.
    state = getattr(model, "_jax_state", None)
    if not state or getattr(model, "_jax_state_synced", True):
        return variable.value  # current (or None: not found)
    optimizer = getattr(model, "optimizer", None)
    values = state.get("optimizer_variables")
    if optimizer is None or not values:
        return None
    index = _index_in(optimizer, variable)
    if index is None or len(values) != len(optimizer.variables):
        return None
    return values[index]


# The place of a variable in an optimizer's `variables`, found once (polled
# at every turn of NaNGuard, the hot path); fixed once the optimizer is built.
_INDEXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _index_in(optimizer: Any, variable: keras.Variable) -> int | None:
    found = _INDEXES.setdefault(optimizer, {})
    if id(variable) not in found:
        ids = [id(v) for v in optimizer.variables]
        if id(variable) not in ids:
            return None  # not this optimizer's (not cached: it may be built later)
        found[id(variable)] = ids.index(id(variable))
    return found[id(variable)]


def extra_forward_state(model: keras.Model) -> list[Tensor]:
    return []


def compiling() -> bool:
    return False


def executing_eagerly(probe: keras.Variable) -> bool:
    return not isinstance(ops.convert_to_tensor(probe), jax.core.Tracer)


def discarded_if_building() -> bool:
    return False  # traced once: what is traced runs


def rollback_buffers(state: list[keras.Variable], cache: dict) -> list | None:
    return None


def no_grad() -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _segment_sums(values: list[Tensor], parts: list[Tensor]) -> list[Tensor]:
    """Per tensor of `values`, the sums of each of `parts` (joint vectors of
    their entries in order, as `_joint` makes them)."""
    ids = common.segment_ids(values)
    return [
        jax.ops.segment_sum(p, ids, len(values), indices_are_sorted=True) for p in parts
    ]


def _joint(values: list[Tensor]) -> Tensor:
    return jnp.concatenate([v.astype("float32").reshape(-1) for v in values])


def sums_of_squares(values: list[Tensor]) -> tuple[Tensor, Tensor]:
    def both(v: Tensor) -> tuple[Tensor, Tensor]:
        # One variadic reduction: XLA reads `v` once for both sums (two
        # reductions are two passes on some XLA backends).
        v = v.astype("float32")
        small = v * 2.0**-64
        return jax.lax.reduce(
            (v * v, small * small),
            (jnp.float32(0), jnp.float32(0)),
            lambda a, b: (a[0] + b[0], a[1] + b[1]),
            tuple(range(v.ndim)),
        )

    def together(part: list[Tensor]) -> list[tuple[Tensor, Tensor]]:
        joint = _joint(part)
        tiny = joint * 2.0**-64
        a, b = _segment_sums(part, [joint * joint, tiny * tiny])
        return [(a[k], b[k]) for k in range(len(part))]

    sums = common.per_tensor([common.raw(v) for v in values], both, together)
    return ops.stack([a for a, _ in sums]), ops.stack([b for _, b in sums])


def update_sums(old: list[Tensor], new: list[Tensor]) -> tuple[Tensor, Tensor]:
    def both(pair: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        # One variadic reduction: XLA reads the pair once for both sums.
        o, n = (x.astype("float32") for x in pair)
        d = n - o
        return jax.lax.reduce(
            (d * d, o * o),
            (jnp.float32(0), jnp.float32(0)),
            lambda a, b: (a[0] + b[0], a[1] + b[1]),
            tuple(range(o.ndim)),
        )

    sums = [both((common.raw(o), common.raw(n))) for o, n in zip(old, new, strict=True)]
    return jnp.stack([a for a, _ in sums]), jnp.stack([b for _, b in sums])


def finite_flags(values: list[Tensor]) -> Tensor:
    raws = [common.raw(v) for v in values]
    if raws and not isinstance(raws[0], jax.core.Tracer):
        return _finite_flags_jit(raws)  # eager: one dispatch, not one per value
    return _finite_flags(raws)


def _finite_flags(values: list[Tensor]) -> Tensor:
    # A sum of `v - v`: NaN exactly when an entry is NaN or inf, else 0 (it
    # cannot overflow). One read, the bytes of a maximum; `all(isfinite)`
    # and `v * 0` cost XLA:CPU 2 and 4 more bytes per entry (a mask, a
    # broadcast zero). XLA folds `v - v` to 0 for floats only under fast
    # math, which folds every finiteness check away (isfinite included).
    def together(part: list[Tensor]) -> list[Tensor]:
        joint = _joint(part)  # float32 keeps NaN, inf
        (found,) = _segment_sums(part, [joint - joint])
        return [found[k] for k in range(len(part))]

    return ops.isfinite(
        ops.stack(common.per_tensor(values, lambda v: ops.sum(v - v), together))
    )


_finite_flags_jit = jax.jit(_finite_flags)


def softmax_parts(x: Tensor, axis: int | tuple[int, ...], log: bool) -> Tensor:
    # Under XLA the careful form fuses into one softmax-like kernel.
    return common.careful_softmax_parts(x, axis, log)


def gradient_pass(
    model: keras.Model, x: Any, loss_of: Callable[[Any], Any], outputs: bool
) -> tuple[Any, Any, Callable[[], list[np.ndarray | None]]]:
    # JAX cannot differentiate an eager pass: `jax.grad` of the same pass
    # re-run statelessly, as a function of the weights.
    y_pred = loss = None
    if outputs:
        y_pred = model(x, training=True)
        loss = loss_of(y_pred)
    tv = model.trainable_variables

    def objective(values: list[Tensor]) -> Tensor:
        with keras.StatelessScope(state_mapping=list(zip(tv, values, strict=True))):
            return loss_of(model(x, training=True))

    return (
        y_pred,
        loss,
        lambda: common.numpy_grads(jax.grad(objective)([v.value for v in tv])),
    )


def processes() -> tuple[int, int]:
    return jax.process_index(), jax.process_count()


def gather_ints(values: list[int]) -> list[list[int]]:
    if jax.process_count() == 1:
        return [list(values)]
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.asarray(values, np.int32))
    return np.asarray(gathered).reshape(jax.process_count(), -1).tolist()


def held_whole(variables: list[keras.Variable]) -> bool:
    return all(
        v.value.is_fully_addressable or v.value.is_fully_replicated for v in variables
    )


def replica_sum(value: Tensor) -> tuple[Tensor, int]:
    return value, 1  # a keras.distribution step sees the global batch
