"""NaNGuard: watch `model.fit`, keep a good state, roll back or stop, say why.

The hooks live here; what they do is in NaNGuard's parts (see this
folder's `__init__`), which the guard holds: for its life an `IncidentLog`,
a `SnapshotKeeper` and a `Notifier`, and for each `fit` a `FitState` with the
training thread's `Supervisor`. Threads: docs/nan_guard.md.
"""

from __future__ import annotations

import os
import threading
from typing import Annotated, Any

import keras
import numpy as np

from keras_nanguard import snapshots
from keras_nanguard._arguments import ArgumentSpec, Check
from keras_nanguard._backend import current as backend
from keras_nanguard._validation import (
    check_bool,
    check_choice,
    check_directory,
    check_file_path,
    check_in,
    check_int,
    check_int_or_auto,
    check_positive,
)
from keras_nanguard.flight.reading import RunDiagnosis
from keras_nanguard.flight.record import FlightRecord
from keras_nanguard.incidents import Incident, QuarantinedRow, write_json
from keras_nanguard.nan_guard import fit_state as _fit
from keras_nanguard.nan_guard import reporting, responses
from keras_nanguard.nan_guard import runs as _runs
from keras_nanguard.nan_guard.reporting import IncidentLog
from keras_nanguard.nan_guard.snapshotting import SnapshotKeeper
from keras_nanguard.nan_guard.supervisor import FlightWatch, Supervisor

POLICIES = ("rollback", "stop", "raise", "warn")


def _check_early_warning(name: str, value: Any) -> bool | str:
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if value != "act":
        raise ValueError(
            f"`{name}` must be True (record a `divergence_warning` incident), "
            "False (none) or 'act' (also lower the learning rate, with "
            f"policy='rollback'). Received: {name}={value!r}"
        )
    return "act"


# A batch end waits at most this long for the one before it (Keras's worker
# threads may start them out of order); past it, it goes on regardless.
_ORDER_TIMEOUT = 60.0
# A batch begins only once the batch end of `_MAX_LAG` executions before it
# has been read: NaNGuard acts at most that many batches late, and the device
# still has that many queued (no stall).
_MAX_LAG = 2


@keras.saving.register_keras_serializable(package="keras_nanguard")
class NaNGuard(keras.callbacks.Callback):
    """Watches `model.fit`, keeps a last-known-good state, and acts on trouble.

    NaNGuard keeps a snapshot of the model and its optimizer that a later,
    healthy batch proved good. On *trouble* (a non-finite state; a
    non-finite loss with a plain optimizer; `max_rejections` steps in a row
    rejected by a `SafeOptimizer`, or its halt; with `loss_spike_sigma`, a
    loss spike) it follows `policy`. Each
    incident is kept in `guard.incidents` and told once, with its action.
    It leaves bad batches out of the epoch's figures, in `logs`: list it
    before `ModelCheckpoint`, `BackupAndRestore`, `EarlyStopping`,
    `CSVLogger` and `TensorBoard`. What counts as trouble, when snapshots
    are taken, the figures it logs, and why it may act up to two batches
    late on JAX and PyTorch: docs/nan_guard.md.

    Args:
        policy: what to do on trouble. `"rollback"`: restore the snapshot,
            multiply the learning rate by `lr_factor`, discard the next
            `skip_batches` batches and go on; after `patience` rollbacks
            with no fresh good snapshot in between, stop. `"stop"`: restore
            the snapshot and stop; `fit` returns a finite model. `"raise"`:
            restore the snapshot and raise `keras_nanguard.NonFiniteError`.
            `"warn"`: only warn. Defaults to `"rollback"`.
        snapshot_every: steps between snapshots (int >= 1), or `"auto"`: as
            often as keeps their cost under `snapshot_budget` of the training
            time, at least 10 steps apart. Defaults to `"auto"`.
        snapshot_budget: float in (0, 1), with `"auto"`. Defaults to 0.01.
        check_every: steps between reads of a SafeOptimizer's counters (int
            >= 1) or `"auto"`, only for steps that do not log its total (a
            custom `train_step`). Defaults to `"auto"`.
        lr_factor: float in (0, 1]: learning-rate multiplier at each rollback
            (1 keeps it; a schedule is not lowered, and the action says so).
            Defaults to 0.5.
        skip_batches: int >= 0: batches discarded after a rollback (their
            updates are undone). Defaults to 0.
        patience: int >= 0: rollbacks allowed without a fresh good snapshot in
            between before stopping. Defaults to 3.
        max_rejections: int >= 1: steps in a row rejected by a SafeOptimizer
            that count as trouble. Defaults to 3.
        loss_spike_sigma: optional float > 0: a batch loss this many standard
            deviations above its rolling mean is high; `None` turns loss-spike
            detection off. Defaults to `None`.
        loss_spike_window: int >= 2: healthy batches in the rolling mean and
            standard deviation. Defaults to 100.
        loss_spike_patience: int >= 1: steps in a row with a high loss that
            make a spike (kind `"loss_spike"`; the rollback point then
            predates it). Defaults to 3.
        directory: optional `str` or `os.PathLike`; the rollback point is
            also written there, atomically, as `nanguard_snapshot.npz`, with
            the learning rate to go on with (load it with `NaNGuard.restore`),
            and as `nanguard_snapshot.weights.h5` (load it with
            `model.load_weights`); when `fit` returns they hold the final
            state if that is finite. Not an existing file. Defaults to `None`.
        report_path: optional `str` or `os.PathLike` of a JSON file with
            every incident, rewritten atomically after each incident and at
            the end of training. Not an existing directory. Defaults to
            `None`.
        replay: optional `(x, y)` arrays (or `x` alone) or a
            `keras.utils.PyDataset` that `fit` reads unshuffled; an
            incident's batch is then kept in `incident.batch_data` and
            diagnosed (see `keras_nanguard.diagnose`). Defaults to `None`.
        batch_size: int >= 1, the batch size of array `replay` data.
            Defaults to 32.
        quarantine: bool: attach the SafeOptimizer with per-sample
            quarantine (`SafeOptimizer.attach`), so that a bad row costs that
            row, not the batch. The rows left out are in `guard.quarantined`
            (with their `position` in the `replay` data when given), in an
            incident of kind `"quarantined_samples"` per epoch and in the
            report. `False` keeps the quarantine the optimizer was attached
            with, if any. Defaults to `False`.
        max_quarantine_fraction: float in (0, 1]: a batch with more bad rows
            than this fraction is left whole (and rejected). Defaults to 0.5.
        early_warning: `True`, `False` or `"act"`. `True` reads the
            SafeOptimizer's flight recorder as training goes (at steps 1, 2,
            4, 8, then every `probe_every` steps, and whenever the
            recorder's alarm rings: the device decides it every step, the
            host learns it without waiting) and records an incident of kind
            `"divergence_warning"` (its cause and evidence, never trouble)
            as soon as the trajectory predicts that the run will diverge,
            before anything is non-finite, or `"stall_warning"` when the run
            has stopped learning (cause `stalled`); once per fit. `"act"`,
            with `policy="rollback"`, also lowers the learning rate by
            `lr_factor` at a divergence warning (not at a stall: a lower
            rate does not restart it). `explain()` gives the run's
            diagnosis whatever this is. Defaults to `True`.
        verbose: 0 or 1: 1 tells each incident once its action is known, in
            a log line (logger `"keras_nanguard"`, level WARNING) that starts
            on a line of its own under `fit`'s progress bar. Whatever
            `verbose`, `"warn"` tells its incidents as a `UserWarning`
            instead, and `"raise"` in the `NonFiniteError`. Defaults to 1.

    Example:

    >>> import numpy as np, keras, keras_nanguard as ng
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer=ng.SafeOptimizer(keras.optimizers.SGD(0.01)),
    ...               loss="mse")
    >>> x = ng.faults.poison(np.ones((64, 4), "float32"), rows=[5])
    >>> guard = ng.NaNGuard(verbose=0)
    >>> history = model.fit(x, np.ones((64, 1)), batch_size=16, verbose=0,
    ...                     shuffle=False, callbacks=[guard])
    >>> len(guard.incidents), guard.incidents[0].kind
    (1, 'rejected_step')
    >>> bool(np.isfinite(history.history["loss"][0]))
    True
    """

    def __init__(
        self,
        # Each argument's one declaration: type, check, default; the
        # attributes of these names, `get_config` and the settings a `fit`
        # runs with are made from them.
        policy: Annotated[str, Check(check_choice, POLICIES)] = "rollback",
        *,
        snapshot_every: Annotated[int | str, Check(check_int_or_auto, 1)] = "auto",
        snapshot_budget: Annotated[
            float, Check(check_in, 0, 1, closed_high=False)
        ] = 0.01,
        check_every: Annotated[int | str, Check(check_int_or_auto, 1)] = "auto",
        lr_factor: Annotated[float, Check(check_in, 0, 1, closed_high=True)] = 0.5,
        skip_batches: Annotated[int, Check(check_int, 0)] = 0,
        patience: Annotated[int, Check(check_int, 0)] = 3,
        max_rejections: Annotated[int, Check(check_int, 1)] = 3,
        loss_spike_sigma: Annotated[
            float | None, Check(check_positive, allow_none=True)
        ] = None,
        loss_spike_window: Annotated[int, Check(check_int, 2)] = 100,
        loss_spike_patience: Annotated[int, Check(check_int, 1)] = 3,
        directory: Annotated[str | os.PathLike | None, Check(check_directory)] = None,
        report_path: Annotated[str | os.PathLike | None, Check(check_file_path)] = None,
        replay: Annotated[Any, Check(responses.check_replay)] = None,
        batch_size: Annotated[int, Check(check_int, 1)] = 32,
        quarantine: Annotated[bool, Check(check_bool)] = False,
        max_quarantine_fraction: Annotated[
            float, Check(check_in, 0, 1, closed_high=True)
        ] = 0.5,
        early_warning: Annotated[bool | str, Check(_check_early_warning)] = True,
        verbose: Annotated[int, Check(check_choice, (0, 1))] = 1,
    ) -> None:
        super().__init__()
        for name, value in ARGUMENTS.checked(locals()).items():  # the names above
            setattr(self, name, value)
        # What outlives a fit: the incidents, the rollback point and the
        # counts, what has been told. `_supervisor`: the fit under way (or the last).
        self._log = IncidentLog()
        self._keeper = SnapshotKeeper()
        self._notifier = reporting.Notifier()
        self._flight = FlightWatch()  # the flight recorder's record, all fits
        self._supervisor: Supervisor | None = None
        self._fits = 0
        # Its copies (KerasTuner makes one per trial), or what it is a copy of.
        self.runs: list[NaNGuard] = []
        self.origin: NaNGuard | None = None
        self.run_index: int | None = None
        self._epochs: _runs.Epochs | None = None  # a copy's, see `runs`

    @property
    def async_safe(self) -> bool:
        """Whether Keras may run `on_train_batch_end` in its worker threads:
        on JAX and torch, in a job of one process (Keras asks when `fit`
        begins). On TensorFlow, and across processes, it stays in line, at
        the same point of every process's loop (see `fit_state`)."""
        return backend.ASYNC_BATCH_END and _fit.processes()[1] == 1

    # ------------------------------------------------------------ what it keeps
    @property
    def incidents(self) -> list[Incident]:
        return self._log.incidents

    @incidents.setter
    def incidents(self, value: list[Incident]) -> None:
        self._log.incidents = value

    @property
    def quarantined(self) -> list[QuarantinedRow]:
        """The rows the quarantine left out of their steps, in all fits, in
        order (`quarantine=True`); see `QuarantinedRow`."""
        return self._log.quarantined

    @property
    def rollbacks(self) -> int:
        return self._keeper.rollbacks

    @rollbacks.setter
    def rollbacks(self, value: int) -> None:
        self._keeper.rollbacks = value

    @property
    def snapshot(self) -> snapshots.Snapshot | None:
        """The rollback point: the last snapshot a healthy batch proved."""
        return self._keeper.point

    @snapshot.setter
    def snapshot(self, value: snapshots.Snapshot | None) -> None:
        self._keeper.point = value

    @property
    def snapshots_taken(self) -> int:
        return self._keeper.kept

    @snapshots_taken.setter
    def snapshots_taken(self, value: int) -> None:
        self._keeper.kept = value

    # ------------------------------------------------------------ lifecycle
    # `on_train_batch_end` may run in Keras's worker threads, the other hooks
    # run on the training thread: see `fit_state` and docs/nan_guard.md.
    def on_train_begin(self, logs: dict | None = None) -> None:
        # The arguments now (checked again: they are attributes a user may
        # have set since), for the whole fit.
        settings = ARGUMENTS.checked({n: getattr(self, n) for n in ARGUMENTS.names})
        check_directory("directory", settings.directory, writable=True)
        check_file_path("report_path", settings.report_path, writable=True)
        index, count = _fit.processes()
        _fit.check_engine(count)
        if count > 1:
            _fit.check_same_settings(settings)
        model = self.model  # once: see `FitState.model`
        if self.policy == "rollback":  # the only policy that lowers the rate
            said = responses.schedule_warning(model.optimizer, self.lr_factor)
            if said is not None:
                reporting.warn(said)
        state = _fit.start_fit(self._fits, model, settings, (index, count))
        self._fits += 1
        self._keeper.begin_fit()
        self._log.begin_fit()
        # The first snapshot waits for the first batch begin (`Supervisor.take`):
        # a callback's `on_train_begin` (`BackupAndRestore`) may still load
        # the state training really starts from, whatever the order.
        self._supervisor = Supervisor.for_fit(
            settings,
            state,
            self._log,
            self._keeper,
            self.report,
            self._write_report,
            self._flight,
        )

    def _current(self) -> Supervisor:
        if self._supervisor is None:
            raise RuntimeError(
                "NaNGuard's hooks run inside `fit`, after `on_train_begin`. "
                "Received: a hook called before `on_train_begin`"
            )
        return self._supervisor

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        state = self._current().state
        state.epoch, state.in_epoch = epoch, True
        with state.lock:
            state.watch.begin_epoch(epoch, state.watch.steps_done)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        state = self._current().state
        with state.lock:
            watch = state.watch
            watch.begins.append(batch)
            state.now = now = watch.base + batch
            # Bounds how late an action can be: the device may run ahead of
            # the batch ends by `_MAX_LAG` executions, no more.
            lag = _MAX_LAG * state.k
            state.lock.wait_for(lambda: watch.steps_done >= now - lag, _ORDER_TIMEOUT)
        self._act()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        logs = logs if logs is not None else {}
        state = self._current().state
        per_epoch = (self.params or {}).get("steps")
        with state.lock:
            watch = state.watch
            first = watch.first_of(batch, state.k)
            # Keras's workers may start batch ends out of order.
            state.lock.wait_for(lambda: watch.next_batch >= first, _ORDER_TIMEOUT)
            # With `steps_per_execution` the last execution may be shorter.
            last = min(batch, per_epoch - 1) if per_epoch else batch
            watch.end(first, max(first, last), logs)
            state.lock.notify_all()
            steps_done = watch.steps_done
        if threading.get_ident() == state.thread:  # Keras calls it in line
            state.now = steps_done
            self._act()
        self._publish(logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        logs = logs if logs is not None else {}
        turns = self._current()
        turns.state.now = turns.state.watch.steps_done  # Keras waited for them
        self._act(snapshot=False)
        checked = turns.end_epoch(epoch, logs)
        if checked and self._epochs is not None:  # a copy KerasTuner runs
            _runs.epoch_end(
                self._epochs, turns.state, self.snapshot, self.incidents, logs
            )
        self._tell()
        self._publish(logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        turns = self._current()
        state = turns.state
        state.now, state.in_epoch = state.watch.steps_done, False  # bar ended
        self._act(snapshot=False)
        turns.snapshotter.finish()
        self._write_report()
        if self.origin is not None:  # a copy's run has ended
            self._release()

    def _act(self, snapshot: bool = True) -> None:
        """The training thread's turn (`Supervisor.take`), then the new incidents
        told, also when the turn raised."""
        try:
            self._current().take(snapshot)
        finally:
            self._tell()

    # ------------------------------------------------------------ telling
    def _tell(self) -> None:
        state = self._current().state
        with state.lock:
            next_batch = state.watch.next_batch
        bar = reporting.bar_open(state.in_epoch, next_batch, self.params)
        self._notifier.tell(self.incidents, self.verbose, bar)

    def _publish(self, logs: dict) -> None:
        state = self._current().state
        rejected = None
        if state.safe is not None:  # an attached step logs its own, exactly
            with state.lock:
                rejected = state.watch.rejected
        reporting.publish(logs, len(self.incidents), self.rollbacks, rejected)

    def _write_report(self) -> None:
        if self.report_path is not None and _fit.processes()[0] == 0:
            write_json(self.report_path, self.report())
        if self.origin is not None:  # the runs together, in the origin's
            self.origin._write_report()

    def report(self) -> dict[str, Any]:
        """Everything NaNGuard saw, as a JSON-ready dict.

        Example:

        >>> import keras_nanguard as ng
        >>> ng.NaNGuard().report()["incidents"]
        []
        """
        out = reporting.report(self.policy, self.rollbacks, self.incidents, self.runs)
        if self.quarantine or self.quarantined:
            out["quarantined"] = [r.to_dict() for r in self.quarantined]
        if self._flight.record is not None and len(self._flight.record):
            out["run_diagnosis"] = self._flight.diagnosis().to_dict()
        return out

    @property
    def flight_record(self) -> FlightRecord | None:
        """What NaNGuard read of its SafeOptimizer's flight recorder, over
        all its fits (None before any); see `FlightRecord`."""
        return self._flight.record

    def explain(self) -> RunDiagnosis:
        """Why the run diverged, or is about to (`RunDiagnosis`), from the
        SafeOptimizer's flight recorder; reads it once more first. Works
        after a `fit` that raised `NonFiniteError` too. Never changes the
        model or the optimizer.

        Example:

        >>> import keras_nanguard as ng
        >>> ng.NaNGuard().explain().cause  # no fit yet: nothing recorded
        'unknown'
        """
        turns = self._supervisor
        if turns is not None and turns.state.safe is not None:
            self._flight.read(turns.state)
        return self._flight.diagnosis()

    def summary(self) -> str:
        """The incidents in words, one per line.

        Example:

        >>> import keras_nanguard as ng
        >>> ng.NaNGuard().summary()
        'NaNGuard: no incidents.'
        """
        text = reporting.summary(self.incidents, self.rollbacks, self.runs)
        if self._flight.record is None or not len(self._flight.record):
            return text
        return text + "\n" + str(self._flight.diagnosis())

    # ------------------------------------------------------------ copies
    def __deepcopy__(self, memo: dict[int, Any]) -> NaNGuard:
        """A fresh guard with the same configuration, registered in its
        origin's `runs`, with its own files (see `runs`). Earlier runs that
        raised have ended: their model and snapshots are let go."""
        origin = self.origin or self
        for run in origin.runs:
            if run.incidents and "raised NonFiniteError" in run.incidents[-1].action:
                run._release()
        index = len(origin.runs)
        config = origin.get_config()
        config["report_path"] = _runs.run_report_path(origin.report_path, index)
        config["directory"] = _runs.run_directory(origin.directory, index)
        copy = type(origin).from_config(config)
        copy.replay = origin.replay  # data, shared (see `runs`)
        copy.origin, copy.run_index, copy._epochs = origin, index, _runs.Epochs()
        memo[id(self)] = copy
        origin.runs.append(copy)
        return copy

    def _release(self) -> None:
        """Lets a finished copy's model and snapshot buffers go: the origin
        keeps every run, and a search must not keep every trial's model with
        it. Its incidents, report and files stay."""
        self._keeper.release()
        self._supervisor = None
        self.set_model(None)

    # ------------------------------------------------------------ files, config
    @staticmethod
    def restore(model: keras.Model, directory: str | os.PathLike) -> int:
        """Loads the snapshot NaNGuard wrote into `directory` into `model`.

        `model` must be built, with the same architecture. Compiled with the
        same optimizer, it gets the weights, the optimizer's variables and the
        learning rate to go on with: it resumes training where the snapshot
        was taken; not compiled, the weights only. Raises `ValueError`, and
        changes nothing, when the shapes do not match. Returns the snapshot's
        step.

        Example:

        >>> import keras_nanguard as ng
        >>> # after fit(..., callbacks=[ng.NaNGuard(directory="ckpt")]):
        >>> # step = ng.NaNGuard.restore(model, "ckpt")
        """
        return snapshots.load_into(model, directory).step

    def get_config(self) -> dict[str, Any]:
        # Every argument but `replay` (data, not configuration).
        return {n: getattr(self, n) for n in ARGUMENTS.names if n != "replay"}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> NaNGuard:
        return cls(**config)


ARGUMENTS = ArgumentSpec(NaNGuard.__init__)
