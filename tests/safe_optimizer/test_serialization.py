"""Every public class serializes: get_config/from_config and a .keras round trip.
Files saved by 0.1 and 0.2 (`tests/fixtures/`) load and train on."""

import os

import keras
import numpy as np
import pytest

import keras_nanguard as ng
from tests.helpers import (
    BACKEND,
    FIXTURES,
    FLIGHT_NAMES,
    all_finite,
    assert_bit_identical,
    numpy,
)


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 5)).astype("float32")
    y = x @ rng.standard_normal((5, 1)).astype("float32")
    return x, y


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )


def test_safe_optimizer_config_round_trip():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    opt = ng.SafeOptimizer(
        keras.optimizers.Adam(schedule, use_ema=True),
        clipnorm=2.5,
        max_consecutive_skips=7,
        name="guarded",
    )
    config = opt.get_config()
    assert config["clipnorm"] == 2.5 and config["max_consecutive_skips"] == 7
    clone = ng.SafeOptimizer.from_config(config)
    assert clone.get_config() == config
    assert isinstance(clone.inner_optimizer, keras.optimizers.Adam)
    assert clone.inner_optimizer.use_ema
    # Through Keras's own (de)serialization, found by its registered name.
    revived = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(revived, ng.SafeOptimizer)
    assert revived.get_config() == config


def test_lr_backoff_config_round_trip():
    opt = ng.SafeOptimizer(
        keras.optimizers.SGD(0.1),
        lr_backoff=0.5,
        lr_recovery_steps=9,
        min_lr_scale=0.01,
    )
    clone = ng.SafeOptimizer.from_config(opt.get_config())
    assert (clone.lr_backoff, clone.lr_recovery_steps, clone.min_lr_scale) == (
        0.5,
        9,
        0.01,
    )


def test_keras_file_round_trip_restores_wrapper_inner_and_counters(tmp_path):
    x, y = _data()
    poisoned = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[1])
    model = _model()
    opt = ng.SafeOptimizer(keras.optimizers.RMSprop(1e-2), clipnorm=1.0, lr_backoff=0.5)
    model.compile(optimizer=opt, loss="mse")
    model.fit(poisoned, epochs=2, verbose=0, shuffle=False)
    assert opt.counters()["skipped_steps"] == 2

    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)  # no custom_objects needed
    lopt = loaded.optimizer
    assert isinstance(lopt, ng.SafeOptimizer)
    assert isinstance(lopt.inner_optimizer, keras.optimizers.RMSprop)
    assert lopt.get_config() == opt.get_config()
    np.testing.assert_equal(lopt.counters(), opt.counters())  # NaN == NaN
    assert int(lopt.iterations) == int(opt.iterations) == 6
    assert_bit_identical(numpy(model.weights), numpy(loaded.weights), "weights")
    assert_bit_identical(numpy(opt.variables), numpy(lopt.variables), "optimizer")

    # Training resumed from the file matches uninterrupted training.
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    loaded.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert_bit_identical(numpy(model.weights), numpy(loaded.weights), "resumed weights")
    np.testing.assert_equal(lopt.counters(), opt.counters())


def test_gradient_fault_layer_round_trip(tmp_path):
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4),
            ng.faults.GradientFault(at_steps=[3, 1], value="inf"),
            keras.layers.Dense(1),
        ]
    )
    path = tmp_path / "fault.keras"
    model.save(path)
    layer = keras.models.load_model(path).layers[1]
    assert isinstance(layer, ng.faults.GradientFault)
    assert layer.at_steps == (1, 3) and layer.value == "inf"


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_gradient_fault_leaves_forward_exact_and_breaks_backward(value):
    x, y = _data()
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4, name="first"),
            ng.faults.GradientFault(at_steps=[1], value=value),
            keras.layers.Dense(1),
        ]
    )
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.01))
    model.compile(optimizer=opt, loss="mse")
    # Not training: identity, bit for bit, before and after training.
    reference = keras.Sequential([model.layers[0], model.layers[2]])
    before = model.predict(x, verbose=0)
    np.testing.assert_array_equal(before, reference.predict(x, verbose=0))
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert np.isfinite(history.history["loss"]).all()
    assert opt.counters()["skipped_steps"] == 1
    assert opt.counters()["last_nonfinite_index"] == 0  # first/kernel
    assert int(opt.iterations) == 3  # steps 0, 2 and 3 applied
    after = model.predict(x, verbose=0)
    np.testing.assert_array_equal(after, reference.predict(x, verbose=0))
    assert np.isfinite(after).all() and not np.array_equal(after, before)


def test_weight_norm_dense_round_trip(tmp_path):
    from tests.models import WeightNormDense, critic

    model = critic("relu", g_init=2.0)
    path = tmp_path / "critic.keras"
    model.save(path)
    loaded = keras.models.load_model(path)  # registered: no custom_objects
    layer = loaded.get_layer("wn2")
    assert type(layer) is WeightNormDense
    assert layer.get_config() == model.get_layer("wn2").get_config()
    assert (layer.units, layer.g_init, layer.b_init, layer.l1) == (32, 2.0, 0.1, 0.005)
    assert_bit_identical(numpy(model.weights), numpy(loaded.weights), "weights")
    x = np.random.default_rng(0).standard_normal((4, 8)).astype("float32")
    np.testing.assert_array_equal(
        model.predict(x, verbose=0), loaded.predict(x, verbose=0)
    )


def _eager_on_torch(model):
    """The fixtures' compile config holds `jit_compile=True` (made on JAX):
    on torch a `torch.compile` of the step, 25 s of Dynamo per test here.
    These tests are about the file's layout; `test_fit.py` trains compiled
    torch steps (`jit_compile=True`) and counts their compiles."""
    if BACKEND == "torch":
        model.jit_compile = False


# ---------------------------------------- the 0.1 layout still loads
def test_a_keras_file_of_version_0_1_loads_and_trains_on():
    """A file saved by 0.1.0 (tests/fixtures/make_0_1_fixture.py): its
    optimizer held the base class's `iteration` and `learning_rate`, 11
    counters, then Adam's variables; no spike window."""
    fixtures = FIXTURES
    expected = np.load(os.path.join(fixtures, "safe_optimizer_0_1_expected.npz"))
    expected = [expected[f"arr_{i}"] for i in range(len(expected.files))]
    model = keras.saving.load_model(os.path.join(fixtures, "safe_optimizer_0_1.keras"))
    opt = model.optimizer
    assert isinstance(opt, ng.SafeOptimizer)
    assert (opt.clipnorm, opt.lr_backoff, opt.max_consecutive_skips) == (1.0, 0.5, 5)
    assert opt.spike_factor is None
    n = len(model.weights)
    assert_bit_identical(expected[:n], numpy(model.weights), "weights")
    saved = expected[n:]
    assert len(saved) == 2 + 11 + 14  # iteration, learning_rate; counters; Adam
    names = [v.name for v in opt.variables]
    assert names[11:15] == [
        "accepted_grad_norm",
        "spike_steps",
        "loss_scale_steps",
        "recent_rejections",
    ]
    assert_bit_identical(saved[2:13], numpy(opt.variables[:11]), "counters")
    assert [int(v) for v in numpy(opt.variables[12:15])] == [0, 0, 0]  # new since
    # New since too: the quarantine's counters and log, at their initial values.
    assert names[15:19] == [
        "quarantine_steps",
        "quarantined_samples",
        "quarantine_limit_steps",
        "quarantine_log",
    ]
    assert [int(v) for v in numpy(opt.variables[15:18])] == [0, 0, 0]
    assert (numpy(opt.variables[18:19])[0] == -1).all()
    # New since too: the flight recorder's, empty.
    assert names[19:25] == FLIGHT_NAMES
    assert [int(v) for v in numpy(opt.variables[19:21])] == [0, 0]
    # Its rings start at 0 (finite): rows past the counts hold no step; no
    # alarm, a level of 0.
    assert all((v == 0).all() for v in numpy(opt.variables[21:25]))
    loaded = numpy(opt.variables[25:])
    adam = [
        s.astype(v.dtype) if s.dtype.kind == v.dtype.kind == "i" else s
        for s, v in zip(saved[13:], loaded, strict=True)
    ]
    assert_bit_identical(adam, loaded, "Adam")
    c = opt.counters()
    assert (c["skipped_steps"], c["clipped_steps"], c["lr_scale"]) == (1, 7, 0.5)
    assert int(opt.iterations) == 7
    # It trains on: 8 batches of 8, the third with a NaN (rejected, the
    # learning rate backed off again).
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 4)).astype("float32")
    y = rng.standard_normal((64, 1)).astype("float32")
    x[20] = np.nan
    opt.attach(model)  # (0.1 had no `attach`): BatchNormalization's statistics
    _eager_on_torch(model)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    c = opt.counters()
    assert (c["skipped_steps"], c["nonfinite_gradient_steps"], int(opt.iterations)) == (
        2,
        2,
        14,
    )
    assert c["lr_scale"] == 0.25
    assert all(np.isfinite(w).all() for w in numpy(model.weights))
    assert not np.array_equal(expected[0], numpy(model.weights)[0])


# ---------------------------------------- the 0.2 layout still loads
def test_a_keras_file_of_version_0_2_loads_and_trains_on():
    path = os.path.join(FIXTURES, "safe_optimizer_0_2.keras")
    expected = np.load(os.path.join(FIXTURES, "safe_optimizer_0_2_expected.npz"))
    expected = [expected[f"arr_{i}"] for i in range(len(expected.files))]
    # 0.2's `spike_sigma=6` loads as today's rule, with a warning that says so.
    with pytest.warns(UserWarning, match=r"spike_sigma=6.0 .* spike_factor=10"):
        model = keras.saving.load_model(path)
    opt = model.optimizer
    assert isinstance(opt, ng.SafeOptimizer)
    assert (opt.spike_factor, opt.spike_window) == (10.0, 4)
    assert "spike_sigma" not in opt.get_config()
    n = len(model.weights)
    assert_bit_identical(expected[:n], numpy(model.weights), "weights")
    # 0.2 saved 13 counters, the spike window, then Adam's variables; the
    # variables new since take their initial values.
    saved = expected[n:]
    # The two counters, the quarantine's three and its log, the window's
    # `last_spike`, the flight recorder's six: new since.
    assert len(opt.variables) == len(saved) + 2 + 4 + 1 + 6
    names = [v.name for v in opt.variables]
    assert names[13:19] == [
        "loss_scale_steps",
        "recent_rejections",
        "quarantine_steps",
        "quarantined_samples",
        "quarantine_limit_steps",
        "quarantine_log",
    ]
    assert [int(v) for v in numpy(opt.variables[15:18])] == [0, 0, 0]
    assert_bit_identical(saved[:13], numpy(opt.variables[:13]), "counters")
    assert (int(opt.loss_scale_steps), int(opt.recent_rejections)) == (0, 0)
    # Adam's `iterations` is int32 in the JAX-made file, int64 on TensorFlow
    # and torch: the same value in the backend's dtype.
    # The window's `last_spike` (new since) starts at zeros.
    np.testing.assert_array_equal(numpy([opt.last_spike])[0], np.zeros(2, "float32"))
    flight = set(FLIGHT_NAMES)
    assert [int(v) for v in numpy(opt.variables[22:24])] == [0, 0]  # after the window
    loaded = numpy(
        [v for v in opt.variables[19:] if v.name not in flight | {"last_spike"}]
    )
    saved = [
        s.astype(v.dtype) if s.dtype.kind == v.dtype.kind == "i" else s
        for s, v in zip(saved[13:], loaded, strict=True)
    ]
    assert_bit_identical(saved, loaded, "window, Adam")
    before = opt.counters()
    assert (before["skipped_steps"], int(opt.iterations)) == (1, 7)
    # It trains on: 8 batches of 8, the third with a NaN.
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 4)).astype("float32")
    y = rng.standard_normal((64, 1)).astype("float32")
    x[20] = np.nan
    opt.attach(model)  # as before saving: BatchNormalization's statistics too
    _eager_on_torch(model)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    c = opt.counters()
    assert (
        c["skipped_steps"],
        c["nonfinite_gradient_steps"],
        c["spike_steps"],
        c["recent_rejections"],
        int(opt.iterations),
    ) == (2, 2, 0, 0b100000, 14)
    assert all_finite(model.weights)
    assert not np.array_equal(expected[0], numpy(model.weights)[0])
