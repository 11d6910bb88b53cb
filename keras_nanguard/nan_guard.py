"""NaNGuard: watch `model.fit`, keep a good state, roll back or stop, say why."""

from __future__ import annotations

import logging
import os
import time
import warnings
from typing import Any

import keras

from keras_nanguard import _replay, snapshots
from keras_nanguard._cadence import Cadence
from keras_nanguard._figures import EpochFigures, is_loss, nonfinite
from keras_nanguard._validation import check_writable, is_int, is_number
from keras_nanguard.errors import NonFiniteError
from keras_nanguard.incidents import Incident, diagnose_batch, write_json

POLICIES = ("rollback", "stop", "raise", "warn")
_LOG = logging.getLogger("keras_nanguard")


@keras.saving.register_keras_serializable(package="keras_nanguard")
class NaNGuard(keras.callbacks.Callback):
    """Watches `model.fit`, keeps a last-known-good state, and acts on trouble.

    What it watches, at the end of every batch (and so synchronously, also on
    JAX and PyTorch where Keras would otherwise run batch-end callbacks in a
    background thread):

    - the batch's loss and metrics: Keras logs running means, so NaNGuard
      excludes a bad batch from them (see below) and sees every bad batch;
    - the counters of a `SafeOptimizer` (also inside a `LossScaleOptimizer`):
      rejected steps, and a halt after `max_consecutive_skips`;
    - the weights and optimizer variables, where reading them is paid for
      anyway: when a snapshot is taken, at the end of an epoch, and at an
      incident.

    It keeps a last-known-good snapshot of every model weight and optimizer
    variable, on the host, taken only when all are finite: at the start of
    training, then every `snapshot_every` steps (by default as often as fits
    in 1% of the training time), and at the end of training; optionally
    written to `directory`.

    A model that `fit` itself builds (a subclassed model or a `Sequential`
    without `Input`, on TensorFlow; JAX and PyTorch build it before training
    begins) has no variables when training begins: the first snapshot is
    then taken at the end of the first batch (the first execution, with
    `steps_per_execution`). That first step cannot be rolled back: with a
    plain optimizer, if it makes the state non-finite there is no good state
    to go back to and NaNGuard raises `NonFiniteError` (with `"warn"`, it
    warns); with a SafeOptimizer a bad first step is never applied. To
    protect the first step too, build the model before `fit`
    (`keras.Input`, or `model.build(input_shape)`).

    What it does on *trouble*: non-finite weights or optimizer state, a
    non-finite loss with a plain optimizer (the bad update has been applied),
    or `max_rejections` steps in a row rejected by a SafeOptimizer (the state
    itself is drifting). A single step rejected by a SafeOptimizer is recorded
    but is not trouble: nothing was applied.

    - `"rollback"` (default): restore the snapshot, multiply the learning rate
      by `lr_factor`, discard the next `skip_batches` batches, and go on;
      after `patience` rollbacks with no fresh good snapshot in between, stop
      as with `"stop"`.
    - `"stop"`: restore the snapshot and stop training; `fit` returns a
      finite, usable model.
    - `"raise"`: restore the snapshot and raise `keras_nanguard.NonFiniteError`
      with the incident report.
    - `"warn"`: only warn.

    Reported figures: a batch whose loss is non-finite, and a discarded
    batch, are left out of the epoch's loss and metrics; a non-finite metric
    with a finite loss (incident kind `"nonfinite_metric"`) is left out of
    that metric only. (Keras's metric states are reset and NaNGuard combines
    the parts, each batch weighted equally.) So the progress bar, `History`,
    `CSVLogger` and callbacks after NaNGuard never see NaN because of a bad
    batch. A figure with no healthy batch in the epoch is left out of that
    epoch's logs, as Keras leaves out `val_loss` in an epoch it does not
    validate: the progress bar does not show it, `History` has no entry for
    that epoch (its list is shorter than `History.epoch`), `CSVLogger`
    writes `NA` (if the first epoch of a `fit` is such an epoch, the file has
    no column for that figure), and `EarlyStopping`, `ReduceLROnPlateau` and
    `ModelCheckpoint` warn that the figure is not available and skip the
    epoch. NaNGuard edits `logs` in place: list it *before*
    `ModelCheckpoint`, `BackupAndRestore`, `EarlyStopping`, `CSVLogger` and
    `TensorBoard`. It adds `nanguard_incidents`, `nanguard_rollbacks` and
    (with a SafeOptimizer) `nanguard_rejected_steps` to the logs.

    With `steps_per_execution=k` (not on PyTorch), Keras calls back once per
    k steps, so detection, rollback and the exclusion of figures work on
    whole executions of k steps. Steps are still counted one by one
    (`incident.step`, `snapshot_every`): an incident in an execution is
    placed at its first step and covers its k steps (`incident.steps`),
    unless the `replay` data shows which batch held a NaN or inf.

    Args:
        policy: `"rollback"`, `"stop"`, `"raise"` or `"warn"`. Defaults to
            `"rollback"`.
        snapshot_every: steps between snapshots (int >= 1), or `"auto"`: as
            often as keeps the snapshot cost under `snapshot_budget` of the
            training time, and at least every 10 steps apart. Defaults to
            `"auto"`.
        snapshot_budget: fraction of training time snapshots may take, with
            `"auto"`. Defaults to 0.01.
        check_every: steps between reads of a SafeOptimizer's counters
            (int >= 1), or `"auto"`: as often as keeps the reads under 1% of
            the training time. A batch with non-finite figures always
            triggers a read. Rejected steps whose loss was finite are
            noticed at the next read (they were not applied, so nothing is
            lost in between). Defaults to `"auto"`.
        lr_factor: float in (0, 1]: learning-rate multiplier at each rollback
            (1 keeps it). Defaults to 0.5.
        skip_batches: int >= 0: batches discarded after a rollback (their
            updates are undone). Defaults to 0.
        patience: int >= 0: rollbacks allowed without a fresh good snapshot in
            between before stopping. Defaults to 3.
        max_rejections: int >= 1: steps in a row rejected by a SafeOptimizer
            that count as trouble. Defaults to 3.
        directory: optional path; each snapshot that becomes the rollback
            point is also written there, atomically, as
            `nanguard_snapshot.npz`, with the learning rate to go on with
            (NaNGuard's lowered one). When `fit` returns it holds the final
            state if that is finite. Load it with `NaNGuard.restore`.
            Defaults to `None`.
        report_path: optional path of a JSON file with every incident,
            rewritten atomically after each incident and at the end of
            training. Defaults to `None`.
        replay: optional `(x, y)` arrays or a `keras.utils.PyDataset` that
            `fit` reads unshuffled; the batch of an incident is then kept in
            `incident.batch_data` (and diagnosed, see `keras_nanguard.diagnose`).
            With `steps_per_execution > 1`, the batch that holds a NaN or inf
            if only one of the execution does, else all the execution's
            batches, concatenated. Defaults to `None`.
        batch_size: batch size used with array `replay` data. Defaults to 32.
        verbose: 0 silent, 1 logs a line per incident (logger
            `"keras_nanguard"`, level WARNING). Defaults to 1.

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
        policy: str = "rollback",
        *,
        snapshot_every: int | str = "auto",
        snapshot_budget: float = 0.01,
        check_every: int | str = "auto",
        lr_factor: float = 0.5,
        skip_batches: int = 0,
        patience: int = 3,
        max_rejections: int = 3,
        directory: str | os.PathLike | None = None,
        report_path: str | os.PathLike | None = None,
        replay: Any = None,
        batch_size: int = 32,
        verbose: int = 1,
    ) -> None:
        super().__init__()
        if policy not in POLICIES:
            raise ValueError(
                f"`policy` must be one of {POLICIES}. Received: policy={policy!r}"
            )
        for name, value in (
            ("snapshot_every", snapshot_every),
            ("check_every", check_every),
        ):
            if value != "auto" and not is_int(value, 1):
                raise ValueError(
                    f"`{name}` must be an int >= 1 or 'auto'. "
                    f"Received: {name}={value!r}"
                )
        if not (is_number(snapshot_budget) and 0 < snapshot_budget < 1):
            raise ValueError(
                "`snapshot_budget` must be in (0, 1). "
                f"Received: snapshot_budget={snapshot_budget!r}"
            )
        if not (is_number(lr_factor) and 0 < lr_factor <= 1):
            raise ValueError(
                f"`lr_factor` must be in (0, 1]. Received: lr_factor={lr_factor!r}"
            )
        for name, value, low in (
            ("skip_batches", skip_batches, 0),
            ("patience", patience, 0),
            ("max_rejections", max_rejections, 1),
            ("batch_size", batch_size, 1),
        ):
            if not is_int(value, low):
                raise ValueError(
                    f"`{name}` must be an int >= {low}. Received: {name}={value!r}"
                )
        self.policy = policy
        self.snapshot_every = snapshot_every
        self.snapshot_budget = float(snapshot_budget)
        self.check_every = check_every
        self.lr_factor = float(lr_factor)
        self.skip_batches = skip_batches
        self.patience = patience
        self.max_rejections = max_rejections
        self.directory = None if directory is None else os.fspath(directory)
        self.report_path = None if report_path is None else os.fspath(report_path)
        self.replay = replay
        self.batch_size = batch_size
        self.verbose = verbose
        self.incidents: list[Incident] = []
        self.rollbacks = 0
        # `snapshot` is the rollback point. A new snapshot is first `_pending`:
        # it becomes the rollback point only once the next batch is healthy,
        # so an update that is finite but ruinous (a learning-rate spike) is
        # not kept as "good" before its damage shows. `_spare` holds the
        # previous buffers for reuse.
        self.snapshot: snapshots.Snapshot | None = None
        self._pending: snapshots.Snapshot | None = None
        self._spare: snapshots.Snapshot | None = None
        self.snapshots_taken = 0
        self._fits = 0

    # ------------------------------------------------------------ lifecycle
    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.directory is not None:
            check_writable(self.directory, "directory")
        if self.report_path is not None:
            check_writable(
                os.path.dirname(os.path.abspath(self.report_path)), "report_path"
            )
        self._fit = self._fits
        self._fits += 1
        self._step = 0  # steps done in this fit
        self._batch_step = 0  # global step of the current execution's first batch
        self._batch_steps = 1  # steps in the current execution
        self._epoch = 0
        self._open: Incident | None = None
        self._rollbacks_since_snapshot = 0
        self._skip_left = 0
        self._safe = snapshots.find_safe_optimizer(self.model.optimizer)
        if self._safe is not None:  # a rejected step keeps BN statistics too
            self._safe.attach(self.model)
        self._snapshots = Cadence(self.snapshot_every, self.snapshot_budget, 10)
        self._checks = Cadence(self.check_every, 0.01, 1)
        self._last_time: float | None = None
        self._step_seconds: float | None = None
        snapshots.sync_from_device(self.model)
        self._rejected_seen = self._read_rejected()
        self._checked_at = -1
        # The last fit's rollback point only lends its buffers.
        self._spare = self.snapshot or self._spare
        self.snapshot = self._pending = None
        self._started = False
        self._at_snapshot = False  # the state is the rollback point's
        if self.model.built:  # else Keras builds it in the first step
            self._start()

    def _start(self) -> None:
        """Takes the first snapshot, once the model has its variables."""
        self._started = True
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        snapshots.sync_from_device(self.model)
        snap, bad = snapshots.take(
            self.model, epoch=self._epoch, step=self._step, into=self._reusable()
        )
        if snap is not None:
            self._keep(snap)
            self._at_snapshot = True
        elif self._step == 0:
            raise NonFiniteError(
                "NaNGuard: the model is already non-finite before training starts "
                f"({', '.join(bad[:5])}); there is no good state to protect. "
                "Re-initialise or load good weights first."
            )
        # else: the first step of a model built by `fit` went bad; the batch's
        # checks report it and `_trouble` finds no snapshot.

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        self._figures = EpochFigures()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        logs = logs if logs is not None else {}
        batch, steps = self._advance(batch)
        self._at_snapshot = False
        if not self._started:  # a model built by this first step
            self._start()
        if self._skip_left > 0:  # discard this batch: undo its update
            self._skip_left = max(0, self._skip_left - steps)
            snapshots.sync_from_device(self.model)
            snapshots.restore(self.model, self.snapshot)
            self._at_snapshot = True
            self._leave_out(logs)
            self._publish(logs)
            return

        bad_logs = sorted(k for k, v in logs.items() if nonfinite(v))
        new_rejections, since = self._check_counters(bool(bad_logs), logs)
        if bad_logs:  # this batch's figures are bad: it is left out of them
            snapshots.sync_from_device(self.model)
            bad_loss = any(is_loss(k) for k in bad_logs)
            if new_rejections:
                self._on_rejection(batch, logs, bad_logs, new_rejections, since)
            else:
                self._on_bad_figures(batch, logs, bad_logs, bad_loss)
            # A non-finite metric with a finite loss: only the metric is left out.
            self._leave_out(logs, None if bad_loss else bad_logs)
        elif new_rejections:  # rejected with finite figures, e.g. an overflow
            if "nanguard_rejected_steps" in logs:
                # An attached step left its batch out of Keras's metrics on
                # the device; an epoch with no accepted batch reports none.
                self._leave_out(logs)
            else:
                self._keep_in(logs)
            self._on_rejection(batch, logs, [], new_rejections, since)
        else:
            self._open = None
            self._keep_in(logs)
            if self._pending is not None:
                self._keep(self._pending)
            self._maybe_snapshot(batch)
        self._publish(logs)

    def _advance(self, batch: int) -> tuple[int, int]:
        """Counts the steps of this execution; returns its first batch (in the
        epoch) and its number of steps.

        With `steps_per_execution=k` Keras calls back once per k steps with
        `batch` = the last of them; the last execution of an epoch may be
        shorter (known from `params["steps"]` when Keras knows the epoch's
        length).
        """
        k = max(1, int(getattr(self.model, "steps_per_execution", 1) or 1))
        first = max(0, batch - k + 1)
        per_epoch = (self.params or {}).get("steps")
        last = min(batch, per_epoch - 1) if per_epoch else batch
        steps = max(1, last - first + 1)
        self._batch_step, self._batch_steps = self._step, steps
        self._step += steps
        self._time_step(steps)
        return first, steps

    def _on_bad_figures(
        self, batch: int, logs: dict, bad_logs: list[str], bad_loss: bool
    ) -> None:
        variables = snapshots.nonfinite_names(self.model)
        detail = _describe_logs(logs, bad_logs)
        if variables:
            detail += " The update was applied: the state is non-finite."
        kind = "nonfinite_loss" if bad_loss else "nonfinite_metric"
        self._record(batch, kind, detail, logs, variables)
        if variables:
            self._trouble()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        logs = logs if logs is not None else {}
        self._figures.finish(logs)
        if not self._started:  # no batch in this epoch built the model
            self._publish(logs)
            return
        snapshots.sync_from_device(self.model)
        new_rejections, since = self._check_counters(force=True)
        if new_rejections:  # not yet seen by a periodic read
            self._on_rejection(-1, logs, [], new_rejections, since)
        snap, bad = snapshots.take(
            self.model, epoch=epoch + 1, step=self._step, into=self._reusable()
        )
        if snap is None:
            self._record(
                -1, "nonfinite_weights", "found at the end of the epoch.", logs, bad
            )
            self._trouble()
        else:
            self._pending = snap
        self._publish(logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._started and not self._at_snapshot:
            self._keep_final_state()
        elif self.snapshot is not None:  # the state is the rollback point's
            self._save(self.snapshot)  # with the learning rate as it is now
        self._write_report()

    def _keep_final_state(self) -> None:
        """Makes the state `fit` returns the rollback point (and writes it to
        `directory`) if it is finite: nothing comes after it to prove it."""
        if self._pending is not None and self._pending.step == self._step:
            self._keep(self._pending)  # taken at the end of the last epoch
            return
        snapshots.sync_from_device(self.model)
        snap, _ = snapshots.take(
            self.model, epoch=self._epoch + 1, step=self._step, into=self._reusable()
        )
        if snap is not None:
            self._keep(snap)

    # -------------------------------------------------------------- signals
    def _check_counters(self, force: bool, logs: dict | None = None) -> tuple[int, int]:
        """New rejections since the last read, and the first step they may
        belong to. A step of an attached SafeOptimizer logs its total, which
        is exact and costs no read; otherwise the counters are read only when
        due (or forced), see `check_every`."""
        if logs is not None and "nanguard_rejected_steps" in logs:
            rejected = int(logs["nanguard_rejected_steps"])
            new, since = rejected - self._rejected_seen, self._checked_at + 1
            self._rejected_seen, self._checked_at = rejected, self._step - 1
            return new, since
        due = self._checks.due(self._step_seconds, self._batch_steps)
        if self._safe is None or not (force or due):
            return 0, self._batch_step
        start = time.perf_counter()
        snapshots.sync_from_device(self.model)
        rejected = self._read_rejected()
        new = rejected - self._rejected_seen
        since = self._checked_at + 1
        self._rejected_seen, self._checked_at = rejected, self._step - 1
        self._checks.done(time.perf_counter() - start)
        return new, since

    def _read_rejected(self) -> int:
        # The caller syncs JAX state first; `.value` avoids the slow
        # KerasVariable.__array__ path.
        if self._safe is None:
            return 0
        value = self._safe.skipped_steps.value
        if keras.backend.backend() == "tensorflow":
            value = value.numpy()  # also a MirroredVariable's (int() is not)
        return int(value)

    def _on_rejection(
        self, batch: int, logs: dict, bad_logs: list[str], count: int, since: int
    ) -> None:
        safe = self._safe
        c = safe.counters()
        if bad_logs and count == 1:  # a step of this execution
            since = self._batch_step
        plural = "s" if count > 1 else ""
        last = self._step - 1
        when = "" if since >= last else f" in steps {since}-{last}"
        detail = (
            f"SafeOptimizer rejected {count} step{plural}{when}: "
            f"{safe.describe_last_rejection()}; nothing was applied."
        )
        if bad_logs:
            detail = _describe_logs(logs, bad_logs) + " " + detail
        halted = (
            safe.max_consecutive_skips is not None
            and c["consecutive_skips"] >= safe.max_consecutive_skips
        )
        kind = "halted" if halted else "rejected_step"
        self._record(
            batch, kind, detail, logs, [], grad_norm=c["rejected_grad_norm"], step=since
        )
        if halted or c["consecutive_skips"] >= self.max_rejections:
            self._trouble()

    # ------------------------------------------------------------ incidents
    def _record(
        self, batch, kind, detail, logs, variables, grad_norm=None, step=None
    ) -> None:
        """Opens an incident, or extends the open one. `batch` is the first
        batch (in the epoch) of the current execution, -1 at an epoch end."""
        loss = logs.get("loss")
        if self._open is not None and batch >= 0:
            inc = self._open  # the same episode goes on
            inc.steps += self._batch_steps
            inc.variables = sorted(set(inc.variables) | set(variables))
            if kind not in ("rejected_step", "nonfinite_metric"):
                inc.kind, inc.detail = kind, detail
            return
        if step is None:
            step = self._batch_step if batch >= 0 else self._step
        inc = Incident(
            fit=self._fit,
            epoch=self._epoch,
            step=step,
            batch=batch,
            kind=kind,
            detail=detail,
            steps=self._batch_steps if batch >= 0 else 1,
            loss=None if loss is None else float(loss),
            grad_norm=grad_norm,
            variables=list(variables),
        )
        if self.replay is not None and batch >= 0:
            inc.batch_data, bad = _replay.batches(
                self.replay, self.batch_size, batch, batch + self._batch_steps - 1
            )
            if bad is not None and step == self._batch_step:  # the bad one is known
                inc.batch, inc.step, inc.steps = bad, step + bad - batch, 1
        self.incidents.append(inc)
        self._open = inc if batch >= 0 else None
        if inc.batch_data is not None:
            diagnose_batch(inc, self.model)
        if self.verbose:
            _LOG.warning("NaNGuard: %s", inc)
        self._write_report()

    def _trouble(self) -> None:
        inc = self.incidents[-1]
        if self.policy == "warn":
            if inc.action != "warned":  # once per incident, not per batch
                inc.action = "warned"
                warnings.warn(f"NaNGuard: {inc}", stacklevel=2)
            return
        if self._pending is not None:  # taken after the last healthy batch
            self._spare, self._pending = self._pending, None
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
        snapshots.restore(self.model, self.snapshot)
        self._at_snapshot = True
        where = f"restored the snapshot of epoch {self.snapshot.epoch}, step {self.snapshot.step}"
        if self.policy == "raise":
            inc.action = where + ", raised NonFiniteError"
            self._write_report()
            raise NonFiniteError(f"NaNGuard: {inc}", report=self.report())
        if self.policy == "rollback" and self._rollbacks_since_snapshot < self.patience:
            self.rollbacks += 1
            self._rollbacks_since_snapshot += 1
            inc.action = "rolled back: " + where
            lr = self._lower_learning_rate()
            if lr is not None:
                inc.learning_rate = lr
                inc.action += f", learning rate {lr[0]:.3g} -> {lr[1]:.3g}"
                self._save(self.snapshot)  # the rate to go on with
            if self.skip_batches:
                self._skip_left = self.skip_batches
                inc.action += f", discarding the next {self.skip_batches} batches"
            return
        self.model.stop_training = True
        inc.action = where + ", stopped training"
        if self.policy == "rollback":
            inc.action += (
                f" after {self._rollbacks_since_snapshot} rollbacks without recovery"
            )

    def _lower_learning_rate(self) -> tuple[float, float] | None:
        lr = self.model.optimizer.learning_rate
        if self.lr_factor == 1 or not isinstance(lr, keras.Variable):
            return None
        old = float(keras.ops.convert_to_numpy(lr))
        lr.assign(old * self.lr_factor)
        return old, float(keras.ops.convert_to_numpy(lr))

    def report(self) -> dict[str, Any]:
        """Everything NaNGuard saw, as a JSON-ready dict.

        Example:

        >>> import keras_nanguard as ng
        >>> ng.NaNGuard().report()["incidents"]
        []
        """
        return {
            "policy": self.policy,
            "rollbacks": self.rollbacks,
            "incidents": [i.to_dict() for i in self.incidents],
        }

    def summary(self) -> str:
        """The incidents in words, one per line.

        Example:

        >>> import keras_nanguard as ng
        >>> ng.NaNGuard().summary()
        'NaNGuard: no incidents.'
        """
        if not self.incidents:
            return "NaNGuard: no incidents."
        lines = [
            f"NaNGuard: {len(self.incidents)} incidents, {self.rollbacks} rollbacks."
        ]
        lines += [f"  {i}" for i in self.incidents]
        return "\n".join(lines)

    def _write_report(self) -> None:
        if self.report_path is not None:
            write_json(self.report_path, self.report())

    # ------------------------------------------------------------ snapshots
    def _reusable(self) -> snapshots.Snapshot | None:
        # Buffers a new snapshot may overwrite: never the rollback point.
        spare = self._pending or self._spare
        self._pending = self._spare = None
        return spare

    def _keep(self, snap: snapshots.Snapshot) -> None:
        """Makes `snap` the rollback point."""
        if self.snapshot is not None and self.snapshot is not snap:
            self._spare = self.snapshot
        self.snapshot, self._pending = snap, None
        self.snapshots_taken += 1
        self._rollbacks_since_snapshot = 0
        snap.seconds += self._save(snap)
        self._snapshots.done(snap.seconds)

    def _save(self, snap: snapshots.Snapshot) -> float:
        """Writes the rollback point to `directory`, with the learning rate
        training goes on with; returns the seconds it took."""
        if self.directory is None:
            return 0.0
        start = time.perf_counter()
        snapshots.sync_from_device(self.model)
        snap.learning_rate = snapshots.learning_rate(self.model)
        snapshots.save(snap, self.directory)
        return time.perf_counter() - start

    def _maybe_snapshot(self, batch: int) -> None:
        if not self._snapshots.due(self._step_seconds, self._batch_steps):
            return
        snapshots.sync_from_device(self.model)
        snap, bad = snapshots.take(
            self.model, epoch=self._epoch, step=self._step, into=self._reusable()
        )
        if snap is None:
            self._record(
                batch, "nonfinite_weights", "found while taking a snapshot.", {}, bad
            )
            self._trouble()
        else:
            self._pending = snap

    def _time_step(self, steps: int) -> None:
        now = time.perf_counter()
        if self._last_time is not None:
            dt = (now - self._last_time) / steps
            self._step_seconds = (
                dt
                if self._step_seconds is None
                else (0.9 * self._step_seconds + 0.1 * dt)
            )
        self._last_time = now

    # --------------------------------------------------------------- logs
    def _keep_in(self, logs: dict) -> None:
        self._figures.keep(logs, self._batch_steps)

    def _leave_out(self, logs: dict, keys: list[str] | None = None) -> None:
        """Leaves this execution's batches out of the epoch's figures (those in
        `keys`, or all); Keras's metric states, which include them, start
        afresh."""
        self._figures.leave_out(logs, keys, self._batch_steps)
        snapshots.sync_from_device(self.model)
        self.model.reset_metrics()

    def _publish(self, logs: dict) -> None:
        logs["nanguard_incidents"] = len(self.incidents)
        logs["nanguard_rollbacks"] = self.rollbacks
        if self._safe is not None:  # an attached step logs its own, exactly
            logs.setdefault("nanguard_rejected_steps", self._rejected_seen)

    @staticmethod
    def restore(model: keras.Model, directory: str | os.PathLike) -> int:
        """Loads the snapshot NaNGuard wrote into `directory` into `model`.

        `model` must be built, with the same architecture. Compiled with the
        same optimizer, it gets the weights, the optimizer's variables and the
        learning rate to go on with (the one NaNGuard lowered, if it did): it
        resumes training where the snapshot was taken. Not compiled (for
        inference), it gets the weights only. Raises `ValueError`, and changes
        nothing, when the shapes do not match. Returns the step at which the
        snapshot was taken.

        Example:

        >>> import keras_nanguard as ng
        >>> # after fit(..., callbacks=[ng.NaNGuard(directory="ckpt")]):
        >>> # step = ng.NaNGuard.restore(model, "ckpt")
        """
        return snapshots.load_into(model, directory).step

    def get_config(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "snapshot_every": self.snapshot_every,
            "snapshot_budget": self.snapshot_budget,
            "check_every": self.check_every,
            "lr_factor": self.lr_factor,
            "skip_batches": self.skip_batches,
            "patience": self.patience,
            "max_rejections": self.max_rejections,
            "directory": self.directory,
            "report_path": self.report_path,
            "batch_size": self.batch_size,
            "verbose": self.verbose,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> NaNGuard:
        return cls(**config)


# ------------------------------------------------------------------ helpers
def _describe_logs(logs: dict, bad: list[str]) -> str:
    shown = ", ".join(f"{k}={logs[k]}" for k in bad)
    return f"non-finite {shown} in this batch."
