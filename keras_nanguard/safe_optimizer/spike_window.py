r"""Gradient-spike detection for SafeOptimizer, on the device.

A step is a spike when its raw global gradient norm :math:`\|g\|` is more
than `factor` times the 90th percentile of the `window` norms in the window
(below: what writes them):

.. math:: \|g\| > \text{factor} \cdot q_{0.9}(\text{window})

Why a percentile and not the mean and standard deviation, as OLMo-core's
`SkipStepOptimizer` decides (mean + 6 standard deviations): measured in
`benchmarks/bench_spike_false_positives.py` (3,000 clean steps of a small
MLP on three backends), a clean step's norm reached 13 times the window's
median with shuffled batches and a 5-sample last batch, and the mean + 6
standard deviations rejected up to 12 clean steps there (1-2 with shuffled
full batches). Late in training, when most batches are learnt, the norms
spread downwards: 6 robust standard deviations of the log-norm (median and
MAD) then reach hundreds of times the median, and a gradient 100 times too
large passes. The 90th percentile tracks the upper range of the clean norms
and nothing else: there, no clean step went past 6 times it, and with
`factor=10` a norm 100 times the median was rejected at every step.

The window is a ring buffer of `window` norms with a count of the steps
written into it, and the figures of the last spike (the threshold and the
percentile), all optimizer variables (saved with the optimizer); the test is
inactive until the window has filled. An accepted step writes its norm; a
step rejected as a spike writes the threshold it exceeded (the window is
winsorized, as ZClip updates its statistics with the clipped norm). A window
of accepted steps only would lock for good when the norm's level rises and
stays (an actor-critic agent whose returns grow: every later step a spike,
training over without a word); OLMo-core's window takes the raw norm of
every step, so a spike widens it and the next few pass. With the threshold
written instead, a lone spike moves the window by one bounded value, and a
lasting rise is taken in after a run of rejections: once a tenth of the
window holds thresholds, the percentile is one of them. Steps rejected for
non-finite values are not written. All of it is a sort of `window` scalars:
no pass over the weights, no branch, no host read.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from keras_nanguard import _kernels as kernels

PERCENTILE = 0.9


def make_window(
    optimizer: keras.optimizers.Optimizer, window: int
) -> tuple[keras.Variable, keras.Variable, keras.Variable]:
    """The ring buffer of norms, the count of steps written into it, and the
    figures of the last spike: threshold and percentile."""
    norms = kernels.state_variable(optimizer, "spike_norms", (window,))
    count = kernels.state_variable(optimizer, "spike_count", (), "int32")
    last = kernels.state_variable(optimizer, "last_spike", (2,))
    return norms, count, last


def percentile(norms: Any) -> Any:
    """The window's 90th percentile (linear interpolation, as NumPy's)."""
    ordered = ops.sort(ops.cast(norms, "float32"))
    position = PERCENTILE * (ops.shape(ordered)[0] - 1)
    low = int(position)
    high = min(low + 1, ops.shape(ordered)[0] - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


def is_spike(norm: Any, norms: Any, count: Any, factor: float) -> tuple[Any, Any]:
    """Whether `norm` is a spike against a full window (bool scalar), and the
    figures it is compared with: threshold and percentile, stacked."""
    reference = percentile(norms)
    threshold = factor * reference
    full = count >= ops.shape(norms)[0]
    spike = ops.logical_and(full, ops.cast(norm, "float32") > threshold)
    return spike, ops.stack([threshold, reference])


def record(
    accepted: Any,
    spike: Any,
    norm: Any,
    figures: Any,
    norms: keras.Variable,
    count: keras.Variable,
    last: keras.Variable,
) -> None:
    """Writes an accepted step's norm into the window, or the threshold a
    step rejected as a spike exceeded, and keeps a spike's figures; any
    other rejected step writes nothing."""
    size = ops.shape(norms.value)[0]
    slot = ops.arange(size) == ops.mod(count.value, size)
    writes = ops.logical_or(accepted, spike)
    value = ops.where(accepted, norm, ops.cast(figures[0], norms.dtype))
    norms.assign(ops.where(ops.logical_and(writes, slot), value, norms.value))
    count.assign(count.value + ops.cast(writes, "int32"))
    last.assign(ops.where(spike, ops.cast(figures, last.dtype), last.value))
