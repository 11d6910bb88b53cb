"""NaNGuard's answers: records an incident, and acts on trouble as the
policy says (roll back, stop, raise or warn).

It reads and changes the model, so it runs on the training thread only:
at `on_train_batch_begin` (which Keras always calls there), at
`on_epoch_end` and `on_train_end` (after Keras has waited for its batch-end
workers), and at `on_train_batch_end` when Keras calls that there too
(TensorFlow, or another callback that is not async-safe).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NoReturn

from keras_nanguard import snapshots
from keras_nanguard._arguments import Arguments
from keras_nanguard.errors import NonFiniteError
from keras_nanguard.flight.reading import RunDiagnosis
from keras_nanguard.incidents import Incident, diagnose_batch
from keras_nanguard.nan_guard import learning_rate as _learning_rate
from keras_nanguard.nan_guard import replay as _replay
from keras_nanguard.nan_guard.batch_watch import Event
from keras_nanguard.nan_guard.fit_state import FitState
from keras_nanguard.nan_guard.incident_log import IncidentLog
from keras_nanguard.nan_guard.snapshot_keeper import SnapshotKeeper
from keras_nanguard.nan_guard.snapshotting import Snapshotter


class Responses:
    """Records incidents in `log` and answers trouble by `settings.policy`,
    restoring `keeper`'s rollback point through `snapshotter`.

    `report` gives the guard's report (for `NonFiniteError`); `write_report`
    rewrites its report file, after each incident and each action.
    """

    def __init__(
        self,
        settings: Arguments,
        state: FitState,
        log: IncidentLog,
        keeper: SnapshotKeeper,
        snapshotter: Snapshotter,
        report: Callable[[], dict[str, Any]],
        write_report: Callable[[], None],
    ) -> None:
        self.settings, self.state, self.log = settings, state, log
        self.keeper, self.snapshotter = keeper, snapshotter
        self.report, self.write_report = report, write_report

    def record(
        self,
        ev: Event | None,
        kind: str,
        detail: str,
        variables: list[str],
        grad_norm: float | None = None,
        step: int | None = None,
    ) -> None:
        """Records an incident: a batch's (`ev`), or one found at an epoch's
        end or in a snapshot (`ev` is `None`, `batch` is -1, `step` the
        snapshot's or by default the step training is at)."""
        state, settings = self.state, self.settings
        loss = None if ev is None else ev.logs.get("loss")
        inc = Incident(
            fit=state.fit,
            epoch=state.epoch if ev is None else ev.epoch,
            step=(state.now if step is None else step) if ev is None else ev.step,
            batch=-1 if ev is None else ev.batch,
            kind=kind,
            detail=detail,
            steps=1 if ev is None or ev.batch < 0 else ev.steps,
            loss=None if loss is None else float(loss),
            grad_norm=grad_norm,
            variables=list(variables),
        )
        if settings.replay is not None and ev is not None and ev.batch >= 0:
            inc.batch_data, bad = _replay.batches(
                settings.replay, settings.batch_size, ev.batch, ev.batch + ev.steps - 1
            )
            if bad is not None:  # the bad one of the execution is known
                inc.batch, inc.step, inc.steps = bad, ev.step + bad - ev.batch, 1
        self.log.add(inc, opens=ev is not None and ev.batch >= 0)
        if inc.batch_data is not None:
            snapshots.sync_from_device(state.net)
            diagnose_batch(inc, state.net)
        self.write_report()  # told once its action is known (`telling`)

    def divergence_warning(self, found: RunDiagnosis) -> None:
        """Records the early warning `found` (never trouble); with
        `early_warning="act"` under `policy="rollback"` it lowers the
        learning rate by `lr_factor` now, before anything is non-finite."""
        stall = found.cause == "stalled"
        detail = "the run stopped learning" if stall else f"{found.cause} predicted"
        if found.onset_step is not None:
            detail += f" (onset at optimizer step {found.onset_step})"
        detail += ": " + " ".join(found.evidence)
        self.record(
            None, "stall_warning" if stall else "divergence_warning", detail, []
        )
        inc = self.log.last
        inc.diagnosis = found
        inc.action = "recorded"
        # A lower rate does not restart a stalled run.
        early = self.settings.early_warning
        if stall or early != "act" or self.settings.policy != "rollback":
            return
        optimizer = self.state.net.optimizer
        lr = _learning_rate.lower(optimizer, self.settings.lr_factor)
        if lr is not None:
            inc.learning_rate = lr
            inc.action = f"lowered the learning rate {lr[0]:.3g} -> {lr[1]:.3g}"
        else:
            inc.action = "recorded" + _learning_rate.not_lowered(optimizer)

    def trouble(self) -> None:
        """Acts on the newest incident, which is trouble."""
        inc, policy = self.log.last, self.settings.policy
        if policy == "warn":
            inc.action = "warned"  # warned once, by `telling`
            return
        self.keeper.drop_pending()  # not yet proven by a healthy batch
        point = self.keeper.point
        if point is None:  # see `Snapshotter.start`
            self._raise_without_rollback_point(inc)
        self.snapshotter.restore()
        self.state.resumed_at = self.state.now
        where = f"restored the snapshot of epoch {point.epoch}, step {point.step}"
        if policy == "raise":
            inc.action = where + ", raised NonFiniteError"
            self.write_report()
            raise NonFiniteError(f"NaNGuard: {inc}", report=self.report())
        if policy == "rollback" and self.keeper.may_roll_back(self.settings.patience):
            self._roll_back(inc, point, where)
        else:
            self._stop(inc, where)

    def _raise_without_rollback_point(self, inc: Incident) -> NoReturn:
        inc.action = "raised NonFiniteError: no good state to restore"
        self.write_report()
        raise NonFiniteError(
            f"NaNGuard: {inc} There is no good state to go back to: the "
            "model was built by `fit`, so NaNGuard could take its first "
            "snapshot only after the first step, and no healthy step has "
            "proven that state since (a first step can be finite and still "
            "ruinous). Build the model before `fit` (`keras.Input` or "
            "`model.build(input_shape)`) so that the state training starts "
            "from is the rollback point.",
            report=self.report(),
        )

    def _roll_back(self, inc: Incident, point: snapshots.Snapshot, where: str) -> None:
        """Goes on from the restored rollback point, with the learning rate
        lowered by `lr_factor` and the next `skip_batches` batches to undo."""
        settings, state = self.settings, self.state
        self.keeper.rolled_back()
        inc.action = "rolled back: " + where
        optimizers = _learning_rate.trained_by(state.net)
        lowered = _learning_rate.lower_all(optimizers, settings.lr_factor)
        if lowered:
            inc.learning_rate = next(iter(lowered.values()))
            inc.action += _learning_rate.lowered_words(lowered)
            self.snapshotter.save(point)  # the rate to go on with
        elif settings.lr_factor < 1:  # a schedule
            inc.action += _learning_rate.not_lowered(next(iter(optimizers.values())))
        skip = settings.skip_batches
        until = state.now + skip
        state.discard_until = until if skip else None
        self.reset_metrics(state.now, until, restored=True)
        if skip:
            inc.action += f", discarding the next {skip} batches"

    def _stop(self, inc: Incident, where: str) -> None:
        state = self.state
        state.net.stop_training = True
        state.stopping = True  # the batch in flight is undone at the epoch end
        self.reset_metrics(state.now, math.inf, restored=True)
        inc.action = where + ", stopped training"
        if self.settings.policy == "rollback":
            rollbacks = self.keeper.rollbacks_since
            inc.action += f" after {rollbacks} rollbacks without recovery"

    def reset_metrics(
        self, step: int, leave_out_until: float | None = None, restored: bool = False
    ) -> None:
        """Starts Keras's running means afresh before `step`; the batch-end
        side leaves the batches before `leave_out_until` out of the figures
        (by default those a restore undid; see `BatchWatch.metrics_reset`)
        and, if the snapshot was `restored`, counts rejections in a row
        afresh from `step`: the restore resets the streak."""
        if restored and leave_out_until is None:
            leave_out_until = step
        state = self.state
        snapshots.sync_from_device(state.net)
        state.net.reset_metrics()
        with state.lock:
            state.watch.metrics_reset(step, leave_out_until, restored)
