"""The methods keras-nanguard sets on a model, and what each replaced.

An attached model gets methods of its own over Keras's public override
points (`train_step`, `train_on_batch`, `compute_loss`, `compute_metrics`):
set on the instance, so that the class and other models are untouched.
Which part set a method (its `owner`: an optimizer, a quarantine, an
observer) and the method it replaced are declared here, in one registry,
instead of as marks on the wrappers.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import keras


@dataclasses.dataclass(frozen=True)
class Patch:
    """A method set on a model: who set it and what it replaced."""

    owner: Any
    original: Callable[..., Any]


_SET: weakref.WeakKeyDictionary[Callable[..., Any], Patch] = weakref.WeakKeyDictionary()


def patch(
    model: keras.Model,
    name: str,
    method: Callable[..., Any],
    owner: Any,
    original: Callable[..., Any],
) -> None:
    """Sets `method` as `model.<name>`, set by `owner` over `original`."""
    _SET[method] = Patch(owner, original)
    setattr(model, name, method)


def patch_of(model: keras.Model, name: str) -> Patch | None:
    """The patch that is `model.<name>` now, if one of ours is."""
    method = getattr(model, name, None)
    try:
        return _SET.get(method)  # type: ignore[arg-type]
    except TypeError:  # not a function of ours (not weakly referable)
        return None


def owner_of(model: keras.Model, name: str) -> Any:
    """Who set `model.<name>` (None: not one of ours)."""
    found = patch_of(model, name)
    return None if found is None else found.owner


def original_of(model: keras.Model, name: str) -> Callable[..., Any]:
    """`model.<name>` as it was before the patch that is there now (as it
    is, when none is)."""
    found = patch_of(model, name)
    return getattr(model, name) if found is None else found.original


def unpatch(model: keras.Model, name: str) -> None:
    """Undoes the patch that is `model.<name>` now: the method it replaced
    again (the class's own by deleting the instance's), or nothing."""
    found = patch_of(model, name)
    if found is None:
        return
    original = found.original
    if getattr(original, "__self__", None) is model and getattr(
        original, "__func__", None
    ) is getattr(type(model), name, None):
        delattr(model, name)  # the class's own method again
    else:
        setattr(model, name, original)  # a method the user had set
