"""An epoch's loss and metrics without the batches NaNGuard leaves out."""

from __future__ import annotations

import math
from typing import Any


class EpochFigures:
    """Keras logs running means over the epoch, kept in its metric states. To
    leave a batch out, the kept part so far is folded into `prefix` and the
    caller resets Keras's states; reported figures are then the batch-weighted
    mean of `prefix` and Keras's running mean since the reset (`segment`):
    exact for mean metrics with equal batch sizes."""

    def __init__(self) -> None:
        self.prefix: dict[str, float] = {}
        self.prefix_n = 0
        self.segment: dict[str, float] = {}
        self.segment_n = 0
        self.left_out = 0

    def keep(self, logs: dict) -> None:
        """A kept batch: `logs` (Keras's running means) become the segment's,
        and show the combined figures."""
        self.segment = {k: float(v) for k, v in logs.items() if is_metric(k, v)}
        self.segment_n += 1
        if self.prefix_n:
            logs.update(_mean(self.prefix, self.prefix_n, self.segment, self.segment_n))

    def leave_out(self, logs: dict) -> None:
        """A left-out batch: fold the segment into the prefix; `logs` show the
        figures without this batch (none yet if nothing was kept)."""
        self.prefix = _mean(self.prefix, self.prefix_n, self.segment, self.segment_n)
        self.prefix_n += self.segment_n
        self.segment, self.segment_n = {}, 0
        self.left_out += 1
        for key in [k for k, v in logs.items() if is_metric(k, v)]:
            if key in self.prefix:
                logs[key] = self.prefix[key]
            else:  # nothing good to show yet
                del logs[key]

    def finish(self, logs: dict) -> None:
        """The epoch-end logs (Keras's from its states) without left-out batches."""
        if self.prefix_n:
            train = {k: float(logs[k]) for k in self.prefix if k in logs}
            segment = train if self.segment_n else {}
            logs.update(_mean(self.prefix, self.prefix_n, segment, self.segment_n))
        elif self.left_out and not self.segment_n:
            # Every batch was left out: there is no figure to report.
            for key in [k for k in logs if is_metric(k, logs[k])]:
                if not key.startswith("val_"):
                    logs[key] = float("nan")


def _mean(
    a: dict[str, float], n_a: int, b: dict[str, float], n_b: int
) -> dict[str, float]:
    """Batch-weighted mean of two running means."""
    if n_a == 0:
        return dict(b)
    if n_b == 0:
        return dict(a)
    return {
        k: (a[k] * n_a + v * n_b) / (n_a + n_b) if k in a else v for k, v in b.items()
    }


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
