"""A frozen run is said: when a SafeOptimizer rejected the last 30 steps or
more of a `fit` in a row, `fit` warns at its end (one read), attached or not,
with or without NaNGuard; a healthy run, or one with a few rejected steps,
says nothing."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest

import keras_nanguard as ng
from tests.models import mse_model

X = np.random.default_rng(0).standard_normal((320, 6)).astype("float32")
Y = np.ones((320, 1), "float32")


def _fit(y, attach):
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.01))
    model = mse_model(opt, seed=0)
    if attach:
        opt.attach(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(X, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    said = [str(w.message) for w in caught if "SafeOptimizer" in str(w.message)]
    return opt, said


@pytest.mark.parametrize("attach", [False, True], ids=["alone", "attached"])
def test_a_fit_whose_every_step_was_rejected_warns_at_its_end(attach):
    y = Y.copy()
    y[8:] = np.nan  # every batch after the first: a NaN label in each row
    opt, said = _fit(y, attach)
    assert opt.counters()["skipped_steps"] == 39
    assert said == [
        "SafeOptimizer rejected the last 39 steps in a row (39 in all); last, "
        "the gradient of 'sequential/dense/kernel' was not finite (global "
        "gradient norm nan). Nothing was applied in those steps: training is "
        "not making progress. Lower the learning rate, check the data, or let "
        "NaNGuard roll back (callbacks=[ng.NaNGuard()])."
    ]


def test_a_fit_with_a_few_rejected_steps_says_nothing():
    y = Y.copy()
    y[8 * np.arange(0, 40, 2)] = np.nan  # every other batch: 20 in all
    opt, said = _fit(y, attach=True)
    assert opt.counters()["skipped_steps"] == 20
    assert said == []
    opt, said = _fit(Y, attach=False)
    assert (opt.counters()["skipped_steps"], said) == (0, [])
