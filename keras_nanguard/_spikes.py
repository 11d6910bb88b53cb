r"""Gradient-spike detection for SafeOptimizer, on the device.

A step is a spike when its raw global gradient norm :math:`\|g\|` is more
than `sigma` standard deviations above the mean of the `window` norms in
the window (below: what writes them):

.. math:: \|g\| > \mu_w + \sigma \cdot s_w

as OLMo-core's `SkipStepOptimizer` decides (population standard deviation).
The window is a ring buffer of `window` norms with a count of the steps
written into it, both optimizer variables (saved with the optimizer); the
test is inactive until the window has filled. An accepted step writes its
norm; a step rejected as a spike writes the threshold it exceeded (the
window is winsorized, as ZClip updates its statistics with the clipped
norm). A window of accepted steps only would lock for good when the norm's
level rises and stays (an actor-critic agent whose returns grow: every later
step a spike, training over without a word); OLMo-core's window takes the
raw norm of every step, so a spike widens it and the next few pass. With the
threshold written instead, a lone spike moves the window by one bounded
value, and a lasting rise is taken in after a run of rejections (about 60
steps for a 1000-fold rise with `window=128`, `sigma=6`). Steps rejected for
non-finite values are not written. All of it is a few hundred scalars: no
pass over the weights, no branch, no host read.
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


def is_spike(norm: Any, norms: Any, count: Any, sigma: float) -> tuple[Any, Any]:
    """Whether `norm` is a spike against a full window (bool scalar), and the
    threshold it is compared with."""
    mean, std = statistics(norms)
    threshold = mean + sigma * std
    full = count >= ops.shape(norms)[0]
    return ops.logical_and(full, norm > threshold), threshold


def record(
    accepted: Any,
    spike: Any,
    norm: Any,
    threshold: Any,
    norms: keras.Variable,
    count: keras.Variable,
) -> None:
    """Writes an accepted step's norm into the window, or the threshold a
    step rejected as a spike exceeded; any other rejected step writes
    nothing."""
    size = ops.shape(norms.value)[0]
    slot = ops.arange(size) == ops.mod(count.value, size)
    writes = ops.logical_or(accepted, spike)
    value = ops.where(accepted, norm, ops.cast(threshold, norms.dtype))
    norms.assign(ops.where(ops.logical_and(writes, slot), value, norms.value))
    count.assign(count.value + ops.cast(writes, "int32"))
