"""Who owns which policy when SafeOptimizer and NaNGuard are both set.

SafeOptimizer owns the step (reject, `lr_backoff`, halt after
`max_consecutive_skips`); NaNGuard owns the run (restore a snapshot, lower
the base learning rate by `lr_factor`). Of the two rejection limits the
smaller acts first. These scenarios pin that precedence.
"""

import keras
import numpy as np
import pytest

import keras_nanguard as ng
from keras_nanguard.nan_guard.callback import _MAX_LAG
from tests.helpers import BACKEND
from tests.models import mse_model


def _data(bad):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((160, 6)).astype("float32")
    y = x.sum(1, keepdims=True)
    return ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=bad)


def test_nan_guard_limit_first_rolls_back_before_the_optimizer_halts():
    opt = ng.SafeOptimizer(
        keras.optimizers.SGD(0.05), lr_backoff=0.5, max_consecutive_skips=5
    )
    guard = ng.NaNGuard(verbose=0, max_rejections=2, lr_factor=0.5)
    mse_model(opt, seed=1).fit(
        _data([2, 3]), verbose=0, shuffle=False, callbacks=[guard]
    )
    # Two rejections in a row: NaNGuard's trouble, one rollback; the
    # optimizer never reached its own limit.
    assert guard.rollbacks == 1
    assert [i.kind for i in guard.incidents] == ["rejected_step"]
    assert opt.counters()["skipped_steps"] == 2
    # The base rate is NaNGuard's (0.05 -> 0.025); the back-off scale was
    # restored with the snapshot (1.0) and never ended at 0.25.
    assert float(opt.learning_rate) == pytest.approx(0.025)
    assert opt.counters()["lr_scale"] == 1.0
    assert opt.counters()["consecutive_skips"] == 0


def test_optimizer_limit_first_halts_and_nan_guard_treats_the_halt():
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.05), max_consecutive_skips=2)
    guard = ng.NaNGuard(verbose=0, max_rejections=5)
    mse_model(opt, seed=1).fit(
        _data([2, 3]), verbose=0, shuffle=False, callbacks=[guard]
    )
    assert [i.kind for i in guard.incidents] == ["halted"]
    assert guard.rollbacks == 1
    # The rollback restored the snapshot of step 0 (iterations 0) and with
    # it the streak. It comes at the next batch begin NaNGuard reaches: at
    # once where Keras calls batch ends in line (TensorFlow), up to
    # _MAX_LAG batches later where they run in its worker thread; batches
    # in between meet the halted optimizer and are rejected. Every one of
    # the 8 clean batches is either applied after the rollback or rejected.
    c = opt.counters()
    assert c["consecutive_skips"] == 0
    late = c["skipped_steps"] - 2
    assert 0 <= late <= _MAX_LAG
    if BACKEND == "tensorflow":
        assert late == 0
    assert int(opt.iterations) == 6 - late
