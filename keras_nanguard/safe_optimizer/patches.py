"""The methods keras-nanguard sets on a model, and what each replaced.

An attached model gets methods of its own over Keras's public override
points (`train_step`, `train_on_batch`, `compute_loss`, `compute_metrics`):
set on the instance, so that the class and other models are untouched.
Which part set a method (its `owner`: an optimizer, a quarantine, an
observer) and the method it replaced are declared here, in one registry per
model, instead of as marks on the wrappers. The registry lives on the model
(`_REGISTRY` in its `__dict__`, past Keras's attribute tracking): a model
and what it holds are freed together, which a registry of ours holding the
replaced methods (bound to the model) would prevent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras


@dataclasses.dataclass(frozen=True)
class Patch:
    """A method set on a model: who set it and what it replaced."""

    method: Callable[..., Any]
    owner: Any
    original: Callable[..., Any]


_REGISTRY = "_keras_nanguard_patches"


def patch(
    model: keras.Model,
    name: str,
    method: Callable[..., Any],
    owner: Any,
    original: Callable[..., Any],
) -> None:
    """Sets `method` as `model.<name>`, set by `owner` over `original`."""
    # A list per name: a part may wrap another's (the observer's
    # `compute_metrics` over the quarantine's).
    vars(model).setdefault(_REGISTRY, {}).setdefault(name, []).append(
        Patch(method, owner, original)
    )
    setattr(model, name, method)


def patch_of(model: keras.Model, name: str) -> Patch | None:
    """The patch that is `model.<name>` now, if one of ours is."""
    current = getattr(model, name, None)
    for found in vars(model).get(_REGISTRY, {}).get(name, []):
        if found.method is current:
            return found
    return None  # none, or the user has set a method of their own since


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
    vars(model)[_REGISTRY][name].remove(found)
    original = found.original
    if getattr(original, "__self__", None) is model and getattr(
        original, "__func__", None
    ) is getattr(type(model), name, None):
        delattr(model, name)  # the class's own method again
    else:
        setattr(model, name, original)  # a method the user had set
