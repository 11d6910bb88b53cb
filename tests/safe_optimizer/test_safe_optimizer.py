"""SafeOptimizer, step by step: counters, rollback, clipping, escalation, errors."""

import math

import keras
import numpy as np
import pytest
from keras import ops

import keras_nanguard as ng
from tests.helpers import BACKEND, assert_bit_identical, inner_state, numpy


def _model():
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, activation="relu", name="hidden"),
            keras.layers.Dense(2, name="out"),
        ]
    )
    return model


def _grads(model, scale=1.0, seed=0):
    rng = np.random.default_rng(seed)
    return [
        ops.convert_to_tensor(scale * rng.standard_normal(v.shape).astype("float32"))
        for v in model.trainable_variables
    ]


def _state(model, opt):
    return numpy(model.trainable_variables), inner_state(opt)


def test_scenario_good_nan_inf_good():
    model = _model()
    opt = ng.SafeOptimizer(keras.optimizers.Adam(0.1), clipnorm=100.0)
    tv = model.trainable_variables

    opt.apply(_grads(model), tv)  # 1: good
    c = opt.counters()
    assert (c["skipped_steps"], c["consecutive_skips"], int(opt.iterations)) == (
        0,
        0,
        1,
    )
    assert c["last_grad_norm"] == pytest.approx(
        float(np.sqrt(sum((g**2).sum() for g in numpy(_grads(model))))), rel=1e-6
    )

    before = _state(model, opt)
    opt.apply(ng.faults.corrupt_gradients(_grads(model, seed=1), "nan", 2), tv)  # 2
    assert_bit_identical(before[0], numpy(tv), "weights")
    assert_bit_identical(before[1], inner_state(opt), "optimizer state")
    c = opt.counters()
    assert c["skipped_steps"] == 1
    assert c["consecutive_skips"] == 1
    assert c["nonfinite_gradient_steps"] == 1
    assert c["nonfinite_update_steps"] == 0
    assert c["last_rejection"] == 1
    assert c["last_nonfinite_index"] == 2  # out/kernel
    assert math.isnan(c["last_grad_norm"])
    assert int(opt.iterations) == 1
    assert "'sequential/out/kernel'" in opt.describe_last_rejection()

    opt.apply(ng.faults.corrupt_gradients(_grads(model, seed=2), "inf", 0), tv)  # 3
    assert_bit_identical(before[0], numpy(tv), "weights")
    assert_bit_identical(before[1], inner_state(opt), "optimizer state")
    c = opt.counters()
    assert (c["skipped_steps"], c["consecutive_skips"]) == (2, 2)
    assert c["nonfinite_gradient_steps"] == 2
    assert c["last_nonfinite_index"] == 0
    assert math.isinf(c["last_grad_norm"])

    opt.apply(_grads(model, seed=3), tv)  # 4: good again
    c = opt.counters()
    assert (c["skipped_steps"], c["consecutive_skips"], int(opt.iterations)) == (
        2,
        0,
        2,
    )
    assert not np.array_equal(before[0][0], numpy(tv)[0])
    # The last rejection stays on record after a good step.
    assert c["last_rejection"] == 1 and c["last_nonfinite_index"] == 0


def test_update_overflow_with_finite_gradients_is_rolled_back():
    model = _model()
    opt = ng.SafeOptimizer(keras.optimizers.SGD(1e38))
    tv = model.trainable_variables
    before = _state(model, opt)
    grads = [ops.full(v.shape, 10.0) for v in tv]  # finite; lr * g = 1e39 = inf
    opt.apply(grads, tv)
    assert_bit_identical(before[0], numpy(tv), "weights")
    assert_bit_identical(before[1], inner_state(opt), "optimizer state")
    c = opt.counters()
    assert c["skipped_steps"] == 1
    assert c["nonfinite_gradient_steps"] == 0
    assert c["nonfinite_update_steps"] == 1
    assert c["last_rejection"] == 2
    assert c["last_grad_norm"] == pytest.approx(10.0 * math.sqrt(3 * 4 + 4 + 4 * 2 + 2))
    assert "learning rate is probably too high" in opt.describe_last_rejection()


def test_optimizer_state_overflow_is_rolled_back():
    # Finite gradients of 1e25: Adam's second moment g**2 overflows to inf
    # while its weight update stays finite; the new *state* is what is bad.
    model = _model()
    opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-3))
    tv = model.trainable_variables
    opt.apply(_grads(model), tv)
    before = _state(model, opt)
    opt.apply(_grads(model, scale=1e25), tv)
    assert_bit_identical(before[0], numpy(tv), "weights")
    assert_bit_identical(before[1], inner_state(opt), "optimizer state")
    c = opt.counters()
    assert (c["nonfinite_gradient_steps"], c["nonfinite_update_steps"]) == (0, 1)
    assert "optimizer variable" in opt.describe_last_rejection()


def test_a_lone_nan_in_a_large_update_is_rolled_back():
    # Adagrad with epsilon=0 and no initial accumulator divides 0 by 0 where
    # a gradient entry is 0: NaN there, finite elsewhere, no inf. In a 64x64
    # kernel (XLA:CPU's fused max reduction drops NaN from 4096 entries on)
    # the one NaN row must still reject the step, in `fit`'s compiled step.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64)])
    inner = keras.optimizers.Adagrad(0.1, initial_accumulator_value=0.0, epsilon=0.0)
    opt = ng.SafeOptimizer(inner)
    model.compile(optimizer=opt, loss="mse")
    x = np.random.default_rng(0).normal(size=(8, 64)).astype("float32")
    x[:, 5] = 0.0  # row 5 of the kernel gets a zero gradient
    before = numpy(model.weights)
    model.train_on_batch(x, np.ones((8, 64), "float32"))
    assert_bit_identical(before, numpy(model.weights), "weights")
    c = opt.counters()
    assert (c["skipped_steps"], c["nonfinite_update_steps"]) == (1, 1)
    assert "kernel" in opt.describe_last_rejection()


def test_large_finite_gradients_are_not_mistaken_for_infinite():
    model = _model()
    opt = ng.SafeOptimizer(keras.optimizers.SGD(1e-30), clipnorm=1.0)
    tv = model.trainable_variables
    grads = _grads(model, scale=1e20)  # squares overflow float32
    expected = math.sqrt(
        sum(float((g.astype("float64") ** 2).sum()) for g in numpy(grads))
    )
    opt.apply(grads, tv)
    c = opt.counters()
    assert c["skipped_steps"] == 0 and c["clipped_steps"] == 1
    assert c["last_grad_norm"] == pytest.approx(expected, rel=1e-5)
    assert int(opt.iterations) == 1


def test_clipnorm_clips_the_global_norm():
    model = _model()
    tv = model.trainable_variables
    before = numpy(tv)
    opt = ng.SafeOptimizer(keras.optimizers.SGD(1.0), clipnorm=0.5)
    opt.apply(_grads(model, scale=3.0), tv)
    delta = [b - a for a, b in zip(numpy(tv), before, strict=True)]  # = clipped grads
    norm = math.sqrt(sum(float((d.astype("float64") ** 2).sum()) for d in delta))
    assert norm == pytest.approx(0.5, rel=1e-5)
    assert opt.counters()["clipped_steps"] == 1
    # Below the threshold nothing is scaled and the step is not counted.
    opt.apply(_grads(model, scale=1e-3), tv)
    assert opt.counters()["clipped_steps"] == 1


def test_lr_backoff_lowers_then_recovers():
    model = _model()
    inner = keras.optimizers.SGD(0.1)
    opt = ng.SafeOptimizer(
        inner, lr_backoff=0.5, lr_recovery_steps=2, min_lr_scale=0.25
    )
    tv = model.trainable_variables
    bad = ng.faults.corrupt_gradients(_grads(model), "nan")
    scales = []
    for step in ["bad", "bad", "bad", "good", "good", "good", "good"]:
        opt.apply(bad if step == "bad" else _grads(model), tv)
        scales.append(float(opt.lr_scale))
    assert scales == [0.5, 0.25, 0.25, 0.25, 0.5, 0.5, 1.0]
    # The inner learning rate itself is untouched between steps.
    assert float(inner.learning_rate) == pytest.approx(0.1)

    # The scaled learning rate is what the inner optimizer used.
    opt.apply(bad, tv)  # scale 0.5
    w = numpy(tv)
    g = _grads(model, seed=7)
    opt.apply(g, tv)
    np.testing.assert_allclose(numpy(tv)[0], w[0] - 0.05 * numpy(g)[0], rtol=1e-6)


def test_max_consecutive_skips_halts_and_raises_in_eager_steps():
    model = _model()
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1), max_consecutive_skips=2)
    tv = model.trainable_variables
    bad = ng.faults.corrupt_gradients(_grads(model), "nan", 1)
    opt.apply(bad, tv)
    with pytest.raises(
        ng.NonFiniteError, match=r"rejected 2 steps in a row.*'sequential/hidden/bias'"
    ):
        opt.apply(bad, tv)
    before = _state(model, opt)
    # Halted: even a good step is rejected, nothing bad or good is applied.
    with pytest.raises(ng.NonFiniteError):
        opt.apply(_grads(model), tv)
    assert_bit_identical(before[0], numpy(tv), "weights")
    assert opt.counters()["skipped_steps"] == 3
    # Resetting the streak (what NaNGuard's rollback does) resumes training.
    opt.consecutive_skips.assign(0)
    opt.apply(_grads(model), tv)
    assert int(opt.iterations) == 1


def test_max_consecutive_skips_in_model_fit_halts_without_applying():
    model = _model()
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1), max_consecutive_skips=2)
    model.compile(optimizer=opt, loss="mse")
    x = ng.faults.poison(np.ones((16, 3), "float32"), rows=range(16))
    y = np.zeros((16, 2), "float32")
    before = numpy(model.trainable_variables)
    if BACKEND == "torch":  # eager steps: raised at the second rejection
        with pytest.raises(ng.NonFiniteError, match="max_consecutive_skips=2"):
            model.fit(x, y, batch_size=4, verbose=0)
    else:
        model.fit(x, y, batch_size=4, verbose=0)
    assert_bit_identical(before, numpy(model.trainable_variables), "weights")
    assert opt.counters()["skipped_steps"] == (2 if BACKEND == "torch" else 4)
    assert int(opt.iterations) == 0
    with pytest.raises(ng.NonFiniteError, match="max_consecutive_skips=2"):
        opt.check_halted()


def test_none_gradients_are_skipped_like_keras():
    model = _model()
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1))
    tv = model.trainable_variables
    grads = _grads(model)
    grads[1] = None
    with pytest.warns(UserWarning, match="Gradients do not exist"):
        opt.apply(grads, tv)
    assert opt.counters()["skipped_steps"] == 0 and int(opt.iterations) == 1


def test_learning_rate_and_iterations_read_and_set_through():
    inner = keras.optimizers.Adam(1e-3)
    opt = ng.SafeOptimizer(inner)
    opt.learning_rate = 5e-4
    assert float(inner.learning_rate) == pytest.approx(5e-4)
    assert float(opt.learning_rate) == pytest.approx(5e-4)
    opt.iterations = 7
    assert int(inner.iterations) == 7 and int(opt.iterations) == 7
    assert opt.inner_optimizer is inner


def test_string_optimizer_is_resolved():
    opt = ng.SafeOptimizer("adam")
    assert isinstance(opt.inner_optimizer, keras.optimizers.Adam)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"optimizer": 3}, TypeError, r"`optimizer` must be .*Received: optimizer=3"),
        (
            {"optimizer": "no-such-opt"},
            ValueError,
            r"Received: optimizer='no-such-opt'",
        ),
        (
            {"clipnorm": 0.0},
            ValueError,
            r"`clipnorm` must be a finite number > 0.*clipnorm=0.0",
        ),
        ({"clipnorm": -1}, ValueError, r"clipnorm=-1"),
        ({"clipnorm": float("inf")}, ValueError, r"clipnorm=inf"),
        (
            {"clipnorm": "1.0"},
            TypeError,
            r"`clipnorm` must be a positive number.*'1.0'",
        ),
        ({"clipnorm": True}, TypeError, r"clipnorm=True"),
        (
            {"lr_backoff": 1.0},
            ValueError,
            r"`lr_backoff` must be in \(0, 1\).*lr_backoff=1.0",
        ),
        ({"lr_backoff": 0}, ValueError, r"lr_backoff=0"),
        ({"lr_recovery_steps": 0}, ValueError, r"lr_recovery_steps=0"),
        ({"min_lr_scale": 2.0}, ValueError, r"min_lr_scale=2.0"),
        ({"max_consecutive_skips": 0}, ValueError, r"max_consecutive_skips=0"),
        ({"max_consecutive_skips": 2.5}, TypeError, r"max_consecutive_skips=2.5"),
        (
            {"global_clipnorm": 1.0},
            TypeError,
            r"unknown keyword arguments \['global_clipnorm'\].*clips by global norm",
        ),
        (
            {"foo": 1},
            TypeError,
            r"unknown keyword arguments \['foo'\]\. Received: foo=1$",
        ),
        (
            {"learning_rate": 1e-3},
            TypeError,
            r"\['learning_rate'\]\. `learning_rate` is an argument of the inner "
            r"optimizer: pass it there, e\.g\. SafeOptimizer\(SGD\(learning_rate"
            r"=\.\.\.\)\)\. Received: learning_rate=0\.001$",
        ),
        (  # the inner class's own arguments and the base class's, not `foo`
            {"momentum": 0.9, "weight_decay": 1e-4, "foo": 1},
            TypeError,
            r"`momentum`, `weight_decay` are arguments of the inner optimizer: "
            r"pass them there, e\.g\. SafeOptimizer\(SGD\(momentum=\.\.\., "
            r"weight_decay=\.\.\.\)\)\. Received: momentum=0\.9, "
            r"weight_decay=0\.0001, foo=1$",
        ),
        (
            {"optimizer": keras.optimizers.Adam(), "beta_1": 0.8},
            TypeError,
            r"`beta_1` is an argument of the inner optimizer: pass it there, "
            r"e\.g\. SafeOptimizer\(Adam\(beta_1=\.\.\.\)\)",
        ),
    ],
)
def test_bad_arguments_get_clear_errors(kwargs, error, match):
    kwargs = dict(kwargs)
    optimizer = kwargs.pop("optimizer", keras.optimizers.SGD(0.1))
    with pytest.raises(error, match=match):
        ng.SafeOptimizer(optimizer, **kwargs)


def test_clipping_on_both_wrapper_and_inner_is_refused():
    with pytest.raises(
        ValueError, match=r"not both.*clipnorm=1.0.*'global_clipnorm': 2.0"
    ):
        ng.SafeOptimizer(keras.optimizers.SGD(0.1, global_clipnorm=2.0), clipnorm=1.0)
    # Clipping on the inner alone is allowed: it runs after the check.
    ng.SafeOptimizer(keras.optimizers.SGD(0.1, clipvalue=2.0))


def test_wrapping_twice_and_loss_scale_inside_are_refused():
    with pytest.raises(ValueError, match="already a SafeOptimizer"):
        ng.SafeOptimizer(ng.SafeOptimizer(keras.optimizers.SGD(0.1)))
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match=r"LossScaleOptimizer\(SafeOptimizer"):
        ng.SafeOptimizer(lso)
    with pytest.raises(ValueError, match="loss_scale_factor=128"):
        ng.SafeOptimizer(keras.optimizers.SGD(0.1, loss_scale_factor=128))


def test_lr_backoff_needs_a_float_learning_rate():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    with pytest.raises(ValueError, match="not a schedule"):
        ng.SafeOptimizer(keras.optimizers.SGD(schedule), lr_backoff=0.5)


def test_mismatched_lengths_are_refused():
    model = _model()
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="same length"):
        opt.apply(_grads(model)[:2], model.trainable_variables)
