"""When a periodic host-side job of NaNGuard (a snapshot, a read of the
optimizer's counters) is due."""

from __future__ import annotations

import math
from collections.abc import Callable


class Cadence:
    """Every `every` steps, or, with "auto", as often as keeps the job's
    measured cost within `budget` of the measured step time, and at least
    `min_every` steps apart.

    With `agree` (a job of many processes), "auto"'s interval is set when
    the job is done, to `agree(this process's interval)`: the same on every
    process (the largest), so that each runs the job at the same steps.
    Alone, the interval follows the newest step time."""

    def __init__(
        self,
        every: int | str,
        budget: float,
        min_every: int,
        agree: Callable[[int], int] | None = None,
    ) -> None:
        self.every, self.budget, self.min_every = every, budget, min_every
        self.agree = agree
        self.cost: float | None = None
        self.since = 0
        self.interval = every if isinstance(every, int) else min_every
        self._step_seconds: float | None = None

    def due(self, step_seconds: float | None, steps: int = 1) -> bool:
        """Whether the job is due after `steps` more steps of `step_seconds`."""
        self.since += steps
        self._step_seconds = step_seconds or self._step_seconds
        if self.agree is None and self.every == "auto":
            self.interval = self._local_interval()
        return self.since >= self.interval

    def done(self, cost: float) -> None:
        self.cost, self.since = cost, 0
        if self.agree is not None and self.every == "auto":
            self.interval = max(self.min_every, self.agree(self._local_interval()))

    def _local_interval(self) -> int:
        if self.cost is None or not self._step_seconds:
            return self.min_every
        interval = math.ceil(self.cost / (self.budget * self._step_seconds))
        return max(self.min_every, interval)
