"""NaNGuard beside other callbacks: CSVLogger, EarlyStopping and
ReduceLROnPlateau see finite figures, ModelCheckpoint never saves NaN
weights, BackupAndRestore keeps a good backup and a `fit` it resumes never
rolls back past it, and LearningRateSpike keeps a learning-rate cut NaNGuard
made during its spike."""

import csv
import os

import keras
import numpy as np
import pytest

import keras_nanguard as ng
from tests.helpers import (
    WithoutBatches,
    all_finite,
    assert_bit_identical,
    binary_data,
    fit_quietly,
    learning_rate,
    numpy,
)
from tests.models import guard_model as _model


def test_csv_logger_sees_finite_figures_and_guard_columns(tmp_path):
    x, y = binary_data()
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[2], target="y")
    path = tmp_path / "log.csv"
    model = _model(ng.SafeOptimizer(keras.optimizers.SGD(0.05)))
    fit_quietly(
        model, data, [ng.NaNGuard(verbose=0), keras.callbacks.CSVLogger(str(path))], 2
    )
    rows = list(csv.DictReader(path.open()))
    assert [int(float(r["nanguard_incidents"])) for r in rows] == [1, 2]
    assert all(np.isfinite(float(r["loss"])) for r in rows)


def test_early_stopping_and_reduce_lr_on_plateau_see_finite_figures():
    x, y = binary_data()
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[1], target="y")
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.05))
    model = _model(opt)
    early = keras.callbacks.EarlyStopping(monitor="loss", patience=0)
    reduce = keras.callbacks.ReduceLROnPlateau(
        monitor="loss", factor=0.5, patience=0, min_delta=10.0
    )
    history = fit_quietly(
        model, data, [ng.NaNGuard(verbose=0), early, reduce], epochs=3
    )
    # Without NaNGuard, EarlyStopping would stop at once on a NaN epoch loss.
    assert len(history.history["loss"]) == 3 or early.stopped_epoch > 0
    assert np.isfinite(history.history["loss"]).all()
    assert float(opt.learning_rate) < 0.05  # ReduceLROnPlateau went through


def test_model_checkpoint_never_saves_nan_weights(tmp_path):
    x, y = binary_data()
    data = ng.faults.PoisonedBatches(
        x, y, batch_size=16, bad_batches=[7], target="y"
    )  # last batch

    def run(callbacks, name):
        path = tmp_path / name
        model = _model(keras.optimizers.SGD(0.05))
        fit_quietly(
            model, data, [*callbacks, keras.callbacks.ModelCheckpoint(str(path))]
        )
        return keras.models.load_model(path)

    assert not all_finite(run([], "plain.keras").weights)
    assert all_finite(run([ng.NaNGuard(verbose=0)], "guarded.keras").weights)


def _backup_weights(backup_dir):
    model = _model(keras.optimizers.SGD(0.05))
    model.load_weights(os.path.join(backup_dir, "latest.weights.h5"))
    return model.weights


def test_backup_and_restore_keeps_a_good_backup(tmp_path):
    x, y = binary_data()

    # Epoch 2 goes bad at its last batch: the epoch-end backup must not be NaN,
    # and a stop/raise must not delete the backup.
    class PoisonEpoch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            data.bad_batches = {7: float("nan")} if epoch == 1 else {}

    data = ng.faults.PoisonedBatches(x, y, batch_size=16, target="y")
    backup = tmp_path / "backup"
    model = _model(keras.optimizers.SGD(0.05))
    guard = ng.NaNGuard("raise", verbose=0)
    with pytest.raises(ng.NonFiniteError):
        fit_quietly(
            model,
            data,
            [PoisonEpoch(), guard, keras.callbacks.BackupAndRestore(str(backup))],
            epochs=3,
        )
    assert all_finite(_backup_weights(backup))  # kept, and good
    assert all_finite(model.weights)

    # "stop" returns normally; with delete_checkpoint=False the backup stays.
    backup2 = tmp_path / "backup2"
    model = _model(keras.optimizers.SGD(0.05))
    fit_quietly(
        model,
        data,
        [
            PoisonEpoch(),
            ng.NaNGuard("stop", verbose=0),
            keras.callbacks.BackupAndRestore(str(backup2), delete_checkpoint=False),
        ],
        epochs=3,
    )
    assert all_finite(_backup_weights(backup2))


class _Interrupt(keras.callbacks.Callback):
    """Raises at the end of epoch `epoch`, as Keras's own tests interrupt."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


class _PoisonEpoch(keras.callbacks.Callback):
    def __init__(self, data, epoch, batch):
        super().__init__()
        self.data, self.epoch, self.batch = data, epoch, batch
        self.epochs = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append(epoch)
        bad = {self.batch: float("nan")} if epoch == self.epoch else {}
        self.data.bad_batches = bad


@pytest.mark.parametrize("guard_first", [True, False])
@pytest.mark.parametrize("policy", ["rollback", "stop", "raise"])
def test_resumed_fit_never_rolls_back_past_the_backup(tmp_path, policy, guard_first):
    x, y = binary_data()
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, target="y")
    backup_dir = str(tmp_path / "backup")

    def callbacks(guard, *others):
        backup = keras.callbacks.BackupAndRestore(backup_dir)
        pair = [guard, backup] if guard_first else [backup, guard]
        return [*pair, *others]

    # Epochs 0 and 1 run; the backup holds the state at the end of epoch 1.
    first = _model(keras.optimizers.SGD(0.05))
    with pytest.raises(RuntimeError, match="interrupted"):
        fit_quietly(first, data, callbacks(ng.NaNGuard(verbose=0), _Interrupt(1)), 4)
    backed_up = _model(keras.optimizers.SGD(0.05), seed=5)
    backed_up.optimizer.build(backed_up.trainable_variables)
    backed_up.load_weights(os.path.join(backup_dir, "latest.weights.h5"))
    backup = numpy(backed_up.weights)
    assert_bit_identical(numpy(first.weights), backup, "the backup")

    # The resumed fit starts at epoch 2, whose first batch is poisoned: a
    # plain optimizer applies it, so NaNGuard must restore the backup's state.
    model = _model(keras.optimizers.SGD(0.05), seed=9)  # fresh, untrained
    untrained = numpy(model.weights)
    guard = ng.NaNGuard(policy, verbose=0, lr_factor=1.0)
    poison = _PoisonEpoch(data, epoch=2, batch=0)
    if policy == "raise":
        with pytest.raises(ng.NonFiniteError):
            fit_quietly(model, data, callbacks(guard, poison), 4)
    else:
        fit_quietly(model, data, callbacks(guard, poison), 4)
    assert poison.epochs[0] == 2  # BackupAndRestore's `_initial_epoch`
    (inc,) = guard.incidents
    assert (inc.kind, inc.epoch, inc.step, inc.batch) == ("nonfinite_loss", 2, 0, 0)
    where = "restored the snapshot of epoch 2, step 0"
    assert inc.action.startswith(where if policy != "rollback" else "rolled back")
    assert where in inc.action
    assert untrained[0].tobytes() != backup[0].tobytes()
    if policy != "rollback":  # stopped (or raised) with the backup's state
        assert poison.epochs == [2]
        assert_bit_identical(backup, numpy(model.weights), "weights")
        return
    # Rolled back to the backup, then trained on from it without batch 0.
    assert poison.epochs == [2, 3]
    reference = _model(keras.optimizers.SGD(0.05), seed=5)
    reference.set_weights(backup)
    clean = WithoutBatches(x, y, 16, [0])
    fit_quietly(reference, clean, [])
    fit_quietly(reference, x, [], y=y, batch_size=16)
    assert_bit_identical(numpy(reference.weights), numpy(model.weights), "weights")


def test_learning_rate_spike_keeps_a_cut_made_during_the_spike():
    x, y = binary_data()
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[2], target="y")
    model = _model(keras.optimizers.SGD(1e-3))
    spike = ng.faults.LearningRateSpike(at_steps=[2, 3, 4, 5], factor=1000)
    guard = ng.NaNGuard(verbose=0)
    fit_quietly(model, data, [spike, guard])
    (inc,) = guard.incidents
    assert inc.learning_rate == (1.0, 0.5)
    assert "learning rate 1 -> 0.5" in inc.action
    assert learning_rate(model) == np.float32(5e-4)
