"""NaNGuard's snapshots on disk and what restores them: `NaNGuard.restore`
into a fresh or an uncompiled model, the final state and the lowered
learning rate when `fit` returns, Keras's `load_weights` on the snapshot's
weights file, a crash in the middle of a write, and dropout's random stream
across a rollback and a restore."""

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
from tests.helpers import (
    WithoutBatches,
    assert_bit_identical,
    binary_data,
    fit_quietly,
    learning_rate,
    numpy,
)
from tests.models import guard_model as _model
from tests.models import tiny_layers as _layers


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


def test_disk_snapshot_is_the_final_state_when_fit_returns(tmp_path):
    x, y = binary_data()
    model = _model(keras.optimizers.Adam(0.01))
    guard = ng.NaNGuard(verbose=0, directory=tmp_path)
    fit_quietly(model, x, [guard], y=y, batch_size=16)  # 8 clean steps
    fresh = _model(keras.optimizers.Adam(0.01), seed=9)
    assert ng.NaNGuard.restore(fresh, tmp_path) == 8
    assert_bit_identical(numpy(model.weights), numpy(fresh.weights), "weights")
    assert_bit_identical(
        numpy(model.optimizer.variables), numpy(fresh.optimizer.variables), "opt"
    )


def test_disk_snapshot_carries_the_learning_rate_nan_guard_lowered(tmp_path):
    x, y = binary_data()
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[3], target="y")
    model = _model(keras.optimizers.SGD(0.05))
    guard = ng.NaNGuard(verbose=0, directory=tmp_path)
    fit_quietly(model, data, [guard])
    assert guard.rollbacks == 1
    lowered = np.float32(0.025)
    assert learning_rate(model) == lowered
    assert snapshots.load(tmp_path).learning_rate == float(lowered)
    fresh = _model(keras.optimizers.SGD(0.05), seed=9)
    assert ng.NaNGuard.restore(fresh, tmp_path) == 8
    assert learning_rate(fresh) == lowered
    assert_bit_identical(numpy(model.weights), numpy(fresh.weights), "weights")


def test_restore_into_an_uncompiled_model_for_inference(tmp_path):
    x, y = binary_data()
    model = _model(keras.optimizers.Adam(0.01))
    fit_quietly(
        model, x, [ng.NaNGuard(verbose=0, directory=tmp_path)], y=y, batch_size=16
    )

    infer = _model(None, seed=9, compile=False)
    assert ng.NaNGuard.restore(infer, tmp_path) == 8
    assert_bit_identical(numpy(model.weights), numpy(infer.weights), "weights")
    np.testing.assert_array_equal(
        infer.predict(x, verbose=0), model.predict(x, verbose=0)
    )

    other = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
    before = numpy(other.weights)
    with pytest.raises(ValueError, match=r"different model.*Received: directory="):
        ng.NaNGuard.restore(other, tmp_path)
    assert_bit_identical(before, numpy(other.weights), "untouched")

    unbuilt = keras.Sequential(_layers())
    with pytest.raises(ValueError, match="not built"):
        ng.NaNGuard.restore(unbuilt, tmp_path)


class _InLine(keras.callbacks.Callback):
    """Not async-safe: Keras then calls every batch end on the training
    thread, so NaNGuard acts at the bad batch's end on every backend."""

    def on_train_batch_end(self, batch, logs=None):
        pass


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
