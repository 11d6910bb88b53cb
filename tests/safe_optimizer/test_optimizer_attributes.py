"""SafeOptimizer's attributes over its parts: every counter read on the
optimizer is the variable of its `Counters`, and a setting set on it reaches
every part."""

import keras
import numpy as np
import pytest

import keras_nanguard as ng
from keras_nanguard.safe_optimizer.counters import COUNTER_NAMES, WINDOW_NAMES
from tests.helpers import FLIGHT_NAMES


def test_each_counter_on_the_optimizer_is_its_variable_in_order():
    opt = ng.SafeOptimizer(keras.optimizers.Adam(0.1), spike_factor=10.0)
    opt.build([keras.Variable([1.0, 2.0])])
    names = COUNTER_NAMES + WINDOW_NAMES
    own = opt.variables[: len(names)]
    # The norms, which may be non-finite, are held as finite codes and read
    # as their values (NaN, inf included): tensors, not the variables.
    coded = ("last_grad_norm", "rejected_grad_norm")
    plain = [(n, v) for n, v in zip(names, own, strict=True) if n not in coded]
    assert [id(getattr(opt, n)) for n, _ in plain] == [id(v) for _, v in plain]
    assert [v.name for v in own] == list(names)
    for name in coded:
        variable = own[names.index(name)]
        variable.assign(-np.finfo("float32").max)  # the code of NaN
        assert np.isnan(float(getattr(opt, name)))
        variable.assign(2.5)
        assert float(getattr(opt, name)) == 2.5
    # Then the flight recorder's (made by `build`), the inner optimizer's,
    # and nothing twice.
    recorder = opt.variables[len(names) : len(names) + len(FLIGHT_NAMES)]
    assert [v.name for v in recorder] == FLIGHT_NAMES
    rest = opt.variables[len(names) + len(FLIGHT_NAMES) :]
    assert [id(v) for v in rest] == [id(v) for v in opt.inner_optimizer.variables]
    assert len({id(v) for v in opt.variables}) == len(opt.variables) == 32


def test_without_spike_factor_there_is_no_window():
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1))
    assert [hasattr(opt, name) for name in WINDOW_NAMES] == [False] * 3
    assert len(opt.variables) == len(COUNTER_NAMES) + 2


def test_counters_are_read_only_attributes_with_their_meaning():
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(AttributeError, match=r"optimizer\.skipped_steps\.assign"):
        opt.skipped_steps = 3
    assert ng.SafeOptimizer.skipped_steps.__doc__ == "Rejected steps in total."
    opt.skipped_steps.assign(3)
    assert int(opt.skipped_steps) == 3 and opt.counters()["skipped_steps"] == 3


def test_a_setting_set_on_the_optimizer_reaches_its_parts():
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1), clipnorm=1.0)
    opt.clipnorm = 2.0
    opt.max_consecutive_skips = 3
    settings = opt._settings
    assert (settings.clipnorm, settings.max_consecutive_skips) == (2.0, 3)
    assert opt._counters.settings is settings
    assert opt._step.settings is settings
    assert opt._model_transaction.settings is settings
    config = opt.get_config()
    assert (config["clipnorm"], config["max_consecutive_skips"]) == (2.0, 3)


def test_the_base_class_default_clipnorm_is_not_the_users():
    # keras.optimizers.Optimizer.__init__ sets `clipnorm = None` first.
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1), clipnorm=0.5)
    assert opt.clipnorm == 0.5
