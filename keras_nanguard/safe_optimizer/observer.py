"""What the flight recorder sees of an attached `fit` step's batch: the
loss (from Keras's running mean of it, before and after the step), the
inputs, and the model's outputs (`compute_metrics`, wrapped on the model,
hands them on).
"""

from __future__ import annotations

import threading
from typing import Any

import keras
from keras import ops

from keras_nanguard.safe_optimizer import patches


class StepObserver:
    """Hands a `fit` step's batch figures to the flight recorder."""

    def __init__(self) -> None:
        self._local = threading.local()  # per thread: tf.distribute replicas

    # ------------------------------------------------------------ the model
    def wrap(self, model: keras.Model) -> None:
        """Wraps `model.compute_metrics` (outermost), which sees the outputs."""
        if patches.owner_of(model, "compute_metrics") is self:
            return
        original = model.compute_metrics

        def compute_metrics(x: Any, y: Any, y_pred: Any, sample_weight: Any = None):
            if getattr(self._local, "watching", False):
                self._local.outputs = y_pred
            return original(x, y, y_pred, sample_weight)

        patches.patch(model, "compute_metrics", compute_metrics, self, original)

    def unwrap(self, model: keras.Model) -> None:
        """Undoes `wrap`."""
        if patches.owner_of(model, "compute_metrics") is self:
            patches.unpatch(model, "compute_metrics")

    # ------------------------------------------------------------ a step
    def begin(self) -> None:
        self._local.watching, self._local.outputs = True, None

    def outputs(self) -> Any:
        """The outputs `compute_metrics` saw in this step so far (or None)."""
        return getattr(self._local, "outputs", None)

    def end(self) -> Any:
        """Ends the step: the outputs `compute_metrics` saw (None if none)."""
        outputs = getattr(self._local, "outputs", None)
        self._local.watching, self._local.outputs = False, None
        return outputs


def loss_tracker(model: keras.Model) -> list[keras.Variable]:
    """The (total, count) variables of Keras's running mean of the loss,
    which weighs each batch by its size (the quarantine's `weigh_loss` makes
    it the healthy rows' count). Empty when the model has none."""
    for metric in model.metrics:
        if metric.name == "loss" and isinstance(metric, keras.metrics.Mean):
            return [metric.total, metric.count]
    return []


def tracker_positions(model: keras.Model) -> list[int]:
    """Where `loss_tracker`'s variables are in `model.metrics_variables` (a
    stateless step's metric values)."""
    index = {id(v): i for i, v in enumerate(model.metrics_variables)}
    return [index[id(v)] for v in loss_tracker(model)]


def step_loss(before: list[Any], after: list[Any]) -> Any:
    """The loss of one step, from the running mean's (total, count) before
    and after it (NaN when there is no tracker)."""
    if len(before) != 2:
        return None
    total = ops.cast(after[0], "float32") - ops.cast(before[0], "float32")
    count = ops.cast(after[1], "float32") - ops.cast(before[1], "float32")
    return total / ops.where(count > 0, count, 1.0)


def inputs_of(data: Any) -> Any:
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    return x
