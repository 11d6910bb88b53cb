"""SafeOptimizer is a transparent wrapper: the public surface of
`keras.optimizers.Optimizer` behaves through it as on the bare inner optimizer.

Each test drives a bare optimizer and a wrapped twin with the same finite
gradients (clipping off, so SafeOptimizer changes nothing) and compares.
"""

import warnings

import keras
import numpy as np
import pytest
from keras import ops

import keras_nanguard as ng
from tests.helpers import BACKEND, FLIGHT_NAMES, assert_bit_identical, numpy


def _twins(make_inner, **safe_kwargs):
    """Two identical models; one trained by `make_inner()`, one by a
    SafeOptimizer around another `make_inner()`."""
    models = []
    for _ in range(2):
        keras.utils.set_random_seed(1)
        models.append(
            keras.Sequential(
                [
                    keras.Input((3,)),
                    keras.layers.Dense(4, bias_initializer="ones", name="hidden"),
                    keras.layers.Dense(2, name="out"),
                ]
            )
        )
    bare = make_inner()
    safe = ng.SafeOptimizer(make_inner(), **safe_kwargs)
    return models[0], bare, models[1], safe


def _grads(model, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return [
        ops.convert_to_tensor(scale * rng.standard_normal(v.shape).astype("float32"))
        for v in model.trainable_variables
    ]


def _step_both(m1, bare, m2, safe, steps, scale=1.0):
    for seed in range(steps):
        bare.apply(_grads(m1, seed, scale), m1.trainable_variables)
        safe.apply(_grads(m2, seed, scale), m2.trainable_variables)


def test_exclude_from_weight_decay_by_name_reaches_the_inner_optimizer():
    make = lambda: keras.optimizers.AdamW(0.05, weight_decay=0.5)  # noqa: E731
    m1, bare, m2, safe = _twins(make)
    bare.exclude_from_weight_decay(var_names=["bias"])
    safe.exclude_from_weight_decay(var_names=["bias"])
    zeros = [ops.zeros(v.shape) for v in m2.trainable_variables]
    for _ in range(3):
        bare.apply(zeros, m1.trainable_variables)
        safe.apply(zeros, m2.trainable_variables)
    # Zero gradients: only weight decay moves weights; the bias is excluded.
    assert numpy([m2.layers[0].bias])[0].tolist() == [1.0] * 4
    assert_bit_identical(numpy(m1.weights), numpy(m2.weights), "weights")


def test_exclude_from_weight_decay_by_variable_reaches_the_inner_optimizer():
    make = lambda: keras.optimizers.AdamW(0.05, weight_decay=0.5)  # noqa: E731
    m1, bare, m2, safe = _twins(make)
    bare.exclude_from_weight_decay(var_list=[m1.layers[0].bias])
    safe.exclude_from_weight_decay(var_list=[m2.layers[0].bias])
    _step_both(m1, bare, m2, safe, 3)
    assert_bit_identical(numpy(m1.weights), numpy(m2.weights), "weights")
    assert_bit_identical(numpy(bare.variables), numpy(safe.inner_optimizer.variables))


def test_attributes_are_the_inner_optimizers():
    inner = keras.optimizers.AdamW(
        0.01,
        weight_decay=0.5,
        use_ema=True,
        ema_momentum=0.9,
        ema_overwrite_frequency=5,
        gradient_accumulation_steps=2,
    )
    safe = ng.SafeOptimizer(inner)
    assert safe.weight_decay == 0.5
    assert safe.use_ema is True
    assert safe.ema_momentum == 0.9
    assert safe.ema_overwrite_frequency == 5
    assert safe.gradient_accumulation_steps == 2
    assert safe.global_clipnorm is None and safe.clipvalue is None
    assert safe.loss_scale_factor is None
    safe.weight_decay = 0.25  # set through the wrapper: the inner's changes
    assert inner.weight_decay == 0.25


def test_variables_are_the_counters_then_the_inner_optimizers():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    safe = ng.SafeOptimizer(keras.optimizers.Adam(0.01))
    safe.build(model.trainable_variables)
    names = [v.name for v in safe.variables]
    counters = list(safe.counters())
    assert names[: len(counters)] == counters
    # Then the quarantine's log (rows, not a number `counters()` reports),
    # then the flight recorder's (made by `build`).
    n = len(counters) + 1
    assert names[n - 1] == "quarantine_log"
    flight = FLIGHT_NAMES
    assert names[n : n + len(flight)] == flight
    n += len(flight)
    inner = safe.inner_optimizer.variables
    assert [id(v) for v in safe.variables[n:]] == [id(v) for v in inner]
    assert "learning_rate" not in names[: len(counters)]
    assert "iteration" not in names[: len(counters)]


def test_set_weights_writes_the_inner_optimizers_state():
    make = lambda: keras.optimizers.Adam(0.05)  # noqa: E731
    m1, bare, m2, safe = _twins(make)
    _step_both(m1, bare, m2, safe, 2)
    moments = [np.full(v.shape, 0.5, v.dtype) for v in bare.variables]
    bare.set_weights(moments)
    safe.set_weights(moments)  # the inner optimizer's list, as from `bare`
    assert_bit_identical(numpy(bare.variables), numpy(safe.inner_optimizer.variables))
    full = [np.array(3, "int32"), *numpy(safe.variables)[1:]]
    safe.set_weights(full)  # or the wrapper's whole list
    assert int(safe.skipped_steps) == 3
    with pytest.raises(ValueError, match=r"one value per variable.*Received: 1 values"):
        safe.set_weights([np.zeros(())])


def test_ema_finalize_matches_the_bare_optimizer():
    make = lambda: keras.optimizers.Adam(  # noqa: E731
        0.05, use_ema=True, ema_momentum=0.5
    )
    m1, bare, m2, safe = _twins(make)
    _step_both(m1, bare, m2, safe, 4)
    bare.finalize_variable_values(m1.trainable_variables)
    safe.finalize_variable_values(m2.trainable_variables)
    assert_bit_identical(numpy(m1.weights), numpy(m2.weights), "weights")


def test_learning_rate_schedule_and_iterations_match():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)
    make = lambda: keras.optimizers.SGD(schedule)  # noqa: E731
    m1, bare, m2, safe = _twins(make)
    _step_both(m1, bare, m2, safe, 3)
    assert int(safe.iterations) == int(bare.iterations) == 3
    assert float(safe.learning_rate) == float(bare.learning_rate) == np.float32(0.0125)
    assert_bit_identical(numpy(m1.weights), numpy(m2.weights), "weights")


def test_learning_rate_set_through_the_wrapper():
    make = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    m1, bare, m2, safe = _twins(make)
    bare.learning_rate = 0.02
    safe.learning_rate = 0.02
    _step_both(m1, bare, m2, safe, 2)
    assert float(safe.inner_optimizer.learning_rate) == pytest.approx(0.02)
    assert_bit_identical(numpy(m1.weights), numpy(m2.weights), "weights")


def test_scale_loss_is_the_inner_optimizers():
    safe = ng.SafeOptimizer(keras.optimizers.SGD(0.1))
    assert float(safe.scale_loss(ops.convert_to_tensor(2.0))) == 2.0


def test_gradient_accumulation_clipnorm_clips_the_applied_gradient():
    # The reference: the inner optimizer's own global clipping, which clips
    # the accumulated (averaged) gradient at each update.
    m1, bare, m2, safe = _twins(
        lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=4),
        clipnorm=1.0,
    )
    bare.global_clipnorm = 1.0
    _step_both(m1, bare, m2, safe, 8, scale=10.0)
    assert int(safe.iterations) == int(bare.iterations) == 2
    assert_bit_identical(numpy(m1.weights), numpy(m2.weights), "weights")
    assert safe.inner_optimizer.global_clipnorm is None  # not changed for good


def test_gradient_accumulation_rejected_micro_step_leaves_no_trace():
    m1, bare, m2, safe = _twins(
        lambda: keras.optimizers.Adam(0.1, gradient_accumulation_steps=2)
    )
    for seed in range(4):
        bare.apply(_grads(m1, seed), m1.trainable_variables)
        safe.apply(_grads(m2, seed), m2.trainable_variables)
        if seed == 1:  # a bad micro-batch between two accumulations
            safe.apply(
                ng.faults.corrupt_gradients(_grads(m2, 9), "nan", 0),
                m2.trainable_variables,
            )
    assert int(safe.skipped_steps) == 1 and int(safe.iterations) == 2
    assert_bit_identical(numpy(m1.weights), numpy(m2.weights), "weights")
    assert_bit_identical(numpy(bare.variables), numpy(safe.inner_optimizer.variables))


def test_own_variables_round_trip():
    make = lambda: keras.optimizers.Adam(0.05)  # noqa: E731
    m1, _, m2, safe = _twins(make)
    safe.apply(_grads(m2, 0), m2.trainable_variables)
    safe.apply(
        ng.faults.corrupt_gradients(_grads(m2, 1), "nan", 0), m2.trainable_variables
    )
    store = {}
    safe.save_own_variables(store)
    assert len(store) == len(safe.variables)
    clone = ng.SafeOptimizer(make())
    clone.build(m1.trainable_variables)
    clone.load_own_variables(store)
    assert_bit_identical(numpy(safe.variables), numpy(clone.variables))
    assert clone.counters()["skipped_steps"] == 1


def test_own_variables_from_version_0_1_load():
    # keras-nanguard 0.1 saved two dead variables of the base class first.
    make = lambda: keras.optimizers.Adam(0.05)  # noqa: E731
    _, _, m2, safe = _twins(make)
    safe.apply(
        ng.faults.corrupt_gradients(_grads(m2, 1), "nan", 0), m2.trainable_variables
    )
    safe.apply(_grads(m2, 2), m2.trainable_variables)  # moments move
    # Its layout: two dead variables, its 11 counters, the inner optimizer's.
    dead = [np.array(0, "int64"), np.array(0.0, "float32")]
    counters = numpy(safe.variables)[:11]
    inner = numpy(safe.inner_optimizer.variables)
    store = {str(i): v for i, v in enumerate(dead + counters + inner)}
    clone = ng.SafeOptimizer(make())
    clone.build(m2.trainable_variables)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "Skipping ... loading"
        clone.load_own_variables(store)
    assert clone.counters()["skipped_steps"] == 1
    assert clone.counters()["accepted_grad_norm"] == 0.0  # new since 0.1
    assert_bit_identical(inner, numpy(clone.inner_optimizer.variables))


def test_the_inner_optimizer_is_not_changed_for_good():
    inner = keras.optimizers.Adam(0.05)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    safe = ng.SafeOptimizer(inner, clipnorm=1.0)
    safe.apply(_grads(model, 0), model.trainable_variables)
    assert "assign_add" not in vars(inner) and "assign_sub" not in vars(inner)
    assert inner.global_clipnorm is None and inner.clipnorm is None


def test_rejection_names_survive_save_and_load(tmp_path):
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, name="out")], name="net"
    )
    safe = ng.SafeOptimizer(keras.optimizers.Adam(0.05))
    model.compile(optimizer=safe, loss="mse")
    x = ng.faults.poison(np.ones((4, 3), "float32"), rows=[0])
    model.fit(x, np.ones((4, 2)), batch_size=4, verbose=0)
    expected = "out/kernel' was not finite (global gradient norm nan)"
    assert "the gradient of 'net/out/kernel" in safe.describe_last_rejection()
    assert safe.describe_last_rejection().endswith(expected)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    # Keras names the loaded variable by its own path ('out/kernel').
    assert loaded.optimizer.describe_last_rejection().endswith(expected)


def test_halt_in_compiled_fit_without_nan_guard_warns_at_the_end():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    safe = ng.SafeOptimizer(keras.optimizers.SGD(0.1), max_consecutive_skips=2)
    model.compile(optimizer=safe, loss="mse")
    x = ng.faults.poison(np.ones((12, 3), "float32"), rows=[0, 4])
    before = numpy(model.weights)
    if BACKEND == "torch":  # eager steps: raised at the second rejection
        with pytest.raises(ng.NonFiniteError, match="max_consecutive_skips=2"):
            model.fit(x, np.ones((12, 1)), batch_size=4, verbose=0, shuffle=False)
    else:
        with pytest.warns(UserWarning, match=r"SafeOptimizer halted: rejected 3 st"):
            model.fit(x, np.ones((12, 1)), batch_size=4, verbose=0, shuffle=False)
    # Nothing applied, not even the good third batch after the halt.
    assert_bit_identical(before, numpy(model.weights), "weights")
    assert int(safe.iterations) == 0
    assert safe.counters()["skipped_steps"] == (2 if BACKEND == "torch" else 3)
