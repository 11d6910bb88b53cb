"""An epoch's loss and metrics without the batches NaNGuard leaves out."""

from __future__ import annotations

import math
from typing import Any


class EpochFigures:
    """Keras logs running means over the epoch, kept in its metric states. To
    leave a batch out of a figure, the part kept so far is folded into
    `prefix` and the caller resets Keras's states; reported figures are then
    the batch-weighted mean of `prefix` and Keras's running mean since the
    reset (`segment`): exact for mean metrics with equal batch sizes.

    A batch may be left out of some figures only (a non-finite metric with a
    finite loss), so `prefix` keeps a count per figure. A figure with no kept
    batch at all is left out of the logs, as Keras leaves out `val_*` figures
    in an epoch it did not validate.
    """

    def __init__(self) -> None:
        self.prefix: dict[str, tuple[float, int]] = {}  # name: (mean, batches)
        self.segment: dict[str, float] = {}
        self.segment_n = 0  # batches since Keras's states were last reset

    def keep(self, logs: dict, steps: int = 1) -> None:
        """`steps` kept batches: `logs` (Keras's running means) become the
        segment's, and show the combined figures."""
        self.segment = {k: float(v) for k, v in logs.items() if is_metric(k, v)}
        self.segment_n += steps
        self._show(logs)

    def leave_out(
        self, logs: dict, keys: list[str] | None = None, steps: int = 1
    ) -> None:
        """Leaves the last `steps` batches out of the figures in `keys` (all by
        default); the other figures keep them. `logs` then show the figures
        without them (a figure with nothing kept yet is removed). The caller
        resets Keras's metric states next."""
        current = {k: float(v) for k, v in logs.items() if is_metric(k, v)}
        for key in set(current) | set(self.segment):
            if keys is None or key in keys or key not in current:
                if key in self.segment:
                    self._fold(key, self.segment[key], self.segment_n)
            else:  # Keras's running mean already includes these batches
                self._fold(key, current[key], self.segment_n + steps)
        self.segment, self.segment_n = {}, 0
        self._show(logs)

    def finish(self, logs: dict) -> None:
        """The epoch-end logs (Keras's, from its states) without the left-out
        batches; a training figure with no kept batch is removed."""
        if self.segment_n:
            self.segment = {
                k: float(v)
                for k, v in logs.items()
                if is_metric(k, v) and not k.startswith("val_")
            }
        self._show(logs, train_only=True)

    def _fold(self, key: str, mean: float, n: int) -> None:
        if n:
            self.prefix[key] = _mean(self.prefix.get(key, (0.0, 0)), (mean, n))

    def _show(self, logs: dict, train_only: bool = False) -> None:
        for key in [k for k, v in logs.items() if is_metric(k, v)]:
            if train_only and key.startswith("val_"):
                continue
            parts = [self.prefix.get(key, (0.0, 0))]
            if self.segment_n and key in self.segment:
                parts.append((self.segment[key], self.segment_n))
            mean, n = _mean(*parts) if len(parts) == 2 else parts[0]
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
