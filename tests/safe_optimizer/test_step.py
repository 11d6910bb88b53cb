"""SafeOptimizer's step, `GuardedStep`, on its own: an inner optimizer, the
counters (held by another optimizer) and the settings, nothing else."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_nanguard.safe_optimizer.counters import Counters
from keras_nanguard.safe_optimizer.optimizer import ARGUMENTS
from keras_nanguard.safe_optimizer.step import GuardedStep
from tests.helpers import assert_bit_identical, numpy


def _transaction(inner, **settings):
    counters = Counters.create(keras.optimizers.SGD(0.0), ARGUMENTS.of(**settings))
    return GuardedStep(inner, counters, ARGUMENTS.of(**settings)), counters


def _variables():
    return [
        keras.Variable(np.array([1.0, 2.0], "float32"), name="w"),
        keras.Variable(np.array([0.5], "float32"), name="b"),
    ]


def _tensors(*arrays):
    return [ops.convert_to_tensor(np.array(a, "float32")) for a in arrays]


def test_a_good_step_is_the_inner_optimizers_step():
    variables = _variables()
    inner = keras.optimizers.SGD(0.5)
    step, counters = _transaction(inner)
    step.build(variables)
    step.apply(_tensors([1.0, -2.0], [4.0]), variables)
    assert numpy(variables)[0].tolist() == [0.5, 3.0]
    assert numpy(variables)[1].tolist() == [-1.5]
    assert int(inner.iterations) == 1
    c = counters.read()
    assert (c["skipped_steps"], c["last_rejection"]) == (0, 0)
    assert c["last_grad_norm"] == pytest.approx(np.sqrt(21.0), rel=1e-6)


def test_a_nan_gradient_leaves_weights_and_inner_state_as_they_were():
    variables = _variables()
    inner = keras.optimizers.Adam(0.1)
    step, counters = _transaction(inner)
    step.build(variables)
    step.apply(_tensors([1.0, 1.0], [1.0]), variables)
    before = numpy(variables) + numpy(inner.variables)
    step.apply(_tensors([1.0, 1.0], [np.nan]), variables)
    assert_bit_identical(before, numpy(variables) + numpy(inner.variables))
    c = counters.read()
    assert (c["skipped_steps"], c["last_rejection"], c["last_nonfinite_index"]) == (
        1,
        1,
        1,
    )
    assert int(inner.iterations) == 1


def test_an_update_that_overflows_is_rolled_back_and_names_the_variable():
    variables = _variables()
    inner = keras.optimizers.SGD(1e38)
    step, counters = _transaction(inner)
    step.build(variables)
    before = numpy(variables)
    step.apply(_tensors([0.0, -1e2], [0.0]), variables)  # w[1] overflows
    assert_bit_identical(before, numpy(variables))
    c = counters.read()
    assert (c["nonfinite_update_steps"], c["last_rejection"]) == (1, 2)
    assert c["last_nonfinite_index"] == 0  # the first float state: `w`


def test_clipnorm_scales_the_gradients_to_the_global_norm():
    variables = _variables()
    step, counters = _transaction(keras.optimizers.SGD(1.0), clipnorm=1.0)
    step.build(variables)
    step.apply(_tensors([3.0, 0.0], [4.0]), variables)  # norm 5
    np.testing.assert_allclose(numpy(variables)[0], [1.0 - 0.6, 2.0], rtol=1e-6)
    np.testing.assert_allclose(numpy(variables)[1], [0.5 - 0.8], rtol=1e-6)
    assert counters.read()["clipped_steps"] == 1


def test_lr_backoff_steps_at_the_scaled_rate_and_puts_the_rate_back():
    variables = _variables()
    inner = keras.optimizers.SGD(1.0)
    step, counters = _transaction(inner, lr_backoff=0.5)
    step.build(variables)
    counters.lr_scale.assign(0.25)
    step.apply(_tensors([1.0, 1.0], [1.0]), variables)
    assert numpy(variables)[0].tolist() == [0.75, 1.75]
    assert float(inner.learning_rate) == 1.0


def test_a_halted_step_rejects_even_a_good_gradient():
    variables = _variables()
    step, counters = _transaction(keras.optimizers.SGD(0.1), max_consecutive_skips=2)
    step.build(variables)
    counters.consecutive_skips.assign(2)
    before = numpy(variables)
    step.apply(_tensors([1.0, 1.0], [1.0]), variables)
    assert_bit_identical(before, numpy(variables))
    assert counters.read()["consecutive_skips"] == 3


def test_the_plan_checks_present_gradients_and_reports_built_positions():
    variables = _variables()
    inner = keras.optimizers.Adam(0.1)
    step, _ = _transaction(inner)
    step.build(variables)
    # Called for `b` alone, its gradient present: reported as built index 1.
    plan = step.plan([None, _tensors([1.0])[0]], variables)
    assert plan.checked == [1]
    assert plan.grad_index == (1,)
    # The weights, then the inner optimizer's variables (Adam: iterations,
    # the learning rate, two moments per weight), the int `iterations` not
    # checked for finiteness.
    assert [id(v) for v in plan.state] == [id(v) for v in variables + inner.variables]
    assert len(plan.state) == 8
    assert plan.floats == [0, 1, 3, 4, 5, 6, 7]
    assert plan.state_index == (0, 1, 3, 4, 5, 6, 7)
    assert step.plan([None, _tensors([1.0])[0]], variables) is plan  # made once
