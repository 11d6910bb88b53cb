"""The model's side of SafeOptimizer's transaction, `ModelTransaction`, on its
own: a model compiled with a plain optimizer that holds the counters, and
the counters set by hand where a step would set them."""

import warnings

import keras
import numpy as np
import pytest
from keras import ops

from keras_nanguard.safe_optimizer import patches
from keras_nanguard.safe_optimizer.counters import Counters
from keras_nanguard.safe_optimizer.model_transaction import ModelTransaction
from keras_nanguard.safe_optimizer.optimizer import ARGUMENTS
from tests.helpers import assert_bit_identical, numpy


def _model():
    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.BatchNormalization(), keras.layers.Dense(1)]
    )
    model.build((None, 2))
    return model


def _side(model=None, **settings):
    holder = keras.optimizers.SGD(0.1)
    counters = Counters.create(holder, ARGUMENTS.of(**settings))
    if model is not None:
        model.compile(optimizer=holder, loss="mse")
    return (
        ModelTransaction(holder, counters, ARGUMENTS.of(**settings)),
        counters,
        holder,
    )


def _statistics(model):
    return numpy(model.non_trainable_variables)


def _forward(model):
    model(np.full((4, 2), 3.0, "float32"), training=True)


def test_attach_wraps_the_train_step_and_detach_gives_the_class_step_back():
    model = _model()
    side, _, holder = _side(model)
    assert side.saved_as_attached() is False
    side.attach(model)
    assert patches.owner_of(model, "train_step") is holder
    assert side.attached is True and side.saved_as_attached() is True
    side.attach(model)  # twice: one wrapper
    assert patches.original_of(model, "train_step").__func__ is type(model).train_step
    side.detach(model)
    assert "train_step" not in vars(model)
    assert side.attached is False


def test_a_step_the_user_set_is_kept_through_attach_and_detach():
    model = _model()
    side, _, _ = _side(model)
    keras_step = model.train_step

    def own(*args):
        return keras_step(*args)

    model.train_step = own
    side.attach(model)
    assert patches.original_of(model, "train_step") is own
    side.detach(model)
    assert vars(model)["train_step"] is own


def test_attach_refuses_what_is_not_a_model_and_another_optimizers_model():
    side, _, _ = _side()
    with pytest.raises(TypeError, match=r"must be a `keras\.Model`"):
        side.attach("model")
    model = _model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(ValueError, match="compiled with another optimizer"):
        side.attach(model)


def test_saved_attached_is_kept_after_a_detach():
    side, _, _ = _side()
    side.expects_attach = True
    assert side.saved_as_attached() is True


def test_a_rejected_step_puts_the_forward_state_back():
    model = _model()
    side, counters, _ = _side(model)
    before = _statistics(model)
    with side.transaction(model):
        _forward(model)
        side.step_begins(model.trainable_variables)
        counters.consecutive_skips.assign(1)  # the step's verdict: rejected
    assert_bit_identical(before, _statistics(model), "statistics")


def test_an_accepted_step_keeps_the_forward_state():
    model = _model()
    side, _, _ = _side(model)
    with side.transaction(model):
        _forward(model)
        side.step_begins(model.trainable_variables)
    moving_mean = model.layers[0].moving_mean
    assert ops.convert_to_numpy(moving_mean).tolist() == pytest.approx([0.03, 0.03])


def test_a_transaction_without_a_step_raises_and_puts_the_state_back():
    model = _model()
    side, _, _ = _side(model)
    before = _statistics(model)
    with (
        pytest.raises(RuntimeError, match="No step of this SafeOptimizer ran"),
        side.transaction(model),
    ):
        _forward(model)
    assert_bit_identical(before, _statistics(model), "statistics")
    assert side.model is None


def test_a_step_of_another_models_variables_is_refused():
    model, other = _model(), _model()
    side, _, _ = _side(model)
    with pytest.raises(ValueError, match="not `model`'s"), side.transaction(model):
        side.step_begins(other.trainable_variables)
    assert side.applied is False


def test_an_unbuilt_model_has_no_transaction():
    model = keras.Sequential([keras.layers.Dense(1)])
    side, _, _ = _side(model)
    with pytest.raises(ValueError, match="needs a built model"):
        side.transaction(model)


def test_stateless_commit_selects_by_consecutive_skips():
    side, counters, holder = _side()
    values = [v.value for v in holder.variables]
    before, after = [ops.zeros(2)], [ops.ones(2)]
    kept = side.stateless_commit(values, before, after)
    assert ops.convert_to_numpy(kept[0]).tolist() == [1.0, 1.0]
    index = [id(v) for v in holder.variables].index(id(counters.consecutive_skips))
    values[index] = ops.convert_to_tensor(1, "int32")
    kept = side.stateless_commit(values, before, after)
    assert ops.convert_to_numpy(kept[0]).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="one value per variable"):
        side.stateless_commit(values[:-1], before, after)


def test_a_step_outside_a_transaction_warns_once_when_saved_attached():
    side, _, _ = _side()
    side.expects_attach = True
    variables = [keras.Variable(1.0)]
    with pytest.warns(UserWarning, match="not attached now"):
        side.step_begins(variables)
    assert side.applied is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        side.step_begins(variables)  # once only


def test_an_attached_model_is_freed_with_its_optimizer():
    # What `attach` set on the model (and what it replaced) lives on the
    # model: nothing of ours keeps an attached model, or its optimizer, alive.
    import gc
    import weakref

    import keras_nanguard as ng

    def trained():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1))
        model.compile(optimizer=opt, loss="mse")
        opt.attach(model, quarantine=True)
        model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
        assert patches.owner_of(model, "train_step") is opt
        return weakref.ref(model), weakref.ref(opt)

    model, opt = trained()
    gc.collect()
    assert (model(), opt()) == (None, None)
