"""Drop-in means the same answers: what an attached model's `train_on_batch`
returns, and an optimizer whose variables are all finite on a healthy run.
Keras's own behaviour, a plain model and optimizer side by side, is the
reference."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_nanguard as ng
from tests.helpers import numpy

X = np.random.default_rng(0).standard_normal((32, 4)).astype("float32")
Y = (X[:, :1] > 0).astype("float32")


def _model(optimizer, metrics, outputs=1):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    if outputs == 1:
        model = keras.Model(inputs, keras.layers.Dense(1, name="out")(hidden))
        model.compile(optimizer, "mse", metrics=metrics)
        return model
    heads = [keras.layers.Dense(1, name=f"out{i}")(hidden) for i in range(outputs)]
    model = keras.Model(inputs, heads)
    model.compile(optimizer, ["mse"] * outputs, metrics=[metrics] * outputs)
    return model


def _pair(metrics, outputs=1):
    plain = _model(keras.optimizers.SGD(0.1), metrics, outputs)
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1))
    guarded = _model(opt, metrics, outputs)
    opt.attach(guarded)
    return plain, guarded


def _targets(outputs):
    return Y if outputs == 1 else [Y] * outputs


@pytest.mark.parametrize(
    "metrics, outputs",
    [(None, 1), (["mae"], 1), (["mae", "mse"], 1), (["mae"], 2)],
    ids=["loss-only", "one-metric", "two-metrics", "two-outputs"],
)
def test_train_on_batch_returns_what_keras_returns(metrics, outputs):
    plain, guarded = _pair(metrics, outputs)
    y = _targets(outputs)
    for _ in range(3):
        want = plain.train_on_batch(X, y)
        got = guarded.train_on_batch(X, y)
        assert type(got) is type(want)
        if isinstance(want, list):
            assert len(got) == len(want)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        else:
            assert float(got) == float(want)  # what an RL loop does every step
    assert plain.test_on_batch(X, y) == guarded.test_on_batch(X, y)


def test_train_on_batch_dict_keeps_the_health_figures():
    plain, guarded = _pair(["mae"])
    want = plain.train_on_batch(X, Y, return_dict=True)
    got = guarded.train_on_batch(X, Y, return_dict=True)
    assert list(got)[: len(want)] == list(want)
    assert {k: got[k] for k in want} == want
    assert sorted(set(got) - set(want)) == [
        "nanguard_grad_norm",
        "nanguard_rejected_steps",
    ]


def test_train_on_batch_of_a_rejected_step_is_still_the_loss():
    """Keras returns the batch's loss, NaN here; an attached step is
    rejected, and its result is the same NaN, not the empty mean (0)."""
    plain, guarded = _pair(None)
    bad = Y.copy()
    bad[3, 0] = np.nan  # a label: TensorFlow's oneDNN relu(NaN) is 0
    loss = guarded.train_on_batch(X, bad)
    assert np.isnan(float(loss))
    assert np.isnan(float(plain.train_on_batch(X, bad)))
    assert int(guarded.optimizer.skipped_steps) == 1
    # And `fit`'s logs of a rejected step keep the metrics without it.
    history = guarded.fit(X, bad, batch_size=32, verbose=0)
    assert history.history["loss"] == [0.0]
    assert int(guarded.optimizer.skipped_steps) == 2


def test_detach_gives_back_the_class_train_on_batch():
    _, guarded = _pair(None)
    assert "train_on_batch" in vars(guarded)
    guarded.optimizer.detach(guarded)
    assert "train_on_batch" not in vars(guarded)
    assert isinstance(guarded.train_on_batch(X, Y, return_dict=True), dict)


@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="the GradientTape form of Keras's custom train_step guide",
)
def test_custom_train_step_logs_in_keras_order():
    """A model of Keras's examples: its own `train_step`, its own metrics,
    logs in another order than `metrics`."""
    import tensorflow as tf

    class TwoTrackers(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)
            self.b_tracker = keras.metrics.Mean(name="b_loss")
            self.a_tracker = keras.metrics.Mean(name="a_loss")

        def call(self, x):
            return self.dense(x)

        @property
        def metrics(self):
            return [self.b_tracker, self.a_tracker]

        def train_step(self, data):
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            with tf.GradientTape() as tape:
                loss = keras.ops.mean((self(x) - y) ** 2)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            self.b_tracker.update_state(loss)
            self.a_tracker.update_state(2 * loss)
            return {
                "a_loss": self.a_tracker.result(),
                "b_loss": self.b_tracker.result(),
            }

    results = []
    for safe in (False, True):
        keras.utils.set_random_seed(0)
        model = TwoTrackers()
        optimizer = keras.optimizers.SGD(0.1)
        model.compile(ng.SafeOptimizer(optimizer) if safe else optimizer)
        if safe:
            model.optimizer.attach(model)
        results.append([float(v) for v in model.train_on_batch(X, Y)])
    assert results[1] == results[0]
    assert results[0][1] == 2 * results[0][0]  # b_loss first: `metrics` order


@pytest.mark.parametrize("spike_factor", [None, 10.0])
def test_optimizer_variables_stay_finite(spike_factor):
    """A healthy run, a rejected NaN batch in it: every variable of the
    optimizer is finite (a user's health check over `opt.variables`), while
    the reports still say NaN."""
    opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-2), spike_factor=spike_factor)
    model = _model(opt, None)
    opt.attach(model)
    fresh = numpy(opt.variables)
    assert all(np.isfinite(v).all() for v in fresh if v.dtype.kind == "f")
    bad = X.copy()
    bad[0, 0] = np.nan
    for batch in (X, bad, X):
        model.train_on_batch(batch, Y)
    values = numpy(opt.variables)
    names = [
        v.path
        for v, a in zip(opt.variables, values, strict=True)
        if a.dtype.kind == "f" and not np.isfinite(a).all()
    ]
    assert names == []
    c = opt.counters()
    assert c["skipped_steps"] == 1
    assert np.isnan(c["rejected_grad_norm"])
    assert np.isnan(float(opt.rejected_grad_norm))
    assert np.isfinite(float(opt.last_grad_norm))  # the last step was healthy
    record = opt.flight_record()
    np.testing.assert_array_equal(record.column("step"), [1.0, 2.0, 3.0])
    assert np.isnan(record.column("grad_norm")[1])
    # Not a probe (probes every 16 steps): its probe figures are not there.
    assert np.isnan(record.column("state_min")[1])
    assert np.isfinite(record.column("state_min")[0])  # step 1 probes
