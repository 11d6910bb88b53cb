r"""Gradient-spike detection for SafeOptimizer, on the device.

A step is a spike when its raw global gradient norm :math:`\|g\|` is more
than `sigma` standard deviations above the mean of the last `window`
accepted steps:

.. math:: \|g\| > \mu_w + \sigma \cdot s_w

as OLMo-core's `SkipStepOptimizer` decides (population standard deviation).
The window is a ring buffer of `window` norms with a count of accepted
steps, both optimizer variables (saved with the optimizer), written only by
accepted steps; the test is inactive until the window has filled. All of it
is a few hundred scalars: no pass over the weights, no branch, no host read.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops


def make_window(optimizer: keras.optimizers.Optimizer, window: int) -> tuple:
    """The ring buffer of accepted norms and the count of accepted steps."""
    norms = optimizer.add_variable(
        shape=(window,), dtype="float32", aggregation="none", name="spike_norms"
    )
    count = optimizer.add_variable(
        shape=(), dtype="int32", aggregation="none", name="spike_count"
    )
    return norms, count


def statistics(norms: Any) -> tuple[Any, Any]:
    """Mean and (population) standard deviation of the window."""
    mean = ops.mean(norms)
    return mean, ops.sqrt(ops.mean(ops.square(norms - mean)))


def is_spike(norm: Any, norms: Any, count: Any, sigma: float) -> Any:
    """Whether `norm` is a spike against a full window (bool scalar)."""
    mean, std = statistics(norms)
    full = count >= ops.shape(norms)[0]
    return ops.logical_and(full, norm > mean + sigma * std)


def record(accepted: Any, norm: Any, norms: keras.Variable, count: keras.Variable):
    """Writes an accepted step's norm into the window (a rejected step's is
    not recorded)."""
    size = ops.shape(norms.value)[0]
    slot = ops.arange(size) == ops.mod(count.value, size)
    norms.assign(ops.where(ops.logical_and(accepted, slot), norm, norms.value))
    count.assign(count.value + ops.cast(accepted, "int32"))
