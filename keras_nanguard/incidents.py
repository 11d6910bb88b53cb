"""Incident: one record of trouble, as NaNGuard keeps it in `guard.incidents`."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import keras
import numpy as np

from keras_nanguard._atomic import atomic_path
from keras_nanguard.diagnosis import Diagnosis, diagnose

#: The incident kinds, a fixed vocabulary: kind -> what it means.
KINDS: dict[str, str] = {
    "rejected_step": "a SafeOptimizer refused the update",
    "halted": "a SafeOptimizer stopped accepting any update",
    "nonfinite_loss": "the loss is NaN or inf",
    "nonfinite_metric": "a metric is NaN or inf, the loss is finite",
    "nonfinite_weights": "the weights or the optimizer state are NaN or inf",
    "loss_spike": "the batch loss stayed far above its rolling mean",
    "loss_blowup": "after a rollback, the batch loss stayed finite but far "
    "above the run's early level",
    "nonfinite_validation": "a validation figure (val_...) is NaN or inf, the "
    "weights are finite: never trouble",
    "quarantined_samples": "rows of the data were left out of their steps "
    "(`quarantine=True`): never trouble",
    "divergence_warning": "the flight recorder predicts that the run will "
    "diverge, before anything is non-finite (`early_warning`): never trouble",
    "stall_warning": "the flight recorder shows that the run stopped learning "
    "while finite (`early_warning`): never trouble",
}


@dataclasses.dataclass(frozen=True)
class QuarantinedRow:
    """A row of a batch that the quarantine left out of its step.

    `step` is the 0-based step of the `fit` (number `fit` of the guard),
    `batch` that step's batch in epoch `epoch`, `row` the row in the batch,
    `reasons` why (`"non-finite input"`, `"non-finite target"`,
    `"non-finite sample weight"`, `"non-finite loss"`), and `position` its
    index in the `replay` data NaNGuard was given (the data `fit` reads in
    order), else `None`.
    """

    fit: int
    epoch: int
    step: int
    batch: int
    row: int
    reasons: tuple[str, ...]
    position: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["reasons"] = list(self.reasons)
        return out


@dataclasses.dataclass
class Incident:
    """One episode of trouble: consecutive bad steps count as one incident.

    `step` is the 0-based step of this `fit` where it began, `batch` that
    step's batch in the epoch (-1 when found at the end of an epoch), and
    `steps` how many steps it covers. With `steps_per_execution=k`, Keras
    reports on k steps at once: rejected steps are still known one by one
    (SafeOptimizer's `recent_rejections`, k <= 30), but an incident found in
    the loss or metrics covers the whole execution, from its first step,
    unless the replayed data shows which batch was bad.
    `kind` is one of `KINDS`: `"rejected_step"` (a SafeOptimizer refused the
    update), `"halted"` (it stopped accepting any), `"nonfinite_loss"`,
    `"nonfinite_metric"` (a metric is NaN or inf, the loss is finite),
    `"nonfinite_weights"`, `"loss_spike"` (the batch loss stayed far above
    its rolling mean; `step` is where the streak began, `steps` its length,
    `detail` the figures that triggered it), `"loss_blowup"` (after a
    rollback, the batch loss stayed finite but 1000 times or more the run's
    early level; `step` and `steps` as for a spike) and
    `"nonfinite_validation"` (a
    `val_` figure is NaN or inf at an epoch's end while the weights are
    finite: recorded, never trouble; `batch` is -1) and
    `"quarantined_samples"` (rows left out of their steps by the
    quarantine, one incident per epoch, the rows in `rows`: never trouble).
    """

    fit: int
    epoch: int
    step: int
    batch: int
    kind: str
    detail: str
    action: str = "none"
    steps: int = 1
    loss: float | None = None
    grad_norm: float | None = None
    variables: list[str] = dataclasses.field(default_factory=list)
    learning_rate: tuple[float, float] | None = None
    batch_data: Any = dataclasses.field(default=None, repr=False)
    diagnosis: Any = dataclasses.field(default=None, repr=False)
    rows: list[QuarantinedRow] = dataclasses.field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["rows"] = [r.to_dict() for r in self.rows]
        out.pop("batch_data")
        diagnosis = out.pop("diagnosis")
        if self.diagnosis is not None and hasattr(self.diagnosis, "to_dict"):
            out["diagnosis"] = self.diagnosis.to_dict()
        elif diagnosis is not None:
            out["diagnosis"] = str(diagnosis)
        return out

    def __str__(self) -> str:
        where = f"epoch {self.epoch}, step {self.step}"
        if self.steps > 1:
            where += f" (+{self.steps - 1} more steps)"
        text = f"[{where}] {self.kind}: {self.detail}"
        if self.variables:
            shown = ", ".join(self.variables[:3])
            more = len(self.variables) - 3
            text += f" Non-finite: {shown}" + (
                f" and {more} more." if more > 0 else "."
            )
        return f"{text} Action: {self.action}."


def diagnose_batch(inc: Incident, model: keras.Model) -> None:
    """Diagnoses the incident's replayed batch; a finding joins the detail."""
    try:
        found = diagnose(model, *inc.batch_data, optimizer=model.optimizer)
    except Exception as err:  # a report must never break training
        inc.diagnosis = f"diagnose() failed: {type(err).__name__}: {err}"
        return
    inc.diagnosis = found
    if isinstance(found, Diagnosis) and not found.healthy:
        layer = f", layer '{found.layer}'" if found.layer else ""
        inc.detail += (
            f" Diagnosis: {found.stage} stage{layer}, {', '.join(found.causes)}."
        )


def write_json(path: str, report: dict[str, Any]) -> None:
    """Writes `report` to `path` atomically (a temporary file, then a rename).

    On any error the temporary file is removed and `path` is left as it was.
    """
    with atomic_path(path, ".json") as tmp, open(tmp, "w") as f:
        json.dump(report, f, indent=2, default=_json_default)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    return str(value)
