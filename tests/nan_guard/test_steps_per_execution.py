"""NaNGuard with `steps_per_execution=k` (issue 18): the batch end sees k steps
at once, and SafeOptimizer's `recent_rejections` tells which were rejected,
so incidents and runs of rejected steps are those of `steps_per_execution=1`.
Also: the 0.2 `.keras` layout (before `recent_rejections`) still loads."""

import os

import keras
import numpy as np
import pytest
from keras import ops

import keras_nanguard as ng
from tests.helpers import (
    BACKEND,
    BINARY_LOSS,
    FIXTURES,
    FLIGHT_NAMES,
    all_finite,
    assert_bit_identical,
    binary_data,
    numpy,
)
from tests.models import tiny_mlp

spe = pytest.mark.skipif(
    BACKEND == "torch", reason="Keras needs steps_per_execution=1 on torch"
)


def _model(k, seed=1):
    keras.utils.clear_session()  # the same variable names each time
    keras.utils.set_random_seed(seed)
    model = tiny_mlp()
    model.compile(
        optimizer=ng.SafeOptimizer(keras.optimizers.SGD(0.05)),
        loss=BINARY_LOSS,
        steps_per_execution=k,
    )
    return model


def _poisoned(bad_batches, n=160):
    x, y = binary_data(n)  # batches of 16
    return ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=bad_batches)


class _Logs(keras.callbacks.Callback):
    """The mask each execution logs; async-safe, so NaNGuard stays async."""

    async_safe = True

    def on_train_begin(self, logs=None):
        self.masks = []

    def on_train_batch_end(self, batch, logs=None):
        # Logged only with steps_per_execution > 1, where NaNGuard needs it.
        self.masks.append(int(logs.get("nanguard_recent_rejections", -1)))


def _where(guard):
    return [(i.kind, i.epoch, i.step, i.batch, i.steps) for i in guard.incidents]


# --------------------------------------------- the mask, step by step
def _net():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def _grads(model, bad=False):
    value = np.nan if bad else 0.5
    return [ops.full(v.shape, value) for v in model.trainable_variables]


def test_recent_rejections_step_by_step():
    model = _net()
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1))
    opt.build(model.trainable_variables)
    assert int(opt.recent_rejections) == 0
    seen = []
    for bad in (False, True, True, False):
        opt.apply(_grads(model, bad), model.trainable_variables)
        seen.append((int(opt.recent_rejections), opt.counters()["recent_rejections"]))
    # Bit 0 is the latest step: accept, reject, reject, accept.
    assert seen == [(0, 0), (1, 1), (3, 3), (6, 6)]
    assert opt.counters()["skipped_steps"] == 2
    assert opt.counters()["consecutive_skips"] == 0


def test_recent_rejections_keeps_30_steps_without_overflow():
    model = _net()
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1))
    opt.build(model.trainable_variables)
    for _ in range(31):
        opt.apply(_grads(model, bad=True), model.trainable_variables)
    assert int(opt.recent_rejections) == 2**30 - 1  # the last 30 steps
    opt.apply(_grads(model), model.trainable_variables)
    assert int(opt.recent_rejections) == 2**30 - 2
    assert opt.counters()["skipped_steps"] == 31


# ------------------------- finding 12: one incident per rejected step
@spe
def test_rejected_steps_in_different_executions_are_separate_incidents():
    found = {}
    for k in (1, 4):  # executions (0-3) (4-7) (8-9) with k=4
        model = _model(k)
        guard, logs = ng.NaNGuard(verbose=0), _Logs()
        history = model.fit(
            _poisoned([2, 6, 9]), shuffle=False, verbose=0, callbacks=[guard, logs]
        )
        found[k] = guard
        assert _where(guard) == [
            ("rejected_step", 0, 2, 2, 1),
            ("rejected_step", 0, 6, 6, 1),
            ("rejected_step", 0, 9, 9, 1),
        ], k
        for inc in guard.incidents:
            assert inc.detail.startswith("SafeOptimizer rejected 1 step: the gradient")
            assert inc.action == "none"  # one rejected step is not trouble
            assert str(inc).startswith(f"[epoch 0, step {inc.step}] rejected_step")
        c = model.optimizer.counters()
        assert (
            c["skipped_steps"],
            c["nonfinite_gradient_steps"],
            c["consecutive_skips"],
            c["recent_rejections"],
        ) == (3, 3, 1, 0b10001001)  # steps 2, 6, 9 of 0..9 (bit 0: step 9)
        assert int(model.optimizer.iterations) == 7
        assert np.isfinite(history.history["loss"]).all()
        if k == 4:  # steps 0-3, then 0-7, then 0-9 (bit 0 the latest)
            assert logs.masks == [0b0010, 0b00100010, 0b0010001001]
        else:
            assert logs.masks == [-1] * 10
    assert [i.detail for i in found[1].incidents] == [
        i.detail for i in found[4].incidents
    ]


# ------------- finding 10e: a run of rejected steps across two executions
@pytest.mark.parametrize("k", [1, pytest.param(4, marks=spe)])
def test_a_run_across_executions_is_trouble(k):
    model = _model(k)
    guard = ng.NaNGuard(verbose=0, max_rejections=3)
    model.fit(_poisoned([2, 3, 4]), shuffle=False, verbose=0, callbacks=[guard])
    # Steps 2, 3 end the execution (0-3), step 4 begins (4-7): 3 in a row.
    assert _where(guard) == [("rejected_step", 0, 2, 2, 3)]
    (inc,) = guard.incidents
    assert inc.detail.startswith("SafeOptimizer rejected 3 steps in steps 2-4: ")
    assert inc.action.startswith(
        "rolled back: restored the snapshot of epoch 0, step 0"
    )
    assert guard.rollbacks == 1
    assert model.optimizer.counters()["skipped_steps"] == 3


@spe
def test_rejected_steps_that_are_not_a_run_are_not_trouble():
    # Steps 1 and 3 of one execution, then 4: never 3 in a row.
    model = _model(4)
    guard = ng.NaNGuard(verbose=0, max_rejections=2)
    model.fit(_poisoned([1, 3, 4]), shuffle=False, verbose=0, callbacks=[guard])
    assert _where(guard) == [
        ("rejected_step", 0, 1, 1, 1),
        ("rejected_step", 0, 3, 3, 2),
    ]
    assert [i.action.split(":")[0] for i in guard.incidents] == ["none", "rolled back"]
    assert guard.rollbacks == 1


# --------------------------- finding 10b: the count is the incident's
def test_an_extended_incident_counts_all_its_rejected_steps():
    model = _model(1)
    guard = ng.NaNGuard(verbose=0)
    model.fit(_poisoned([3, 4]), shuffle=False, verbose=0, callbacks=[guard])
    (inc,) = guard.incidents
    assert (inc.kind, inc.step, inc.steps, inc.action) == (
        "rejected_step",
        3,
        2,
        "none",
    )
    assert inc.detail.startswith("SafeOptimizer rejected 2 steps in steps 3-4: ")
    assert str(inc).startswith(
        "[epoch 0, step 3 (+1 more steps)] rejected_step: SafeOptimizer "
        "rejected 2 steps in steps 3-4: the gradient of"
    )


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
