"""The one place that knows which Keras backend runs.

Keras picks its backend once, at import (`KERAS_BACKEND`); so does this
package: `current` is the module of that backend, `tensorflow.py`, `jax.py`
or `torch.py`, each implementing `interface.Backend` (mypy checks all three
against it). The rest of the package has no backend branch and imports no
framework: it calls `current`'s functions and reads its constants.

Example:

>>> from keras_nanguard._backend import current
>>> current.NAME in ("tensorflow", "jax", "torch")
True
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, cast

import keras

from keras_nanguard._backend.interface import Backend

SUPPORTED = ("tensorflow", "jax", "torch")

_name = keras.backend.backend()
if _name not in SUPPORTED:
    raise ImportError(
        f"keras_nanguard trains on the {', '.join(SUPPORTED)} backends of Keras "
        f"(KERAS_BACKEND). Received: KERAS_BACKEND={_name!r}"
    )
current = cast(Backend, importlib.import_module(f"keras_nanguard._backend.{_name}"))

if TYPE_CHECKING:  # each backend module implements the whole interface
    from keras_nanguard._backend import jax as _jax
    from keras_nanguard._backend import tensorflow as _tensorflow
    from keras_nanguard._backend import torch as _torch

    _checked: tuple[Backend, Backend, Backend] = (_jax, _tensorflow, _torch)

__all__ = ["SUPPORTED", "Backend", "current"]
