"""NaNGuard: watch `model.fit`, keep a good state, roll back or stop, say why."""

from __future__ import annotations

import inspect
import os
import threading
from typing import Any

import keras

from keras_nanguard import snapshots
from keras_nanguard._validation import (
    check_choice,
    check_in,
    check_int,
    check_int_or_auto,
    check_output_paths,
    check_positive,
)
from keras_nanguard.incidents import Incident
from keras_nanguard.nan_guard import learning_rate as _learning_rate
from keras_nanguard.nan_guard import replay as _replay
from keras_nanguard.nan_guard import runs as _runs
from keras_nanguard.nan_guard import snapshot_files as _snapshot_io
from keras_nanguard.nan_guard.batch_watch import watch_for_fit
from keras_nanguard.nan_guard.cadence import Cadence
from keras_nanguard.nan_guard.figures import nonfinite_validation
from keras_nanguard.nan_guard.responses import Responses
from keras_nanguard.nan_guard.telling import Telling, warn

POLICIES = ("rollback", "stop", "raise", "warn")
# A batch end waits at most this long for the one before it (Keras's worker
# threads may start them out of order); past it, it goes on regardless.
_ORDER_TIMEOUT = 60.0
# A batch begins only once the batch end of `_MAX_LAG` executions before it
# has been read: NaNGuard acts at most that many batches late, and the device
# still has that many queued (no stall).
_MAX_LAG = 2


@keras.saving.register_keras_serializable(package="keras_nanguard")
class NaNGuard(Responses, Telling, keras.callbacks.Callback):
    """Watches `model.fit`, keeps a last-known-good state, and acts on trouble.

    NaNGuard snapshots every weight, optimizer variable and random stream
    (`SeedGenerator` state) when all are finite: at the first batch (after
    every callback's `on_train_begin`, so after `BackupAndRestore` loaded
    its backup), every `snapshot_every` steps, at each
    epoch's end and at the end (optionally to `directory`); on JAX and
    PyTorch a copy on the device when it has room, else on the host. A
    snapshot becomes the rollback point once a later batch was healthy.
    *Trouble* is a non-finite state; a non-finite loss with a plain
    optimizer (the update was applied); `max_rejections` steps in a row
    rejected by a `SafeOptimizer` (NaNGuard attaches it to the model), or
    its halt; and, with `loss_spike_sigma` set, a loss spike (kind
    `"loss_spike"`; the rollback point then predates the spike). A single
    rejected step is recorded but is not trouble: nothing was applied. On
    trouble:

    - `"rollback"` (default): restore the snapshot, multiply the learning rate
      by `lr_factor` (not a schedule: the action says so), discard the
      next `skip_batches` batches, and go on;
      after `patience` rollbacks with no fresh good snapshot in between, stop.
    - `"stop"`: restore the snapshot and stop; `fit` returns a finite model.
    - `"raise"`: restore the snapshot and raise `keras_nanguard.NonFiniteError`.
    - `"warn"`: only warn.

    Each incident is kept in `guard.incidents` and told once, with its
    action (see `verbose`). Bad batches are left out of the epoch's loss and
    metrics (a non-finite metric with a finite loss, kind
    `"nonfinite_metric"`, out of that metric only; a non-finite `val_`
    figure with finite weights is kind `"nonfinite_validation"`, not
    trouble): NaNGuard edits `logs` in
    place, so list it before `ModelCheckpoint`, `BackupAndRestore`,
    `EarlyStopping`, `CSVLogger` and `TensorBoard`. It adds
    `nanguard_incidents`, `nanguard_rollbacks` and, with a SafeOptimizer,
    `nanguard_rejected_steps` and `nanguard_grad_norm` to the logs.

    On JAX and PyTorch NaNGuard is asynchronous (`async_safe`): it acts
    at most two executions after a bad batch. `steps_per_execution`,
    models built by `fit`, copies made by KerasTuner (`guard.runs`): see the
    README.

    Args:
        policy: `"rollback"`, `"stop"`, `"raise"` or `"warn"`. Defaults to
            `"rollback"`.
        snapshot_every: steps between snapshots (int >= 1), or `"auto"`: as
            often as keeps their cost under `snapshot_budget` of the training
            time, at least 10 steps apart. Defaults to `"auto"`.
        snapshot_budget: float in (0, 1), with `"auto"`. Defaults to 0.01.
        check_every: steps between reads of a SafeOptimizer's counters (int
            >= 1) or `"auto"`, only for steps that do not log its total (a
            custom `train_step`). Defaults to `"auto"`.
        lr_factor: float in (0, 1]: learning-rate multiplier at each rollback
            (1 keeps it). Defaults to 0.5.
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
            make a spike. Defaults to 3.
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
        policy: str = "rollback",
        *,
        snapshot_every: int | str = "auto",
        snapshot_budget: float = 0.01,
        check_every: int | str = "auto",
        lr_factor: float = 0.5,
        skip_batches: int = 0,
        patience: int = 3,
        max_rejections: int = 3,
        loss_spike_sigma: float | None = None,
        loss_spike_window: int = 100,
        loss_spike_patience: int = 3,
        directory: str | os.PathLike | None = None,
        report_path: str | os.PathLike | None = None,
        replay: Any = None,
        batch_size: int = 32,
        verbose: int = 1,
    ) -> None:
        super().__init__()
        self.policy = check_choice("policy", policy, POLICIES)
        self.snapshot_every = check_int_or_auto("snapshot_every", snapshot_every, 1)
        self.snapshot_budget = check_in(
            "snapshot_budget", snapshot_budget, 0, 1, closed_high=False
        )
        self.check_every = check_int_or_auto("check_every", check_every, 1)
        self.lr_factor = check_in("lr_factor", lr_factor, 0, 1, closed_high=True)
        self.skip_batches = check_int("skip_batches", skip_batches, 0)
        self.patience = check_int("patience", patience, 0)
        self.max_rejections = check_int("max_rejections", max_rejections, 1)
        self.loss_spike_sigma = check_positive(
            "loss_spike_sigma", loss_spike_sigma, allow_none=True
        )
        self.loss_spike_window = check_int("loss_spike_window", loss_spike_window, 2)
        self.loss_spike_patience = check_int(
            "loss_spike_patience", loss_spike_patience, 1
        )
        self.directory, self.report_path = check_output_paths(directory, report_path)
        self.replay = _replay.check(replay)
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.verbose = check_choice("verbose", verbose, (0, 1))
        self.incidents: list[Incident] = []
        self.rollbacks = 0
        # `snapshot` is the rollback point. A new snapshot is pending
        # (`_pendings`, oldest first) until a later batch is healthy, so a
        # finite but ruinous update is not kept as "good" before its damage
        # shows. `_spare` holds the previous buffers for reuse.
        self.snapshot: snapshots.Snapshot | None = None
        self._pendings: list[snapshots.Snapshot] = []
        self._spare: snapshots.Snapshot | None = None
        self.snapshots_taken = 0
        self._fits = 0
        # Its copies (KerasTuner makes one per trial), or what it is a copy of.
        self.runs: list[NaNGuard] = []
        self.origin: NaNGuard | None = None
        self.run_index: int | None = None

    # On JAX and torch Keras runs `on_train_batch_end` in worker threads,
    # only when every callback is async-safe. On TensorFlow it stays in line.
    async_safe = keras.backend.backend() in ("jax", "torch")

    # ------------------------------------------------------------ lifecycle
    # Threads: `on_train_batch_end` may run in Keras's worker threads, the
    # other hooks run on the training thread. They share `self._watch` (the
    # batch-end side's state, `batch_watch.BatchWatch`) under `self._lock`; the
    # batch-end side queues `Event`s there, the training thread takes them
    # in `_act`. Only the training thread touches the model.
    def on_train_begin(self, logs: dict | None = None) -> None:
        # Again: the paths may have changed since the constructor.
        check_output_paths(self.directory, self.report_path, writable=True)
        self._fit = self._fits
        self._fits += 1
        self._thread = threading.get_ident()
        self._lock = threading.Condition()
        self._epoch = self._now = self._seen = self._checked_at = 0
        self._checked_at = -1
        self._open: Incident | None = None
        self._rollbacks_since_snapshot = 0
        self._resumed_at = 0  # events of earlier steps ran on an undone state
        self._restored_at = -1  # `_now` when the snapshot was last restored
        self._discard_until: int | None = None
        self._stopping = self._in_epoch = False
        # Keras's `Callback.model` syncs JAX state at each access (and so makes
        # the next step gather it again): NaNGuard reads it once per fit and
        # syncs only where it reads or changes the model.
        self._net = self.model
        self._k = max(1, int(getattr(self._net, "steps_per_execution", 1) or 1))
        self._safe = snapshots.find_safe_optimizer(self._net.optimizer)
        if self.policy == "rollback":  # the only policy that lowers the rate
            said = _learning_rate.schedule_warning(self._net.optimizer, self.lr_factor)
            if said is not None:
                warn(said)
        if self._safe is not None:  # a rejected step keeps BN statistics too
            self._safe.attach(self._net)
            snapshots.sync_from_device(self._net)
        self._watch = watch_for_fit(
            self._safe,
            self.loss_spike_sigma,
            self.loss_spike_window,
            self.loss_spike_patience,
        )
        self._snapshots = Cadence(self.snapshot_every, self.snapshot_budget, 10)
        self._checks = Cadence(self.check_every, 0.01, 1)
        # The last fit's rollback point only lends its buffers.
        self._spare = self.snapshot or self._spare
        self.snapshot, self._pendings = None, []
        # The first snapshot waits for the first batch begin (`_take_turn`):
        # a callback's `on_train_begin` (`BackupAndRestore`) may still load
        # the state training really starts from, whatever the order.
        self._started = False

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch, self._in_epoch = epoch, True
        with self._lock:
            self._watch.begin_epoch(epoch, self._watch.steps_done)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        with self._lock:
            watch = self._watch
            watch.begins.append(batch)
            self._now = now = watch.base + batch
            # Bounds how late an action can be: the device may run ahead of
            # the batch ends by `_MAX_LAG` executions, no more.
            lag = _MAX_LAG * self._k
            self._lock.wait_for(lambda: watch.steps_done >= now - lag, _ORDER_TIMEOUT)
        self._act()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        logs = logs if logs is not None else {}
        per_epoch = (self.params or {}).get("steps")
        with self._lock:
            watch = self._watch
            first = watch.first_of(batch, self._k)
            # Keras's workers may start batch ends out of order.
            self._lock.wait_for(lambda: watch.next_batch >= first, _ORDER_TIMEOUT)
            # With `steps_per_execution` the last execution may be shorter.
            last = min(batch, per_epoch - 1) if per_epoch else batch
            watch.end(first, max(first, last), logs)
            self._lock.notify_all()
        if threading.get_ident() == self._thread:  # Keras calls it in line
            self._now = watch.steps_done
            self._act()
        self._publish(logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        logs = logs if logs is not None else {}
        self._now = self._watch.steps_done  # Keras waited for its workers
        self._act(snapshot=False)
        if self._stopping:  # undo the step that ran after the stop
            self._restore()
        with self._lock:
            self._watch.figures.finish(logs)
        if not self._started:  # no batch in this epoch built the model
            self._publish(logs)
            return
        self._poll_counters(0, None, force=True)
        bad: list[str] = []  # else the state is the snapshot's, or checked now
        if not self._stopping and self._restored_at != self._now:
            snap, bad = self._capture(verify=True)  # one read per epoch
            if snap is None:
                self._record(
                    None, "nonfinite_weights", "found at the end of the epoch.", bad
                )
                self._trouble()
            else:
                snap.epoch = epoch + 1
                self._pendings.append(snap)
                self._snapshots.done(snap.seconds)
        detail = nonfinite_validation(logs)
        if detail is not None and not bad:  # the weights are finite
            self._record(None, "nonfinite_validation", detail, [])  # not trouble
        _runs.epoch_end(self, logs)  # a copy KerasTuner runs
        self._tell()
        self._publish(logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        self._now, self._in_epoch = self._watch.steps_done, False  # bar ended
        self._act(snapshot=False)
        if self._stopping and self._restored_at != self._now:
            self._restore()
        if self._started and self._restored_at != self._now:
            self._keep_final_state()
        elif self.snapshot is not None:  # the state is the rollback point's
            self._save(self.snapshot)  # with the learning rate as it is now
        self._write_report()
        _runs.release(self)

    def _act(self, snapshot: bool = True) -> None:
        """The training thread's turn: acts on what the batch ends found,
        promotes a proven snapshot, takes a due one, then tells the new
        incidents. Touches the model only when there is something to do."""
        try:
            self._take_turn(snapshot)
        finally:
            self._tell()

    def _take_turn(self, snapshot: bool) -> None:
        with self._lock:
            events, self._watch.events = self._watch.events, []
            healthy = self._watch.healthy_step
            step_seconds = self._watch.step_seconds
        steps, self._seen = self._now - self._seen, self._now
        if not self._started and self._net.built:
            self._start()
        # A healthy batch after the pending snapshot proves it, even if a
        # later one is bad: promote it before acting on that one.
        self._promote(healthy)
        for ev in events:
            self._handle(ev)
        if self._stopping:
            return
        if self._discard_until is not None:  # `skip_batches` after a rollback
            if self._now < self._discard_until:
                return  # batches to discard still run
            self._discard_until = None
            self._restore()  # undoes them
            self._reset_metrics(self._now, restored=True)
        self._poll_counters(steps, step_seconds, force=False)
        if snapshot and self._started and not events and not self._stopping:
            with self._lock:
                clean = self._watch.leave_out_until <= self._now
            if clean:
                self._maybe_snapshot(steps, step_seconds)

    def __deepcopy__(self, memo: dict) -> NaNGuard:
        return _runs.copy_of(self, memo)  # a fresh guard, in `self.runs`

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
        return _snapshot_io.load_into(model, directory).step

    def get_config(self) -> dict[str, Any]:
        # Every constructor argument but `replay` (data, not configuration).
        names = inspect.signature(NaNGuard.__init__).parameters
        return {n: getattr(self, n) for n in names if n not in ("self", "replay")}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> NaNGuard:
        return cls(**config)
