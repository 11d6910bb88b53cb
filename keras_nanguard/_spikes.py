r"""Gradient-spike detection for SafeOptimizer, on the device.

A step is a spike when its raw global gradient norm :math:`\|g\|` is more
than `sigma` robust standard deviations of the log-norm above the median
log-norm of the `window` norms in the window (below: what writes them):

.. math::

    m = \operatorname{median}_w \log\|g_i\|, \qquad
    s = 1.4826 \cdot \operatorname{median}_w \bigl|\log\|g_i\| - m\bigr|,

    \|g\| > e^{m + \sigma s}

(:math:`1.4826 \cdot` MAD is the standard deviation for normal data, and
gradient norms are roughly log-normal). OLMo-core's `SkipStepOptimizer`
uses the mean and standard deviation of the raw norms instead; replayed on
the clean norms of `benchmarks/bench_spike_false_positives.py` (3,000 steps
of a small MLP), that rejects up to 15 of them with shuffled batches and a
short last batch, whose norm reached 13 times the median, and up to 5 with
full batches; this rule rejected none there on JAX, TensorFlow and torch.
The price, measured there too: late in training the clean norms spread so
that :math:`e^{6 s}` is often above 100 (on JAX, 34-47 times in half the
steps, over 130 in a tenth), so a norm 100 times the median is rejected in
only 58-100 % of the steps, by backend and scenario, and JAX accepted a 100-fold gradient of a
batch whose clean norm is under the median after steps 2,000 and 3,000.

The window is a ring buffer of `window` norms with a count of the steps
written into it, both optimizer variables (saved with the optimizer), and
the figures of the last spike (threshold, median norm :math:`e^m`, scale
:math:`s`), for its report; the test is inactive until the window has
filled. An accepted step writes its norm; a step rejected as a spike writes
the threshold it exceeded (the window is winsorized, as ZClip updates its
statistics with the clipped norm). A window of accepted steps only would
lock for good when the norm's level rises and stays (an actor-critic agent
whose returns grow: every later step a spike, training over without a
word); OLMo-core's window takes the raw norm of every step, so a spike
widens it and the next few pass. With the threshold written instead, a lone
spike moves the window by one bounded value, and a lasting rise is taken in
after a run of rejections, as the thresholds written widen the window's
statistics (5 to 7 steps, by backend, for a 1000-fold rise with
`window=16`, `sigma=6`). Steps rejected for non-finite values are not written. All of it
is a few hundred scalars and two sorts of `window` values: no pass over the
weights, no branch, no host read.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

# 1.4826 * MAD estimates the standard deviation of normal data.
_MAD_TO_STD = 1.4826
# The log of a norm of zero, kept finite.
_TINY = 1e-30


def make_window(optimizer: keras.optimizers.Optimizer, window: int) -> tuple:
    """The ring buffer of norms, the count of steps written into it, and the
    figures of the last spike: threshold, median norm, scale of the
    log-norm."""
    norms = optimizer.add_variable(
        shape=(window,), dtype="float32", aggregation="none", name="spike_norms"
    )
    count = optimizer.add_variable(
        shape=(), dtype="int32", aggregation="none", name="spike_count"
    )
    last = optimizer.add_variable(
        shape=(3,), dtype="float32", aggregation="none", name="last_spike"
    )
    return norms, count, last


def _median(sorted_values: Any) -> Any:
    size = ops.shape(sorted_values)[0]
    return (sorted_values[(size - 1) // 2] + sorted_values[size // 2]) / 2


def statistics(norms: Any) -> tuple[Any, Any]:
    """The median norm of the window and the robust standard deviation of
    its log-norms (1.4826 times their median absolute deviation)."""
    logs = ops.log(ops.maximum(ops.cast(norms, "float32"), _TINY))
    centre = _median(ops.sort(logs))
    scale = _MAD_TO_STD * _median(ops.sort(ops.abs(logs - centre)))
    return ops.exp(centre), scale


def is_spike(norm: Any, norms: Any, count: Any, sigma: float) -> tuple[Any, Any]:
    """Whether `norm` is a spike against a full window (bool scalar), and the
    figures it is compared with: threshold, median norm and scale, stacked."""
    median, scale = statistics(norms)
    threshold = median * ops.exp(sigma * scale)
    full = count >= ops.shape(norms)[0]
    spike = ops.logical_and(full, ops.cast(norm, "float32") > threshold)
    return spike, ops.stack([threshold, median, scale])


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
