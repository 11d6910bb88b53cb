"""The whole-model transaction on everyday paths:
`run_eagerly`, training with another optimizer after an attach, `detach`, a
transaction around another model's step, and a model loaded from `.keras`."""

import warnings

import keras
import numpy as np
import pytest

import keras_nanguard as ng
from tests.helpers import BACKEND, all_finite, assert_bit_identical, numpy


def _bn_model(optimizer, seed=1):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(6),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(1),
        ]
    )
    if optimizer is not None:
        model.compile(optimizer=optimizer, loss="mse")
    return model


def _data(bad_row=None):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 4)).astype("float32")
    y = x[:, :1] - x[:, 1:2]
    if bad_row is not None:
        x[bad_row, 0] = np.nan
    return x, y


def _bn(model):
    layer = model.layers[1]
    return numpy([layer.moving_mean, layer.moving_variance])


# ------------------------------------------------- finding 3: run_eagerly
@pytest.mark.parametrize("how", ["attach", "nan_guard"])
def test_run_eagerly_trains_and_rejects_like_the_compiled_step(how):
    x, y = _data(bad_row=9)
    results = []
    for eager in (False, True):
        opt = ng.SafeOptimizer(keras.optimizers.SGD(0.05))
        model = _bn_model(None)
        model.compile(optimizer=opt, loss="mse", run_eagerly=eager)
        callbacks = [ng.NaNGuard(verbose=0)] if how == "nan_guard" else []
        if how == "attach":
            opt.attach(model)
        history = model.fit(
            x, y, batch_size=8, verbose=0, shuffle=False, callbacks=callbacks
        )
        assert opt.counters()["skipped_steps"] == 1
        assert int(opt.iterations) == 3
        assert history.history["nanguard_rejected_steps"] == [1.0]
        assert all_finite(model.variables)
        results.append(numpy(model.weights))
    for a, b in zip(*results, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# -------------------------------------------- finding 4: another optimizer
@pytest.mark.parametrize("how", ["attach", "nan_guard"])
def test_after_an_attach_the_model_trains_with_another_optimizer(how):
    x, y = _data()
    model = _bn_model(ng.SafeOptimizer(keras.optimizers.SGD(0.05)))
    if how == "attach":
        model.optimizer.attach(model)
        model.fit(x, y, batch_size=8, verbose=0)
    else:
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[ng.NaNGuard(verbose=0)])
    reference = _bn_model(None)
    reference.set_weights(model.get_weights())
    # Fine-tuning with a plain optimizer: the same as a model never attached.
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    reference.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
    reference.fit(x, y, batch_size=8, verbose=0, shuffle=False)
    assert_bit_identical(numpy(reference.weights), numpy(model.weights), "weights")


def test_detach_gives_the_model_its_own_step_back():
    x, y = _data(bad_row=3)
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.05))
    model = _bn_model(opt)
    opt.attach(model)
    before = _bn(model)
    model.fit(x[:8], y[:8], batch_size=8, verbose=0)
    assert_bit_identical(before, _bn(model), "attached: statistics kept")
    opt.detach(model)
    assert "train_step" not in vars(model)
    opt.detach(model)  # a second time: nothing to undo
    model.fit(x[:8], y[:8], batch_size=8, verbose=0)
    # Detached, the optimizer keeps the weights, not the forward pass's state.
    assert not np.isfinite(_bn(model)[0]).all()
    assert all_finite(model.trainable_variables)
    assert opt.counters()["skipped_steps"] == 2


def test_detach_keeps_a_train_step_the_user_had_set():
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.05))
    model = _bn_model(opt)
    own = model.train_step
    model.train_step = lambda *args: own(*args)
    mine = model.train_step
    opt.attach(model)
    assert model.train_step is not mine
    opt.detach(model)
    assert model.train_step is mine


# --------------------------------- finding 5: a transaction around another model
@pytest.mark.skipif(BACKEND == "jax", reason="JAX loops use stateless_commit")
def test_a_transaction_refuses_a_step_of_another_model():
    x, _ = _data()
    model_a, model_b = _bn_model(None, seed=1), _bn_model(None, seed=2)
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1))
    opt.build(model_a.trainable_variables)
    grads = [keras.ops.full(v.shape, np.nan) for v in model_a.trainable_variables]
    weights_a, weights_b = numpy(model_a.weights), numpy(model_b.weights)
    refused = pytest.raises(ValueError, match=r"not `model`'s.*Received: model=")
    with refused, opt.transaction(model_b):
        model_b(x, training=True)
        opt.apply(grads, model_a.trainable_variables)
    # Nothing was applied, and model_b's forward pass was put back.
    assert_bit_identical(weights_a, numpy(model_a.weights), "model_a")
    assert_bit_identical(weights_b, numpy(model_b.weights), "model_b")
    assert opt.counters()["skipped_steps"] == 0
    # The model's own step still runs.
    with opt.transaction(model_a):
        model_a(x, training=True)
        opt.apply(grads, model_a.trainable_variables)
    assert opt.counters()["skipped_steps"] == 1
    assert_bit_identical(weights_a, numpy(model_a.weights), "model_a, rejected")


# -------------------------------------------- finding 6: a loaded model
def test_a_loaded_model_warns_that_it_is_not_attached(tmp_path):
    x, y = _data(bad_row=3)
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.05))
    model = _bn_model(opt)
    opt.attach(model)
    model.fit(x, y, batch_size=8, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    with pytest.warns(UserWarning, match=r"not attached now.*attach\(model\)"):
        loaded.fit(x[8:16], y[8:16], batch_size=8, verbose=0)
    # Attached again (NaNGuard does it), it trains guarded and quietly.
    loaded = keras.saving.load_model(path)
    loaded.optimizer.attach(loaded)
    before = _bn(loaded)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded.fit(x[:8], y[:8], batch_size=8, verbose=0)
    assert_bit_identical(before, _bn(loaded), "statistics after a rejected step")
    assert loaded.optimizer.get_config()["attached"] is True


def test_a_never_attached_optimizer_does_not_warn_after_loading(tmp_path):
    x, y = _data()
    model = _bn_model(ng.SafeOptimizer(keras.optimizers.SGD(0.05)))
    model.fit(x, y, batch_size=8, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert loaded.optimizer.get_config()["attached"] is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded.fit(x, y, batch_size=8, verbose=0)
