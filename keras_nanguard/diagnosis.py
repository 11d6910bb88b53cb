"""diagnose(): where a batch first goes non-finite, and why, in words."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import keras
import numpy as np

from keras_nanguard import _probes as probes
from keras_nanguard import snapshots
from keras_nanguard.causes import CAUSES, hints_for, overflow_hints

__all__ = ["CAUSES", "STAGES", "Diagnosis", "LayerStats", "diagnose"]

STAGES = ("input", "target", "weights", "forward", "loss", "backward", "update")

#: Global gradient norm above `_EXPLODING * (1 + global weight norm)` counts
#: as exploding.
_EXPLODING = 1e4
_SATURATED = 1e-7


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
    optimizer_vars = list(optimizer.variables) if optimizer is not None else []
    saved = [
        np.array(snapshots.host_view(v), copy=True)
        for v in list(model.weights) + optimizer_vars
    ]
    try:
        return _diagnose(model, x, y, loss_of, leaves, optimizer)
    finally:
        for v, value in zip(list(model.weights) + optimizer_vars, saved, strict=True):
            v.assign(value)


def _diagnose(model, x, y, loss_of, leaves, optimizer) -> Diagnosis:
    for stage, cause, data in (
        ("input", "nonfinite_input", x),
        ("target", "nonfinite_target", y),
    ):
        bad = probes.nonfinite_arrays(data)
        if bad:
            return _result(stage, None, [cause], f"{stage}s: {bad}")
    for name, layer in leaves:
        bad = [
            v.name
            for v in layer.weights
            if not snapshots.host_finite(snapshots.host_view(v))
        ]
        if bad:
            return _result(
                "weights",
                name,
                ["nonfinite_weights"],
                f"non-finite weights {bad} in layer '{name}'",
            )
    if optimizer is not None:
        bad = snapshots.nonfinite_variables(snapshots.optimizer_state(optimizer))
        if bad:
            return _result(
                "weights",
                None,
                ["nonfinite_weights"],
                f"non-finite optimizer state: {bad[:5]}",
            )

    # Forward, layer by layer.
    records, y_pred, loss_tensor, gradients = probes.record_forward(
        model, x, leaves, loss_of
    )
    stats = [_layer_stats(name, layer, out) for name, layer, _, out in records]
    for i, ((name, layer, inputs, out), st) in enumerate(
        zip(records, stats, strict=True)
    ):
        if st.nonfinite:
            upto = [rec[1] for rec in records[: i + 1]]
            return _forward_cause(name, layer, inputs, out, stats, upto)

    # Loss.
    loss_value = probes.to_float(loss_tensor)
    probs = probes.probability_outputs(y_pred, records[-1][1] if records else None)
    out_name = records[-1][0] if records else None
    if not math.isfinite(loss_value):
        if probs is not None and probes.clipped_loss_finite(loss_of, y_pred, probs):
            return _result(
                "loss",
                out_name,
                ["log_of_zero"],
                f"loss {loss_value}: predicted probabilities include exact "
                f"0 ({probes.fraction_zero(y_pred, probs):.1%} of entries) and a log "
                "takes them",
                stats,
                loss_value,
            )
        if probes.scaled_loss_finite(loss_of, y_pred, y):
            return _result(
                "loss",
                out_name,
                ["loss_overflow"],
                f"loss {loss_value} with finite predictions (max |y_pred| "
                f"{probes.max_abs(y_pred):.3g}, max |y| {probes.max_abs(y):.3g})",
                stats,
                loss_value,
            )
        return _result(
            "loss",
            out_name,
            ["invalid_arithmetic"],
            f"loss {loss_value} with finite predictions",
            stats,
            loss_value,
        )

    # Backward.
    grads = gradients()
    tv = model.trainable_variables
    owner = probes.owners(leaves)
    norms = [
        None if g is None else float(np.sqrt(np.sum(np.square(g, dtype=np.float64))))
        for g in grads
    ]
    for st in stats:
        per_layer = [
            n
            for v, n in zip(tv, norms, strict=True)
            if owner.get(id(v)) == st.name and n is not None
        ]
        st.grad_norm = (
            float(np.sqrt(sum(n * n for n in per_layer))) if per_layer else None
        )
    global_norm = float(np.sqrt(sum(n * n for n in norms if n is not None)))
    bad = [
        i for i, g in enumerate(grads) if g is not None and not snapshots.host_finite(g)
    ]
    if bad:
        order = {name: k for k, (name, _) in enumerate(leaves)}
        last = max(bad, key=lambda i: order.get(owner.get(id(tv[i])), -1))
        layer = owner.get(id(tv[last]))
        causes = ["nonfinite_gradient"]
        if probs is not None and probes.clipped_gradients_finite(
            model, x, loss_of, probs
        ):
            causes = ["log_of_zero", "nonfinite_gradient"]
        return _result(
            "backward",
            layer,
            causes,
            f"forward pass and loss ({_fmt(loss_value)}) are finite, but the "
            f"gradient of '{snapshots.variable_name(tv[last])}' is not (going backward, the "
            f"first of {len(bad)} non-finite gradients)",
            stats,
            loss_value,
            global_norm,
        )
    weight_norm = float(
        np.sqrt(
            sum(np.sum(np.square(snapshots.host_view(v), dtype=np.float64)) for v in tv)
        )
    )
    if global_norm > _EXPLODING * (1.0 + weight_norm):
        biggest = max(
            (s for s in stats if s.grad_norm), key=lambda s: s.grad_norm, default=None
        )
        return _result(
            "backward",
            biggest.name if biggest else None,
            ["exploding_gradient"],
            f"global gradient norm {global_norm:.3g} against a weight norm "
            f"of {weight_norm:.3g}",
            stats,
            loss_value,
            global_norm,
        )

    # Update.
    if optimizer is not None:
        bad_after = probes.probe_update(model, optimizer, grads, leaves)
        if bad_after:
            layer, names = bad_after
            return _result(
                "update",
                layer,
                ["update_overflow"],
                f"one update with the gradients (finite, global norm "
                f"{global_norm:.3g}) makes {names} non-finite",
                stats,
                loss_value,
                global_norm,
            )
    return Diagnosis(stage=None, layers=stats, loss=loss_value, grad_norm=global_norm)


# ------------------------------------------------------------------- causes
def _forward_cause(name, layer, inputs, out, stats, upto) -> Diagnosis:
    values = probes.host_tree(out)
    has_nan = any(np.isnan(v).any() for v in values)
    has_inf = any(np.isinf(v).any() for v in values)
    finite_in = not probes.nonfinite_arrays(inputs)
    big = max(
        (float(np.max(np.abs(v[np.isfinite(v)]), initial=0.0)) for v in values),
        default=0.0,
    )
    if has_inf or big > 1e30:
        causes = ["activation_overflow"] + (["invalid_arithmetic"] if has_nan else [])
    else:
        causes = ["invalid_arithmetic"]
    detail = (
        f"layer '{name}' ({type(layer).__name__}) outputs "
        f"{'NaN' if has_nan else ''}{' and ' if has_nan and has_inf else ''}"
        f"{'inf' if has_inf else ''} from {'finite' if finite_in else 'non-finite'} "
        "inputs"
    )
    hints = overflow_hints(upto) if "activation_overflow" in causes else []
    return _result("forward", name, causes, detail, stats, extra_hints=hints)


def _result(
    stage, layer, causes, detail, stats=(), loss=None, grad_norm=None, extra_hints=()
) -> Diagnosis:
    return Diagnosis(
        stage=stage,
        layer=layer,
        causes=list(causes),
        hints=hints_for(causes, extra_hints),
        detail=detail,
        layers=list(stats),
        loss=loss,
        grad_norm=grad_norm,
    )


# ------------------------------------------------------------------ helpers
def _layer_stats(name, layer, out) -> LayerStats:
    # Activations can be large (a conv layer's output): reductions only, on
    # host views in the native dtype, no float64 or boolean copies on the
    # healthy path.
    values = [v for v in probes.host_tree(out) if v.dtype.kind == "f" and v.size]
    st = LayerStats(name=name, class_name=type(layer).__name__)
    if not values:
        return st
    size = sum(v.size for v in values)
    lo = min(float(v.min()) for v in values)  # NaN and inf show up here
    hi = max(float(v.max()) for v in values)
    st.nonfinite = not (math.isfinite(lo) and math.isfinite(hi))
    if st.nonfinite:
        values = [v[np.isfinite(v)] for v in values]
        lo = min(float(v.min(initial=np.inf)) for v in values)
        hi = max(float(v.max(initial=-np.inf)) for v in values)
    st.max_abs = max(abs(lo), abs(hi)) if math.isfinite(lo) else 0.0
    st.zero_fraction = sum(v.size - np.count_nonzero(v) for v in values) / size
    if not st.nonfinite and lo >= 0 and hi <= 1:
        sat = sum(
            np.count_nonzero((v < _SATURATED) | (v > 1 - _SATURATED)) for v in values
        )
        st.saturated_fraction = sat / size
    return st


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
