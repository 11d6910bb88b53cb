"""Mixed precision: a step that any layer of the
optimizer stack skips, the LossScaleOptimizer that `compile` adds under
`mixed_float16` included, is a whole-model no-op, counted as a rejected step;
a bad batch costs one rejected step, not a rollback, and leaves the loss
scale as it was, so the run equals the run without that batch."""

import keras
import numpy as np
import pytest

import keras_nanguard as ng
from tests.helpers import BACKEND, all_finite, assert_bit_identical, numpy

BATCH = 8
# batch -> (where, value): NaN and inf in the inputs and in the targets.
BAD = {2: ("x", np.nan), 5: ("y", np.inf), 6: ("x", np.inf), 9: ("y", np.nan)}


class _Batches(keras.utils.PyDataset):
    """The batches of (x, y), with `bad` poisoned (one row each) and `drop`
    left out."""

    def __init__(self, x, y, bad=None, drop=()):
        super().__init__()
        self.x, self.y, self.bad = x, y, bad or {}
        self.keep = [i for i in range(len(x) // BATCH) if i not in drop]

    def __len__(self):
        return len(self.keep)

    def __getitem__(self, i):
        b = self.keep[i]
        s = slice(b * BATCH, (b + 1) * BATCH)
        x, y = self.x[s].copy(), self.y[s].copy()
        if b in self.bad:
            where, value = self.bad[b]
            (x if where == "x" else y)[3, 0] = value
        return x, y


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((96, 4)).astype("float32")
    y = (x[:, :1] * 0.5 - x[:, 1:2]).astype("float32")
    return x, y


def _model(policy, outer_scaler=False):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8),
            keras.layers.BatchNormalization(),
            keras.layers.Activation("relu"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-2))
    compiled = keras.optimizers.LossScaleOptimizer(opt) if outer_scaler else opt
    model.compile(optimizer=compiled, loss="mse")
    return model, opt


def _train(policy, how, data, outer_scaler=False):
    model, opt = _model(policy, outer_scaler)
    callbacks = []
    if how == "attach":
        opt.attach(model)
    else:
        callbacks = [ng.NaNGuard(verbose=0)]
    model.fit(data, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)
    return model, opt, callbacks


CASES = [
    ("mixed_float16", "attach", False),
    ("mixed_float16", "nan_guard", False),
    ("mixed_float16", "nan_guard", True),  # a LossScaleOptimizer of the user's
    ("mixed_bfloat16", "attach", False),
    ("mixed_bfloat16", "nan_guard", False),
]


@pytest.mark.parametrize("policy,how,outer_scaler", CASES)
def test_bad_batches_are_rejected_steps_and_the_run_equals_the_clean_one(
    policy, how, outer_scaler
):
    x, y = _data()
    model, opt, callbacks = _train(policy, how, _Batches(x, y, BAD), outer_scaler)
    clean, clean_opt, _ = _train(policy, how, _Batches(x, y, drop=BAD), outer_scaler)
    scaled = isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert scaled == (policy == "mixed_float16")

    assert all_finite(model.variables)
    assert all_finite(model.optimizer.variables[:2] if scaled else [])
    assert np.isfinite(model.predict(x, verbose=0)).all()
    # Bit for bit the run without the bad batches: weights, BatchNormalization
    # statistics, the inner optimizer's moments and iterations, the scale.
    assert_bit_identical(numpy(clean.weights), numpy(model.weights), "weights")
    assert_bit_identical(
        numpy(clean.optimizer.variables[:2] if scaled else []),
        numpy(model.optimizer.variables[:2] if scaled else []),
        "loss scaler",
    )
    assert_bit_identical(
        numpy(clean_opt.inner_optimizer.variables),
        numpy(opt.inner_optimizer.variables),
        "inner optimizer",
    )
    c, ref = opt.counters(), clean_opt.counters()
    bad_steps = 2 * len(BAD)
    assert c["skipped_steps"] == ref["skipped_steps"] + bad_steps
    assert c["nonfinite_gradient_steps"] == bad_steps
    assert ref["nonfinite_gradient_steps"] == 0
    assert c["loss_scale_steps"] == ref["loss_scale_steps"]  # overflows alike
    assert c["consecutive_skips"] == 0
    assert int(opt.iterations) == 2 * 12 - c["skipped_steps"]
    if how == "nan_guard":
        (guard,) = callbacks
        assert guard.rollbacks == 0
        rejected = [i for i in guard.incidents if i.kind == "rejected_step"]
        assert [i.action for i in guard.incidents] == ["none"] * len(guard.incidents)
        # One rejected step per bad batch; the overflows are the loss
        # scaler's routine, not incidents.
        assert len(rejected) == len(guard.incidents)
        assert sum(i.steps for i in rejected) == bad_steps


def test_an_overflow_halves_the_scale_and_is_counted_apart():
    """Scaled gradients that overflow float16 (a finite loss): the scaler's
    routine, kept as plain Keras does it; counted in `loss_scale_steps`,
    rejected as a whole-model no-op, not a streak."""
    x, y = _data()
    model, opt = _model("mixed_float16")
    model.optimizer.build(model.trainable_variables)
    model.optimizer.dynamic_scale.assign(2.0**40)  # overflows float16 at once
    opt.attach(model)
    bn = model.layers[1]
    before = numpy([bn.moving_mean, bn.moving_variance])
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
    c = opt.counters()
    assert (c["skipped_steps"], c["loss_scale_steps"]) == (1, 1)
    assert (c["consecutive_skips"], c["nonfinite_gradient_steps"]) == (0, 0)
    assert float(model.optimizer.dynamic_scale) == 2.0**39
    assert int(opt.iterations) == 0
    assert_bit_identical(before, numpy([bn.moving_mean, bn.moving_variance]), "bn")
    assert "overflowed" in opt.describe_last_rejection()


def test_a_bad_batch_keeps_the_scale():
    x, y = _data()
    model, opt = _model("mixed_float16")
    opt.attach(model)
    x = x[:BATCH].copy()
    x[0, 0] = np.nan
    model.fit(x, y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
    assert float(model.optimizer.dynamic_scale) == 2.0**15
    assert int(model.optimizer.step_counter) == 0
    c = opt.counters()
    assert (c["skipped_steps"], c["nonfinite_gradient_steps"]) == (1, 1)
    assert (c["loss_scale_steps"], c["consecutive_skips"]) == (0, 1)
    assert opt.describe_last_rejection().startswith("the loss was not finite")


@pytest.mark.skipif(BACKEND == "jax", reason="JAX loops use stateless_commit")
def test_custom_loop_transaction_under_a_loss_scaler():
    """`with opt.transaction(model)` around a step that a LossScaleOptimizer
    skips: no error (torch raised), the forward state put back."""
    x, y = _data()
    model, opt = _model("mixed_float16")
    scaler = model.optimizer
    scaler.build(model.trainable_variables)
    scaler.dynamic_scale.assign(2.0**40)
    bn = model.layers[1]
    before = numpy([bn.moving_mean, bn.moving_variance])
    xb, yb = (
        keras.ops.convert_to_tensor(x[:BATCH]),
        keras.ops.convert_to_tensor(y[:BATCH]),
    )
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with opt.transaction(model):
            with tf.GradientTape() as tape:
                loss = scaler.scale_loss(
                    keras.ops.mean((model(xb, training=True) - yb) ** 2)
                )
            grads = tape.gradient(loss, model.trainable_variables)
            scaler.apply(grads, model.trainable_variables)
    else:
        with opt.transaction(model):
            loss = scaler.scale_loss(
                keras.ops.mean((model(xb, training=True) - yb) ** 2)
            )
            model.zero_grad()
            loss.backward()
            grads = [v.value.grad for v in model.trainable_variables]
            scaler.apply(grads, model.trainable_variables)
    assert_bit_identical(before, numpy([bn.moving_mean, bn.moving_variance]), "bn")
    assert opt.counters()["loss_scale_steps"] == 1
