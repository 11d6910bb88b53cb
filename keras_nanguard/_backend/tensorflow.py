"""The TensorFlow backend's side of keras_nanguard (see `interface.Backend`),
with the one place that knows `tf.distribute` (`run_step`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from keras_nanguard._backend import common

Tensor = Any

NAME = "tensorflow"
ASYNC_BATCH_END = False  # Keras runs batch ends in line
STATELESS_TRAIN_STEP = False
COPIES_ON_WRITE = True
REUSES_DEVICE_BUFFERS = False

frozen = common.no_frozen
restore_unless = common.restore_by_assign
constant_table = common.host_constant
update_sums = common.update_sums


def host_view(value: Tensor) -> np.ndarray:
    if hasattr(value, "read_value"):
        value = value.read_value()  # a read is a copy-on-write view
    return np.asarray(value)


def eager_read(variable: keras.Variable) -> np.ndarray:
    with tf.init_scope():  # out of a traced step: the variable's own value
        return np.asarray(variable.value.read_value())


def device_copies(values: list[Tensor]) -> list[Tensor]:
    return [tf.identity(v) for v in values]  # a read of a variable


def start_host_copies(values: list[Tensor]) -> list[Tensor]:
    return device_copies(values)


def device_room(variables: list[keras.Variable], need: int) -> bool:
    # Snapshots are host copies: a read per epoch is cheap next to a TF
    # step, and a device copy would be a copy-on-write view anyway.
    return False


def held_value(variable: keras.Variable) -> Tensor:
    return variable.value.read_value()  # copied on write


def copy_values(values: list[Tensor], buffers: list | None) -> list:
    # A read is a copy-on-write snapshot: the buffer is copied only if the
    # variable is then written in place while the snapshot is alive.
    return [tf.identity(t) for t in values]


def copy_into(buffers: list[Tensor], values: list[Tensor]) -> None:
    raise TypeError("TensorFlow keeps no device snapshots to reuse")


def assignable(value: Tensor, variable: keras.Variable) -> Tensor:
    return value


def sync_state(model: keras.Model) -> None:
    return None


def live_value(variable: keras.Variable, model: Any) -> Tensor | None:
    return variable.value


def extra_forward_state(model: keras.Model) -> list[Tensor]:
    return []


def compiling() -> bool:
    return False


def executing_eagerly(probe: keras.Variable) -> bool:
    return tf.executing_eagerly()


def discarded_if_building() -> bool:
    # A `tf.function` whose first trace makes variables is traced again,
    # and only that second trace runs (once the variables are initialised
    # from their initial values: those of an optimizer's build are constants).
    return tf.inside_function()


def rollback_buffers(state: list[keras.Variable], cache: dict) -> list | None:
    return None


def no_grad() -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


assign_block = common.assign_block


def in_replica() -> bool:
    return tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context()


def record_rows(record: Callable[[Any, Any], None], codes: Any, over: Any) -> None:
    """`record_rows` under `tf.distribute`: every replica's rows (of every
    worker), in replica order, recorded once in cross-replica context
    (mirrored writes, alike on every worker)."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None or not tf.distribute.has_strategy():
        record(codes, over)
        return
    limits = tf.fill(tf.shape(codes), tf.cast(tf.reshape(over, ()), tf.int32))
    all_codes = ctx.all_gather(codes, axis=0)
    all_limits = ctx.all_gather(limits, axis=0) > 0

    def cross_replica(distribution: Any, codes: Any, over: Any) -> None:
        record(
            distribution.experimental_local_results(codes)[0],
            distribution.experimental_local_results(over)[0],
        )

    ctx.merge_call(cross_replica, args=(all_codes, all_limits))


def run_step(
    run: Callable[..., None],
    inner: keras.optimizers.Optimizer,
    grads: list,
    variables: list,
) -> None:
    """The transaction under `tf.distribute`.

    In a replica context of a real strategy each replica holds its own
    gradients. They are all-reduced first, and the whole transaction then
    runs once in cross-replica context (`merge_call`), as Keras's
    LossScaleOptimizer does: one decision, taken on the aggregated
    gradients and the resulting mirrored state, and so the same on every
    replica, with every write (update, rollback, counters) mirrored.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None or not tf.distribute.has_strategy():
        run(grads, variables, None)  # default strategy or cross-replica
        return
    present = [i for i, g in enumerate(grads) if g is not None]
    reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in present])
    summed: list[Any] = [None] * len(grads)
    for i, g in zip(present, reduced, strict=True):
        summed[i] = g

    def cross_replica(distribution: Any, summed: list, grads: list, variables: list):
        variables = list(variables)
        # The decision: on the summed gradients (the same on every replica).
        decide_on = [
            None if g is None else distribution.experimental_local_results(g)[0]
            for g in summed
        ]

        def update(clip: Callable[[list], list]) -> None:
            # The update: each replica hands the inner optimizer its own
            # gradients, which it all-reduces itself, as it would unwrapped.
            def per_replica(grads: Any, variables: Any) -> None:
                inner.apply(clip(list(grads)), list(variables))

            distribution.extended.call_for_each_replica(
                per_replica, args=(grads, variables)
            )

        run(decide_on, variables, update)

    ctx.merge_call(cross_replica, args=(summed, grads, variables))


def sums_of_squares(values: list[Tensor]) -> tuple[Tensor, Tensor]:
    def alone(v: Tensor) -> tuple[Tensor, Tensor]:
        # L2Loss is one fused kernel; square-then-sum allocates a temporary.
        v = tf.cast(v, "float32")
        return 2.0 * tf.nn.l2_loss(v), 2.0 * tf.nn.l2_loss(v * 2.0**-64)

    def together(part: list[Tensor]) -> list[tuple[Tensor, Tensor]]:
        joint = _joint(part)
        tiny = joint * 2.0**-64
        ids = common.segment_ids(part)
        a = tf.math.unsorted_segment_sum(joint * joint, ids, len(part))
        b = tf.math.unsorted_segment_sum(tiny * tiny, ids, len(part))
        # One Unpack, not a slice per tensor: a slice costs ~1 ms to trace.
        n = len(part)
        return list(zip(tf.unstack(a, num=n), tf.unstack(b, num=n), strict=True))

    sums = common.per_tensor(values, alone, together)
    return tf.stack([a for a, _ in sums]), tf.stack([b for _, b in sums])


def finite_flags(values: list[Tensor]) -> Tensor:
    def together(part: list[Tensor]) -> list[Tensor]:
        bad = tf.cast(tf.logical_not(tf.math.is_finite(_joint(part))), "float32")
        ids = common.segment_ids(part)
        found = tf.math.unsorted_segment_sum(bad, ids, len(part)) == 0
        return tf.unstack(found, num=len(part))

    return tf.stack(
        common.per_tensor(
            values, lambda v: tf.reduce_all(tf.math.is_finite(v)), together
        )
    )


def _joint(values: list[Tensor]) -> Tensor:
    """The entries of `values` in one float32 vector (keeps NaN and inf)."""
    return tf.concat([tf.reshape(tf.cast(v, "float32"), [-1]) for v in values], 0)


def softmax_parts(x: Tensor, axis: int | tuple[int, ...], log: bool) -> Tensor:
    # The backend's fused kernel whenever every row's maximum is finite, the
    # careful form otherwise.
    m = ops.max(x, axis=axis, keepdims=True)
    fused = ops.log_softmax if log else ops.softmax
    return ops.cond(
        ops.all(ops.isfinite(m)),
        lambda: fused(x, axis=axis),
        lambda: common.careful_softmax_parts(x, axis, log, m),
    )


def gradient_pass(
    model: keras.Model, x: Any, loss_of: Callable[[Any], Any], outputs: bool
) -> tuple[Any, Any, Callable[[], list[np.ndarray | None]]]:
    tv = model.trainable_variables
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = loss_of(y_pred)
    return y_pred, loss, lambda: common.numpy_grads(tape.gradient(loss, tv))


def _workers() -> Any:
    """The MultiWorkerMirroredStrategy in scope with more than one worker,
    or None."""
    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return None
    resolver = strategy.cluster_resolver
    if resolver.cluster_spec().num_tasks("worker") < 2:
        return None
    return strategy


def processes() -> tuple[int, int]:
    strategy = _workers()
    if strategy is None:
        return 0, 1
    resolver = strategy.cluster_resolver
    return int(resolver.task_id), resolver.cluster_spec().num_tasks("worker")


def gather_ints(values: list[int]) -> list[list[int]]:
    strategy = _workers()
    if strategy is None:
        return [list(values)]
    local = tf.constant([list(values)], tf.int32)

    def gather() -> Any:
        return tf.distribute.get_replica_context().all_gather(local, axis=0)

    # Each replica's copy: the workers' devices in order, each worker's
    # values once per local device.
    out = strategy.experimental_local_results(strategy.run(gather))[0].numpy()
    per_worker = len(out) // processes()[1]
    return out[::per_worker].tolist()


def held_whole(variables: list[keras.Variable]) -> bool:
    return True  # a worker's mirrored variables are whole on each device


def replica_sum(value: Tensor) -> tuple[Tensor, int]:
    # Across workers only: one process's replicas of a MirroredStrategy
    # keep the per-replica reduction they had (a collective here put the
    # replicas' collectives out of step with those of later strategies).
    if _workers() is None or tf.distribute.in_cross_replica_context():
        return value, 1
    context = tf.distribute.get_replica_context()
    total = context.all_reduce(tf.distribute.ReduceOp.SUM, value)
    return total, context.num_replicas_in_sync
