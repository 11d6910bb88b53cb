"""NaNGuard's batch-end side: reads a batch's logs, keeps the figures and
queues what needs the model.

It runs where Keras runs `on_train_batch_end`: in Keras's callback worker
threads on JAX and PyTorch (the logs already Python numbers), on the
training thread on TensorFlow. It never touches the model: on JAX the
variables are stale during `fit` and the step's buffers are donated.
Whatever needs the model is queued as an `Event` for the training thread
(`NaNGuard._act`).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from typing import Any, NamedTuple

from keras_nanguard.nan_guard.figures import EpochFigures, is_loss, nonfinite
from keras_nanguard.nan_guard.loss_spikes import (
    BatchLosses,
    Blowup,
    LossBlowup,
    LossSpikes,
    Spike,
)
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
