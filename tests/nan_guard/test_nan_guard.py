"""NaNGuard: detection, policies, snapshots, figures, and the other callbacks."""

import csv
import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import keras_nanguard as ng
from keras_nanguard import snapshots
from keras_nanguard.nan_guard import callback as nan_guard
from tests.helpers import (
    BACKEND,
    BINARY_LOSS,
    WithoutBatches,
    all_finite,
    assert_bit_identical,
    binary_data,
    fit_quietly,
    numpy,
)
from tests.models import guard_model as _model


# --------------------------------------------------------------- arguments
@pytest.mark.backend_free
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"policy": "retry"}, r"`policy` must be one of .*Received: policy='retry'"),
        (
            {"patience": -1},
            r"`patience` must be an integer >= 0. Received: patience=-1",
        ),
        (
            {"lr_factor": 0.0},
            r"`lr_factor` must be in \(0, 1\]. Received: lr_factor=0.0",
        ),
        ({"lr_factor": 1.5}, r"lr_factor=1.5"),
        ({"skip_batches": -2}, r"skip_batches=-2"),
        ({"snapshot_every": 0}, r"`snapshot_every` must be an integer >= 1 or 'auto'"),
        ({"check_every": "often"}, r"check_every='often'"),
        ({"max_rejections": 0}, r"max_rejections=0"),
        ({"snapshot_budget": 1.0}, r"snapshot_budget=1.0"),
        ({"snapshot_budget": float("nan")}, r"must be in \(0, 1\). .*=nan"),
        ({"verbose": 2}, r"`verbose` must be one of \(0, 1\). Received: verbose=2"),
        ({"directory": ""}, r"`directory` must not be empty. Received: directory=''"),
        ({"replay": (np.ones((4, 2)),)}, r"`replay` must be `\(x, y\)` arrays"),
        (
            {"replay": (np.ones((4, 2)), np.ones((3, 1)))},
            r"the same length. Received: len\(x\)=4, len\(y\)=3",
        ),
    ],
)
def test_bad_arguments_get_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ng.NaNGuard(**kwargs)


@pytest.mark.backend_free
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"directory": 123},
            r"`directory` must be a str or an os.PathLike or None. "
            r"Received: directory=123$",
        ),
        ({"report_path": b"r.json"}, r"`report_path` must be a str .*=b'r.json'"),
        ({"verbose": "yes"}, r"`verbose` must be one of \(0, 1\). .*verbose='yes'"),
        ({"verbose": True}, r"Received: verbose=True"),
        ({"policy": None}, r"`policy` must be one of .*Received: policy=None"),
        ({"snapshot_every": 2.5}, r"`snapshot_every` must be an integer >= 1 or"),
        ({"check_every": True}, r"Received: check_every=True"),
        ({"snapshot_budget": "0.1"}, r"`snapshot_budget` must be a number in \(0"),
        ({"lr_factor": np.bool_(True)}, r"`lr_factor` must be a number in \(0, 1\]"),
        ({"skip_batches": 1.0}, r"`skip_batches` must be an integer >= 0"),
        ({"patience": None}, r"Received: patience=None"),
        ({"max_rejections": "3"}, r"Received: max_rejections='3'"),
        ({"loss_spike_sigma": True}, r"`loss_spike_sigma` must be a positive number"),
        ({"loss_spike_window": 10.0}, r"Received: loss_spike_window=10.0"),
        ({"batch_size": np.float32(16)}, r"`batch_size` must be an integer >= 1"),
        ({"replay": 5}, r"`replay` must be .*Received: replay=5"),
    ],
)
def test_arguments_of_the_wrong_type_get_type_errors(kwargs, match):
    with pytest.raises(TypeError, match=match):
        ng.NaNGuard(**kwargs)


@pytest.mark.backend_free
def test_numpy_scalars_and_paths_are_accepted_as_plain_values(tmp_path):
    guard = ng.NaNGuard(
        np.str_("stop"),
        snapshot_every=np.int64(5),
        snapshot_budget=np.float32(0.25),
        check_every=np.int32(2),
        lr_factor=np.float64(0.5),
        skip_batches=np.int8(1),
        patience=np.uint8(2),
        max_rejections=np.int16(4),
        loss_spike_sigma=np.float32(6),
        loss_spike_window=np.int64(10),
        loss_spike_patience=np.int64(2),
        directory=tmp_path / "snaps",
        report_path=tmp_path / "r.json",
        batch_size=np.int64(8),
        quarantine=np.bool_(True),
        max_quarantine_fraction=np.float32(0.25),
        early_warning=np.bool_(False),
        verbose=np.int64(0),
    )
    config = guard.get_config()
    assert config == {
        "policy": "stop",
        "snapshot_every": 5,
        "snapshot_budget": 0.25,
        "check_every": 2,
        "lr_factor": 0.5,
        "skip_batches": 1,
        "patience": 2,
        "max_rejections": 4,
        "loss_spike_sigma": 6.0,
        "loss_spike_window": 10,
        "loss_spike_patience": 2,
        "directory": str(tmp_path / "snaps"),
        "report_path": str(tmp_path / "r.json"),
        "batch_size": 8,
        "quarantine": True,
        "max_quarantine_fraction": 0.25,
        "early_warning": False,
        "verbose": 0,
    }
    # Plain Python values: the config is JSON, as `.keras` files store it.
    assert json.loads(json.dumps(config)) == config
    assert {type(v) for v in config.values()} == {str, int, float, bool}


def test_unwritable_directory_fails_at_train_begin(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    guard = ng.NaNGuard(directory=blocker / "snapshots")
    x, y = binary_data(32)
    with pytest.raises(ValueError, match="`directory` must be a writable directory"):
        _model().fit(x, y, verbose=0, callbacks=[guard])


def test_model_already_nan_is_refused():
    model = _model()
    model.layers[0].kernel.assign(np.full((6, 8), np.nan, "float32"))
    x, y = binary_data(32)
    with pytest.raises(ng.NonFiniteError, match="already non-finite"):
        model.fit(x, y, verbose=0, callbacks=[ng.NaNGuard()])


@pytest.mark.backend_free
def test_config_round_trip():
    guard = ng.NaNGuard("stop", snapshot_every=7, lr_factor=0.25, patience=2)
    clone = ng.NaNGuard.from_config(guard.get_config())
    assert clone.get_config() == guard.get_config()
    assert keras.saving.get_registered_object("keras_nanguard>NaNGuard") is ng.NaNGuard


# --------------------------------------------------- with a SafeOptimizer
def test_rejected_step_is_one_incident_and_left_out_of_the_figures():
    x, y = binary_data()
    # A NaN label: the batch's loss is NaN on every backend.
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[3], target="y")
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.05))
    guard = ng.NaNGuard(verbose=0)
    history = fit_quietly(_model(opt), data, [guard], epochs=2)

    assert [i.kind for i in guard.incidents] == ["rejected_step", "rejected_step"]
    first = guard.incidents[0]
    assert (first.epoch, first.step, first.batch, first.action) == (0, 3, 3, "none")
    assert "nothing was applied" in first.detail
    assert guard.rollbacks == 0
    assert history.history["nanguard_incidents"] == [1, 2]
    assert history.history["nanguard_rejected_steps"] == [1, 2]

    # The epoch loss is the mean over the kept batches: exactly what Keras
    # reports for the same run without the poisoned batch.
    reference = fit_quietly(
        _model(keras.optimizers.SGD(0.05)), WithoutBatches(x, y, 16, [3]), [], 2
    )
    np.testing.assert_allclose(
        history.history["loss"], reference.history["loss"], rtol=1e-6
    )


def test_rejection_with_finite_loss_is_found_at_its_own_step():
    # The attached step logs SafeOptimizer's total of rejected steps: exact
    # at every step, with no read of the counters (`check_every` unused).
    x, y = binary_data()
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.05))
    spike = ng.faults.LearningRateSpike(at_steps=[2], factor=float("inf"))
    guard = ng.NaNGuard(verbose=0, check_every=3)
    history = fit_quietly(_model(opt), x, [spike, guard], y=y, batch_size=16)
    (inc,) = guard.incidents
    assert (inc.kind, inc.step, inc.steps) == ("rejected_step", 2, 1)
    assert "SafeOptimizer rejected 1 step: the update would have made" in inc.detail
    assert "learning rate is probably too high" in inc.detail
    assert np.isfinite(history.history["loss"]).all()
    assert opt.counters()["nonfinite_update_steps"] == 1


def test_repeated_rejections_are_trouble_and_roll_back():
    x, y = binary_data()
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[2, 3, 4, 5])
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.05))
    guard = ng.NaNGuard(verbose=0, max_rejections=3, check_every=1)
    fit_quietly(_model(opt), data, [guard])
    assert len(guard.incidents) == 1
    inc = guard.incidents[0]
    assert (inc.step, inc.steps) == (2, 4)
    assert inc.action.startswith("rolled back: restored the snapshot")
    assert "learning rate 0.05 -> 0.025" in inc.action
    assert guard.rollbacks == 1
    assert float(opt.learning_rate) == pytest.approx(0.025)
    # History counters survive the rollback; the streak is reset.
    assert opt.counters()["skipped_steps"] == 4


def test_halted_optimizer_is_trouble():
    x, y = binary_data()
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[1, 2, 3])
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.05), max_consecutive_skips=2)
    guard = ng.NaNGuard("stop", verbose=0, check_every=1)
    model = _model(opt)
    # Also on torch: an attached optimizer leaves the halt to NaNGuard.
    fit_quietly(model, data, [guard], epochs=3)
    assert guard.incidents[0].kind == "halted"
    assert "stopped training" in guard.incidents[0].action
    assert model.stop_training
    assert_bit_identical(
        snapshots.host_values(guard.snapshot)[:4], numpy(model.weights), "weights"
    )


# ------------------------------------------------- with a plain optimizer
class _Probe(keras.callbacks.Callback):
    """Listed after NaNGuard: checks the weights at every batch start."""

    def on_train_begin(self, logs=None):
        self.finite_at_begin = []

    def on_train_batch_begin(self, batch, logs=None):
        self.finite_at_begin.append(all_finite(self.model.weights))


def test_plain_optimizer_nan_is_rolled_back_at_a_batch_begin_soon_after():
    x, y = binary_data()
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[3], target="y")
    probe = _Probe()
    guard = ng.NaNGuard(verbose=0)
    model = _model(keras.optimizers.SGD(0.05))
    history = fit_quietly(model, data, [guard, probe])
    inc = guard.incidents[0]
    assert (inc.kind, inc.step) == ("nonfinite_loss", 3)
    assert "The update was applied" in inc.detail
    assert any("dense" in v for v in inc.variables)
    assert inc.action.startswith("rolled back")
    # TensorFlow calls batch ends in line: batch 4 already starts from the
    # restored state. JAX and torch call them in a worker thread: the
    # rollback happens at a later batch begin, at most `_MAX_LAG` batches
    # late; those batches ran on the bad state.
    late = [i for i, ok in enumerate(probe.finite_at_begin) if not ok]
    assert len(probe.finite_at_begin) == 8
    lag = 0 if BACKEND == "tensorflow" else nan_guard._MAX_LAG
    assert late == list(range(4, 4 + len(late))) and len(late) <= lag
    assert all_finite(model.weights)
    assert np.isfinite(history.history["loss"]).all()


def test_nan_weights_with_a_finite_loss_are_caught_at_the_next_check():
    # A NaN *input*: on TensorFlow's CPU kernels the fused MatMul+BiasAdd+ReLU
    # maps it to 0, so the loss stays finite while the kernel goes NaN; the
    # next weight check (a snapshot, here every 2 steps) catches it.
    x, y = binary_data()
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[3])
    guard = ng.NaNGuard(verbose=0, snapshot_every=2)
    model = _model(keras.optimizers.SGD(0.05))
    fit_quietly(model, data, [guard])
    (inc,) = guard.incidents
    assert inc.kind in ("nonfinite_loss", "nonfinite_weights")
    assert inc.step in (3, 4)
    assert inc.action.startswith("rolled back")
    assert all_finite(model.weights)


def test_diverging_learning_rate_rolls_back_lowers_lr_and_finishes_finite():
    x, y = binary_data(256)

    class BadSchedule(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:  # a schedule gone wrong: far too high from here on
                self.model.optimizer.learning_rate.assign(1e30)

    guard = ng.NaNGuard(verbose=0, lr_factor=1e-31, patience=3)
    model = _model(keras.optimizers.SGD(0.05))
    history = fit_quietly(
        model, x, [BadSchedule(), guard], epochs=5, y=y, batch_size=16
    )
    assert guard.rollbacks >= 1
    assert all_finite(model.weights)
    assert float(model.optimizer.learning_rate) < 1.0
    assert np.isfinite(history.history["loss"]).all()
    assert len(history.history["loss"]) == 5  # recovered, did not stop


def test_patience_exhausted_stops_with_good_weights():
    x, y = binary_data(512)
    # Every batch from the fifth on is poisoned: rollbacks cannot recover.
    # (32 batches: a batch already in flight at a rollback does not count,
    # so with asynchronous batch ends the three troubles take more batches.)
    data = ng.faults.PoisonedBatches(
        x, y, batch_size=16, bad_batches=range(4, 32), target="y"
    )
    guard = ng.NaNGuard(verbose=0, patience=2)
    model = _model(keras.optimizers.SGD(0.05))
    history = fit_quietly(model, data, [guard], epochs=3)
    assert guard.rollbacks == 2
    assert (
        "stopped training after 2 rollbacks without recovery"
        in guard.incidents[-1].action
    )
    assert len(history.history["loss"]) == 1
    assert all_finite(model.weights)


def test_stop_policy_restores_the_last_snapshot_bit_identical():
    x, y = binary_data()
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[5], target="y")
    guard = ng.NaNGuard("stop", snapshot_every=2, verbose=0)
    model = _model(keras.optimizers.Adam(0.01))
    history = fit_quietly(model, data, [guard], epochs=3)
    assert model.stop_training and len(history.history["loss"]) == 1
    assert guard.snapshot.step == 4  # after step 3, confirmed by step 4
    n = len(model.weights)
    assert_bit_identical(
        snapshots.host_values(guard.snapshot)[:n], numpy(model.weights), "weights"
    )
    state = [
        v for v in model.optimizer.variables if v is not model.optimizer.learning_rate
    ]
    expected = [
        a
        for v, a in zip(
            model.optimizer.variables,
            snapshots.host_values(guard.snapshot)[n:],
            strict=True,
        )
        if v is not model.optimizer.learning_rate
    ]
    assert_bit_identical(expected, numpy(state), "optimizer state")
    assert "stopped training" in guard.incidents[0].action


def test_raise_policy_restores_then_raises_with_the_report():
    x, y = binary_data()
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[2], target="y")
    guard = ng.NaNGuard("raise", verbose=0)
    model = _model(keras.optimizers.SGD(0.05))
    with pytest.raises(
        ng.NonFiniteError, match=r"nonfinite_loss.*raised NonFiniteError"
    ) as err:
        fit_quietly(model, data, [guard])
    assert err.value.report["incidents"][0]["step"] == 2
    assert all_finite(model.weights)


def test_warn_policy_only_warns():
    x, y = binary_data()
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[2], target="y")
    model = _model(keras.optimizers.SGD(0.05))
    guard = ng.NaNGuard("warn", verbose=0)
    with pytest.warns(UserWarning, match="NaNGuard: ") as caught:
        fit_quietly(model, data, [guard])
    assert not all_finite(model.weights)
    # The NaN batch, then the NaN weights found at the end of the epoch.
    assert [i.kind for i in guard.incidents] == ["nonfinite_loss", "nonfinite_weights"]
    assert {i.action for i in guard.incidents} == {"warned"}
    assert sum("NaNGuard: " in str(w.message) for w in caught) == 2


def test_skip_batches_discards_the_next_updates():
    x, y = binary_data()
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[3], target="y")
    guard = ng.NaNGuard(verbose=0, skip_batches=2, lr_factor=1.0, snapshot_every=100)

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:
                self.after_skips = numpy(self.model.weights)
                n = len(self.model.weights)
                self.snapshot = snapshots.host_values(guard.snapshot)[:n]

    record = Record()
    model = _model(keras.optimizers.SGD(0.05))
    fit_quietly(model, data, [guard, record])
    assert "discarding the next 2 batches" in guard.incidents[0].action
    # Batches 4 and 5 were undone: the state is still the snapshot's (the
    # rollback point then; at the end of fit it is the final state).
    assert_bit_identical(record.snapshot, record.after_skips)


def test_one_instance_serves_several_fits():
    x, y = binary_data()
    guard = ng.NaNGuard(verbose=0, check_every=1)
    model = _model(ng.SafeOptimizer(keras.optimizers.SGD(0.05)))
    for _ in range(2):
        fit_quietly(
            model,
            ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[1]),
            [guard],
        )
    assert [(i.fit, i.step) for i in guard.incidents] == [(0, 1), (1, 1)]


@pytest.mark.skipif(
    BACKEND == "torch", reason="Keras needs steps_per_execution=1 on torch"
)
def test_steps_per_execution_groups_are_left_out_whole():
    x, y = binary_data()
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[3])
    model = _model(ng.SafeOptimizer(keras.optimizers.SGD(0.05)))
    model.compile(optimizer=model.optimizer, loss=BINARY_LOSS, steps_per_execution=2)
    guard = ng.NaNGuard(verbose=0)
    history = fit_quietly(model, data, [guard])
    assert len(guard.incidents) == 1
    assert np.isfinite(history.history["loss"]).all()


def test_replay_keeps_the_incident_batch():
    x, y = binary_data()
    x_bad = ng.faults.poison(x, rows=[40])  # batch 2 (rows 32..47)
    guard = ng.NaNGuard(verbose=0, replay=(x_bad, y), batch_size=16, check_every=1)
    fit_quietly(
        _model(ng.SafeOptimizer(keras.optimizers.SGD(0.05))),
        x_bad,
        [guard],
        y=y,
        batch_size=16,
    )
    inc = guard.incidents[0]
    bx, by = inc.batch_data
    np.testing.assert_array_equal(bx, x_bad[32:48])
    np.testing.assert_array_equal(by, y[32:48])
    # ... and diagnosed: the NaN is in the data.
    assert (inc.diagnosis.stage, inc.diagnosis.causes) == ("input", ["nonfinite_input"])
    assert "Diagnosis: input stage, nonfinite_input." in inc.detail
    assert inc.to_dict()["diagnosis"]["stage"] == "input"


# ------------------------------------------------------- snapshots on disk
def test_snapshots_on_disk_restore_into_a_fresh_model(tmp_path):
    x, y = binary_data()
    guard = ng.NaNGuard(verbose=0, directory=tmp_path, snapshot_every=3)
    model = _model(keras.optimizers.Adam(0.01))
    fit_quietly(model, x, [guard], y=y, batch_size=16, epochs=2)
    assert (tmp_path / "nanguard_snapshot.npz").exists()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    fresh = _model(keras.optimizers.Adam(0.01), seed=9)
    step = ng.NaNGuard.restore(fresh, tmp_path)
    assert step == guard.snapshot.step
    assert_bit_identical(
        snapshots.host_values(guard.snapshot)[: len(fresh.weights)],
        numpy(fresh.weights),
    )
    other = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
    other.compile(optimizer="adam", loss="mse")
    with pytest.raises(ValueError, match="different model"):
        ng.NaNGuard.restore(other, tmp_path)


CRASHER = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    from keras_nanguard import snapshots
    from keras_nanguard.nan_guard import callback as nan_guard

    directory = sys.argv[1]
    good = snapshots.Snapshot([np.arange(1000.0)], ["w"], epoch=1, step=10)
    snapshots.save(good, directory)
    real_savez = np.savez

    def slow_savez(f, **arrays):  # write half, then hang: killed mid-write
        f.write(b"PK\\x03\\x04 partial zip header")
        f.flush()
        open(os.path.join(directory, "writing"), "w").close()
        time.sleep(60)

    np.savez = slow_savez
    snapshots.save(snapshots.Snapshot([np.zeros(1000)], ["w"], 2, 20), directory)
    """
)


def test_crash_during_a_snapshot_write_leaves_the_previous_one_loadable(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CRASHER, str(tmp_path)])
    try:
        for _ in range(600):
            if (tmp_path / "writing").exists() or proc.poll() is not None:
                break
            import time

            time.sleep(0.1)
        assert (tmp_path / "writing").exists(), "the writer never got mid-write"
    finally:
        proc.kill()
        proc.wait()
    snap = snapshots.load(tmp_path)
    assert (snap.epoch, snap.step) == (1, 10)
    np.testing.assert_array_equal(snap.values[0], np.arange(1000.0))


def test_report_file_is_json(tmp_path):
    x, y = binary_data()
    path = tmp_path / "report.json"
    guard = ng.NaNGuard(verbose=0, report_path=path)
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[2], target="y")
    fit_quietly(_model(ng.SafeOptimizer(keras.optimizers.SGD(0.05))), data, [guard])
    report = json.loads(path.read_text())
    assert report["policy"] == "rollback"
    assert report["incidents"][0]["kind"] == "rejected_step"
    assert report["incidents"][0]["step"] == 2
    assert "nanguard: 1 incidents" in guard.summary().lower()


# -------------------------------------------------- with other callbacks
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
