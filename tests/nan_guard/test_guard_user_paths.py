"""NaNGuard on more paths users take (issue 18): resuming with
`BackupAndRestore`, path arguments that are not what they should be,
dropout's random stream across a rollback, the snapshot as a Keras weights
file, a learning-rate cut that other callbacks must keep, schedules, and
non-finite validation figures."""

import json
import os
import warnings

import keras
import numpy as np
import pytest

import keras_nanguard as ng
from keras_nanguard import incidents, snapshots
from tests.helpers import (
    WithoutBatches,
    assert_bit_identical,
    binary_data,
    fit_quietly,
    learning_rate,
    numpy,
)
from tests.models import guard_model as _model


class _InLine(keras.callbacks.Callback):
    """Not async-safe: Keras then calls every batch end on the training
    thread, so NaNGuard acts at the bad batch's end on every backend."""

    def on_train_batch_end(self, batch, logs=None):
        pass


# ----------------------------------- finding 2: resuming with BackupAndRestore
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


# -------------------------------------------------- finding 7: path arguments
def test_path_arguments_are_checked_up_front_and_leave_no_temporary_file(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    with pytest.raises(ValueError, match=r"`report_path` .*Received: report_path="):
        ng.NaNGuard(report_path=tmp_path)
    with pytest.raises(ValueError, match=r"`directory` .*Received: directory="):
        ng.NaNGuard(directory=a_file)

    # Paths that change between the constructor and `fit`.
    x, y = binary_data(32)
    report = tmp_path / "report.json"
    guard = ng.NaNGuard(verbose=0, report_path=report)
    report.mkdir()
    with pytest.raises(ValueError, match=r"`report_path` .*Received: report_path="):
        fit_quietly(_model(keras.optimizers.SGD(0.05)), x, [guard], y=y, batch_size=16)
    snap_dir = tmp_path / "snapshots"
    guard = ng.NaNGuard(verbose=0, directory=snap_dir)
    snap_dir.write_text("now a file")
    with pytest.raises(ValueError, match=r"`directory` .*Received: directory="):
        fit_quietly(_model(keras.optimizers.SGD(0.05)), x, [guard], y=y, batch_size=16)

    # The JSON writer cleans up after itself whatever goes wrong.
    with pytest.raises(IsADirectoryError):
        incidents.write_json(str(report), {"incidents": []})
    with pytest.raises(TypeError):
        incidents.write_json(str(tmp_path / "r.json"), {1j: "no JSON key"})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a_file",
        "report.json",
        "snapshots",
    ]
    assert list(report.iterdir()) == []


# --------------------------------------- finding 9: dropout's random stream
def test_rollback_and_restore_bring_back_the_random_stream(tmp_path):
    x, y = binary_data()
    # A rollback to the first snapshot (step 0) at the end of batch 0, then
    # batches 1-7: the same as batches 1-7 from the start.
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[0], target="y")
    model = _model(keras.optimizers.SGD(0.05), dropout=True)
    guard = ng.NaNGuard(verbose=0, lr_factor=1.0, directory=tmp_path)
    fit_quietly(model, data, [guard, _InLine()])
    assert guard.rollbacks == 1
    assert "restored the snapshot of epoch 0, step 0" in guard.incidents[0].action
    reference = _model(keras.optimizers.SGD(0.05), dropout=True)
    fit_quietly(reference, WithoutBatches(x, y, 16, [0]), [])
    assert_bit_identical(numpy(reference.variables), numpy(model.variables), "state")

    # `NaNGuard.restore` of the final state, then one more epoch, is the same
    # as that epoch trained on from the final state directly.
    fresh = _model(keras.optimizers.SGD(0.05), seed=3, dropout=True)
    assert ng.NaNGuard.restore(fresh, tmp_path) == 8
    assert_bit_identical(numpy(model.variables), numpy(fresh.variables), "restored")
    fit_quietly(model, x, [], y=y, batch_size=16)
    fit_quietly(fresh, x, [], y=y, batch_size=16)
    assert_bit_identical(numpy(model.variables), numpy(fresh.variables), "trained")

    # A file of the previous version (no random stream) still loads: the
    # weights and the optimizer's variables, the stream left as it is.
    old = tmp_path / "old"
    old.mkdir()
    state = numpy(model.weights) + numpy(model.optimizer.variables)
    meta = {
        "names": [str(i) for i in range(len(state))],
        "epoch": 1,
        "step": 8,
        "n_weights": len(model.weights),
        "learning_rate": 0.05,
    }
    encoded = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    arrays = {f"v{i}": v for i, v in enumerate(state)}
    np.savez(old / snapshots.SNAPSHOT_FILE, __meta__=encoded, **arrays)
    other = _model(keras.optimizers.SGD(0.05), seed=4, dropout=True)
    stream = [v for v in other.variables if "seed" in v.path]
    before = numpy(stream)
    assert ng.NaNGuard.restore(other, old) == 8
    assert_bit_identical(numpy(model.weights), numpy(other.weights), "weights")
    assert_bit_identical(before, numpy(stream), "the stream")


# ------------------------------- finding 11: the snapshot as a weights file
class _FilesAtEpochEnd(keras.callbacks.Callback):
    """Listed after NaNGuard: the files and the model's weights at the end of
    epoch 0 (the rollback point then predates the model's state)."""

    def __init__(self, directory):
        super().__init__()
        self.directory = directory

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            self.npz = snapshots.load(self.directory)
            h5 = os.path.join(self.directory, "nanguard_snapshot.weights.h5")
            with open(h5, "rb") as f:
                self.h5 = f.read()
            self.weights = numpy(self.model.weights)


def test_disk_snapshot_loads_with_keras_load_weights(tmp_path):
    x, y = binary_data()
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[3], target="y")
    model = _model(keras.optimizers.Adam(0.01))
    guard = ng.NaNGuard(verbose=0, directory=tmp_path, snapshot_every=2)
    files = _FilesAtEpochEnd(tmp_path)
    fit_quietly(model, data, [guard, files, _InLine()], epochs=2)
    assert guard.rollbacks == 2  # batch 3 of each epoch
    # Writing the file put the model's own values back: the guarded run is
    # the same as one that writes no files.
    unwritten = _model(keras.optimizers.Adam(0.01))
    fit_quietly(
        unwritten, data, [ng.NaNGuard(verbose=0, snapshot_every=2), _InLine()], 2
    )
    assert_bit_identical(numpy(unwritten.weights), numpy(model.weights), "weights")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

    def loaded(h5_bytes):
        path = tmp_path / "copy.weights.h5"
        path.write_bytes(h5_bytes)
        model2 = _model(keras.optimizers.Adam(0.01), seed=7)
        model2.optimizer.build(model2.trainable_variables)
        model2.load_weights(path)
        return model2

    # Mid-fit the file holds the rollback point, not the model's state.
    snap, model2 = files.npz, loaded(files.h5)
    n = snap.n_weights
    assert snap.step < 8
    assert files.weights[0].tobytes() != snap.values[0].tobytes()
    assert_bit_identical(snap.values[:n], numpy(model2.weights), "weights")
    opt_values = snap.values[n : n + len(model2.optimizer.variables)]
    got = numpy(model2.optimizer.variables)
    for v, want, have in zip(model2.optimizer.variables, opt_values, got, strict=True):
        if "learning_rate" in v.path:  # the rate to go on with
            assert have == np.float32(snap.learning_rate)
        else:
            assert_bit_identical([want], [have], v.path)
    # When `fit` returns both hold the final state.
    h5 = tmp_path / "nanguard_snapshot.weights.h5"
    model3 = loaded(h5.read_bytes())
    assert_bit_identical(numpy(model.weights), numpy(model3.weights), "final")
    assert_bit_identical(
        numpy(model.optimizer.variables), numpy(model3.optimizer.variables), "opt"
    )


# ----------------------------- finding 13: a rate cut another callback keeps
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


# --------------------------------------- finding 10d: learning-rate schedules
def test_schedule_that_cannot_be_lowered_is_said():
    x, y = binary_data()
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[3], target="y")
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, 100, 0.9)
    model = _model(keras.optimizers.SGD(schedule))
    guard = ng.NaNGuard(verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_quietly(model, data, [guard])
    ours = [str(w.message) for w in caught if "NaNGuard" in str(w.message)]
    assert len(ours) == 1
    assert "`lr_factor=0.5`" in ours[0] and "schedule" in ours[0]
    (inc,) = guard.incidents
    assert inc.learning_rate is None
    assert inc.action.endswith(
        ", the learning rate was not lowered: it is a schedule (ExponentialDecay)"
    )
    # lr_factor=1 asks for no cut: no warning.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_quietly(model, data, [ng.NaNGuard(verbose=0, lr_factor=1.0)])
    assert [w for w in caught if "NaNGuard" in str(w.message)] == []


# ---------------------------------- finding 10f: non-finite validation figures
def test_nonfinite_validation_figures_are_an_incident_not_trouble():
    x, y = binary_data()
    x_val, y_val = binary_data(32, seed=1)
    # A NaN label, not a NaN input: TensorFlow's oneDNN kernels (on by
    # default on CPUs with AVX-512) give relu(NaN) = 0, so a NaN input to
    # this ReLU model would not reach the loss there.
    y_val = ng.faults.poison(y_val, rows=[5])

    def run(callbacks):
        model = _model(keras.optimizers.SGD(0.05))
        history = fit_quietly(
            model,
            x,
            callbacks,
            epochs=2,
            y=y,
            batch_size=16,
            validation_data=(x_val, y_val),
        )
        return model, history

    reference, _ = run([])
    guard = ng.NaNGuard(verbose=0)
    model, history = run([guard])
    assert np.isnan(history.history["val_loss"]).all()
    found = [(i.kind, i.epoch, i.step, i.batch, i.action) for i in guard.incidents]
    assert found == [
        ("nonfinite_validation", 0, 8, -1, "none"),
        ("nonfinite_validation", 1, 16, -1, "none"),
    ]
    assert guard.incidents[0].detail == (
        "non-finite val_loss=nan at the end of the epoch. The weights are "
        "finite: the validation data or the model's outputs on it are not."
    )
    assert guard.rollbacks == 0
    assert_bit_identical(numpy(reference.weights), numpy(model.weights), "weights")
