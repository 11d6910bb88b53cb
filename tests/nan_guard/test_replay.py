"""The batch of an incident, kept from `replay=(x, y)` and diagnosed: the one
bad batch, also inside an execution of `steps_per_execution` steps, or the
whole execution when which of its steps went bad is unknown."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_nanguard as ng
from tests.helpers import BACKEND, binary_data, fit_quietly
from tests.models import guard_model as _model


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
