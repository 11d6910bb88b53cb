"""Gradient-spike skipping in SafeOptimizer (`spike_factor`), on every backend."""

import keras
import numpy as np
import pytest
from sklearn.datasets import load_digits

import keras_nanguard as ng
from keras_nanguard.demo import mlp
from keras_nanguard.safe_optimizer import spike_window as spikes
from tests.helpers import assert_bit_identical, numpy

SPIKE_BATCH = 30  # after a window of 16 accepted steps has filled
SHIFT_REJECTIONS = 5  # the same on the three backends
FACTOR = 10.0


def _data(drop_spike: bool = False):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8 * 40, 4)).astype("float32")
    y = x.sum(1, keepdims=True)
    lo, hi = 8 * SPIKE_BATCH, 8 * (SPIKE_BATCH + 1)
    y[lo:hi] *= 1e3  # finite targets, a gradient spike
    if drop_spike:
        x, y = np.delete(x, np.s_[lo:hi], 0), np.delete(y, np.s_[lo:hi], 0)
    return x, y


def _fit(spike_factor, drop_spike=False, steps=None):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )
    opt = ng.SafeOptimizer(
        keras.optimizers.SGD(1e-2), spike_factor=spike_factor, spike_window=16
    )
    model.compile(optimizer=opt, loss="mse")
    opt.attach(model)  # logs nanguard_spike_steps
    x, y = _data(drop_spike)
    if steps is not None:
        x, y = x[: 8 * steps], y[: 8 * steps]
    history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    return model, opt, history


def test_a_gradient_spike_is_rejected_like_a_bad_step():
    model, opt, history = _fit(FACTOR)
    c = opt.counters()
    assert (c["spike_steps"], c["skipped_steps"], c["last_rejection"]) == (1, 1, 3)
    assert c["nonfinite_gradient_steps"] == c["nonfinite_update_steps"] == 0
    assert int(opt.iterations) == 39
    assert c["rejected_grad_norm"] > 1000
    # The report names the figures the spike was compared with, kept when it
    # was rejected: the window before it (the same as after its first 30
    # steps), not the window now.
    before = _fit(FACTOR, steps=SPIKE_BATCH)[1]
    threshold, reference = numpy([opt.last_spike])[0]
    window = numpy([before.spike_norms])[0].astype("float64")
    np.testing.assert_allclose(reference, np.quantile(window, 0.9), rtol=1e-6)
    assert_bit_identical(
        numpy([spikes.percentile(before.spike_norms.value)]), [reference]
    )
    assert threshold == np.float32(FACTOR * reference)
    assert c["rejected_grad_norm"] > threshold
    now = numpy([spikes.percentile(opt.spike_norms.value)])[0]
    assert f"{now:.4g}" != f"{reference:.4g}"
    assert opt.describe_last_rejection() == (
        f"the global gradient norm {c['rejected_grad_norm']:.4g} was a spike, "
        "more than 10 times the 90th percentile of the last 16 steps' norms "
        f"({reference:.4g}): above {threshold:.4g}"
    )
    assert history.history["nanguard_spike_steps"] == [1]
    reference, ref_opt, _ = _fit(FACTOR, drop_spike=True)
    assert ref_opt.counters()["spike_steps"] == 0
    assert_bit_identical(numpy(reference.weights), numpy(model.weights), "weights")
    assert_bit_identical(
        numpy(ref_opt.inner_optimizer.variables), numpy(opt.inner_optimizer.variables)
    )
    # The window holds the same accepted norms in both runs, and where the
    # spike was (slot 30 % 16), the threshold it exceeded.
    window, ref = numpy([opt.spike_norms])[0], numpy([ref_opt.spike_norms])[0]
    before, after = list(range(8, 14)), [14, 15, *range(7)]  # ref's slots
    assert_bit_identical([ref[before]], [window[before]])
    assert_bit_identical([ref[after]], [window[[(s + 1) % 16 for s in after]]])
    others = np.delete(window, 14)
    assert others.max() < window[14] < c["rejected_grad_norm"]
    assert (int(opt.spike_count), int(ref_opt.spike_count)) == (40, 39)


def test_a_lasting_rise_is_taken_in_after_a_run_of_rejections():
    # From step 30 on every target is 1000 times larger: a new level, not a
    # spike. The window takes in the thresholds of the rejected steps and
    # accepts the new level after a run of rejections, instead of rejecting
    # every later step (a window of accepted norms only would lock).
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = ng.SafeOptimizer(
        keras.optimizers.SGD(1e-4), spike_factor=FACTOR, spike_window=16
    )
    model.compile(optimizer=opt, loss="mse")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8 * 80, 4)).astype("float32")
    y = x.sum(1, keepdims=True)
    y[8 * 30 :] *= 1e3
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    c = opt.counters()
    assert c["spike_steps"] == c["skipped_steps"] == SHIFT_REJECTIONS
    assert c["consecutive_skips"] == 0
    assert int(opt.iterations) == 80 - SHIFT_REJECTIONS


def test_without_spike_factor_the_spike_is_applied():
    _, opt, _ = _fit(None)
    assert opt.counters()["skipped_steps"] == 0
    assert int(opt.iterations) == 40
    assert not hasattr(opt, "spike_norms")


def test_the_window_must_fill_before_it_judges():
    # A window of 64 never fills in 40 steps: nothing is a spike yet.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = ng.SafeOptimizer(
        keras.optimizers.SGD(1e-2), spike_factor=FACTOR, spike_window=64
    )
    model.compile(optimizer=opt, loss="mse")
    x, y = _data()
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert opt.counters()["spike_steps"] == 0 and int(opt.spike_count) == 40


@pytest.mark.slow
def test_no_false_rejection_with_shuffled_batches_and_a_short_last_one():
    # 49 batches of 32 and one of 5 an epoch, shuffled, 700 steps: the short
    # batch's norm reaches several times the window's median. The mean + 6
    # standard deviations of the raw norms (keras-nanguard 0.2) rejected
    # clean steps here; 10 times the window's 90th percentile rejects none,
    # and still rejects a gradient 100 times too large.
    d = load_digits()
    order = np.random.default_rng(0).permutation(len(d.data))[: 49 * 32 + 5]
    x = (d.data[order] / 16.0).astype("float32")
    y = d.target[order].astype("int32")
    keras.utils.set_random_seed(0)
    model = mlp(64, 10)
    opt = ng.SafeOptimizer(
        keras.optimizers.Adam(1e-3), spike_factor=FACTOR, spike_window=64
    )
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=32, epochs=14, verbose=0)
    assert int(opt.iterations) == 700
    assert opt.counters()["skipped_steps"] == 0
    weights = numpy(model.weights)
    model.train_on_batch(x[:32], y[:32], sample_weight=np.full(32, 100.0))
    c = opt.counters()
    assert (c["spike_steps"], c["skipped_steps"], c["last_rejection"]) == (1, 1, 3)
    assert_bit_identical(weights, numpy(model.weights), "weights")


def test_the_window_round_trips_through_a_keras_file(tmp_path):
    model, opt, _ = _fit(FACTOR)
    path = str(tmp_path / "spiky.keras")
    model.save(path)
    loaded = keras.models.load_model(path).optimizer
    assert (loaded.spike_factor, loaded.spike_window) == (FACTOR, 16)
    assert_bit_identical(numpy([opt.spike_norms]), numpy([loaded.spike_norms]))
    assert_bit_identical(numpy([opt.last_spike]), numpy([loaded.last_spike]))
    assert loaded.describe_last_rejection() == opt.describe_last_rejection()
    assert int(loaded.spike_count) == 40
    assert loaded.counters()["spike_steps"] == 1


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"spike_factor": 1}, ValueError, r"in \(1, inf\)\. Received: spike_factor=1"),
        ({"spike_factor": float("nan")}, ValueError, r"spike_factor=nan"),
        ({"spike_factor": "10"}, TypeError, r"spike_factor='10'"),
        # 0.2's argument, a different rule: named, with what replaces it.
        (
            {"spike_sigma": 6},
            TypeError,
            r"unknown keyword arguments \['spike_sigma'\]\. `spike_sigma` .* "
            r"use `spike_factor=10`.* Received: spike_sigma=6",
        ),
        ({"spike_window": 1}, ValueError, r"spike_window=1"),
        ({"spike_window": 2.5}, TypeError, r"spike_window=2.5"),
    ],
)
def test_bad_spike_arguments_get_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        ng.SafeOptimizer(keras.optimizers.SGD(0.1), **kwargs)
