"""Every built-in optimizer, every way of calling it: bad steps vanish, good ones
are exactly the inner optimizer's.

The property: SafeOptimizer(inner) fed a stream with bad steps ends every good
step bit-identical to `inner` alone fed the same stream with the bad steps left
out, and a bad step leaves weights and optimizer state bit-identical.
"""

import itertools
import math

import keras
import numpy as np
import pytest
from keras import ops

import keras_nanguard as ng
from tests.helpers import BACKEND, assert_bit_identical, numpy
from tests.models import linear_stack

SCHEDULE = keras.optimizers.schedules.ExponentialDecay(0.05, 2, 0.5)
OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "sgd_weight_decay": lambda: keras.optimizers.SGD(0.05, weight_decay=0.1),
    "adam": lambda: keras.optimizers.Adam(0.05),
    "adam_amsgrad": lambda: keras.optimizers.Adam(0.05, amsgrad=True),
    "adam_schedule": lambda: keras.optimizers.Adam(SCHEDULE),
    "adam_ema": lambda: keras.optimizers.Adam(
        0.05, use_ema=True, ema_overwrite_frequency=3
    ),
    "adam_accumulation": lambda: keras.optimizers.Adam(
        0.05, gradient_accumulation_steps=2
    ),
    "adamw": lambda: keras.optimizers.AdamW(0.05, weight_decay=0.01),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "rmsprop_centered_momentum": lambda: keras.optimizers.RMSprop(
        0.01, momentum=0.5, centered=True
    ),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "nadam": lambda: keras.optimizers.Nadam(0.05),
    "adamax": lambda: keras.optimizers.Adamax(0.05),
    "lion": lambda: keras.optimizers.Lion(0.01),
    "ftrl": lambda: keras.optimizers.Ftrl(0.05, l1_regularization_strength=0.01),
}

MODES = {
    "tensorflow": ["eager", "tf.function", "xla"],
    "jax": ["eager", "jit_stateless"],
    "torch": ["eager"],
}[BACKEND]
# On TensorFlow every optimizer runs in a `tf.function` (the step of its
# `fit`); eagerly and under XLA, the optimizers whose state the transaction
# handles differently (no learning-rate variable, a `cond` and writes to the
# weights inside `apply`, accumulators, momentum alone, Adam's moments): the
# other optimizers there differ from these in Keras's update arithmetic
# only, which the `tf.function` runs, and JAX and torch, every one. Each
# such case a TensorFlow step of ~2 s to trace and compile; skipped, same IDs.
TF_EVERY_MODE = {
    "adam",
    "adam_schedule",
    "adam_ema",
    "adam_accumulation",
    "sgd_momentum",
}


def _cases():
    """(name, mode) of the matrix, the IDs `name-mode`."""
    return [
        pytest.param(
            name,
            mode,
            id=f"{name}-{mode}",
            marks=pytest.mark.skip(
                reason="eager and XLA on TensorFlow: the optimizers of TF_EVERY_MODE"
            )
            if BACKEND == "tensorflow"
            and mode in ("eager", "xla")
            and name not in TF_EVERY_MODE
            else (),
        )
        for mode in MODES
        for name in sorted(OPTIMIZERS)
    ]


# good, good, NaN gradient, good, inf gradient, good, overflowing update, good
STREAM = ["good", "good", "nan", "good", "inf", "good", "overflow", "good", "good"]


def _grads(shapes, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype("float32") for s in shapes]


def _make_step(opt, tv, mode):
    if mode == "eager":
        return lambda grads: opt.apply([ops.convert_to_tensor(g) for g in grads], tv)
    if mode in ("tf.function", "xla"):
        import tensorflow as tf

        fn = tf.function(
            lambda grads: opt.apply(grads, tv), jit_compile=(mode == "xla")
        )
        return lambda grads: fn([tf.constant(g) for g in grads])
    if mode == "jit_stateless":
        import jax

        fn = jax.jit(opt.stateless_apply)

        def step(grads):
            new_tv, new_ov = fn(
                [v.value for v in opt.variables],
                [ops.convert_to_tensor(g) for g in grads],
                [v.value for v in tv],
            )
            for v, value in zip(tv, new_tv, strict=True):
                v.assign(value)
            for v, value in zip(opt.variables, new_ov, strict=True):
                v.assign(value)

        return step
    raise AssertionError(mode)


def _run(make, safe, mode):
    keras.utils.set_random_seed(1)
    model = linear_stack()
    tv = model.trainable_variables
    inner = make()
    opt = ng.SafeOptimizer(inner) if safe else inner
    opt.build(tv)
    step = _make_step(opt, tv, mode)
    shapes = [tuple(v.shape) for v in tv]
    trace = []
    for t, kind in enumerate(STREAM):
        if kind != "good" and not safe:
            continue
        grads = _grads(shapes, t)
        if kind in ("nan", "inf"):
            grads[t % len(grads)][0] = math.nan if kind == "nan" else math.inf
        if kind == "overflow":
            if not isinstance(inner.learning_rate, keras.Variable):
                continue  # a schedule has no learning rate to spike
            with ng.faults.learning_rate_spike(inner, math.inf):
                step(grads)
        else:
            step(grads)
        trace.append((kind, numpy(tv), numpy(inner.variables)))
    return trace, opt


@pytest.mark.parametrize(("name", "mode"), _cases())
def test_bad_steps_vanish_and_good_steps_match_the_inner_optimizer(name, mode):
    make = OPTIMIZERS[name]
    safe_trace, opt = _run(make, True, mode)
    plain_trace, _ = _run(make, False, mode)

    good = [entry for entry in safe_trace if entry[0] == "good"]
    assert len(good) == len(plain_trace) == STREAM.count("good")
    for i, ((_, w, s), (_, pw, ps)) in enumerate(zip(good, plain_trace, strict=True)):
        assert_bit_identical(pw, w, f"weights after good step {i}")
        assert_bit_identical(ps, s, f"optimizer state after good step {i}")
    for prev, entry in itertools.pairwise(safe_trace):
        if entry[0] != "good":
            assert_bit_identical(prev[1], entry[1], f"weights after {entry[0]} step")
            assert_bit_identical(prev[2], entry[2], f"state after {entry[0]} step")

    rejected = len(safe_trace) - len(good)
    c = opt.counters()
    assert c["skipped_steps"] == rejected
    assert c["nonfinite_gradient_steps"] == 2
    assert c["nonfinite_update_steps"] == rejected - 2
    assert rejected == (
        3 if isinstance(opt.inner_optimizer.learning_rate, keras.Variable) else 2
    )
    assert c["consecutive_skips"] == 0
