"""What an example's `train` returns, and the optimizer each mode uses."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras

import keras_nanguard as ng

MODES = ("plain", "safe", "guard")


@dataclasses.dataclass
class Run:
    """One run of an example: the model, its losses (per epoch or step), the
    guard (mode `"guard"`), the optimizers, and `check`: the loss of the
    trained model on fresh clean batches."""

    model: keras.Model
    losses: list[float]
    guard: ng.NaNGuard | None
    optimizers: list[keras.optimizers.Optimizer]
    check: Callable[[], float]


def optimizer(mode: str, inner: keras.optimizers.Optimizer) -> Any:
    """`inner` as the mode trains with it."""
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}. Received: mode={mode!r}")
    return inner if mode == "plain" else ng.SafeOptimizer(inner)


def guard(mode: str) -> ng.NaNGuard | None:
    """The mode's NaNGuard, as the README adds it: `callbacks=[ng.NaNGuard()]`."""
    return ng.NaNGuard(verbose=0) if mode == "guard" else None


def callbacks(guard: ng.NaNGuard | None) -> list[keras.callbacks.Callback]:
    return [] if guard is None else [guard]
