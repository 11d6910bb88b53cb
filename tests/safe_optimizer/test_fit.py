"""SafeOptimizer drop-in for model.fit and custom loops, on every backend."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_nanguard as ng
from tests.helpers import (
    BACKEND,
    WithoutBatches,
    all_finite,
    assert_bit_identical,
    numpy,
)


def _data(n=96, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8)).astype("float32")
    y = (x[:, :1] - x[:, 1:2] > 0).astype("float32")
    return x, y


def _model(seed=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1),
        ]
    )


# Logits: with the torch backend, a probability-space binary cross-entropy
# raises on NaN predictions before any optimizer could act.
LOSS = keras.losses.BinaryCrossentropy(from_logits=True)


FIT_MODES = {
    "default": {},
    "jit_compile": {"jit_compile": True},
    "steps_per_execution": {"steps_per_execution": 2},
    "run_eagerly": {"run_eagerly": True},
}
if BACKEND == "torch":  # Keras allows only steps_per_execution=1 there.
    del FIT_MODES["steps_per_execution"]


# torch.compile (jit_compile=True on torch): ~25 s of Dynamo per test, left
# out of `python -m tests --fast`.
TORCH_COMPILE = pytest.mark.slow if BACKEND == "torch" else ()


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(m, marks=TORCH_COMPILE if m == "jit_compile" else ())
        for m in sorted(FIT_MODES)
    ],
)
def test_fit_rejects_poisoned_batches_and_matches_clean_training(mode):
    x, y = _data()
    bad = [2, 5]
    poisoned = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=bad)
    model = _model()
    opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-2))
    model.compile(optimizer=opt, loss=LOSS, **FIT_MODES[mode])
    model.fit(poisoned, epochs=1, verbose=0, shuffle=False)
    assert poisoned.poisoned == bad
    c = opt.counters()
    assert c["skipped_steps"] == 2 and c["nonfinite_gradient_steps"] == 2
    assert int(opt.iterations) == 4
    assert all_finite(model.weights)

    reference = _model()
    reference.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=LOSS,
        **FIT_MODES[mode],
    )
    reference.fit(WithoutBatches(x, y, 16, bad), epochs=1, verbose=0, shuffle=False)
    assert_bit_identical(numpy(reference.weights), numpy(model.weights), "weights")


def test_train_on_batch():
    x, y = _data(32)
    model = _model()
    opt = ng.SafeOptimizer(keras.optimizers.RMSprop(1e-3), clipnorm=1.0)
    model.compile(optimizer=opt, loss=LOSS)
    model.train_on_batch(x[:16], y[:16])
    before = numpy(model.weights)
    model.train_on_batch(ng.faults.poison(x[16:], rows=[3]), y[16:])
    assert_bit_identical(before, numpy(model.weights), "weights")
    model.train_on_batch(x[16:], y[16:])
    assert opt.counters()["skipped_steps"] == 1 and int(opt.iterations) == 2


def test_nan_sample_poisons_plain_training_but_not_safe_training():
    """The motivating comparison from the issue, as a test."""
    x, y = _data()
    x_bad = ng.faults.poison(x, rows=[20])  # one NaN entry, second batch

    def train(optimizer, callbacks=()):
        model = _model()
        model.compile(optimizer=optimizer, loss=LOSS)
        model.fit(
            x_bad,
            y,
            batch_size=16,
            epochs=1,
            verbose=0,
            shuffle=False,
            callbacks=list(callbacks),
        )
        return model

    clipped = train(keras.optimizers.RMSprop(1e-3, global_clipnorm=1.0))
    assert not all_finite(clipped.weights)
    terminate = train(
        keras.optimizers.RMSprop(1e-3), [keras.callbacks.TerminateOnNaN()]
    )
    assert not all_finite(terminate.weights)
    safe_opt = ng.SafeOptimizer(keras.optimizers.RMSprop(1e-3), clipnorm=1.0)
    safe = train(safe_opt)
    assert all_finite(safe.weights)
    assert safe_opt.counters()["skipped_steps"] == 1
    assert int(safe_opt.iterations) == 5


def _train_1000_steps(optimizer):
    x, y = _data(16 * 250, seed=1)
    model = _model()
    model.compile(optimizer=optimizer, loss=LOSS)
    model.fit(x, y, batch_size=16, epochs=4, verbose=0, shuffle=False)
    return model


@pytest.fixture(scope="module")
def plain_1000_steps_weights():
    """The weights plain Adam ends with after the 1000 clean steps: the
    reference of every `clipnorm` below, trained once."""
    return numpy(_train_1000_steps(keras.optimizers.Adam(1e-3)).weights)


@pytest.mark.slow
@pytest.mark.parametrize("clipnorm", [None, 1e6])
def test_clean_run_of_1000_steps_rejects_nothing_and_is_bit_identical(
    clipnorm, plain_1000_steps_weights
):
    opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-3), clipnorm=clipnorm)
    safe = _train_1000_steps(opt)
    assert int(opt.iterations) == 1000
    assert opt.counters()["skipped_steps"] == 0
    assert opt.counters()["clipped_steps"] == 0
    assert_bit_identical(plain_1000_steps_weights, numpy(safe.weights), "weights")


def test_mixed_float16_model_fit():
    keras.config.set_dtype_policy("mixed_float16")
    x, y = _data()
    model = _model()
    opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-2))
    model.compile(optimizer=opt, loss=LOSS)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert model.optimizer.inner_optimizer is opt
    # The NaN batch is skipped by the loss scaler (scaled gradients not
    # finite); the learning-rate spike is caught only by SafeOptimizer, which
    # checks the update itself.
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[1])
    spike = ng.faults.LearningRateSpike(at_steps=[3], factor=float("inf"))
    model.fit(data, epochs=1, verbose=0, callbacks=[spike])
    assert all_finite(model.weights)
    c = opt.counters()
    assert c["nonfinite_update_steps"] == 1 and c["skipped_steps"] == 1
    assert int(opt.iterations) == 4
    assert float(opt.learning_rate) == pytest.approx(1e-2)


def _tf_loop(model, opt, batches):
    import tensorflow as tf

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = LOSS(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=False))
        return loss

    compiled = tf.function(step)
    for i, (xb, yb) in enumerate(batches):
        (step if i % 2 else compiled)(tf.constant(xb), tf.constant(yb))


def _jax_loop(model, opt, batches):
    import jax

    opt.build(model.trainable_variables)

    def loss_of(tv, ntv, xb, yb):
        pred, ntv = model.stateless_call(tv, ntv, xb, training=True)
        return LOSS(yb, pred), ntv

    @jax.jit
    def train_step(state, xb, yb):
        tv, ntv, ov = state
        (loss, ntv), grads = jax.value_and_grad(loss_of, has_aux=True)(tv, ntv, xb, yb)
        tv, ov = opt.stateless_apply(ov, grads, tv)
        return loss, (tv, ntv, ov)

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in opt.variables],
    )
    for xb, yb in batches:
        _, state = train_step(state, xb, yb)
    for v, value in zip(model.trainable_variables, state[0], strict=True):
        v.assign(value)
    for v, value in zip(opt.variables, state[2], strict=True):
        v.assign(value)


def _torch_loop(model, opt, batches):
    import torch

    for xb, yb in batches:
        model.zero_grad()
        loss = LOSS(torch.as_tensor(yb), model(torch.as_tensor(xb), training=True))
        loss.backward()
        grads = [v.value.grad for v in model.trainable_variables]
        with torch.no_grad():
            opt.apply(grads, model.trainable_variables)


def test_custom_loop_eager_and_compiled():
    """The user's loop: compute grads, then `optimizer.apply_gradients`."""
    x, y = _data(64)
    model = _model()
    opt = ng.SafeOptimizer(keras.optimizers.RMSprop(1e-3), clipnorm=5.0)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    batches[2] = (ng.faults.poison(batches[2][0], rows=[0]), batches[2][1])
    loop = {"tensorflow": _tf_loop, "jax": _jax_loop, "torch": _torch_loop}
    loop[BACKEND](model, opt, batches)

    assert all_finite(model.weights)
    assert opt.counters()["skipped_steps"] == 1
    assert int(opt.iterations) == 3
    assert float(ops.convert_to_numpy(opt.last_grad_norm)) > 0


def _traced_steps(monkeypatch):
    """A list that gets one entry per `GuardedStep._run` traced in a graph
    (TensorFlow: inside a `tf.function`)."""
    import tensorflow as tf

    from keras_nanguard.safe_optimizer.step import GuardedStep

    traced, run = [], GuardedStep._run

    def counted(self, *args, **kwargs):
        if tf.inside_function():
            traced.append(1)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(GuardedStep, "_run", counted)
    return traced


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.function's two traces")
@pytest.mark.parametrize("built", [False, True], ids=["built_in_the_step", "built"])
def test_a_tf_function_step_traces_the_transaction_once(monkeypatch, built):
    """A `tf.function` that makes variables is traced twice, and only its
    second trace runs: the optimizer's build is all the first one does
    (its transaction is traced once). The first step is the transaction's
    all the same: a poisoned first batch is rejected and counted, and the
    weights are bit-identical to those of an optimizer built beforehand."""
    import tensorflow as tf

    x, y = _data(64)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    batches[0] = (ng.faults.poison(batches[0][0], rows=[0]), batches[0][1])
    weights = []
    for prebuild in (True, built):
        model = _model()
        opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-2))
        if prebuild:
            opt.build(model.trainable_variables)
        traced = _traced_steps(monkeypatch)

        @tf.function
        def step(xb, yb, model=model, opt=opt):
            with tf.GradientTape() as tape:
                loss = LOSS(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)
            return loss

        for xb, yb in batches:
            step(tf.constant(xb), tf.constant(yb))
        assert len(traced) == 1
        assert opt.counters()["skipped_steps"] == 1
        assert opt.counters()["nonfinite_gradient_steps"] == 1
        assert int(opt.iterations) == 3
        weights.append(numpy(model.weights))
    assert_bit_identical(weights[0], weights[1], "weights")


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.function's two traces")
@pytest.mark.parametrize(
    "attach", [None, False, True], ids=["compiled", "attached", "quarantine"]
)
def test_a_first_fit_traces_the_transaction_once(monkeypatch, attach):
    """Keras traces its step twice, the first building the optimizer: the
    transaction is traced in the second only, and the first step, a
    poisoned batch, is the transaction's all the same."""
    x, y = _data(64)
    x = ng.faults.poison(x, rows=[0])  # a bad row in the first batch
    model = _model()
    opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-2))
    model.compile(opt, LOSS)
    if attach is not None:
        opt.attach(model, quarantine=attach)
    traced = _traced_steps(monkeypatch)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    assert len(traced) == 1
    counters = opt.counters()
    if attach:  # the row left out of each epoch's first step
        assert (int(opt.iterations), counters["skipped_steps"]) == (8, 0)
        assert int(opt.quarantined_samples) == 2
    else:
        assert (int(opt.iterations), counters["skipped_steps"]) == (6, 2)
    assert all_finite(model.weights)


_PLAIN_GRAPHS: dict = {}  # plain Keras's graph count, for both cases below


@pytest.mark.skipif(BACKEND != "torch", reason="torch.compile (jit_compile=True)")
@pytest.mark.slow  # torch.compile
@pytest.mark.parametrize("guarded", [False, True])
def test_torch_compiled_fit_compiles_as_often_as_plain_keras(guarded):
    # A Python int the step reads and changes, or a NumPy constant, made
    # dynamo recompile every step until its limit, then run eagerly.
    from torch._dynamo.utils import counters

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = x.sum(1, keepdims=True)

    def graphs(optimizer, callbacks=()):
        import torch

        torch._dynamo.reset()
        counters.clear()
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dense(1)]
        )
        model.compile(optimizer=optimizer, loss="mse", jit_compile=True)
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=list(callbacks))
        return counters["stats"]["unique_graphs"]

    if "plain" not in _PLAIN_GRAPHS:  # the same for both cases: counted once
        _PLAIN_GRAPHS["plain"] = graphs(
            keras.optimizers.RMSprop(1e-3, global_clipnorm=1.0)
        )
    plain = _PLAIN_GRAPHS["plain"]
    opt = ng.SafeOptimizer(keras.optimizers.RMSprop(1e-3), clipnorm=1.0)
    if guarded:  # NaNGuard attaches it: a wrapped train_step, compiled too
        safe = graphs(opt, [ng.NaNGuard(verbose=0)])
        # Three more, each compiled once (a step that recompiled would reach
        # dynamo's limit of 8): the wrapper's frame breaks where Keras's
        # layer call reads its signature (a mappingproxy) after the wrapper's
        # Python bookkeeping wrote attributes ("mapping proxy affected by
        # dictionary mutation"), and resumes after it. (Until the torch
        # registration hooks moved to import time, a break at their
        # registration in the first step split the frame earlier: +2.)
        assert safe == plain + 3
    else:
        safe = graphs(opt)
        assert safe == plain
    assert int(opt.iterations) == 32
