"""The training thread's side (`Supervisor`): what NaNGuard makes of what
the batch ends found, at each of its turns; with the flight recorder's
record read for the early warning and the run diagnosis (`FlightWatch`).

At each batch begin, at a batch end that Keras calls on the training thread
and at an epoch's end, the training thread takes the events the batch-end
side queued (`BatchWatch.events`, under the lock), promotes the snapshot a
healthy batch proved, makes incidents of the events and answers the
trouble among them (`Responses`), undoes the batches `skip_batches`
discards, reads a SafeOptimizer's counters when its steps do not log them
and takes a snapshot when one is due. It touches the model only when there
is something to do. `state.now` is the step training is at: the steps run
before the batch about to begin, or all of them at an epoch's end.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from keras_nanguard import snapshots
from keras_nanguard._arguments import Arguments
from keras_nanguard.flight import reading
from keras_nanguard.flight.reading import RunDiagnosis
from keras_nanguard.flight.record import FlightRecord
from keras_nanguard.incidents import QuarantinedRow
from keras_nanguard.nan_guard.batch_watch import Event, is_loss, nonfinite_validation
from keras_nanguard.nan_guard.fit_state import FitState
from keras_nanguard.nan_guard.reporting import IncidentLog, rejected_words
from keras_nanguard.nan_guard.responses import Responses, replay_positions
from keras_nanguard.nan_guard.snapshotting import SnapshotKeeper, Snapshotter
from keras_nanguard.safe_optimizer.forward_state import is_built

_IN_SNAPSHOT = "found while taking a snapshot."


class Supervisor:
    """The training thread's turns in one `fit`, on `state`."""

    def __init__(
        self,
        settings: Arguments,
        state: FitState,
        log: IncidentLog,
        snapshotter: Snapshotter,
        responses: Responses,
        flight: FlightWatch | None = None,
    ) -> None:
        self.settings, self.state, self.log = settings, state, log
        self.snapshotter, self.responses = snapshotter, responses
        self.flight = flight if flight is not None else FlightWatch()
        self.flight.begin_fit(state)

    @classmethod
    def for_fit(
        cls,
        settings: Arguments,
        state: FitState,
        log: IncidentLog,
        keeper: SnapshotKeeper,
        report: Callable[[], dict[str, Any]],
        write_report: Callable[[], None],
        flight: FlightWatch | None = None,
    ) -> Supervisor:
        """The turns of a fit, with the parts they act through (see
        `Responses` for `report` and `write_report`)."""
        snapshotter = Snapshotter(state, keeper, settings.directory)
        responses = Responses(
            settings, state, log, keeper, snapshotter, report, write_report
        )
        return cls(settings, state, log, snapshotter, responses, flight)

    def take(self, snapshot: bool) -> None:
        """One turn; with `snapshot`, a due snapshot is taken too."""
        state = self.state
        with state.lock:
            events, state.watch.events = state.watch.events, []
            healthy = state.watch.healthy_step
            step_seconds = state.watch.step_seconds
        steps, state.seen = state.now - state.seen, state.now
        # The first snapshot once the state is known: the model built, and
        # the optimizers it holds besides `model.optimizer` (a GAN's), which
        # make their variables at their first step.
        if (
            not state.started
            and is_built(state.model)
            and not snapshots.unbuilt_optimizers(state.model)
        ):
            if state.safe is not None and self.settings.quarantine:
                snapshots.sync_from_device(state.model)
                state.quarantine_base = int(state.safe.counters()["quarantine_steps"])
            self.snapshotter.start()
        # A healthy batch after the pending snapshot proves it, even if a
        # later one is bad: promote it before acting on that one.
        self._promote(healthy)
        for ev in events:
            self.handle(ev)
        if state.stopping or self._discarding():
            return
        self.poll_counters(steps, step_seconds, force=False)
        self.watch_flight(force=False)
        if state.stopping:
            return
        if snapshot and state.started and not events and not state.stopping:
            with state.lock:
                clean = state.watch.leave_out_until <= state.now
            if clean:
                self._snapshot_if_due(steps, step_seconds)

    def _discarding(self) -> bool:
        """Whether batches that `skip_batches` discards still run; once they
        have, the rollback point is restored again, which undoes them."""
        state = self.state
        if state.discard_until is None:
            return False
        if state.now < state.discard_until:
            return True
        state.discard_until = None
        self.snapshotter.restore()
        self.responses.reset_metrics(state.now, restored=True)
        return False

    def _promote(self, healthy: int) -> None:
        found = self.snapshotter.promote(healthy)
        if found is not None:  # the proven snapshot is not finite after all
            step, bad = found
            self.responses.record(
                None, "nonfinite_weights", _IN_SNAPSHOT, bad, step=step
            )
            self.responses.trouble()

    def _snapshot_if_due(self, steps: int, step_seconds: float | None) -> None:
        bad = self.snapshotter.take_if_due(steps, step_seconds)
        if bad:
            self.responses.record(None, "nonfinite_weights", _IN_SNAPSHOT, bad)
            self.responses.trouble()

    # ------------------------------------------------------------ events
    def handle(self, ev: Event) -> None:
        """Makes an incident of `ev`, or adds it to the open one."""
        if ev.kind == "rejection":
            self._on_rejection(ev)
        elif ev.kind in ("loss_spike", "loss_blowup"):
            self._on_loss_trouble(ev)
        elif ev.kind == "quarantine":
            self._on_quarantine(ev)
        elif ev.step >= self.state.resumed_at:  # else it ran on an undone state
            self._on_bad_figures(ev)

    def _on_bad_figures(self, ev: Event) -> None:
        model = self.state.model
        snapshots.sync_from_device(model)
        variables = snapshots.nonfinite_names(model)
        if self.log.extend(ev):  # the same episode: is the state bad again?
            inc = self.log.open
            assert inc is not None  # `extend` extends the open incident
            inc.variables = sorted(set(inc.variables) | set(variables))
        else:
            detail = _describe_logs(ev.logs, ev.bad_logs)
            if variables:
                detail += " The update was applied: the state is non-finite."
            loss = any(map(is_loss, ev.bad_logs))
            kind = "nonfinite_loss" if loss else "nonfinite_metric"
            self.responses.record(ev, kind, detail, variables)
        if variables:
            self.responses.trouble()
        else:  # Keras's running means hold the bad batch: start them afresh
            self.responses.reset_metrics(self.state.now)

    def _on_loss_trouble(self, ev: Event) -> None:
        """A confirmed loss spike or blow-up: trouble. The rollback point
        predates the streak (no snapshot is promoted while a streak is open,
        and `Responses.trouble` drops the pending ones: the PaLM recipe)."""
        state = self.state
        if ev.step < state.resumed_at:  # it ran on a state since undone
            with state.lock:  # undo the worker's hold on the figures
                if state.watch.leave_out_until == math.inf:
                    state.watch.leave_out_until = state.now
            return
        if ev.blowup is not None:
            detail = ev.blowup.describe()
        else:  # the loss-spike rule, on when `loss_spike_sigma` is set
            sigma = self.settings.loss_spike_sigma
            assert ev.spike is not None and sigma is not None
            detail = ev.spike.describe(sigma)
        self.log.close()  # a new episode, whatever came before
        self.responses.record(ev, ev.kind, detail, [])
        self.responses.trouble()
        if self.settings.policy == "warn":  # training goes on as it is
            self.responses.reset_metrics(state.now)

    def _on_quarantine(self, ev: Event) -> None:
        """Rows the quarantine left out of the execution `ev`: named, and
        added to the epoch's quarantine incident (never trouble)."""
        state, safe = self.state, self.state.safe
        assert safe is not None and ev.quarantined is not None
        since, until = ev.quarantined
        snapshots.sync_from_device(state.model)
        named = []
        for number, row, why in safe.quarantined_rows(since, until):
            step = number - state.quarantine_base - 1  # this fit's step
            named.append((step, ev.batch + (step - ev.step), row, why))
        where = replay_positions(
            self.settings.replay, self.settings.batch_size, [n[1:3] for n in named]
        )
        rows = [
            QuarantinedRow(state.fit, ev.epoch, step, batch, row, why, position)
            for (step, batch, row, why), position in zip(named, where, strict=True)
        ]
        self.log.quarantine(ev, state.fit, rows, until - since)
        self.responses.write_report()

    def _on_rejection(self, ev: Event) -> None:
        safe = self.state.safe
        assert safe is not None  # only a SafeOptimizer rejects steps
        limit = safe.max_consecutive_skips
        halted = limit is not None and ev.run >= limit
        if self.log.extend(ev, "halted" if halted else None):
            self.log.count_rejections(ev.rejections)
        else:
            snapshots.sync_from_device(self.state.model)
            c = safe.counters()
            words = rejected_words(ev.rejections, ev.step, ev.steps)
            detail = f"{words}: {safe.describe_last_rejection()}; nothing was applied."
            if ev.bad_logs:
                detail = _describe_logs(ev.logs, ev.bad_logs) + " " + detail
            kind = "halted" if halted else "rejected_step"
            grad_norm = c["rejected_grad_norm"]
            self.responses.record(ev, kind, detail, [], grad_norm=grad_norm)
            self.log.count_from(ev.rejections, words)
        streak = halted or ev.run >= self.settings.max_rejections
        if streak and ev.step >= self.state.resumed_at:
            self.responses.trouble()

    # ------------------------------------------------------------ counters
    def poll_counters(
        self, steps: int, step_seconds: float | None, force: bool
    ) -> None:
        """Reads a SafeOptimizer's total when its steps do not log it (a
        custom `train_step`), every `check_every` steps or when forced."""
        state = self.state
        due = state.check_cadence.due(step_seconds, steps)
        with state.lock:
            logged = state.watch.counts_rejections or not state.watch.steps_done
        if state.safe is None or logged:
            return  # `fit`'s steps log it (known once one has ended)
        if not (force or due):
            return
        start = time.perf_counter()
        snapshots.sync_from_device(state.model)
        c = state.safe.counters()
        total = int(c["skipped_steps"])
        since = state.checked_at + 1
        with state.lock:
            new, state.watch.rejected = total - state.watch.rejected, total
        state.checked_at = state.now - 1
        state.check_cadence.done(time.perf_counter() - start)
        if new > 0:
            ev = Event(
                "rejection",
                state.epoch,
                -1,
                since,
                max(1, state.now - since),
                {},
                [],
                rejections=new,
                run=int(c["consecutive_skips"]),
            )
            self._on_rejection(ev)

    def watch_flight(self, force: bool) -> None:
        """Reads the flight recorder when due (or forced: at once), and gives
        the early warning when the rows read predict trouble."""
        flight = self.flight
        if force or flight.due(self.state):
            added = flight.read(self.state, wait=force)
        else:
            added = flight.collect(self.state, wait=False)
        if added and self.settings.early_warning:
            found = flight.warning()
            if found is not None:
                # Rows read earlier: the state (a rate to lower) is made
                # current again.
                snapshots.sync_from_device(self.state.model)
                self.responses.divergence_warning(found)

    # ------------------------------------------------------------ epoch's end
    def end_epoch(self, epoch: int, logs: dict[str, Any]) -> bool:
        """After the epoch's last turn: undoes the step that ran after a
        stop, finishes the epoch's figures in `logs`, and checks the state
        (one read per epoch) and the validation figures. Returns whether the
        model was built to be checked."""
        state = self.state
        if state.stopping:  # undo the step that ran after the stop
            self.snapshotter.restore()
        with state.lock:
            state.watch.figures.finish(logs)
        if not state.started:  # no batch in this epoch built the model
            return False
        self.poll_counters(0, None, force=True)
        self.watch_flight(force=True)
        bad: list[str] = []  # else the state is the snapshot's, or checked now
        if not state.stopping and state.restored_at != state.now:
            bad = self.snapshotter.take_at_epoch_end(epoch)
            if bad:
                where = "found at the end of the epoch."
                self.responses.record(None, "nonfinite_weights", where, bad)
                self.responses.trouble()
        detail = nonfinite_validation(logs)
        if detail is not None and not bad:  # the weights are finite
            self.responses.record(None, "nonfinite_validation", detail, [])
        return True


def _describe_logs(logs: dict[str, Any], bad: list[str]) -> str:
    shown = ", ".join(f"{k}={logs[k]}" for k in bad)
    return f"non-finite {shown} in this batch."


# NaNGuard's reading of SafeOptimizer's flight recorder: the run's record,
# gathered over its fits, and the early warning.
#
# The record is read on the training thread at steps 1, 2, 4, 8, then every
# `probe_every` steps of the recorder, whenever the recorder's alarm rings (the
# device decides it every step; the host polls a copy two turns later, see
# `FlightRecorder.newest_alarm`), at epoch ends and when asked
# (`NaNGuard.explain`). A read due during an epoch does not wait for the
# device: it copies the recorder's variables on the device and starts their
# copy to the host, and the rows join the record two executions later (when
# that step has surely run), at the same step on every process; a forced
# read (epoch end, `explain`) reads at once.


class FlightWatch:
    """The record of the guard's runs and what it predicts."""

    def __init__(self) -> None:
        self.record: FlightRecord | None = None
        self.read_at = 0  # `state.now` at the last read in this fit
        self.warned = False  # this fit's warning was given
        # The last warning given on this record (None: none).
        self.given: RunDiagnosis | None = None
        self._source: int | None = None  # id of the optimizer recorded
        self.alarm_seen = 0  # the newest alarm step read for
        self._for_alarm = False  # the read now due is an alarm's
        self.alarm_reads = 0  # reads the alarm asked for, over the guard's fits
        # The reads under way: the step each was asked at, and its finish.
        self._pending: list[tuple[int, Callable[[], FlightRecord]]] = []

    def begin_fit(self, state: FitState) -> None:
        self.read_at, self.warned, self._pending = 0, False, []
        if state.safe is not None and id(state.safe) != self._source:
            self.record, self._source = None, id(state.safe)
            self.given = None

    def due(self, state: FitState) -> bool:
        """Whether a read is due: by the cadence, or an alarm the host has
        not read for yet (polled every turn)."""
        if state.safe is None or state.now < 1:
            return False
        alarm = state.safe._newest_alarm(2, state.model)  # polled every turn
        rang = alarm > self.alarm_seen
        self.alarm_seen = max(alarm, self.alarm_seen)
        every = getattr(getattr(state.safe, "_recorder", None), "probe_every", 16)
        if state.now - self.read_at >= min(every, max(1, self.read_at)):
            return True  # the cadence's read (it reads for the alarm too)
        self._for_alarm = rang  # a read besides the cadence, which stays
        return rang

    def read(self, state: FitState, wait: bool = True) -> bool:
        """Adds the recorder's rows to the record. With `wait`, a host read
        now (after the reads under way); without, the read is started and
        its rows are added by the first `collect` two executions later.
        Returns whether rows were added."""
        if state.safe is None or not is_built(state.model):
            return False
        snapshots.sync_from_device(state.model)
        self._pending.append((state.now, state.safe._start_flight_read()))
        if self._for_alarm:
            self.alarm_reads += 1
        else:
            self.read_at = state.now  # the cadence's last read
        self._for_alarm = False
        return self.collect(state, wait)

    def collect(self, state: FitState, wait: bool) -> bool:
        """Adds the rows of the reads under way that were asked two
        executions ago or more (all of them with `wait`). Returns whether
        rows were added."""
        lag = 2 * max(1, state.k)
        due = [p for p in self._pending if wait or state.now - p[0] >= lag]
        if not due:
            return False
        self._pending = self._pending[len(due) :]  # in the order asked
        for _, finish in due:
            new = finish()
            if self.record is None or self.record.columns != new.columns:
                self.record = new
            else:
                self.record.add(new.rows)
        return True

    def warning(self) -> RunDiagnosis | None:
        """This fit's early warning, once: what the record predicts."""
        if self.warned or self.record is None:
            return None
        found = reading.warning(self.record)
        self.warned = found is not None
        if found is not None:
            self.given = found
        return found

    def diagnosis(self) -> RunDiagnosis:
        if self.record is None:
            return reading.RunDiagnosis(
                "unknown",
                evidence=[
                    "Nothing was recorded: no step of a SafeOptimizer ran "
                    "under this guard (its flight recorder is what explain "
                    "reads; compile with ng.SafeOptimizer(optimizer))."
                ],
                hints=list(reading.RUN_HINTS["unknown"]),
            )
        return reading.diagnose_warned_run(self.record, self.given)
