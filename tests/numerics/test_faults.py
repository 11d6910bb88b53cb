"""keras_nanguard.faults on its own: exactly which entries are poisoned, which
steps are faulty, what is restored after a spike, and the errors for bad
arguments."""

import math

import keras
import numpy as np
import pytest
from keras import ops

import keras_nanguard as ng
from keras_nanguard import faults
from tests.helpers import numpy


# ----------------------------------------------------------------- poison
@pytest.mark.backend_free
def test_poison_default_is_the_first_entry_of_the_first_sample_in_a_copy():
    x = np.arange(12, dtype="int64").reshape(4, 3)
    out = faults.poison(x)
    assert out.dtype == np.float64  # ints widen to a float that holds NaN
    assert np.isnan(out[0, 0])
    expected = x.astype("float64")
    expected[0, 0] = out[0, 0]
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(x, np.arange(12).reshape(4, 3))  # untouched
    assert faults.poison(np.ones((2, 2), "float16")).dtype == np.float32


@pytest.mark.backend_free
@pytest.mark.parametrize(
    ("value", "expected"),
    [("inf", math.inf), ("-inf", -math.inf), ("NaN", math.nan), (7.5, 7.5), (3, 3.0)],
)
def test_poison_rows_and_flattened_columns(value, expected):
    x = np.zeros((4, 2, 3), "float32")
    out = faults.poison(x, rows=[1, 3], value=value, columns=[0, 4])
    assert out.shape == (4, 2, 3) and out.dtype == np.float32
    mask = np.zeros((4, 2, 3), bool)
    mask[[1, 1, 3, 3], [0, 1, 0, 1], [0, 1, 0, 1]] = True  # flat 4 = [1, 1]
    np.testing.assert_array_equal(out[~mask], 0.0)
    np.testing.assert_array_equal(out[mask], np.float32(expected))


@pytest.mark.backend_free
def test_poison_whole_samples_with_columns_none():
    out = faults.poison(np.ones((3, 2, 2), "float32"), rows=2, columns=None)
    assert np.isnan(out[2]).all()
    np.testing.assert_array_equal(out[:2], 1.0)


@pytest.mark.backend_free
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"value": "zero"}, ValueError, r"`value` must be .*Received: value='zero'"),
        ({"value": True}, TypeError, r"Received: value=True"),
        ({"value": None}, TypeError, r"Received: value=None"),
    ],
)
def test_poison_refuses_bad_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        faults.poison(np.ones((2, 2)), **kwargs)


@pytest.mark.backend_free
def test_poison_refuses_a_scalar():
    with pytest.raises(ValueError, match=r"sample axis\. Received: x.shape=\(\)"):
        faults.poison(1.0)


@pytest.mark.backend_free
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rows": [0, 4]}, r"`rows`.*Received: rows="),
        ({"rows": 4}, r"`rows`.*Received: rows="),
        ({"columns": [6]}, r"`columns`.*Received: columns="),
    ],
)
def test_poison_out_of_range_index_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        faults.poison(np.ones((4, 2, 3)), **kwargs)


# ------------------------------------------------------- PoisonedBatches
def _xy(n=10):
    x = np.arange(n * 3, dtype="float32").reshape(n, 3)
    return x, np.arange(n, dtype="float32").reshape(n, 1) + 100


@pytest.mark.backend_free
def test_poisoned_batches_poison_the_first_rows_of_the_chosen_batch_only():
    x, y = _xy()
    ds = faults.PoisonedBatches(x, y, batch_size=4, bad_batches=[1], rows=2)
    assert len(ds) == 3 and ds.poisoned == []
    for i in (0, 2):
        bx, by = ds[i]
        np.testing.assert_array_equal(bx, x[4 * i : 4 * i + 4])
        np.testing.assert_array_equal(by, y[4 * i : 4 * i + 4])
    assert ds.poisoned == []
    bx, by = ds[1]
    expected = x[4:8].copy()
    expected[[0, 1], 0] = np.nan
    np.testing.assert_array_equal(bx, expected)  # NaN where NaN
    np.testing.assert_array_equal(by, y[4:8])  # target="x": y untouched
    assert ds.poisoned == [1]
    assert ds[2][0].shape == (2, 3)  # the short last batch
    np.testing.assert_array_equal(x, _xy()[0])  # the source is not modified


@pytest.mark.backend_free
@pytest.mark.parametrize("target", ["y", "both"])
def test_poisoned_batches_target(target):
    x, y = _xy()
    bx, by = faults.PoisonedBatches(
        x, y, batch_size=5, bad_batches=[0], value="-inf", target=target
    )[0]
    assert by[0, 0] == -np.inf
    np.testing.assert_array_equal(by[1:], y[1:5])
    if target == "both":
        assert bx[0, 0] == -np.inf
        np.testing.assert_array_equal(bx[0, 1:], x[0, 1:])
        np.testing.assert_array_equal(bx[1:], x[1:5])
    else:
        np.testing.assert_array_equal(bx, x[:5])


@pytest.mark.backend_free
def test_poisoned_batches_value_per_batch_and_rows_capped_by_the_last_batch():
    x, _ = _xy()
    ds = faults.PoisonedBatches(
        x, batch_size=4, bad_batches={2: "inf", 0: -1e9}, rows=3
    )
    assert ds.bad_batches == {0: -1e9, 2: math.inf}
    (b0,), (b1,), (b2,) = ds[0], ds[1], ds[2]  # no targets: 1-tuples
    np.testing.assert_array_equal(b0[:, 0], [-1e9, -1e9, -1e9, x[3, 0]])
    np.testing.assert_array_equal(b1, x[4:8])
    np.testing.assert_array_equal(b2[:, 0], [np.inf, np.inf])  # 2 of rows=3
    np.testing.assert_array_equal(b2[:, 1:], x[8:, 1:])
    assert ds.poisoned == [0, 2]


@pytest.mark.backend_free
def test_poisoned_batches_shuffle_keeps_every_sample_and_the_bad_batch():
    x, y = _xy(8)
    ds = faults.PoisonedBatches(x, y, batch_size=4, bad_batches=[1], shuffle=True)
    first = np.concatenate([ds[0][1], ds[1][1]])
    np.testing.assert_array_equal(first, y)  # no shuffle before the first epoch
    ds.on_epoch_end()
    (x0, y0), (x1, y1) = ds[0], ds[1]
    order = np.concatenate([y0, y1])[:, 0].astype(int) - 100
    assert sorted(order) == list(range(8)) and list(order) != list(range(8))
    assert np.isnan(x1[0, 0]) and np.isfinite(x0).all()
    np.testing.assert_array_equal(x1[1:], x[order[5:]])


@pytest.mark.backend_free
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"target": "z"}, ValueError, r"Received: target='z'"),
        ({"batch_size": 0}, ValueError, r"`batch_size`.*Received: batch_size=0"),
        ({"batch_size": 2.0}, ValueError, r"Received: batch_size=2.0"),
        ({"rows": 0}, ValueError, r"`rows`.*Received: rows=0"),
        ({"rows": 5}, ValueError, r"`rows`.*Received: rows=5"),
        ({"bad_batches": [3]}, ValueError, r"< the number of batches \(3\)"),
        ({"bad_batches": {0: "zero"}}, ValueError, r"Received: value='zero'"),
        ({"value": "x"}, ValueError, r"Received: value='x'"),
    ],
)
def test_poisoned_batches_refuse_bad_arguments(kwargs, error, match):
    x, y = _xy()
    with pytest.raises(error, match=match):
        faults.PoisonedBatches(x, y, **{"batch_size": 4, **kwargs})


@pytest.mark.backend_free
@pytest.mark.parametrize(
    ("bad_batches", "error", "match"),
    [
        # Today: "must hold ints >= 0 (0-based training steps). Received:
        # bad_batches={-1: nan}", not what the user passed.
        ([-1], ValueError, r"`bad_batches`.*Received: bad_batches=\[-1\]"),
        # Today: a raw "'float' object is not iterable".
        (1.5, TypeError, r"`bad_batches`.*Received: bad_batches=1.5"),
    ],
)
def test_poisoned_batches_name_bad_batches_as_given(bad_batches, error, match):
    x, y = _xy()
    with pytest.raises(error, match=match):
        faults.PoisonedBatches(x, y, batch_size=4, bad_batches=bad_batches)


@pytest.mark.backend_free
def test_poisoned_batches_refuse_mismatched_or_missing_targets():
    x, y = _xy()
    with pytest.raises(ValueError, match=r"len\(x\)=10, len\(y\)=9"):
        faults.PoisonedBatches(x, y[:9])
    with pytest.raises(ValueError, match=r"needs targets `y`. Received: y=None"):
        faults.PoisonedBatches(x, target="both")


# --------------------------------------------------------- GradientFault
def _fault_model(value):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, name="first"),
            faults.GradientFault(at_steps=[1], value=value, name="fault"),
            keras.layers.Dense(1, name="last"),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_gradient_fault_breaks_the_layers_before_it_at_its_step_only(value):
    x, y = _xy(8)
    x /= 30.0
    model = _fault_model(value)
    fault = model.get_layer("fault")
    assert int(ops.convert_to_numpy(fault.calls)) == 0
    # Step 0 is healthy: everything finite; not-training calls are not counted.
    model.fit(x[:4], y[:4], batch_size=4, verbose=0)
    model.predict(x, verbose=0)
    assert int(ops.convert_to_numpy(fault.calls)) == 1
    first, last = model.get_layer("first"), model.get_layer("last")
    assert all(np.isfinite(w).all() for w in numpy(model.weights))
    last_before = numpy(last.weights)
    # Step 1 is faulty: plain SGD writes the non-finite gradient into `first`.
    history = model.fit(x[4:], y[4:], batch_size=4, verbose=0)
    assert int(ops.convert_to_numpy(fault.calls)) == 2
    assert np.isfinite(history.history["loss"]).all()  # the forward is intact
    kernel, bias = numpy(first.weights)
    if value == "nan":
        assert np.isnan(kernel).all() and np.isnan(bias).all()
    else:
        assert not np.isfinite(kernel).any() and not np.isfinite(bias).any()
        assert np.isinf(bias).all()
    # The layer after the fault got a finite gradient and moved.
    after = numpy(last.weights)
    assert all(np.isfinite(w).all() for w in after)
    assert not np.array_equal(after[0], last_before[0])


def test_gradient_fault_is_the_identity_forward_and_without_steps():
    x = np.random.default_rng(0).standard_normal((5, 3)).astype("float32")
    layer = faults.GradientFault(at_steps=[0])
    np.testing.assert_array_equal(ops.convert_to_numpy(layer(x, training=True)), x)
    np.testing.assert_array_equal(ops.convert_to_numpy(layer(x)), x)
    idle = faults.GradientFault(at_steps=[])
    idle(x, training=True)
    assert idle.at_steps == () and int(ops.convert_to_numpy(idle.calls)) == 0
    assert faults.GradientFault(at_steps=2).at_steps == (2,)
    assert faults.GradientFault(at_steps=[3, 1, 3]).at_steps == (1, 3)
    assert faults.GradientFault(at_steps=np.int64(4)).at_steps == (4,)


@pytest.mark.backend_free
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"at_steps": [1], "value": "-inf"}, ValueError, r"Received: value='-inf'"),
        ({"at_steps": [-1]}, ValueError, r"Received: at_steps=\[-1\]"),
        ({"at_steps": [1.0]}, ValueError, r"Received: at_steps=\[1.0\]"),
        ({"at_steps": 1.5}, TypeError, r"Received: at_steps=1.5"),
        ({"at_steps": None}, TypeError, r"Received: at_steps=None"),
    ],
)
def test_gradient_fault_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        faults.GradientFault(**kwargs)


# ----------------------------------------------------- corrupt_gradients
@pytest.mark.parametrize(
    ("value", "index", "where"), [("inf", 1, 1), ("nan", -1, 2), (-2.5, 0, 0)]
)
def test_corrupt_gradients_fills_one_gradient_of_a_copy(value, index, where):
    grads = [ops.ones((2, 3)), ops.ones((3,)), ops.zeros((1,), dtype="float16")]
    out = faults.corrupt_gradients(grads, value, index)
    assert out is not grads and len(out) == 3
    for i, (g, o) in enumerate(zip(grads, out, strict=True)):
        if i != where:
            assert o is g
            continue
        arr = ops.convert_to_numpy(o)
        assert arr.shape == tuple(g.shape)
        assert arr.dtype == ops.convert_to_numpy(g).dtype
        np.testing.assert_array_equal(arr, np.full(arr.shape, value, arr.dtype))
    assert all(ops.convert_to_numpy(ops.all(ops.isfinite(g))) for g in grads)


def test_corrupt_gradients_refuses_bad_arguments():
    grads = [ops.ones((2,)), ops.ones((1,))]
    with pytest.raises(ValueError, match=r"the 2 gradients\. Received: index=2"):
        faults.corrupt_gradients(grads, "nan", 2)
    with pytest.raises(ValueError, match=r"Received: index=-3"):
        faults.corrupt_gradients(grads, "nan", -3)
    with pytest.raises(ValueError, match=r"Received: value='huge'"):
        faults.corrupt_gradients(grads, "huge")


# ------------------------------------------------------ learning-rate spikes
def _lr(optimizer):
    return np.array(ops.convert_to_numpy(optimizer.learning_rate))


@pytest.mark.parametrize("wrap", [False, True])
def test_learning_rate_spike_restores_the_exact_value_also_on_error(wrap):
    inner = keras.optimizers.SGD(0.1)
    opt = ng.SafeOptimizer(inner) if wrap else inner
    original = _lr(inner)
    with faults.learning_rate_spike(opt, 1e6):
        assert _lr(inner) == original * np.float32(1e6)
    assert _lr(inner).tobytes() == original.tobytes()
    with (
        pytest.raises(RuntimeError, match="boom"),
        faults.learning_rate_spike(opt, math.inf),
    ):
        assert _lr(inner) == np.inf
        raise RuntimeError("boom")
    assert _lr(inner).tobytes() == original.tobytes()


def test_learning_rate_spike_refuses_a_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    spike = faults.learning_rate_spike(keras.optimizers.SGD(schedule), 10.0)
    with pytest.raises(ValueError, match=r"not a schedule.*Received: learning_rate="):
        spike.__enter__()


class _LrLog(keras.callbacks.Callback):
    """The learning rate each step runs with (after the spike callback)."""

    def on_train_begin(self, logs=None):
        self.seen = []

    def on_train_batch_begin(self, batch, logs=None):
        self.seen.append(_lr(self.model.optimizer))


@pytest.mark.parametrize("wrap", [False, True])
def test_learning_rate_spike_callback_covers_exactly_its_steps(wrap):
    x, y = _xy(6)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    inner = keras.optimizers.SGD(1e-4)
    model.compile(optimizer=ng.SafeOptimizer(inner) if wrap else inner, loss="mse")
    original = _lr(inner)
    high = original * np.float32(10.0)
    spike, log = faults.LearningRateSpike(at_steps=[1, 3, 5], factor=10), _LrLog()
    # Steps count across epochs (3 batches per epoch); the last step's spike
    # is undone by on_train_end.
    model.fit(x, y, batch_size=2, epochs=2, verbose=0, shuffle=False,
              callbacks=[spike, log])  # fmt: skip
    assert [float(v) for v in log.seen] == [
        float(v) for v in [original, high, original, high, original, high]
    ]
    assert _lr(inner).tobytes() == original.tobytes()
    # The same instance serves a second fit from step 0 again.
    model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[spike, log])
    assert [float(v) for v in log.seen] == [
        float(original),
        float(high),
        float(original),
    ]
    assert _lr(inner).tobytes() == original.tobytes()


@pytest.mark.backend_free
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"at_steps": [1], "factor": 0}, ValueError, r"Received: factor=0"),
        ({"at_steps": [1], "factor": -2.0}, ValueError, r"Received: factor=-2.0"),
        ({"at_steps": [1], "factor": True}, ValueError, r"Received: factor=True"),
        ({"at_steps": [1], "factor": "10"}, ValueError, r"Received: factor='10'"),
        ({"at_steps": [-2], "factor": 10}, ValueError, r"Received: at_steps=\[-2\]"),
    ],
)
def test_learning_rate_spike_callback_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        faults.LearningRateSpike(**kwargs)


def test_learning_rate_spike_callback_refuses_a_schedule_at_train_begin():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    x, y = _xy(4)
    spike = faults.LearningRateSpike(at_steps=[0], factor=10.0)
    with pytest.raises(ValueError, match=r"not a schedule"):
        model.fit(x, y, verbose=0, callbacks=[spike])
