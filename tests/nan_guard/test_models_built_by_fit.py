"""Models that `fit` builds (a Sequential without `Input`, a subclassed
model) under NaNGuard: trained as without it, rolled back to their first
snapshot (on TensorFlow, taken after step 0: the model has no variables at
train begin), and a bad first step with a SafeOptimizer or a plain one."""

import keras
import pytest

import keras_nanguard as ng
from tests.helpers import (
    BACKEND,
    WithoutBatches,
    all_finite,
    assert_bit_identical,
    binary_data,
    fit_quietly,
    numpy,
)
from tests.models import guard_model as _model


class _Weights(keras.callbacks.Callback):
    """Listed after NaNGuard: the weights at train begin (when they exist) and
    after every batch."""

    def on_train_begin(self, logs=None):
        self.at_begin = numpy(self.model.weights) if self.model.weights else None
        self.after = []

    def on_train_batch_end(self, batch, logs=None):
        self.after.append(numpy(self.model.weights))


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
