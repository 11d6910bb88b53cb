"""diagnose(): where a batch first goes non-finite, and why, in words.

Here: `diagnose()` itself (its arguments, and the model and optimizer state it
leaves as it found them), and what it returns, `Diagnosis` with a `LayerStats`
per layer. The checks it runs, one per stage, are in `_stages`; the cause
vocabulary (`CAUSES`, also importable from here) and the hints in `causes`;
the eager probes in `_probes`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import keras
import numpy as np

from keras_nanguard import _probes as probes
from keras_nanguard import snapshots
from keras_nanguard.causes import CAUSES

__all__ = ["CAUSES", "STAGES", "Diagnosis", "LayerStats", "diagnose"]

STAGES = ("input", "target", "weights", "forward", "loss", "backward", "update")


@dataclasses.dataclass
class LayerStats:
    """Per-layer figures from the diagnosed batch."""

    name: str
    class_name: str
    max_abs: float | None = None
    zero_fraction: float | None = None
    saturated_fraction: float | None = None
    nonfinite: bool = False
    grad_norm: float | None = None


@dataclasses.dataclass
class Diagnosis:
    """Where a batch first stops being finite, why, and what to change.

    Attributes:
        stage: one of `STAGES` (`"input"`, `"target"`, `"weights"`,
            `"forward"`, `"loss"`, `"backward"`, `"update"`), or `None` when
            the batch is healthy.
        layer: the name (path) of the first layer involved, or `None`.
        causes: codes from `CAUSES`, most likely first.
        hints: sentences saying what to change.
        detail: what was found, in words.
        layers: `LayerStats` for every layer, in forward order.
        loss: the loss of the batch (may be NaN/inf), or `None`.
        grad_norm: global norm of the gradients, or `None`.

    Example:

    >>> import keras_nanguard as ng
    >>> ng.Diagnosis(stage=None).healthy
    True
    """

    stage: str | None
    layer: str | None = None
    causes: list[str] = dataclasses.field(default_factory=list)
    hints: list[str] = dataclasses.field(default_factory=list)
    detail: str = ""
    layers: list[LayerStats] = dataclasses.field(default_factory=list)
    loss: float | None = None
    grad_norm: float | None = None

    @property
    def healthy(self) -> bool:
        return self.stage is None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (NaN/inf as strings)."""
        return _jsonable(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Diagnosis:
        data = dict(data)
        data["layers"] = [LayerStats(**_unjson(s)) for s in data.get("layers", [])]
        for key in ("loss", "grad_norm"):
            data[key] = _unjson_value(data.get(key))
        return cls(**data)

    def __str__(self) -> str:
        if self.healthy:
            return (
                "Diagnosis: healthy. Inputs, targets, weights, every layer's "
                f"output, the loss ({_fmt(self.loss)}) and the gradients "
                f"(global norm {_fmt(self.grad_norm)}) are finite."
            )
        where = f" in layer '{self.layer}'" if self.layer else ""
        lines = [
            f"Diagnosis: the batch first goes non-finite at the {self.stage} "
            f"stage{where}.",
            f"  What: {self.detail}",
            "  Likely cause: "
            + "; then ".join(f"{c} ({CAUSES[c]})" for c in self.causes)
            + ".",
        ]
        lines += [f"  Do: {h}" for h in self.hints]
        return "\n".join(lines)


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
    if isinstance(optimizer, str):  # a name, as `compile` accepts
        optimizer = keras.optimizers.get(optimizer)
    if optimizer is not None and not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`optimizer` must be a Keras optimizer, its name, or None. "
            f"Received: optimizer={optimizer!r} of type {type(optimizer).__name__}"
        )
    # Every variable, seed generators' state included (not only `weights`):
    # the probes' training-mode calls advance Dropout's random stream.
    state = list(model.variables)
    state += list(optimizer.variables) if optimizer is not None else []
    saved = [np.array(snapshots.host_view(v), copy=True) for v in state]
    # _stages builds Diagnosis objects from this module: imported on first
    # use, not at the top, so that neither module imports the other half-made.
    from keras_nanguard import _stages

    try:
        return _stages.run_stages(model, x, y, loss_of, leaves, optimizer)
    finally:
        for v, value in zip(state, saved, strict=True):
            v.assign(value)


# ------------------------------------------------------------------ helpers
def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj


def _unjson_value(value: Any) -> Any:
    return float(value) if value in ("nan", "inf", "-inf") else value


def _unjson(data: dict) -> dict:
    return {k: _unjson_value(v) for k, v in data.items()}
