"""When a periodic host-side job of NaNGuard (a snapshot, a read of the
optimizer's counters) is due."""

from __future__ import annotations

import math


class Cadence:
    """Every `every` steps, or, with "auto", as often as keeps the job's
    measured cost within `budget` of the measured step time, and at least
    `min_every` steps apart."""

    def __init__(self, every: int | str, budget: float, min_every: int) -> None:
        self.every, self.budget, self.min_every = every, budget, min_every
        self.cost: float | None = None
        self.since = 0

    def due(self, step_seconds: float | None, steps: int = 1) -> bool:
        """Whether the job is due after `steps` more steps of `step_seconds`."""
        self.since += steps
        if isinstance(self.every, int):  # else "auto"
            return self.since >= self.every
        if self.cost is None or not step_seconds:
            return self.since >= self.min_every
        interval = math.ceil(self.cost / (self.budget * step_seconds))
        return self.since >= max(self.min_every, interval)

    def done(self, cost: float) -> None:
        self.cost, self.since = cost, 0
