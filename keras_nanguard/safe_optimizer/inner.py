"""The optimizer a SafeOptimizer wraps: the checks on it, and the attributes
of `keras.optimizers.Optimizer` that are read and written through to it."""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import keras

from keras_nanguard import _rates as rates
from keras_nanguard._arguments import Arguments
from keras_nanguard.safe_optimizer.adaptive_clip import MAX_UPDATE_RATIO


class _Wrapper(Protocol):
    """What `forwarded` needs of the wrapper (a SafeOptimizer): its inner
    optimizer. A protocol, so this module does not import the wrapper's."""

    inner_optimizer: keras.optimizers.Optimizer


def forwarded(name: str) -> property:
    """An attribute of `keras.optimizers.Optimizer` that belongs to the inner
    optimizer: read and written through the wrapper."""

    def get(self: _Wrapper) -> Any:
        return getattr(self.inner_optimizer, name)

    def set_(self: _Wrapper, value: Any) -> None:
        # The base class's __init__ writes its own defaults before the inner
        # optimizer is known; those are not the user's and are dropped.
        if "inner_optimizer" in self.__dict__:
            setattr(self.inner_optimizer, name, value)

    return property(get, set_, doc=f"The inner optimizer's `{name}`.")


def _inner_arguments(inner: keras.optimizers.Optimizer) -> set[str]:
    """The keyword arguments of the inner optimizer's class and of the
    optimizer base classes it derives from."""
    names: set[str] = set()
    for cls in type(inner).__mro__:
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        try:
            parameters = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            continue
        names.update(
            p.name
            for p in parameters
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        )
    return names - {"self", "name"}


def refuse_unknown(kwargs: dict[str, Any], inner: keras.optimizers.Optimizer) -> None:
    """Unknown keyword arguments are an error, with a hint for clipping and
    for arguments that belong to the inner optimizer."""
    if not kwargs:
        return
    hints = []
    clipping = {"global_clipnorm", "clipvalue"} & set(kwargs)
    if clipping:
        hints.append(
            " SafeOptimizer clips by global norm with `clipnorm`; set "
            "other clipping on the inner optimizer."
        )
    if "spike_sigma" in kwargs:
        hints.append(
            " `spike_sigma` (mean + sigma standard deviations, keras-nanguard "
            "0.2) rejected clean steps of noisy batches; use "
            "`spike_factor=10` (10 times the window's 90th percentile)."
        )
    inner_args = sorted((_inner_arguments(inner) & set(kwargs)) - clipping)
    if inner_args:
        named = ", ".join(f"`{a}`" for a in inner_args)
        one = len(inner_args) == 1
        example = ", ".join(f"{a}=..." for a in inner_args)
        hints.append(
            f" {named} {'is an argument' if one else 'are arguments'} of the "
            f"inner optimizer: pass {'it' if one else 'them'} there, e.g. "
            f"SafeOptimizer({type(inner).__name__}({example}))."
        )
    raise TypeError(
        f"SafeOptimizer got unknown keyword arguments {sorted(kwargs)}."
        f"{''.join(hints)} Received: "
        + ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    )


def check_clipping(inner: keras.optimizers.Optimizer, clipnorm: float | None) -> None:
    if clipnorm is None:
        return
    inner_clip = {
        k: getattr(inner, k)
        for k in ("clipnorm", "global_clipnorm", "clipvalue")
        if getattr(inner, k, None) is not None
    }
    if inner_clip:
        raise ValueError(
            "Set gradient clipping on the SafeOptimizer or on the inner "
            "optimizer, not both: clipping before the finiteness check "
            "turns every gradient into NaN when the norm is not finite. "
            f"Received: clipnorm={clipnorm} and inner optimizer {inner_clip}"
        )


def check_with_inner(settings: Arguments, inner: keras.optimizers.Optimizer) -> None:
    """Raises what `settings` cannot do with the optimizer `inner`: clip
    twice, back off a schedule, grade steps the inner optimizer sums, or
    bound and reset without the graded handling."""
    owners = rates.rate_owners(inner)
    for owner in [inner, *(o for o in owners.values() if o is not inner)]:
        check_clipping(owner, settings.clipnorm)
    for sub, owner in owners.items():
        if settings.lr_backoff is not None and not isinstance(
            owner.learning_rate, keras.Variable
        ):
            which = f"sub-optimizer {sub!r}" if sub else "inner optimizer"
            raise ValueError(
                f"`lr_backoff` needs the {which}'s learning rate to be a "
                "float, not a schedule or a callable. Received: "
                f"learning_rate={owner._learning_rate!r}"
            )
    clip, ratio, resets = (
        settings.clip,
        settings.max_update_ratio,
        settings.reset_moments,
    )
    bound = ratio not in (None, MAX_UPDATE_RATIO)  # None: no bound, the same
    if clip is None and (bound or resets is not None):
        given = "max_update_ratio" if bound else "reset_moments"
        raise ValueError(
            f'`{given}` is part of the graded handling: set `clip="adaptive"` '
            f"too. Received: clip=None, {given}="
            f"{ratio if given == 'max_update_ratio' else resets!r}"
        )
    subs = list(owners.values()) if rates.is_multi(inner) else []
    accumulating = [o.name for o in subs if o.gradient_accumulation_steps]
    if accumulating:
        raise ValueError(
            "A SafeOptimizer decides on each batch's gradients, and these "
            "sub-optimizers of the MultiOptimizer apply a sum of them every "
            "few batches: the two cannot make one transaction. Set "
            "`gradient_accumulation_steps` on none of them. Received: "
            f"sub-optimizers with gradient_accumulation_steps: {accumulating}"
        )
    if resets is not None and any(o.use_ema for o in subs):
        raise ValueError(
            "`reset_moments` resets every variable of the inner optimizer but "
            "its step counts and learning rates, which would wipe a "
            "sub-optimizer's weight averages (`use_ema`) too. Received: "
            f"reset_moments={resets}, use_ema on "
            f"{[o.name for o in subs if o.use_ema]}"
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


def check_multi(optimizer: Any, wrapper: type) -> None:
    """Refuses a MultiOptimizer whose sub-optimizers are `wrapper`s
    (SafeOptimizers). A map given as a callable has its sub-optimizers once
    it is built: `SafeOptimizer.build` checks again then."""
    if not rates.is_multi(optimizer):
        return
    held = [o for o in optimizer.optimizers if isinstance(o, wrapper)]
    if held:
        raise ValueError(
            "The MultiOptimizer's map holds SafeOptimizers: each would "
            "guard its own variables, and a step could commit on some "
            "and not others. Map plain optimizers, and wrap the "
            "MultiOptimizer once: SafeOptimizer(MultiOptimizer(...)), one "
            f"transaction over all of them. Received: {held!r}"
        )


def resolve_inner(optimizer: Any, wrapper: type) -> keras.optimizers.Optimizer:
    """The optimizer to wrap, from an instance or a built-in one's name.

    `wrapper` is the class that wraps it (`SafeOptimizer`, passed by its
    `__init__` so that this module need not import it): an optimizer that
    already is one is refused."""
    if isinstance(optimizer, str):
        try:
            optimizer = keras.optimizers.get(optimizer)
        except ValueError as err:
            raise ValueError(
                "`optimizer` must be a Keras optimizer or the name of a built-in "
                f"one. Received: optimizer={optimizer!r}"
            ) from err
    if isinstance(optimizer, wrapper):
        raise ValueError(
            "`optimizer` is already a SafeOptimizer; wrapping it twice would "
            f"count and check every step twice. Received: optimizer={optimizer!r}"
        )
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "Wrap the other way round: LossScaleOptimizer(SafeOptimizer(...)). "
            "Under the `mixed_float16` policy, `model.compile` does this for "
            "you when given a SafeOptimizer; a SafeOptimizer inside a "
            "LossScaleOptimizer sees unscaled gradients. "
            f"Received: optimizer={optimizer!r}"
        )
    check_multi(optimizer, wrapper)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`optimizer` must be a `keras.optimizers.Optimizer` instance (Keras "
            f"3) or its name. Received: optimizer={optimizer!r} of type "
            f"{type(optimizer).__name__}"
        )
    if optimizer.loss_scale_factor is not None:
        raise ValueError(
            "The inner optimizer scales the loss (`loss_scale_factor`), so "
            "SafeOptimizer would see scaled gradients. Remove it; for mixed "
            "precision use LossScaleOptimizer(SafeOptimizer(...)). Received: "
            f"loss_scale_factor={optimizer.loss_scale_factor}"
        )
    return optimizer
