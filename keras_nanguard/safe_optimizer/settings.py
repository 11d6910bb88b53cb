"""SafeOptimizer's settings: its arguments, checked once, read by its parts."""

from __future__ import annotations

import dataclasses
import math

import keras

from keras_nanguard._validation import check_in, check_int, check_positive
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
