"""diagnose(): where a batch first goes non-finite, and why, in words.

Here: `diagnose()` itself (its arguments, and the model and optimizer state it
leaves as it found them), and what it returns, `Diagnosis` with a `LayerStats`
per layer (defined in `findings`, which both this module and `stages`
import, and importable from here). The checks it runs, one per stage, are in
`stages`; the cause vocabulary (`CAUSES`, also importable from here) and the
hints in `causes`; the eager probes in `probes`.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from keras_nanguard._host_device import host_view
from keras_nanguard.diagnosis import probes
from keras_nanguard.diagnosis import stages as _stages
from keras_nanguard.diagnosis.causes import CAUSES
from keras_nanguard.diagnosis.findings import STAGES, Diagnosis, LayerStats

__all__ = ["CAUSES", "STAGES", "Diagnosis", "LayerStats", "diagnose"]


def diagnose(
    model: keras.Model,
    x: Any,
    y: Any = None,
    *,
    loss: Any = None,
    optimizer: keras.optimizers.Optimizer | None = None,
    sample_weight: Any = None,
) -> Diagnosis:
    """Re-runs one batch eagerly and finds where, and why, it goes non-finite.

    It checks, in order: the inputs, the targets, the weights (and the
    optimizer's state), each layer's output in forward order, the loss, the
    gradients (the first non-finite one going backward), and, given an
    optimizer, the update it would make. Training pays nothing for it; the
    model, its optimizer and its metrics are left exactly as they were.

    Layers are followed into nested models (Sequential, functional and
    subclassed: whatever `model.layers` lists, recursively); a custom layer
    that holds sublayers without being a `Model` is seen as one unit. Where a
    weightless layer (a norm, a sqrt) breaks the backward pass, the layer
    named is the nearest layer before it that has weights.

    Args:
        model: a built Keras model.
        x: one batch of inputs.
        y: its targets, or `None`.
        loss: a Keras loss, its name, or a callable `(y_true, y_pred)`;
            defaults to the model's compiled loss (with its regularisation).
        optimizer: optionally, the optimizer whose update to check
            (SafeOptimizer and LossScaleOptimizer are looked through).
        sample_weight: optional sample weights for the loss.

    Returns:
        A `Diagnosis`.

    Example:

    >>> import numpy as np, keras, keras_nanguard as ng
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> report = ng.diagnose(model, np.array([[1.0, np.nan]]), np.ones((1, 1)),
    ...                      loss="mse")
    >>> report.stage, report.causes
    ('input', ['nonfinite_input'])
    """
    # As in fit: the loss sees backend tensors, not NumPy arrays.
    y, sample_weight = probes.to_tensors(y), probes.to_tensors(sample_weight)
    loss_of = probes.loss_function(model, loss, x, y, sample_weight)
    if not model.built:
        model(x, training=False)  # build it, without touching any state
    leaves = probes.leaf_layers(model)
    optimizer = _optimizer(optimizer)
    # Every variable, seed generators' state included (not only `weights`):
    # the probes' training-mode calls advance Dropout's random stream.
    state = list(model.variables)
    state += list(optimizer.variables) if optimizer is not None else []
    saved = [np.array(host_view(v), copy=True) for v in state]
    try:
        return _stages.run_stages(model, x, y, loss_of, leaves, optimizer)
    finally:
        for v, value in zip(state, saved, strict=True):
            v.assign(value)


def _optimizer(optimizer: Any) -> keras.optimizers.Optimizer | None:
    """The optimizer to check: one, its name (as `compile` accepts), or None."""
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    if optimizer is not None and not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`optimizer` must be a Keras optimizer, its name, or None. "
            f"Received: optimizer={optimizer!r} of type {type(optimizer).__name__}"
        )
    return optimizer
