"""NaNGuard's training-thread side: incidents, snapshots, rollback and stop.

Everything here reads or changes the model, so it runs only on the thread
that runs `fit`: at `on_train_batch_begin` (which Keras always calls
there), at `on_epoch_end` and `on_train_end` (after Keras has waited for
its batch-end workers), and at `on_train_batch_end` when Keras calls that
there too (TensorFlow, or another callback that is not async-safe).
"""

from __future__ import annotations

import math
import time
from typing import Any

from keras_nanguard import snapshots
from keras_nanguard.errors import NonFiniteError
from keras_nanguard.incidents import Incident, diagnose_batch
from keras_nanguard.nan_guard import learning_rate as _learning_rate
from keras_nanguard.nan_guard import replay as _replay
from keras_nanguard.nan_guard import snapshot_files as _snapshot_io
from keras_nanguard.nan_guard.batch_watch import Event
from keras_nanguard.nan_guard.figures import is_loss

# Snapshots waiting for a healthy batch (the batch ends run behind).
_MAX_PENDING = 3


class Responses:
    """The training-thread half of `NaNGuard` (a mixin: the state is the
    callback's). `self._now` is the step training is at: the steps run
    before the batch about to begin, or all of them at an epoch's end."""

    # ------------------------------------------------------------ events
    def _handle(self, ev: Event) -> None:
        if ev.kind == "rejection":
            self._on_rejection(ev)
        elif ev.kind == "loss_spike":
            self._on_loss_spike(ev)
        elif ev.step >= self._resumed_at:  # else it ran on a state since undone
            self._on_bad_figures(ev)

    def _on_bad_figures(self, ev: Event) -> None:
        snapshots.sync_from_device(self._net)
        variables = snapshots.nonfinite_names(self._net)
        if self._extend(ev):  # the same episode: is the state bad again?
            inc = self.incidents[-1]
            inc.variables = sorted(set(inc.variables) | set(variables))
        else:
            detail = _describe_logs(ev.logs, ev.bad_logs)
            if variables:
                detail += " The update was applied: the state is non-finite."
            loss = any(map(is_loss, ev.bad_logs))
            kind = "nonfinite_loss" if loss else "nonfinite_metric"
            self._record(ev, kind, detail, variables)
        if variables:
            self._trouble()
        else:  # Keras's running means hold the bad batch: start them afresh
            self._reset_metrics(self._now)

    def _on_loss_spike(self, ev: Event) -> None:
        """A confirmed loss spike: trouble. The rollback point predates the
        streak (no snapshot is promoted while a streak is open, and
        `_trouble` drops the pending ones: the PaLM recipe)."""
        if ev.step < self._resumed_at:  # it ran on a state since undone
            with self._lock:  # undo the worker's hold on the figures
                if self._watch.leave_out_until == math.inf:
                    self._watch.leave_out_until = self._now
            return
        self._open = None  # a new episode, whatever came before
        self._record(ev, "loss_spike", ev.spike.describe(self.loss_spike_sigma), [])
        self._trouble()
        if self.policy == "warn":  # training goes on with the state as it is
            self._reset_metrics(self._now)

    def _on_rejection(self, ev: Event) -> None:
        safe = self._safe
        halted = (
            safe.max_consecutive_skips is not None
            and ev.run >= safe.max_consecutive_skips
        )
        if self._extend(ev, "halted" if halted else None):
            self._count_rejections(ev.rejections)
        else:
            snapshots.sync_from_device(self._net)
            c = safe.counters()
            words = _rejected(ev.rejections, ev.step, ev.steps)
            detail = f"{words}: {safe.describe_last_rejection()}; nothing was applied."
            if ev.bad_logs:
                detail = _describe_logs(ev.logs, ev.bad_logs) + " " + detail
            kind = "halted" if halted else "rejected_step"
            self._record(ev, kind, detail, [], grad_norm=c["rejected_grad_norm"])
            self._rejections = (self._open, ev.rejections, words)
        if (halted or ev.run >= self.max_rejections) and ev.step >= self._resumed_at:
            self._trouble()

    # ------------------------------------------------------------ incidents
    # The open incident's rejected steps, and the words that count them in
    # its detail: (incident, count, words).
    _rejections: tuple[Incident | None, int, str] = (None, 0, "")

    def _count_rejections(self, more: int) -> None:
        """Counts `more` rejected steps in the open incident, in its detail
        too: the count there is the incident's, not its first event's."""
        inc, count, words = self._rejections
        if inc is None or inc is not self._open:  # it did not begin rejected
            return
        count += more
        new = _rejected(count, inc.step, inc.steps)
        inc.detail = inc.detail.replace(words, new, 1)
        self._rejections = (inc, count, new)

    def _extend(self, ev: Event, kind: str | None = None) -> bool:
        """Adds `ev` to the open incident if it continues its episode."""
        inc = self._open
        if not (ev.continues and inc is not None):
            return False
        inc.steps = ev.step + ev.steps - inc.step
        if kind is not None:
            inc.kind = kind
        return True

    def _record(
        self,
        ev: Event | None,
        kind: str,
        detail: str,
        variables: list[str],
        grad_norm: float | None = None,
        step: int | None = None,
    ) -> None:
        """Records an incident: a batch's (`ev`), or one found at an epoch's
        end or in a snapshot (`ev` is `None`, `batch` is -1)."""
        loss = None if ev is None else ev.logs.get("loss")
        inc = Incident(
            fit=self._fit,
            epoch=self._epoch if ev is None else ev.epoch,
            step=(self._now if step is None else step) if ev is None else ev.step,
            batch=-1 if ev is None else ev.batch,
            kind=kind,
            detail=detail,
            steps=1 if ev is None or ev.batch < 0 else ev.steps,
            loss=None if loss is None else float(loss),
            grad_norm=grad_norm,
            variables=list(variables),
        )
        if self.replay is not None and ev is not None and ev.batch >= 0:
            inc.batch_data, bad = _replay.batches(
                self.replay, self.batch_size, ev.batch, ev.batch + ev.steps - 1
            )
            if bad is not None:  # the bad one of the execution is known
                inc.batch, inc.step, inc.steps = bad, ev.step + bad - ev.batch, 1
        self.incidents.append(inc)
        self._open = inc if ev is not None and ev.batch >= 0 else None
        if inc.batch_data is not None:
            snapshots.sync_from_device(self._net)
            diagnose_batch(inc, self._net)
        self._write_report()  # told once its action is known (`telling`)

    # ------------------------------------------------------------ actions
    def _trouble(self) -> None:
        inc = self.incidents[-1]
        if self.policy == "warn":
            inc.action = "warned"  # warned once, by `telling`
            return
        self._drop_pending()  # not yet proven by a healthy batch
        if self.snapshot is None:  # see `_start`
            inc.action = "raised NonFiniteError: no good state to restore"
            self._write_report()
            raise NonFiniteError(
                f"NaNGuard: {inc} The first step made the model non-finite and "
                "there is no earlier good state: the model was built by `fit`, "
                "so NaNGuard could take its first snapshot only after that "
                "step. Build the model before `fit` (`keras.Input` or "
                "`model.build(input_shape)`), or use a SafeOptimizer.",
                report=self.report(),
            )
        self._restore()
        self._resumed_at = self._now
        snap = self.snapshot
        where = f"restored the snapshot of epoch {snap.epoch}, step {snap.step}"
        if self.policy == "raise":
            inc.action = where + ", raised NonFiniteError"
            self._write_report()
            raise NonFiniteError(f"NaNGuard: {inc}", report=self.report())
        if self.policy == "rollback" and self._rollbacks_since_snapshot < self.patience:
            self.rollbacks += 1
            self._rollbacks_since_snapshot += 1
            inc.action = "rolled back: " + where
            lr = _learning_rate.lower(self._net.optimizer, self.lr_factor)
            if lr is not None:
                inc.learning_rate = lr
                inc.action += f", learning rate {lr[0]:.3g} -> {lr[1]:.3g}"
                self._save(snap)  # the rate to go on with
            elif self.lr_factor < 1:  # a schedule
                inc.action += _learning_rate.not_lowered(self._net.optimizer)
            until = self._now + self.skip_batches
            self._discard_until = until if self.skip_batches else None
            self._reset_metrics(self._now, until, restored=True)
            if self.skip_batches:
                inc.action += f", discarding the next {self.skip_batches} batches"
            return
        self._net.stop_training = True
        self._stopping = True  # the batch in flight is undone at the epoch end
        self._reset_metrics(self._now, math.inf, restored=True)
        inc.action = where + ", stopped training"
        if self.policy == "rollback":
            inc.action += (
                f" after {self._rollbacks_since_snapshot} rollbacks without recovery"
            )

    def _restore(self) -> None:
        snapshots.sync_from_device(self._net)
        snapshots.restore(self._net, self.snapshot)
        self._restored_at = self._now

    def _reset_metrics(
        self, step: int, leave_out_until: float | None = None, restored: bool = False
    ) -> None:
        """Starts Keras's running means afresh before `step`; the batch-end
        side leaves the batches before `leave_out_until` out of the figures
        (by default those a restore undid; see `BatchWatch.metrics_reset`)
        and, if the snapshot was `restored`, counts rejections in a row
        afresh from `step`: the restore resets the streak."""
        if restored and leave_out_until is None:
            leave_out_until = step
        snapshots.sync_from_device(self._net)
        self._net.reset_metrics()
        with self._lock:
            self._watch.metrics_reset(step, leave_out_until, restored)

    # ------------------------------------------------------------ snapshots
    def _reusable(self) -> snapshots.Snapshot | None:
        # Buffers a new snapshot may overwrite: never the rollback point.
        spare, self._spare = self._spare, None
        return spare

    def _drop_pending(self) -> None:
        if self._pendings:
            self._spare = self._pendings[-1]
        self._pendings = []

    def _capture(self, verify: bool) -> tuple[snapshots.Snapshot | None, list[str]]:
        """A snapshot of the state now; with `verify`, its finiteness is read
        at once, else when it is promoted (`_promote`)."""
        snapshots.sync_from_device(self._net)
        snap, bad = snapshots.capture(
            self._net, epoch=self._epoch, step=self._now, into=self._reusable()
        )
        if snap is not None and verify:
            bad = snapshots.verify(snap)
            if bad:
                self._spare, snap = snap, None
        return snap, bad or []

    def _maybe_snapshot(self, steps: int, step_seconds: float | None) -> None:
        due = self._snapshots.due(step_seconds, steps)
        if not due or len(self._pendings) >= _MAX_PENDING:
            return
        snap, bad = self._capture(verify=False)
        if snap is None:
            self._record(
                None, "nonfinite_weights", "found while taking a snapshot.", bad
            )
            self._trouble()
        else:
            self._pendings.append(snap)
            self._snapshots.done(snap.seconds)  # counts from the copy

    def _promote(self, healthy: int) -> None:
        """Makes the newest pending snapshot that a healthy batch (at step
        `healthy`) ran after the rollback point. Its finiteness flag is read
        here, steps after it was set."""
        proven = [p for p in self._pendings if p.step <= healthy]
        if not proven:
            return
        snap = proven[-1]
        self._pendings = [p for p in self._pendings if p.step > healthy]
        bad = snapshots.verify(snap)
        if not bad:
            self._keep(snap)
            return
        self._spare = snap
        self._record(
            None,
            "nonfinite_weights",
            "found while taking a snapshot.",
            bad,
            step=snap.step,
        )
        self._trouble()

    def _keep(self, snap: snapshots.Snapshot) -> None:
        """Makes `snap` the rollback point."""
        if self.snapshot is not None and self.snapshot is not snap:
            self._spare = self.snapshot
        self.snapshot = snap
        self._pendings = [p for p in self._pendings if p is not snap]
        self.snapshots_taken += 1
        self._rollbacks_since_snapshot = 0
        snap.seconds += self._save(snap)
        self._snapshots.cost = snap.seconds  # with the read and the write

    def _save(self, snap: snapshots.Snapshot) -> float:
        """Writes the rollback point to `directory` (NaNGuard's file and a
        Keras weights file), with the learning rate training goes on with;
        returns the seconds it took."""
        if self.directory is None:
            return 0.0
        start = time.perf_counter()
        snapshots.sync_from_device(self._net)
        snap.learning_rate = snapshots.learning_rate(self._net)
        snapshots.save(snap, self.directory)
        _snapshot_io.save_weights_file(self._net, snap, self.directory)
        return time.perf_counter() - start

    def _start(self) -> None:
        """Takes the first snapshot, once the model has its variables."""
        self._started = True
        optimizer = self._net.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self._net.trainable_variables)
        snap, bad = self._capture(verify=True)
        if snap is not None:
            self._keep(snap)
            self._restored_at = self._now  # the state is the rollback point's
        elif self._now == 0:
            raise NonFiniteError(
                "NaNGuard: the model is already non-finite before training starts "
                f"({', '.join(bad[:5])}); there is no good state to protect. "
                "Re-initialise or load good weights first."
            )
        # else: the first step of a model built by `fit` went bad; its event
        # reports it and `_trouble` finds no snapshot.

    def _keep_final_state(self) -> None:
        """Makes the state `fit` returns the rollback point (and writes it to
        `directory`) if it is finite: nothing comes after it to prove it."""
        if self._pendings and self._pendings[-1].step == self._now:
            self._keep(self._pendings[-1])  # taken (and read) at the epoch end
            return
        snap, _ = self._capture(verify=True)
        if snap is not None:
            snap.epoch = self._epoch + 1
            self._keep(snap)

    # ------------------------------------------------------------ counters
    def _poll_counters(
        self, steps: int, step_seconds: float | None, force: bool
    ) -> None:
        """Reads a SafeOptimizer's total when its steps do not log it (a
        custom `train_step`), every `check_every` steps or when forced."""
        due = self._checks.due(step_seconds, steps)
        watch = self._watch
        if self._safe is None or watch.counts_rejections or not watch.steps_done:
            return  # `fit`'s steps log it (known once one has ended)
        if not (force or due):
            return
        start = time.perf_counter()
        snapshots.sync_from_device(self._net)
        c = self._safe.counters()
        new = c["skipped_steps"] - self._watch.rejected
        since = self._checked_at + 1
        self._watch.rejected, self._checked_at = c["skipped_steps"], self._now - 1
        self._checks.done(time.perf_counter() - start)
        if new > 0:
            ev = Event(
                "rejection",
                self._epoch,
                -1,
                since,
                max(1, self._now - since),
                {},
                [],
                rejections=new,
                run=c["consecutive_skips"],
            )
            self._on_rejection(ev)


def _rejected(count: int, step: int, steps: int) -> str:
    """'SafeOptimizer rejected 2 steps in steps 3-4', of an incident's (or an
    event's) `steps` steps from `step`."""
    last = step + steps - 1
    when = "" if step >= last else f" in steps {step}-{last}"
    return f"SafeOptimizer rejected {count} step{'s' if count > 1 else ''}{when}"


def _describe_logs(logs: dict[str, Any], bad: list[str]) -> str:
    shown = ", ".join(f"{k}={logs[k]}" for k in bad)
    return f"non-finite {shown} in this batch."
