"""`train_on_batch` of an attached model returns what Keras returns.

The attached `train_step` adds training-health figures to the step's logs
(`nanguard_grad_norm`, ...), and after a rejected step it logs the metrics
as they are, without the rejected batch: `fit` shows those in its progress
bar, History and callbacks (`TerminateOnNaN` does not stop on a batch that
was not applied). `train_on_batch` is another contract: Keras returns the
batch's own figures, flattened into a list unless there is one. So the
attached model's `train_on_batch` runs a train function of its own, traced
with the step's own logs (`raw_logs`), and leaves the `nanguard_*` entries
out of its `return_dict=False` result; with `return_dict=True` they stay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import keras

from keras_nanguard.safe_optimizer import patches

PREFIX = "nanguard_"  # the log entries of keras-nanguard's figures


def wrap(
    model: keras.Model, raw_logs: Callable[[], contextlib.AbstractContextManager]
) -> None:
    """Makes `model.train_on_batch` return what Keras's returns: its step
    traced and run inside `raw_logs()`, the `nanguard_*` entries left out
    of its `return_dict=False` result."""
    original = patches.original_of(model, "train_on_batch")
    # Its own train function, and `fit`'s when it was made: a new one for
    # `fit` (after `compile`, or `attach`) means this one is stale too.
    made: dict[str, Any] = {"own": None, "beside": None}

    def train_on_batch(
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        class_weight: Any = None,
        return_dict: bool = False,
    ) -> Any:
        fit_function = model.train_function
        if made["beside"] is not fit_function:
            made["own"], made["beside"] = None, fit_function
        model.train_function = made["own"]  # Keras makes it when None
        try:
            with raw_logs():
                logs = original(
                    x,
                    y,
                    sample_weight=sample_weight,
                    class_weight=class_weight,
                    return_dict=True,
                )
            made["own"] = model.train_function
        finally:
            model.train_function = fit_function
        if return_dict or not isinstance(logs, dict):
            return logs
        own = {k: v for k, v in logs.items() if not k.startswith(PREFIX)}
        return in_keras_order(model, own)

    train_on_batch.__doc__ = original.__doc__
    patches.patch(model, "train_on_batch", train_on_batch, wrap, original)


def unwrap(model: keras.Model) -> None:
    """Undoes `wrap`."""
    if patches.owner_of(model, "train_on_batch") is wrap:
        patches.unpatch(model, "train_on_batch")


def _metric_names(model: keras.Model) -> list[str]:
    """The names of `model.metrics` in order, a container of metrics (the
    compiled metrics) by the names of the metrics it holds."""
    names: list[str] = []
    for metric in model.metrics:
        held = getattr(metric, "metrics", None)
        if isinstance(held, list | tuple):
            names += [m.name for m in held]
        else:
            names.append(metric.name)
    return names


def in_keras_order(model: keras.Model, logs: dict[str, Any]) -> Any:
    """`logs` as Keras's `train_on_batch(return_dict=False)` returns them:
    the metrics' values in the order of `model.metrics`, then the other
    entries by name; one value alone, not in a list."""
    names = _metric_names(model)
    results = [logs[n] for n in names if n in logs]
    results += [logs[k] for k in sorted(logs) if k not in names]
    return results[0] if len(results) == 1 else results
