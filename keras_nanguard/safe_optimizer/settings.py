"""SafeOptimizer's settings: its arguments, checked once, read by its parts."""

from __future__ import annotations

import dataclasses
import math

import keras

from keras_nanguard._validation import (
    check_choice,
    check_in,
    check_int,
    check_positive,
)
from keras_nanguard.safe_optimizer.adaptive_clip import MAX_UPDATE_RATIO
from keras_nanguard.safe_optimizer.inner import check_clipping


@dataclasses.dataclass(frozen=True)
class Settings:
    """The arguments of `SafeOptimizer` (see there for what each one does).

    Frozen: the optimizer hands a new one to its parts when a setting is
    set on it (`opt.clipnorm = ...`), so no part sees a half-changed one.
    """

    clipnorm: float | None = None
    lr_backoff: float | None = None
    lr_recovery_steps: int = 100
    min_lr_scale: float = 1e-3
    max_consecutive_skips: int | None = None
    spike_factor: float | None = None
    spike_window: int = 128
    clip: str | None = None
    max_update_ratio: float | None = MAX_UPDATE_RATIO
    reset_moments: int | None = None

    @property
    def adaptive(self) -> bool:
        """Whether the graded handling is on (`clip="adaptive"`)."""
        return self.clip == "adaptive"

    def replaced(
        self, inner: keras.optimizers.Optimizer, **changed: object
    ) -> Settings:
        """These settings with `changed` ones, all checked again."""
        return Settings.checked(inner, **{**dataclasses.asdict(self), **changed})

    @classmethod
    def checked(
        cls,
        inner: keras.optimizers.Optimizer,
        *,
        clipnorm: object = None,
        lr_backoff: object = None,
        lr_recovery_steps: object = 100,
        min_lr_scale: object = 1e-3,
        max_consecutive_skips: object = None,
        spike_factor: object = None,
        spike_window: object = 128,
        clip: object = None,
        max_update_ratio: object = MAX_UPDATE_RATIO,
        reset_moments: object = None,
    ) -> Settings:
        """The settings from user arguments, each checked (in this order),
        for the optimizer `inner` that they wrap."""
        checked_clipnorm = check_positive("clipnorm", clipnorm, allow_none=True)
        check_clipping(inner, checked_clipnorm)
        return cls(
            clipnorm=checked_clipnorm,
            lr_backoff=_check_lr_backoff(inner, lr_backoff),
            lr_recovery_steps=check_int("lr_recovery_steps", lr_recovery_steps, 1),
            min_lr_scale=check_in("min_lr_scale", min_lr_scale, 0, 1, closed_high=True),
            max_consecutive_skips=check_int(
                "max_consecutive_skips", max_consecutive_skips, 1, allow_none=True
            ),
            spike_factor=_check_spike_factor(spike_factor),
            spike_window=check_int("spike_window", spike_window, 2),
            **_check_graded(inner, clip, max_update_ratio, reset_moments),
        )


def _check_lr_backoff(
    inner: keras.optimizers.Optimizer, lr_backoff: object
) -> float | None:
    if lr_backoff is None:
        return None
    checked = check_in("lr_backoff", lr_backoff, 0, 1, closed_high=False)
    if not isinstance(inner.learning_rate, keras.Variable):
        raise ValueError(
            "`lr_backoff` needs the inner optimizer's learning rate to "
            "be a float, not a schedule or a callable. Received: "
            f"learning_rate={inner._learning_rate!r}"
        )
    return checked


def _check_spike_factor(spike_factor: object) -> float | None:
    if spike_factor is None:
        return None
    return check_in("spike_factor", spike_factor, 1, math.inf, closed_high=False)


def _check_graded(
    inner: keras.optimizers.Optimizer,
    clip: object,
    max_update_ratio: object,
    reset_moments: object,
) -> dict:
    """`clip`, `max_update_ratio` and `reset_moments`, checked: the last two
    belong to the graded handling and need `clip="adaptive"`."""
    if clip is not None:
        clip = check_choice("clip", clip, ("adaptive",))
    ratio = check_positive("max_update_ratio", max_update_ratio, allow_none=True)
    resets = check_int("reset_moments", reset_moments, 1, allow_none=True)
    bound = ratio not in (None, MAX_UPDATE_RATIO)  # None: no bound, the same
    if clip is None and (bound or resets is not None):
        given = "max_update_ratio" if bound else "reset_moments"
        raise ValueError(
            f'`{given}` is part of the graded handling: set `clip="adaptive"` '
            f"too. Received: clip=None, {given}="
            f"{ratio if given == 'max_update_ratio' else resets!r}"
        )
    if clip is not None and inner.gradient_accumulation_steps:
        raise ValueError(
            '`clip="adaptive"` decides on each batch\'s gradients, and with '
            "gradient accumulation the inner optimizer applies their sum every "
            "few batches. Use `clipnorm` with gradient accumulation. Received: "
            f"gradient_accumulation_steps={inner.gradient_accumulation_steps}"
        )
    if resets is not None and (inner.use_ema or inner.gradient_accumulation_steps):
        raise ValueError(
            "`reset_moments` resets every variable of the inner optimizer but "
            "its step count and learning rate, which would wipe its weight "
            "averages (`use_ema`) too. Received: reset_moments="
            f"{resets}, use_ema={inner.use_ema}"
        )
    return {"clip": clip, "max_update_ratio": ratio, "reset_moments": resets}
