"""Finite loss trouble for NaNGuard's batch-end side: Python floats only.

Keras logs the loss as a running mean over the batches since its metric
states were last reset; a batch's own loss is recovered from two
consecutive running means, `n·m_n - (n-1)·m_{n-1}` (`BatchLosses`; per
batch: exact for equal batch sizes; a smaller last batch is pulled toward
the mean, which can only weaken its signal, never raise a false alarm).

Two rules read those losses. `LossSpikes` (with `loss_spike_sigma`, off by
default): a loss many standard deviations above its rolling mean.
`LossBlowup` (always on): a finite loss `BLOWUP_FACTOR` times the run's
early level (the median of its first `BLOWUP_WINDOW` healthy batch losses)
proves no snapshot; after a rollback, `BLOWUP_PATIENCE` steps of it in a
row are trouble. A run whose rate a rollback could not lower (a schedule)
climbs to a loss of 1e20 before its first NaN and blows up again after it
without one: its snapshots were proven by batches of finite but ruinous
loss, and `fit` returned a model with a loss of 1e9 and said nothing.
Before any rollback a loss that high is not trouble: a healthy run's loss
may rise far above its early level (a reinforcement-learning agent whose
returns grow); it only leaves the rollback point where it was.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics

# A loss this many times the run's early level ...
BLOWUP_FACTOR = 1000.0
# ... for this many steps in a row after a rollback is a blow-up.
BLOWUP_PATIENCE = 3
# The early level: the median of the fit's first healthy batch losses.
BLOWUP_WINDOW = 100


class BatchLosses:
    """Each execution's own loss, from Keras's running means of it."""

    def __init__(self) -> None:
        self._mean: float | None = None  # Keras's last running mean of the loss

    def segment_reset(self) -> None:
        """Keras's running means restart (a new epoch, or a metrics reset)."""
        self._mean = None

    def batch_loss(self, raw: object, before: int, counted: int) -> float | None:
        """The mean loss of the `counted` batches just folded into Keras's
        running mean `raw` (which held `before` batches), if recoverable."""
        prev, self._mean = self._mean, _float(raw)
        if counted <= 0 or self._mean is None:
            return None
        if before == 0:
            return self._mean
        if prev is None:
            return None
        return ((before + counted) * self._mean - before * prev) / counted


@dataclasses.dataclass
class Spike:
    """A confirmed loss spike: what triggered it, in figures."""

    step: int  # the first step of the streak
    steps: int  # the steps in the streak
    loss: float  # the last batch loss of the streak
    mean: float  # the rolling mean and standard deviation it was above
    std: float
    window: int  # the healthy batches the statistics cover

    def describe(self, sigma: float) -> str:
        return (
            f"the batch loss stayed more than {sigma:g} standard deviations "
            f"above its rolling mean for {self.steps} steps in a row "
            f"(last loss {self.loss:.4g}, mean {self.mean:.4g}, "
            f"std {self.std:.3g}, over the last {self.window} healthy batches)."
        )


@dataclasses.dataclass
class Blowup:
    """A confirmed blow-up of the loss after a rollback, in figures."""

    step: int  # the first step of the streak
    steps: int  # the steps in the streak
    loss: float  # the last batch loss of the streak
    level: float  # the run's early level

    def describe(self) -> str:
        return (
            f"after a rollback the batch loss stayed above {BLOWUP_FACTOR:g} "
            f"times the run's early level for {self.steps} steps in a row "
            f"(last loss {self.loss:.4g}, level {self.level:.4g}, the median "
            "of its first healthy batches): finite, but the run has blown up "
            "again."
        )


class LossBlowup:
    """The loss's early level, and the open streak of losses far above it
    (see the module)."""

    def __init__(self) -> None:
        # The first healthy batch losses of the fit: the run's level.
        self.early: list[float] = []
        self._level: float | None = None  # the level, once `early` is full
        self.armed = False  # after a rollback
        self.streak_from: int | None = None  # first step of the open streak
        self.streak = 0

    @property
    def level(self) -> float | None:
        if self._level is None and self.early:
            level = statistics.median(self.early)
            if len(self.early) < BLOWUP_WINDOW:
                return level
            self._level = level  # the window is full: fixed from now on
        return self._level

    def arm(self) -> None:
        """A rollback: from now on a streak of ruinous losses is trouble."""
        self.armed = True
        self.streak_from, self.streak = None, 0

    def see(self, loss: float | None, step: int, steps: int) -> Blowup | bool:
        """Feeds a healthy execution's loss. Returns a `Blowup` when a streak
        reaches `BLOWUP_PATIENCE` steps after a rollback; `True` when the
        loss proves nothing: `BLOWUP_FACTOR` times the level or more (never
        a snapshot's proof, armed or not), or a streak is open."""
        if loss is None:
            return self.streak_from is not None
        level = loss if self.level is None else self.level
        if loss < BLOWUP_FACTOR * max(level, 1e-12):
            if len(self.early) < BLOWUP_WINDOW:  # a ruinous one is not the level
                self.early.append(loss)
            self.streak_from, self.streak = None, 0
            return False
        if not self.armed:
            return True  # ruinous but, before any trouble, not trouble
        if self.streak_from is None:
            self.streak_from = step
        self.streak += steps
        if self.streak < BLOWUP_PATIENCE:
            return True
        found = Blowup(self.streak_from, self.streak, loss, level)
        self.streak_from, self.streak = None, 0
        return found


class LossSpikes:
    """Rolling statistics of healthy batch losses, and the open streak
    (with `loss_spike_sigma`)."""

    def __init__(self, sigma: float, window: int, patience: int) -> None:
        self.sigma, self.patience, self.window = sigma, patience, window
        self.losses: collections.deque[float] = collections.deque(maxlen=window)
        self.streak_from: int | None = None  # first step of the open streak
        self.streak = 0

    def see(self, loss: float | None, step: int, steps: int) -> Spike | bool:
        """Feeds a healthy execution's loss. Returns a `Spike` when a streak
        reaches `patience` steps, `True` while a streak is open, else `False`."""
        if loss is None:
            return self.streak_from is not None
        n = len(self.losses)
        if n < self.window:  # not armed until the window is full
            self.losses.append(loss)
            return False
        mean = sum(self.losses) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in self.losses) / n)
        if loss <= mean + self.sigma * std:
            self.streak_from, self.streak = None, 0
            self.losses.append(loss)
            return False
        if self.streak_from is None:
            self.streak_from = step
        self.streak += steps
        if self.streak < self.patience:
            return True
        spike = Spike(self.streak_from, self.streak, loss, mean, std, n)
        self.clear()
        return spike

    def clear(self) -> None:
        """Forgets the streak and the window: the statistics start afresh
        (after a rollback, the state is the one before the spike, but the
        learning rate may differ)."""
        self.losses.clear()
        self.streak_from, self.streak = None, 0


def _float(value: object) -> float | None:
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None
