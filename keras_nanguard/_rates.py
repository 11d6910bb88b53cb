"""The learning rates an optimizer trains with: its own, or, for Keras's
`MultiOptimizer` (per-layer optimizers), one per sub-optimizer.

Everything in the package that reads or changes "the" learning rate goes
through `rate_owners`: the step's backed-off rate, NaNGuard's `lr_factor`,
its schedule warning, snapshots (which leave the rates as they are) and
the learning-rate fault.
"""

from __future__ import annotations

from typing import Any

import keras

# Keras 3.15 ships it; older releases have no MultiOptimizer.
MULTI = getattr(keras.optimizers, "MultiOptimizer", None)


def unwrapped(optimizer: Any) -> Any:
    """`optimizer` without the wrappers that forward their learning rate
    (`LossScaleOptimizer`, `SafeOptimizer`)."""
    for _ in range(8):
        inner = getattr(optimizer, "inner_optimizer", None)
        if inner is None:
            break
        optimizer = inner
    return optimizer


def is_multi(optimizer: Any) -> bool:
    """Whether `optimizer` (under its wrappers) is a `MultiOptimizer`."""
    return MULTI is not None and isinstance(unwrapped(optimizer), MULTI)


def rate_owners(optimizer: Any) -> dict[str, keras.optimizers.Optimizer]:
    """The optimizers whose learning rates `optimizer` trains with, by the
    name a message gives each: `{"": optimizer}` (unwrapped) for one rate,
    a MultiOptimizer's sub-optimizers by their names."""
    base = unwrapped(optimizer)
    if not is_multi(base):
        return {"": base}
    owners: dict[str, keras.optimizers.Optimizer] = {}
    for sub in base.optimizers:
        name, k = sub.name, 1
        while name in owners:  # two sub-optimizers of one name
            k += 1
            name = f"{sub.name}_{k}"
        owners[name] = sub
    return owners


def rate_variables(optimizer: Any) -> list[keras.Variable]:
    """The learning rates of `optimizer` held in variables (a schedule or a
    callable is computed at each step: none)."""
    found = []
    for owner in rate_owners(optimizer).values():
        lr = owner.learning_rate
        if isinstance(lr, keras.Variable):
            found.append(lr)
    return found


def label(name: str, sub: str) -> str:
    """How a message names a rate: the attribute holding the optimizer
    (`optimizer`, a GAN's `d_optimizer`), then the sub-optimizer's name."""
    return name if not sub else f"{name}/{sub}"
