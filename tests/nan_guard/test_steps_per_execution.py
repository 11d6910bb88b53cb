"""NaNGuard with `steps_per_execution=k`: the batch end sees k steps at once,
and SafeOptimizer's `recent_rejections` tells which were rejected, so
incidents and runs of rejected steps are those of `steps_per_execution=1`."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_nanguard as ng
from tests.helpers import BACKEND, BINARY_LOSS, binary_data
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


# ------------------------------------- one incident per rejected step
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


# -------------------------- a run of rejected steps across two executions
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


# --------------------------------------- the count is the incident's
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
