"""NaNGuard on the paths users take (issue 11): models built by `fit`,
`steps_per_execution`, the snapshot on disk after `fit`, figures that never
show NaN because NaNGuard left batches out, and how incidents are told."""

import contextlib
import csv
import io
import logging
import re
import threading
import warnings

import keras
import numpy as np
import pytest
from keras import ops

import keras_nanguard as ng
from keras_nanguard import snapshots
from tests.helpers import (
    BACKEND,
    BINARY_LOSS,
    WithoutBatches,
    all_finite,
    assert_bit_identical,
    binary_data,
    fit_quietly,
    learning_rate,
    numpy,
)
from tests.models import guard_model as _model
from tests.models import tiny_layers as _layers


class _Weights(keras.callbacks.Callback):
    """Listed after NaNGuard: the weights at train begin (when they exist) and
    after every batch."""

    def on_train_begin(self, logs=None):
        self.at_begin = numpy(self.model.weights) if self.model.weights else None
        self.after = []

    def on_train_batch_end(self, batch, logs=None):
        self.after.append(numpy(self.model.weights))


# ------------------------------------- finding 2: models built by `fit`
UNBUILT = ["sequential", "subclassed"]


@pytest.mark.parametrize("kind", UNBUILT)
def test_model_built_by_fit_trains_as_without_nan_guard(kind):
    x, y = binary_data()
    plain = _model(keras.optimizers.Adam(0.01), kind)
    fit_quietly(plain, x, [], y=y, batch_size=16)
    model = _model(keras.optimizers.Adam(0.01), kind)
    guard = ng.NaNGuard(verbose=0)
    fit_quietly(model, x, [guard], y=y, batch_size=16)
    assert guard.incidents == []
    assert_bit_identical(numpy(plain.weights), numpy(model.weights), "weights")
    assert_bit_identical(
        numpy(plain.optimizer.variables), numpy(model.optimizer.variables), "opt"
    )


@pytest.mark.parametrize("kind", UNBUILT)
def test_model_built_by_fit_is_rolled_back_to_its_first_snapshot(kind):
    x, y = binary_data()
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[3], target="y")
    model = _model(keras.optimizers.SGD(0.05), kind)
    guard, weights = ng.NaNGuard(verbose=0), _Weights()
    fit_quietly(model, data, [guard, weights])
    (inc,) = guard.incidents
    assert (inc.kind, inc.step, inc.batch) == ("nonfinite_loss", 3, 3)
    # On TensorFlow the model has no variables at train begin: the first
    # snapshot is taken after step 0. JAX and torch build it before.
    first = 1 if BACKEND == "tensorflow" else 0
    assert inc.action.startswith(
        f"rolled back: restored the snapshot of epoch 0, step {first},"
    )
    expected = weights.after[0] if first else weights.at_begin
    assert_bit_identical(expected, weights.after[3], "weights after the rollback")
    assert all_finite(model.weights)


@pytest.mark.parametrize("kind", UNBUILT)
def test_model_built_by_fit_bad_first_step_with_safe_optimizer(kind):
    x, y = binary_data()
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[0], target="y")
    model = _model(ng.SafeOptimizer(keras.optimizers.Adam(0.01)), kind)
    guard = ng.NaNGuard(verbose=0)
    fit_quietly(model, data, [guard])
    assert [(i.kind, i.step, i.action) for i in guard.incidents] == [
        ("rejected_step", 0, "none")
    ]
    reference = _model(ng.SafeOptimizer(keras.optimizers.Adam(0.01)), kind)
    fit_quietly(reference, WithoutBatches(x, y, 16, [0]), [])
    assert_bit_identical(numpy(reference.weights), numpy(model.weights), "weights")


@pytest.mark.parametrize("kind", UNBUILT)
def test_model_built_by_fit_bad_first_step_with_plain_optimizer(kind):
    x, y = binary_data()
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[0], target="y")
    model = _model(keras.optimizers.SGD(0.05), kind)
    guard, weights = ng.NaNGuard(verbose=0), _Weights()
    if BACKEND == "tensorflow":  # no state before step 0 to go back to
        with pytest.raises(ng.NonFiniteError, match=r"built by `fit`.*first step"):
            fit_quietly(model, data, [guard, weights])
        assert [i.kind for i in guard.incidents] == ["nonfinite_loss"]
        return
    fit_quietly(model, data, [guard, weights])
    assert guard.incidents[0].action.startswith("rolled back")
    assert_bit_identical(weights.at_begin, weights.after[0], "weights")


# -------------------------------------- finding 8: steps_per_execution
class _InfiniteLearningRate(keras.callbacks.Callback):
    """Sets the learning rate to inf for the execution that begins at `batch`."""

    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_begin(self, batch, logs=None):
        lr = self.model.optimizer.learning_rate
        if batch == self.batch:
            self.saved = float(ops.convert_to_numpy(lr))
            lr.assign(float("inf"))
        elif hasattr(self, "saved"):
            lr.assign(self.saved)
            del self.saved


spe = pytest.mark.skipif(
    BACKEND == "torch", reason="Keras needs steps_per_execution=1 on torch"
)


@spe
def test_steps_per_execution_replay_keeps_the_bad_batch_and_counts_steps():
    x, y = binary_data(112)  # 7 batches of 16: groups (0, 1) (2, 3) (4, 5) (6)
    y_bad = ng.faults.poison(y, rows=[40])  # batch 2, first of its group
    model = _model(ng.SafeOptimizer(keras.optimizers.SGD(0.05)), steps_per_execution=2)
    guard = ng.NaNGuard(verbose=0, replay=(x, y_bad), batch_size=16, check_every=1)
    fit_quietly(model, x, [guard], y=y_bad, batch_size=16, epochs=2)
    assert [(i.kind, i.epoch, i.step, i.batch) for i in guard.incidents] == [
        ("rejected_step", 0, 2, 2),
        ("rejected_step", 1, 9, 2),  # 7 steps in epoch 0, not 4 executions
    ]
    for inc in guard.incidents:
        bx, by = inc.batch_data  # the batch with the NaN, not batch 3
        np.testing.assert_array_equal(bx, x[32:48])
        np.testing.assert_array_equal(by, y_bad[32:48])
    assert guard.snapshot.step == 14


@spe
def test_steps_per_execution_unknown_bad_step_keeps_the_whole_group():
    x, y = binary_data()
    model = _model(ng.SafeOptimizer(keras.optimizers.SGD(0.05)), steps_per_execution=2)
    guard = ng.NaNGuard(verbose=0, replay=(x, y), batch_size=16, check_every=1)
    fit_quietly(model, x, [_InfiniteLearningRate(4), guard], y=y, batch_size=16)
    (inc,) = guard.incidents
    assert (inc.kind, inc.step, inc.batch, inc.steps) == ("rejected_step", 4, 4, 2)
    assert "rejected 2 steps in steps 4-5" in inc.detail
    bx, by = inc.batch_data  # both batches of the group
    np.testing.assert_array_equal(bx, x[64:96])
    np.testing.assert_array_equal(by, y[64:96])


# -------------------------------------------- finding 10: snapshot on disk
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


# ------------------------------------------------------ finding 11: figures
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


# --------------------------- messages: once per incident, on their own line
def _nan_target_run(guard, verbose, n=64):
    """A plain optimizer, a NaN target in batch 2 of n/16: the update is
    applied, so the state goes non-finite. Returns everything written to
    stdout, where the progress bar goes, with the warnings and the log lines
    of "keras_nanguard" interleaved in the order they were written."""
    x, y = binary_data(n)
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[2], target="y")
    model = _model(keras.optimizers.SGD(0.05))
    out, shown = io.StringIO(), []

    def show(message, category, filename, lineno, file=None, line=None):
        shown.append((category, str(message), filename))
        out.write(f"{message}\n")

    handler = logging.StreamHandler(out)
    logger = logging.getLogger("keras_nanguard")
    logger.addHandler(handler)
    try:
        with contextlib.redirect_stdout(out), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # others' deprecations
            warnings.filterwarnings("always", message="NaNGuard")
            warnings.showwarning = show
            model.fit(data, verbose=verbose, shuffle=False, callbacks=[guard])
    finally:
        logger.removeHandler(handler)
    return out.getvalue(), shown


@pytest.mark.parametrize("fit_verbose", [1, 0])
def test_incident_line_starts_a_line_of_its_own_under_the_progress_bar(
    fit_verbose,
):
    guard = ng.NaNGuard(verbose=1)
    text, shown = _nan_target_run(guard, fit_verbose)
    (inc,) = guard.incidents
    assert inc.action.startswith("rolled back: restored the snapshot")
    assert shown == []
    line = f"NaNGuard: {inc}\n"  # told once, with its action
    assert text.count("NaNGuard: ") == 1 and line in text
    at = text.index(line)
    if fit_verbose:
        # The bar had drawn its first line (no newline: Keras rewrites it
        # with `\r`); the incident begins a line of its own all the same.
        assert "1/4" in text[:at]
        assert text[at - 1] == "\n"
    else:  # no bar: nothing else written, no stray newline
        assert text == line


def test_warn_policy_warns_once_per_incident_at_the_fit_call(caplog):
    guard = ng.NaNGuard("warn", verbose=1)
    with caplog.at_level(logging.WARNING, logger="keras_nanguard"):
        text, shown = _nan_target_run(guard, verbose=1)
    # The NaN batch, then the NaN weights found at the end of the epoch.
    assert [i.kind for i in guard.incidents] == ["nonfinite_loss", "nonfinite_weights"]
    told = [f"NaNGuard: {i}" for i in guard.incidents]
    # Exactly one message per incident: its warning, and no log line besides.
    assert [message for _, message, _ in shown] == told
    assert [r for r in caplog.records if r.name == "keras_nanguard"] == []
    assert all(text.count(t) == 1 for t in told)
    # The warnings point at the code that called `fit` (this file), not
    # inside keras_nanguard or Keras.
    assert {(category, filename) for category, _, filename in shown} == {
        (UserWarning, __file__)
    }
    assert all(text[text.index(t) - 1] == "\n" for t in told)


def test_raise_policy_tells_the_incident_in_the_error_only(caplog):
    guard = ng.NaNGuard("raise", verbose=1)
    at_warning = caplog.at_level(logging.WARNING, logger="keras_nanguard")
    with at_warning, pytest.raises(ng.NonFiniteError) as err:
        _nan_target_run(guard, verbose=0)
    (inc,) = guard.incidents
    assert str(err.value) == f"NaNGuard: {inc}"
    assert inc.action.endswith(", raised NonFiniteError")
    assert [r for r in caplog.records if r.name == "keras_nanguard"] == []
