"""What NaNGuard finds, and at which step: a model non-finite before
training, a step SafeOptimizer rejected (one incident, found at its own
step), a run of rejected steps or a halted optimizer (trouble), NaN weights
behind a finite loss; one guard across several `fit` calls."""

import keras
import numpy as np
import pytest

import keras_nanguard as ng
from keras_nanguard import snapshots
from tests.helpers import (
    all_finite,
    assert_bit_identical,
    binary_data,
    fit_quietly,
    numpy,
)
from tests.models import guard_model as _model


def test_model_already_nan_is_refused():
    model = _model()
    model.layers[0].kernel.assign(np.full((6, 8), np.nan, "float32"))
    x, y = binary_data(32)
    with pytest.raises(ng.NonFiniteError, match="already non-finite"):
        model.fit(x, y, verbose=0, callbacks=[ng.NaNGuard()])


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
