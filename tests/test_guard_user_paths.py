"""NaNGuard on more paths users take (issue 18): resuming with
`BackupAndRestore`, path arguments that are not what they should be,
dropout's random stream across a rollback, the snapshot as a Keras weights
file, a learning-rate cut that other callbacks must keep, schedules, and
non-finite validation figures."""

import keras
import numpy as np
from keras import ops

import keras_nanguard as ng
from tests.helpers import (
    BINARY_LOSS,
    binary_data,
)


def _model(optimizer, seed=1, dropout=False):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((6,)), keras.layers.Dense(8, activation="relu")]
    if dropout:
        layers.append(keras.layers.Dropout(0.5, seed=1))
    model = keras.Sequential([*layers, keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss=BINARY_LOSS)
    return model


def _fit(model, data, callbacks, epochs=1, **kwargs):
    return model.fit(
        data, epochs=epochs, verbose=0, shuffle=False, callbacks=callbacks, **kwargs
    )


def _lr(model):
    return np.float32(ops.convert_to_numpy(model.optimizer.learning_rate))


class _InLine(keras.callbacks.Callback):
    """Not async-safe: Keras then calls every batch end on the training
    thread, so NaNGuard acts at the bad batch's end on every backend."""

    def on_train_batch_end(self, batch, logs=None):
        pass


# ----------------------------- finding 13: a rate cut another callback keeps
def test_learning_rate_spike_keeps_a_cut_made_during_the_spike():
    x, y = binary_data()
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[2], target="y")
    model = _model(keras.optimizers.SGD(1e-3))
    spike = ng.faults.LearningRateSpike(at_steps=[2, 3, 4, 5], factor=1000)
    guard = ng.NaNGuard(verbose=0)
    _fit(model, data, [spike, guard])
    (inc,) = guard.incidents
    assert inc.learning_rate == (1.0, 0.5)
    assert "learning rate 1 -> 0.5" in inc.action
    assert _lr(model) == np.float32(5e-4)
