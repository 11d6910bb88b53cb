"""NaNGuard's batch-end side: reads a batch's logs, keeps the figures and
queues what needs the model; with the epoch's figures without the bad
batches (`EpochFigures`) and the loss-spike rule (`Spike`, `Blowup`).

It runs where Keras runs `on_train_batch_end`: in Keras's callback worker
threads on JAX and PyTorch (the logs already Python numbers), on the
training thread on TensorFlow. It never touches the model: on JAX the
variables are stale during `fit` and the step's buffers are donated.
Whatever needs the model is queued as an `Event` for the training thread
(`NaNGuard._act`).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
import statistics
import time
from typing import Any, NamedTuple

from keras_nanguard.safe_optimizer.counters import RECENT_STEPS

REJECTED = "nanguard_rejected_steps"
OVERFLOWS = "nanguard_loss_scale_steps"
RECENT = "nanguard_recent_rejections"
QUARANTINED = "nanguard_quarantined_samples"


@dataclasses.dataclass
class Event:
    """Steps of an execution that need the training thread's attention: a
    run of rejected steps, or the whole execution."""

    # "bad_figures", "rejection", "loss_spike", "loss_blowup" or "quarantine"
    kind: str
    epoch: int
    batch: int  # its first batch in the epoch
    step: int  # its first step in this fit
    steps: int
    logs: dict[str, Any]
    bad_logs: list[str]
    rejections: int = 0
    run: int = 0  # steps rejected in a row, up to its last one
    continues: bool = False  # the step before was bad too
    spike: Spike | None = None  # what a "loss_spike" event found
    blowup: Blowup | None = None  # what a "loss_blowup" event found
    # A "quarantine" event's rows: `since` <= i < `until` of the total.
    quarantined: tuple[int, int] | None = None


class _Run(NamedTuple):
    """Rejected steps of one execution, `offset`.. `offset + steps - 1`."""

    offset: int
    steps: int
    rejections: int
    run: int  # steps rejected in a row, up to the last of them


class BatchWatch:
    """The per-fit state of the batch-end side. Its caller holds NaNGuard's
    lock around every method, and calls `end` in batch order."""

    def __init__(
        self,
        rejected: int,
        consecutive: int,
        spikes: LossSpikes | None = None,
        overflows: int = 0,
        quarantined: int = 0,
    ) -> None:
        self.spikes = spikes  # loss-spike detection, when NaNGuard has it on
        self.losses = BatchLosses()  # each execution's own loss
        self.blowup = LossBlowup()  # always on, armed by a rollback
        self.rejected = rejected  # a SafeOptimizer's total, as last logged
        self.run = consecutive
        self.overflows = overflows  # the loss-scale overflow skips, likewise
        self.quarantined = quarantined  # rows the quarantine left out, likewise
        self.counts_rejections = False  # the logs carry the exact total
        self.steps_done = 0  # steps seen in this fit
        self.events: list[Event] = []
        self.healthy_step = -1  # first step of the last healthy execution
        self.step_seconds: float | None = None
        self.reset_at: int | None = None  # Keras's metrics reset before this step
        self.run_reset_at: int | None = None  # the streak restarts at this step
        # Steps before it are left out of the figures (`math.inf`: all, until
        # the training thread acts).
        self.leave_out_until: float = 0
        self._last_time: float | None = None
        self._bad_before = False
        self.begin_epoch(0, 0)

    def begin_epoch(self, epoch: int, base: int) -> None:
        self.epoch, self.base = epoch, base
        self.figures = EpochFigures()
        self.begins: list[int] = []  # batches begun in this epoch
        self.next_batch = 0
        self.reset_at = None
        self.losses.segment_reset()

    def first_of(self, batch: int, k: int) -> int:
        """The first batch of the execution that ended at `batch`."""
        i = bisect.bisect_right(self.begins, batch)
        return self.begins[i - 1] if i else max(0, batch - k + 1)

    def end(self, first: int, last: int, logs: dict) -> None:
        """Reads the logs of the execution of batches `first`..`last`."""
        steps = last - first + 1
        step = self.base + first
        self.next_batch = last + 1
        self.steps_done = step + steps
        self._time(steps)
        if self.reset_at is not None and step >= self.reset_at:
            self.figures.reset()
            self.reset_at = None
            self.losses.segment_reset()
        new, overflows = self._rejections(logs)
        self._quarantined(first, steps, logs)
        if self.run_reset_at is not None and step >= self.run_reset_at:
            self.run, self.run_reset_at = 0, None
        # Overflow skips of a loss scaler are not trouble: the mask has 0 there.
        runs = self._runs(logs.get(RECENT), steps, new - overflows)
        # A tainted figure's running mean holds a batch already left out.
        tainted = self.figures.tainted
        bad_logs = sorted(
            k for k, v in logs.items() if nonfinite(v) and k not in tainted
        )
        seen = {k: v for k, v in logs.items() if k == "loss" or k in bad_logs}
        bad_loss = any(is_loss(k) for k in bad_logs)
        # An attached step leaves a rejected batch out of Keras's metrics.
        counted = steps - new if self.counts_rejections else steps
        leave_out: list[str] | bool = bad_loss or bad_logs
        if step < self.leave_out_until:  # before a rollback, or discarded
            leave_out = True
        before, raw = self.figures.since_reset, logs.get("loss")
        self.figures.add(logs, counted, leave_out)
        loss = self.losses.batch_loss(raw, before, counted)  # the execution's own
        if not (bad_logs or runs):
            self._bad_before = False
            if step >= self.leave_out_until and not self._spiking(loss, step, steps):
                self.healthy_step = step
            return
        self._queue(first, steps, runs, seen, bad_logs)
        if bad_loss and not self.counts_rejections:  # the weights may be bad
            self.leave_out_until = math.inf

    def _queue(
        self,
        first: int,
        steps: int,
        runs: list[_Run],
        seen: dict[str, Any],
        bad_logs: list[str],
    ) -> None:
        """An event per run of rejected steps of the execution that begins
        at batch `first`; the bad figures, of the whole execution, go with
        its last event (or make one of their own)."""
        if not runs:
            runs = [_Run(0, steps, 0, self.run)]
        end = 0  # where the run before ended
        for i, r in enumerate(runs):
            self.events.append(
                Event(
                    "rejection" if r.rejections else "bad_figures",
                    self.epoch,
                    first + r.offset,
                    self.base + first + r.offset,
                    r.steps,
                    seen,
                    bad_logs if i == len(runs) - 1 else [],
                    rejections=r.rejections,
                    run=r.run,
                    continues=self._bad_before if r.offset == 0 else r.offset == end,
                )
            )
            end = r.offset + r.steps
        self._bad_before = bool(bad_logs) or end == steps

    def _runs(self, mask: Any, steps: int, new: int) -> list[_Run]:
        """The execution's runs of rejected steps, from SafeOptimizer's
        `recent_rejections` (its last `RECENT_STEPS` steps, bit 0 the
        latest), and `self.run` after its last step. Steps it does not cover
        (no mask, a longer execution) are taken as one run, its rejections
        at its end: a guess, as their order is not known."""
        known = bits = 0
        if mask is not None:
            known = min(steps, RECENT_STEPS)
            bits = int(mask) & ((1 << known) - 1)
            unknown = new - bin(bits).count("1")
            if not 0 <= unknown <= steps - known:  # not this execution's bits
                known = unknown = 0
        if not known:
            unknown = new
        runs: list[_Run] = []
        if unknown > 0:
            guessed = steps - known
            self.run = self.run + guessed if unknown == guessed else unknown
            runs.append(_Run(0, guessed, unknown, self.run))
        elif steps > known:
            self.run = 0
        for offset in range(steps - known, steps):
            if not (bits >> (steps - 1 - offset)) & 1:
                self.run = 0
                continue
            self.run += 1
            if runs and runs[-1].offset + runs[-1].steps == offset:  # goes on
                last = runs.pop()
                runs.append(
                    _Run(last.offset, last.steps + 1, last.rejections + 1, self.run)
                )
            else:
                runs.append(_Run(offset, 1, 1, self.run))
        return runs

    def _rejections(self, logs: dict) -> tuple[int, int]:
        """The steps an attached SafeOptimizer rejected since the last logs,
        and how many of them were loss-scale overflows (a loss scaler's
        routine, not trouble)."""
        new = overflows = 0
        if REJECTED in logs:
            self.counts_rejections = True
            rejected = int(logs[REJECTED])
            new, self.rejected = rejected - self.rejected, rejected
        if OVERFLOWS in logs:
            overflowed = int(logs[OVERFLOWS])
            overflows, self.overflows = overflowed - self.overflows, overflowed
        return new, overflows

    def _quarantined(self, first: int, steps: int, logs: dict) -> None:
        """Queues the rows the quarantine left out of the execution, if any
        (its logs carry the total)."""
        if QUARANTINED not in logs:
            return
        total = int(logs[QUARANTINED])
        if total > self.quarantined:
            self.events.append(
                Event(
                    "quarantine",
                    self.epoch,
                    first,
                    self.base + first,
                    steps,
                    {},
                    [],
                    quarantined=(self.quarantined, total),
                )
            )
        self.quarantined = total

    def _spiking(self, loss: float | None, step: int, steps: int) -> bool:
        """Feeds a healthy execution's loss to the loss-spike and blow-up
        rules. True while a streak of either is open or confirmed: the
        execution is then not healthy, so no snapshot taken during the
        streak is promoted."""
        found: Spike | Blowup | bool = self.blowup.see(loss, step, steps)
        spiking = self.spikes is not None and self.spikes.see(loss, step, steps)
        if isinstance(spiking, Spike) and not isinstance(found, Blowup):
            found = spiking
        if not isinstance(found, Spike | Blowup):
            return bool(found or spiking)
        spike = found if isinstance(found, Spike) else None
        blowup = found if isinstance(found, Blowup) else None
        self.events.append(
            Event(
                "loss_spike" if spike is not None else "loss_blowup",
                self.epoch,
                max(0, found.step - self.base),
                found.step,
                found.steps,
                {"loss": found.loss},
                [],
                spike=spike,
                blowup=blowup,
            )
        )
        # The state is bad: nothing is healthy and the figures leave the
        # batches out until the training thread acts (`metrics_reset`).
        self.leave_out_until = math.inf
        return True

    def _time(self, steps: int) -> None:
        now = time.perf_counter()
        if self._last_time is not None:
            dt = (now - self._last_time) / steps
            old = self.step_seconds
            self.step_seconds = dt if old is None else 0.9 * old + 0.1 * dt
        self._last_time = now

    def metrics_reset(
        self, step: int, leave_out_until: float | None, restored: bool = False
    ) -> None:
        """Keras's metric states were reset before `step`; batches before
        `leave_out_until` are left out of the figures (`None`, a reset that
        undoes nothing: only a hold, `math.inf`, ends at `step`; the batches
        before `step` still to be read are read as they would have been in
        line, before the reset);
        `restored`: the snapshot was restored there, which resets a
        SafeOptimizer's streak of rejected steps."""
        self.reset_at = step
        if leave_out_until is not None:
            self.leave_out_until = leave_out_until
        elif self.leave_out_until == math.inf:
            self.leave_out_until = step
        if restored:
            self.run_reset_at = step
            self.blowup.arm()  # and ends its streak on the undone state
            if self.spikes is not None:  # a streak on the undone state ends
                self.spikes.streak_from, self.spikes.streak = None, 0


def watch_for_fit(
    safe: Any,
    spike_sigma: float | None,
    spike_window: int,
    spike_patience: int,
) -> BatchWatch:
    """The batch-end side of one `fit`: it starts from the totals of the
    attached SafeOptimizer `safe` (one read per fit), with loss-spike
    detection when `spike_sigma` is set."""
    rejected = consecutive = overflows = quarantined = 0
    if safe is not None:
        c = safe.counters()
        rejected, consecutive = c["skipped_steps"], c["consecutive_skips"]
        overflows, quarantined = c["loss_scale_steps"], c["quarantined_samples"]
    spikes = None
    if spike_sigma is not None:
        spikes = LossSpikes(spike_sigma, spike_window, spike_patience)
    return BatchWatch(rejected, consecutive, spikes, overflows, quarantined)


# An epoch's loss and metrics without the batches NaNGuard leaves out.


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


# Finite loss trouble for NaNGuard's batch-end side: Python floats only.
#
# Keras logs the loss as a running mean over the batches since its metric
# states were last reset; a batch's own loss is recovered from two
# consecutive running means, `n·m_n - (n-1)·m_{n-1}` (`BatchLosses`; per
# batch: exact for equal batch sizes; a smaller last batch is pulled toward
# the mean, which can only weaken its signal, never raise a false alarm).
#
# Two rules read those losses. `LossSpikes` (with `loss_spike_sigma`, off by
# default): a loss many standard deviations above its rolling mean.
# `LossBlowup` (always on): a finite loss `BLOWUP_FACTOR` times the run's
# early level (the median of its first `BLOWUP_WINDOW` healthy batch losses)
# proves no snapshot; after a rollback, `BLOWUP_PATIENCE` steps of it in a
# row are trouble. A run whose rate a rollback could not lower (a schedule)
# climbs to a loss of 1e20 before its first NaN and blows up again after it
# without one: its snapshots were proven by batches of finite but ruinous
# loss, and `fit` returned a model with a loss of 1e9 and said nothing.
# Before any rollback a loss that high is not trouble: a healthy run's loss
# may rise far above its early level (a reinforcement-learning agent whose
# returns grow); it only leaves the rollback point where it was.

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
