"""The figures of a guarded `fit`: a rejected batch left out of the epoch's
(a whole group with `steps_per_execution`), no training figure for an epoch
without a healthy batch, a non-finite metric left out of that metric only,
and non-finite validation figures: an incident, not trouble."""

import csv
import re
import threading

import keras
import numpy as np
import pytest
from keras import ops

import keras_nanguard as ng
from tests.helpers import (
    BACKEND,
    BINARY_LOSS,
    WithoutBatches,
    assert_bit_identical,
    binary_data,
    fit_quietly,
    numpy,
)
from tests.models import guard_model as _model


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


class _PoisonEpoch(keras.callbacks.Callback):
    def __init__(self, data, epoch, batches):
        super().__init__()
        self.data, self.epoch, self.batches = data, epoch, batches

    def on_epoch_begin(self, epoch, logs=None):
        bad = self.batches if epoch == self.epoch else []
        self.data.bad_batches = {b: float("nan") for b in bad}


def test_epoch_with_no_healthy_batch_reports_no_train_figure(tmp_path, capsys):
    x, y = binary_data(64)  # 4 batches
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, target="y")
    path = tmp_path / "log.csv"
    model = _model(ng.SafeOptimizer(keras.optimizers.SGD(0.05)))
    guard = ng.NaNGuard(verbose=0, max_rejections=100)
    history = model.fit(
        data,
        epochs=3,
        verbose=1,
        shuffle=False,
        callbacks=[
            _PoisonEpoch(data, 1, range(4)),
            guard,
            keras.callbacks.CSVLogger(str(path)),
        ],
    )
    assert history.epoch == [0, 1, 2]
    assert [i.kind for i in guard.incidents] == ["rejected_step"]
    assert guard.incidents[0].steps == 4
    # No figure for epoch 1, as Keras has no val_loss on an epoch it did not
    # validate: the key is left out, History's list skips it.
    assert len(history.history["loss"]) == 2
    assert np.isfinite(history.history["loss"]).all()
    assert history.history["nanguard_rejected_steps"] == [0, 4, 4]
    rows = list(csv.DictReader(path.open()))
    assert [r["loss"] for r in rows][1] == "NA"
    assert all(np.isfinite(float(rows[i]["loss"])) for i in (0, 2))
    assert not re.search(r"\bnan\b", capsys.readouterr().out, re.IGNORECASE)


def _spiky_mae(y_true, y_pred):
    """Mean absolute error, but inf on a batch holding a target of 10."""
    mae = ops.mean(ops.abs(y_true - y_pred))
    return ops.where(ops.max(y_true) > 5.0, float("inf"), mae)


class _BatchFigures(keras.callbacks.Callback):
    """Each batch's own figures, from Keras's running means."""

    def on_epoch_begin(self, epoch, logs=None):
        self.means, self.batches = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.means.append({k: float(v) for k, v in logs.items()})

    def values(self, key):
        m = [d[key] for d in self.means]
        return [m[0]] + [(i + 1) * m[i] - i * m[i - 1] for i in range(1, len(m))]


class _Lagging:
    """Holds Keras's batch-end worker back so that NaNGuard resets the
    metrics while the logs of the batch before are still to be read. The
    worker reads the end of batch `bad` once batch `bad + 2` begins, and
    `bad + 2` goes on only once NaNGuard has read it (`Seen`, listed after
    NaNGuard); it reads the end of `bad + 1` only once `bad + 3` begins. So
    NaNGuard acts on batch `bad` at the beginning of `bad + 2`, before it
    has read `bad + 1`. Batch ends in line (TensorFlow) never wait. `held`
    records that each wait ended on its signal."""

    def __init__(self, bad):
        self.held = []
        outer = self

        class Before(keras.callbacks.Callback):
            async_safe = True

            def on_train_begin(self, logs=None):
                outer.thread = threading.get_ident()

            def on_epoch_begin(self, epoch, logs=None):
                outer.begun = {b: threading.Event() for b in (bad + 2, bad + 3)}
                outer.read = threading.Event()

            def on_train_batch_begin(self, batch, logs=None):
                if batch in outer.begun:
                    outer.begun[batch].set()
                if batch == bad + 2:  # NaNGuard, next, acts on batch `bad`
                    outer.held.append(outer.read.wait(60))

            def on_train_batch_end(self, batch, logs=None):
                in_line = threading.get_ident() == outer.thread
                if batch in (bad, bad + 1) and not in_line:
                    outer.held.append(outer.begun[batch + 2].wait(60))

        class Seen(keras.callbacks.Callback):
            async_safe = True

            def on_train_batch_end(self, batch, logs=None):
                if batch == bad:
                    outer.read.set()

        self.before, self.seen = Before(), Seen()

    def around(self, guard):
        return [self.before, guard, self.seen]


def test_nonfinite_metric_has_its_own_kind_and_keeps_the_finite_loss():
    x, y = binary_data()
    y = y.copy()
    y[50] = 10.0  # batch 3: the metric is inf there, the loss is finite

    def run(callbacks, metric):
        model = _model(None, compile=False)
        model.compile(keras.optimizers.SGD(0.05), loss=BINARY_LOSS, metrics=[metric])
        return model, fit_quietly(model, x, callbacks, y=y, batch_size=16, epochs=2)

    def mae(y_true, y_pred):
        return ops.mean(ops.abs(y_true - y_pred))

    mae.__name__ = "_spiky_mae"  # the same log key as the guarded run
    figures = _BatchFigures()
    ref_model, reference = run([figures], mae)
    guard = ng.NaNGuard(verbose=0)
    # With Keras's worker thread (JAX, torch) NaNGuard resets the metrics at
    # the beginning of batch 5, before it has read batch 4's logs (Keras's
    # running means then, before the reset): the race that left batch 4 out
    # of the loss.
    lagging = _Lagging(bad=3)
    model, history = run(lagging.around(guard), _spiky_mae)

    assert [(i.kind, i.epoch, i.step, i.batch) for i in guard.incidents] == [
        ("nonfinite_metric", 0, 3, 3),
        ("nonfinite_metric", 1, 11, 3),
    ]
    assert "_spiky_mae=inf" in guard.incidents[0].detail
    assert guard.rollbacks == 0
    asynchronous = BACKEND != "tensorflow"
    assert lagging.held == [True] * (6 if asynchronous else 2)
    assert_bit_identical(numpy(ref_model.weights), numpy(model.weights), "weights")
    # The finite loss keeps batch 3; only the metric leaves it out.
    np.testing.assert_allclose(
        history.history["loss"], reference.history["loss"], rtol=1e-6
    )
    per_batch = figures.values("_spiky_mae")  # epoch 1's, batch by batch
    # Keras's running mean holds the inf until NaNGuard resets the metrics:
    # in line at the same batch end (only batch 3 is left out of the
    # metric), asynchronously at the beginning of batch 5 (3 and 4).
    out = (3, 4) if asynchronous else (3,)
    got = history.history["_spiky_mae"][1]
    expected = np.mean([v for i, v in enumerate(per_batch) if i not in out])
    np.testing.assert_allclose(got, expected, rtol=1e-5)


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
