"""Mixed precision: the loss scalers around a SafeOptimizer, and their skips.

Under `mixed_float16`, `model.compile` wraps the optimizer in a
`keras.optimizers.LossScaleOptimizer` (users may add one themselves). When the
scaled gradients are not finite, the loss scaler skips the step inside its
own branch: it halves its scale, resets its growth counter and never calls
the SafeOptimizer inside it. The whole-model transaction must still reject
such a step (BatchNormalization statistics, seed state and metrics stay as
they were), so it reads the scalers' state around the step:

- a scaler skipped exactly when its scale went down (an accepted step keeps
  it or doubles it);
- a skip whose batch loss was not finite is bad data, not an overflow of the
  float16 gradients: the scaler's state is put back (halving the scale would
  not help, and the run then equals the run without that batch); a skip with
  a finite loss is an overflow, and the scaler keeps its halved scale, as it
  does without keras-nanguard.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from keras_nanguard.safe_optimizer import step_ops
from keras_nanguard.safe_optimizer.counters import Counters


def scalers(outer: Any, safe: Any) -> list[keras.optimizers.LossScaleOptimizer]:
    """The `LossScaleOptimizer`s between `outer` (the model's optimizer) and
    `safe`, outermost first; empty when `safe` is `outer`'s own."""
    found = []
    while outer is not None and outer is not safe:
        if isinstance(outer, keras.optimizers.LossScaleOptimizer):
            found.append(outer)
        outer = getattr(outer, "inner_optimizer", None)
    return found


def state(found: list[keras.optimizers.LossScaleOptimizer]) -> list[keras.Variable]:
    """The scalers' own variables: growth counter and scale, per scaler."""
    out: list[keras.Variable] = []
    for scaler in found:
        if not scaler.built:
            return []  # built by its first apply, inside the step
        out += [scaler.step_counter, scaler.dynamic_scale]
    return out


def read_state(found: list[keras.optimizers.LossScaleOptimizer]) -> list[Any]:
    """The values of `state(found)` now, unaffected by the step's writes; a
    scaler not built yet (its first `apply` builds it) starts from its
    initial scale and a growth counter of 0."""
    values: list[Any] = []
    for scaler in found:
        if scaler.built:
            values += [
                ops.copy(scaler.step_counter.value),
                ops.copy(scaler.dynamic_scale.value),
            ]
        else:
            values += [0, float(scaler.initial_scale)]  # typed by `typed`
    return values


def typed(before: list[Any], variables: list[keras.Variable]) -> list[Any]:
    """`before` as tensors of the variables' dtypes (a scaler built during
    the step had plain numbers)."""
    return [
        ops.convert_to_tensor(b, v.dtype) if isinstance(b, (int, float)) else b
        for b, v in zip(before, variables, strict=True)
    ]


def skipped(before: list[Any], after: list[Any]) -> Any:
    """Whether a scaler skipped the step, from `state` before and after it
    (bool scalar): its scale went down."""
    flag = ops.convert_to_tensor(False)
    for old, new in zip(before[1::2], after[1::2], strict=True):
        flag = ops.logical_or(flag, new < old)
    return flag


def finite_loss(logs: Any) -> Any:
    """Whether the step's logged loss is finite (bool scalar), or `None` when
    the logs carry no loss (a custom `train_step`)."""
    if not isinstance(logs, dict) or "loss" not in logs:
        return None
    return ops.all(ops.isfinite(ops.convert_to_tensor(logs["loss"])))


def settle(counters: Counters, found: list[Any], before: list[Any], logs: Any) -> Any:
    """After a step under the loss scalers `found` (their `read_state` in
    `before`): whether one of them skipped it (bool scalar). A skip with a
    non-finite loss is bad data: the scalers' state is put back and the
    `counters` (of the SafeOptimizer inside) count a rejected step; with a
    finite loss it is an overflow, counted apart, and the scalers keep their
    halved scale."""
    variables = state(found)
    before = typed(before, variables)
    skip = skipped(before, [v.value for v in variables])
    loss_ok = finite_loss(logs)
    bad_data = ops.convert_to_tensor(False)
    if loss_ok is not None:
        bad_data = ops.logical_and(skip, ops.logical_not(loss_ok))
    step_ops.restore_unless(ops.logical_not(bad_data), variables, before)
    counters.record_scaler_skip(skip, bad_data)
    return skip
