"""diagnose()'s stages, in order: the batch's data, the weights, the forward
pass layer by layer, the loss, the gradients, the optimizer's update.

Each stage is one check that takes the `_Run` (the batch, and what the stages
before it measured), adds what it measures, and returns a `Diagnosis` when
the batch goes non-finite there, or `None` to go on. `run_stages` calls them
in order; the first finding is the diagnosis.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from keras_nanguard import snapshots
from keras_nanguard._host_device import host_finite, host_view
from keras_nanguard.diagnosis import probes
from keras_nanguard.diagnosis.causes import hints_for, overflow_hints
from keras_nanguard.diagnosis.findings import Diagnosis, LayerStats

#: Global gradient norm above `_EXPLODING * (1 + global weight norm)` counts
#: as exploding.
_EXPLODING = 1e4
_SATURATED = 1e-7


@dataclasses.dataclass
class _Run:
    """One diagnosis: the batch, and what each stage leaves for the next."""

    model: keras.Model
    x: Any
    y: Any
    loss_of: Callable[..., Any]
    leaves: list[tuple[str, keras.layers.Layer]]
    optimizer: keras.optimizers.Optimizer | None
    # Forward: (name, layer, inputs, output) per leaf call, and the outputs.
    records: list[tuple[str, Any, Any, Any]] = dataclasses.field(default_factory=list)
    y_pred: Any = None
    loss_tensor: Any = None
    gradients: Callable[[], list[np.ndarray | None]] | None = None
    stats: list[LayerStats] = dataclasses.field(default_factory=list)
    # Loss: its value, and which outputs are probabilities.
    loss: float | None = None
    probs: list[bool] | None = None
    # Backward.
    grads: list[np.ndarray | None] = dataclasses.field(default_factory=list)
    grad_norm: float | None = None

    def result(self, stage, layer, causes, detail, extra_hints=()) -> Diagnosis:
        """A finding at `stage`, with what the stages so far have measured."""
        return Diagnosis(
            stage=stage,
            layer=layer,
            causes=list(causes),
            hints=hints_for(causes, extra_hints),
            detail=detail,
            layers=list(self.stats),
            loss=self.loss,
            grad_norm=self.grad_norm,
        )


def run_stages(model, x, y, loss_of, leaves, optimizer) -> Diagnosis:
    """Runs the stage checks in order; the first finding is the diagnosis."""
    state = _Run(model, x, y, loss_of, leaves, optimizer)
    for check in (
        _check_data,
        _check_weights,
        _check_forward,
        _check_loss,
        _check_backward,
        _check_update,
    ):
        found = check(state)
        if found is not None:
            return found
    return Diagnosis(
        stage=None, layers=state.stats, loss=state.loss, grad_norm=state.grad_norm
    )


def _check_data(run: _Run) -> Diagnosis | None:
    """Inputs, then targets: NaN or inf already in the batch."""
    for stage, cause, data in (
        ("input", "nonfinite_input", run.x),
        ("target", "nonfinite_target", run.y),
    ):
        bad = probes.nonfinite_arrays(data)
        if bad:
            return run.result(stage, None, [cause], f"{stage}s: {bad}")
    return None


def _check_weights(run: _Run) -> Diagnosis | None:
    """Each layer's weights, then the optimizer's state."""
    for name, layer in run.leaves:
        bad = [v.name for v in layer.weights if not host_finite(host_view(v))]
        if bad:
            return run.result(
                "weights",
                name,
                ["nonfinite_weights"],
                f"non-finite weights {bad} in layer '{name}'",
            )
    if run.optimizer is not None:
        bad = snapshots.nonfinite_variables(snapshots.optimizer_state(run.optimizer))
        if bad:
            return run.result(
                "weights",
                None,
                ["nonfinite_weights"],
                f"non-finite optimizer state: {bad[:5]}",
            )
    return None


def _check_forward(run: _Run) -> Diagnosis | None:
    """One recorded forward pass: the first layer whose output is not finite."""
    run.records, run.y_pred, run.loss_tensor, run.gradients = probes.record_forward(
        run.model, run.x, run.leaves, run.loss_of
    )
    run.stats = [_layer_stats(name, layer, out) for name, layer, _, out in run.records]
    for i, ((name, layer, inputs, out), st) in enumerate(
        zip(run.records, run.stats, strict=True)
    ):
        if st.nonfinite:
            upto = [rec[1] for rec in run.records[: i + 1]]
            return _forward_cause(run, name, layer, inputs, out, upto)
    return None


def _check_loss(run: _Run) -> Diagnosis | None:
    """The loss of that pass: log(0), an overflow, or a NaN made in the loss."""
    run.loss = loss_value = probes.to_float(run.loss_tensor)
    last = run.records[-1] if run.records else None
    run.probs = probes.probability_outputs(run.y_pred, last[1] if last else None)
    if math.isfinite(loss_value):
        return None
    out_name = last[0] if last else None
    y_pred = run.y_pred
    if run.probs is not None and probes.clipped_loss_finite(
        run.loss_of, y_pred, run.probs
    ):
        return run.result(
            "loss",
            out_name,
            ["log_of_zero"],
            f"loss {loss_value}: predicted probabilities include exact "
            f"0 ({probes.fraction_zero(y_pred, run.probs):.1%} of entries) and a log "
            "takes them",
        )
    if probes.scaled_loss_finite(run.loss_of, y_pred, run.y):
        return run.result(
            "loss",
            out_name,
            ["loss_overflow"],
            f"loss {loss_value} with finite predictions (max |y_pred| "
            f"{probes.max_abs(y_pred):.3g}, max |y| {probes.max_abs(run.y):.3g})",
        )
    return run.result(
        "loss",
        out_name,
        ["invalid_arithmetic"],
        f"loss {loss_value} with finite predictions",
    )


def _check_backward(run: _Run) -> Diagnosis | None:
    """The gradients: a non-finite one (the first going backward), or a global
    norm that explodes."""
    assert run.gradients is not None  # set by the forward stage
    run.grads = run.gradients()
    _gradient_norms(run)
    bad = [i for i, g in enumerate(run.grads) if g is not None and not host_finite(g)]
    if bad:
        return _nonfinite_gradient(run, bad)
    return _exploding_gradient(run)


def _check_update(run: _Run) -> Diagnosis | None:
    """Given an optimizer: does one update make weights or its state non-finite?"""
    if run.optimizer is None:
        return None
    bad_after = probes.probe_update(run.model, run.optimizer, run.grads, run.leaves)
    if not bad_after:
        return None
    layer, names = bad_after
    return run.result(
        "update",
        layer,
        ["update_overflow"],
        f"one update with the gradients (finite, global norm "
        f"{run.grad_norm:.3g}) makes {names} non-finite",
    )


# ------------------------------------------------------------------- causes
def _forward_cause(run: _Run, name, layer, inputs, out, upto) -> Diagnosis:
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
    return run.result("forward", name, causes, detail, extra_hints=hints)


def _gradient_norms(run: _Run) -> None:
    """Sets each layer's gradient norm and the global one."""
    tv = run.model.trainable_variables
    owner = probes.owners(run.leaves)
    norms = [
        None if g is None else float(np.sqrt(np.sum(np.square(g, dtype=np.float64))))
        for g in run.grads
    ]
    for st in run.stats:
        per_layer = [
            n
            for v, n in zip(tv, norms, strict=True)
            if owner.get(id(v)) == st.name and n is not None
        ]
        st.grad_norm = (
            float(np.sqrt(sum(n * n for n in per_layer))) if per_layer else None
        )
    run.grad_norm = float(np.sqrt(sum(n * n for n in norms if n is not None)))


def _nonfinite_gradient(run: _Run, bad: list[int]) -> Diagnosis:
    tv = run.model.trainable_variables
    owner = probes.owners(run.leaves)
    order = {name: k for k, (name, _) in enumerate(run.leaves)}
    last = max(bad, key=lambda i: order.get(owner.get(id(tv[i]), ""), -1))
    causes = ["nonfinite_gradient"]
    if run.probs is not None and probes.clipped_gradients_finite(
        run.model, run.x, run.loss_of, run.probs
    ):
        causes = ["log_of_zero", "nonfinite_gradient"]
    return run.result(
        "backward",
        owner.get(id(tv[last])),
        causes,
        f"forward pass and loss ({run.loss:.4g}) are finite, but the "
        f"gradient of '{snapshots.variable_name(tv[last])}' is not (going backward, the "
        f"first of {len(bad)} non-finite gradients)",
    )


def _exploding_gradient(run: _Run) -> Diagnosis | None:
    tv = run.model.trainable_variables
    weight_norm = float(
        np.sqrt(sum(np.sum(np.square(host_view(v), dtype=np.float64)) for v in tv))
    )
    if run.grad_norm is not None and run.grad_norm > _EXPLODING * (1.0 + weight_norm):
        biggest = max(
            (s for s in run.stats if s.grad_norm),
            key=lambda s: s.grad_norm or 0.0,
            default=None,
        )
        return run.result(
            "backward",
            biggest.name if biggest else None,
            ["exploding_gradient"],
            f"global gradient norm {run.grad_norm:.3g} against a weight norm "
            f"of {weight_norm:.3g}",
        )
    return None


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
