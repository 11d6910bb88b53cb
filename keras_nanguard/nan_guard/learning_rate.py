"""NaNGuard and the learning rate: lowering it at a rollback, and saying so
when it cannot.

A rate held in a variable is multiplied by `lr_factor`. A schedule (or a
callable) is left as it is: the optimizer computes the rate from it at every
step, on TensorFlow in a traced function that captured it, so no public API
lowers it in place. NaNGuard says so, in the incident's action and in a
warning when training begins.
"""

from __future__ import annotations

from typing import Any

import keras

from keras_nanguard import snapshots
from keras_nanguard.safe_optimizer import find_safe_optimizer


def lower(optimizer: Any, factor: float) -> tuple[float, float] | None:
    """Multiplies a variable learning rate by `factor`; returns the rate
    before and after, or `None` if nothing changed (`factor` 1, a schedule)."""
    lr = optimizer.learning_rate
    if factor == 1 or not isinstance(lr, keras.Variable):
        return None
    old = float(keras.ops.convert_to_numpy(lr))
    lr.assign(old * factor)
    return old, float(keras.ops.convert_to_numpy(lr))


def trained_by(model: keras.Model) -> dict[str, Any]:
    """The optimizers that train `model`, by the attribute holding them: the
    built ones of `snapshots.model_optimizers` (a GAN's `d_optimizer` and
    `g_optimizer`, not the default `compile()` left unused), or
    `model.optimizer` when none is built yet."""
    held = snapshots.model_optimizers(model)
    built = {name: opt for name, opt in held.items() if opt.built}
    if built:
        return built
    return {"optimizer": model.optimizer} if model.optimizer is not None else {}


def lower_all(
    optimizers: dict[str, Any], factor: float
) -> dict[str, tuple[float, float]]:
    """`lower` for each optimizer: the rates it changed, by name."""
    found = {name: lower(opt, factor) for name, opt in optimizers.items()}
    return {name: lr for name, lr in found.items() if lr is not None}


def lowered_words(lowered: dict[str, tuple[float, float]]) -> str:
    """What an incident's action says of the rates `lower_all` changed."""
    if list(lowered) == ["optimizer"]:
        old, new = lowered["optimizer"]
        return f", learning rate {old:.3g} -> {new:.3g}"
    each = ", ".join(f"{k} {a:.3g} -> {b:.3g}" for k, (a, b) in lowered.items())
    return f", learning rates {each}"


def schedule_name(optimizer: Any) -> str | None:
    """The class name of the optimizer's learning-rate schedule, as its
    public config names it; `None` when the rate is a variable."""
    if optimizer is None or isinstance(optimizer.learning_rate, keras.Variable):
        return None
    safe = find_safe_optimizer(optimizer)
    inner = optimizer if safe is None else safe.inner_optimizer
    try:
        config = inner.get_config().get("learning_rate")
    except Exception:  # a callable Keras cannot serialise
        config = None
    if isinstance(config, dict) and config.get("class_name"):
        return str(config["class_name"])
    return "a callable"


def not_lowered(optimizer: Any) -> str:
    """The words an incident's action ends with when `lower` could not."""
    return (
        ", the learning rate was not lowered: it is a schedule "
        f"({schedule_name(optimizer)})"
    )


def schedule_warning(optimizer: Any, factor: float) -> str | None:
    """The warning for `lr_factor` < 1 with a schedule, else `None`."""
    name = None if factor == 1 else schedule_name(optimizer)
    if name is None:
        return None
    return (
        f"NaNGuard: `lr_factor={factor:g}` cannot lower the learning rate: the "
        f"optimizer's is a schedule ({name}), which a rollback leaves as it is. "
        "Lower the schedule's rates yourself, or pass `lr_factor=1.0` to say "
        "a rollback should not lower the rate."
    )
