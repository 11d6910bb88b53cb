"""What `diagnose()` returns: a `Diagnosis`, with a `LayerStats` per layer,
and the stages a batch is checked at (`STAGES`).

Apart from `diagnosis` (which runs the stages) so that `stages`, which makes
these, and `diagnosis`, which calls `stages`, do not import each other. The
public names are `keras_nanguard.diagnosis.Diagnosis` and friends.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from keras_nanguard.diagnosis.causes import CAUSES

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


# Their public home is `diagnosis`: pickles and help() name it, not this
# private module.
for _cls in (LayerStats, Diagnosis):
    _cls.__module__ = "keras_nanguard.diagnosis"
del _cls


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
