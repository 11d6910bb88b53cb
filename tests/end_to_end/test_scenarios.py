"""End-to-end scenario on scikit-learn's digits (shipped with the package):
5% of the batches poisoned in every epoch, plus a learning-rate spike."""

import keras
import numpy as np
import pytest
from sklearn.datasets import load_digits

import keras_nanguard as ng
from keras_nanguard.demo import mlp
from keras_nanguard.nan_guard import callback as nan_guard
from tests.helpers import BACKEND, all_finite

EPOCHS = 16
BAD = {5: "nan", 27: "inf"}  # 2 of 40 batches (5%), NaN/inf in inputs and labels

SPIKE_STEP = 100  # a schedule gone wrong for one step: lr x 1e30


@pytest.fixture(scope="module")
def digits():
    d = load_digits()
    x = (d.data / 16.0).astype("float32")
    y = keras.utils.to_categorical(d.target, 10).astype("float32")
    order = np.random.default_rng(0).permutation(len(x))
    train, test = order[:1280], order[1280:]  # 40 batches of 32

    return x[train], y[train], x[test], y[test]


def _train(digits, kind):
    x, y, x_test, y_test = digits
    keras.utils.set_random_seed(0)
    model = mlp(64, 10)
    optimizer = keras.optimizers.Adam(1e-3)
    callbacks = []
    if kind == "guarded":
        optimizer = ng.SafeOptimizer(optimizer, clipnorm=5.0)
        callbacks.append(ng.NaNGuard(verbose=0))
    if kind == "plain":
        callbacks.append(keras.callbacks.TerminateOnNaN())
    faults = kind != "clean"
    if faults:
        callbacks.append(
            ng.faults.LearningRateSpike(at_steps=[SPIKE_STEP], factor=1e30)
        )
    data = ng.faults.PoisonedBatches(
        x, y, batch_size=32, bad_batches=BAD if faults else {}, target="both"
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.CategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(
        data, epochs=EPOCHS, verbose=0, shuffle=False, callbacks=callbacks
    )
    accuracy = model.evaluate(x_test, y_test, verbose=0)[1]
    return model, history, accuracy, callbacks


def test_poisoned_batches_and_a_learning_rate_spike(digits):
    clean, _, clean_acc, _ = _train(digits, "clean")
    assert all_finite(clean.weights) and clean_acc > 0.9

    plain, plain_history, _, _ = _train(digits, "plain")
    assert not all_finite(plain.weights)  # TerminateOnNaN stops too late
    assert len(plain_history.history["loss"]) == 1

    guarded, history, acc, callbacks = _train(digits, "guarded")
    guard = callbacks[0]
    assert all_finite(guarded.weights)
    assert acc >= clean_acc - 0.02, (acc, clean_acc)
    assert np.isfinite(history.history["loss"]).all()
    # One incident per injected fault: each poisoned batch of each epoch, and
    # the spike (a run of rejected steps, rolled back as one episode).
    assert len(guard.incidents) == len(BAD) * EPOCHS + 1
    rolled = [i for i in guard.incidents if i.action.startswith("rolled back")]
    assert len(rolled) == 1 and rolled[0].step == SPIKE_STEP + 1
    # The three rejected steps after the spike; with batch ends in a worker
    # thread (JAX, torch) the rollback comes at a later batch begin, at most
    # `_MAX_LAG` batches late, and the steps rejected meanwhile join it.
    lag = 0 if BACKEND == "tensorflow" else nan_guard._MAX_LAG
    assert 3 <= rolled[0].steps <= 3 + lag
