"""NaNGuard's policies: what it does about trouble (roll back and lower the
learning rate, stop, raise, warn; discard the next batches; stop after
`patience` rollbacks), a learning rate it cannot lower (a schedule), and who
owns which policy when SafeOptimizer is set too.

SafeOptimizer owns the step (reject, `lr_backoff`, halt after
`max_consecutive_skips`); NaNGuard owns the run (restore a snapshot, lower
the base learning rate by `lr_factor`). Of the two rejection limits the
smaller acts first: the last two scenarios pin that precedence."""

import warnings

import keras
import numpy as np
import pytest

import keras_nanguard as ng
from keras_nanguard import snapshots
from keras_nanguard.nan_guard.callback import _MAX_LAG
from tests.helpers import (
    BACKEND,
    all_finite,
    assert_bit_identical,
    binary_data,
    fit_quietly,
    numpy,
)
from tests.models import guard_model as _model
from tests.models import mse_model


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


def _data(bad):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((160, 6)).astype("float32")
    y = x.sum(1, keepdims=True)
    return ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=bad)


def test_nan_guard_limit_first_rolls_back_before_the_optimizer_halts():
    opt = ng.SafeOptimizer(
        keras.optimizers.SGD(0.05), lr_backoff=0.5, max_consecutive_skips=5
    )
    guard = ng.NaNGuard(verbose=0, max_rejections=2, lr_factor=0.5)
    mse_model(opt, seed=1).fit(
        _data([2, 3]), verbose=0, shuffle=False, callbacks=[guard]
    )
    # Two rejections in a row: NaNGuard's trouble, one rollback; the
    # optimizer never reached its own limit.
    assert guard.rollbacks == 1
    assert [i.kind for i in guard.incidents] == ["rejected_step"]
    assert opt.counters()["skipped_steps"] == 2
    # The base rate is NaNGuard's (0.05 -> 0.025); the back-off scale was
    # restored with the snapshot (1.0) and never ended at 0.25.
    assert float(opt.learning_rate) == pytest.approx(0.025)
    assert opt.counters()["lr_scale"] == 1.0
    assert opt.counters()["consecutive_skips"] == 0


def test_optimizer_limit_first_halts_and_nan_guard_treats_the_halt():
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.05), max_consecutive_skips=2)
    guard = ng.NaNGuard(verbose=0, max_rejections=5)
    mse_model(opt, seed=1).fit(
        _data([2, 3]), verbose=0, shuffle=False, callbacks=[guard]
    )
    assert [i.kind for i in guard.incidents] == ["halted"]
    assert guard.rollbacks == 1
    # The rollback restored the snapshot of step 0 (iterations 0) and with
    # it the streak. It comes at the next batch begin NaNGuard reaches: at
    # once where Keras calls batch ends in line (TensorFlow), up to
    # _MAX_LAG batches later where they run in its worker thread; batches
    # in between meet the halted optimizer and are rejected. Every one of
    # the 8 clean batches is either applied after the rollback or rejected.
    c = opt.counters()
    assert c["consecutive_skips"] == 0
    late = c["skipped_steps"] - 2
    assert 0 <= late <= _MAX_LAG
    if BACKEND == "tensorflow":
        assert late == 0
    assert int(opt.iterations) == 6 - late
