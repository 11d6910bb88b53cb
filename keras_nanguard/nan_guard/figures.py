"""An epoch's loss and metrics without the batches NaNGuard leaves out."""

from __future__ import annotations

import math
from typing import Any


class EpochFigures:
    """Keras logs running means over the batches since its metric states were
    last reset (`since_reset` of them). To leave a batch out of a figure,
    the figure is *tainted* (its running mean includes that batch) until the
    states are reset: reported figures are then the batch-weighted mean of
    `prefix` (the parts folded at earlier resets) and `segment` (the last
    running mean kept since the last reset): exact for mean metrics with
    equal batch sizes.

    A batch may be left out of some figures only (a non-finite metric with a
    finite loss), so each figure has its own parts. A figure with no kept
    batch at all is left out of the logs, as Keras leaves out `val_*`
    figures in an epoch it did not validate.
    """

    def __init__(self) -> None:
        self.prefix: dict[str, tuple[float, int]] = {}  # name: (mean, batches)
        self.segment: dict[str, tuple[float, int]] = {}
        self.tainted: set[str] = set()
        self.since_reset = 0  # batches in Keras's running means

    def add(
        self, logs: dict, counted: int, leave_out: list[str] | bool = False
    ) -> None:
        """One execution's logs. `counted`: its batches that Keras's metric
        states hold (a step rejected by an attached SafeOptimizer is not
        counted there); `leave_out`: the figures to leave it out of (`True`:
        all). `logs` then show the figures without the left-out batches (a
        figure with nothing kept yet is removed)."""
        self.since_reset += counted
        for key, value in logs.items():
            if not is_metric(key, value):
                continue
            if leave_out is True or key in (leave_out or ()):
                self.tainted.add(key)
            elif key not in self.tainted:
                self.segment[key] = (float(value), self.since_reset)
        self._show(logs)

    def reset(self) -> None:
        """Keras's metric states were reset (before the batch now seen)."""
        for key, part in self.segment.items():
            self._fold(key, *part)
        self.segment, self.tainted, self.since_reset = {}, set(), 0

    def finish(self, logs: dict) -> None:
        """The epoch-end logs (Keras's, from its states) without the left-out
        batches; a training figure with no kept batch is removed."""
        for key, value in logs.items():
            train = is_metric(key, value) and not key.startswith("val_")
            if train and key not in self.tainted:
                self.segment[key] = (float(value), self.since_reset)
        self._show(logs, train_only=True)

    def _fold(self, key: str, mean: float, n: int) -> None:
        if n:
            self.prefix[key] = _mean(self.prefix.get(key, (0.0, 0)), (mean, n))

    def _show(self, logs: dict, train_only: bool = False) -> None:
        for key in [k for k, v in logs.items() if is_metric(k, v)]:
            if train_only and key.startswith("val_"):
                continue
            mean, n = _mean(
                self.prefix.get(key, (0.0, 0)), self.segment.get(key, (0.0, 0))
            )
            if n:
                logs[key] = mean
            else:  # nothing kept: no figure rather than NaN
                del logs[key]


def _mean(a: tuple[float, int], b: tuple[float, int]) -> tuple[float, int]:
    """Batch-weighted mean of two running means, and the batches in it."""
    (mean_a, n_a), (mean_b, n_b) = a, b
    if n_a == 0:
        return mean_b, n_b
    if n_b == 0:
        return mean_a, n_a
    return (mean_a * n_a + mean_b * n_b) / (n_a + n_b), n_a + n_b


def is_metric(key: str, value: Any) -> bool:
    if key.startswith("nanguard_"):
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def nonfinite(value: Any) -> bool:
    try:
        return not math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def is_loss(key: str) -> bool:
    """Whether a log key is a loss (`loss`, or an output's `..._loss`)."""
    return key == "loss" or key.endswith("_loss")


def nonfinite_validation(logs: dict[str, Any]) -> str | None:
    """The detail of a `nonfinite_validation` incident: the epoch's
    non-finite `val_` figures, with the weights finite; `None` if none."""
    bad = sorted(k for k, v in logs.items() if k.startswith("val_") and nonfinite(v))
    if not bad:
        return None
    shown = ", ".join(f"{k}={logs[k]}" for k in bad)
    return (
        f"non-finite {shown} at the end of the epoch. The weights are finite: "
        "the validation data or the model's outputs on it are not."
    )
