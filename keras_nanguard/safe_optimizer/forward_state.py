"""The state the forward pass of a training step writes, and how it is kept.

The forward pass writes state of its own before the optimizer sees any
gradient: BatchNormalization's moving statistics, any layer's non-trainable
variables, seed-generator state, and on torch the buffers of modules inside
`keras.layers.TorchModuleWrapper`. A rejected step must leave that state as
it was too. Here is which state that is, a copy of it, and a select that
keeps the old values unless the step was accepted (one pass over this state,
which is small next to the weights; no branch, no host read).
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from keras_nanguard._backend import current as backend


def forward_state(model: keras.Model) -> list[Any]:
    """The state the forward pass may write: Keras's non-trainable variables
    (metrics excluded) and, on torch, module buffers Keras does not track."""
    return list(model.non_trainable_variables) + backend.extra_forward_state(model)


def read(state: list[Any]) -> list[Any]:
    """Values of `state` now, unaffected by the step's later writes."""
    values = [v.value if isinstance(v, keras.Variable) else v for v in state]
    return backend.copy_values(values, None)


def select(accepted: Any, before: list[Any], after: list[Any]) -> list[Any]:
    """Stateless: `after` if `accepted`, else `before`, tensor by tensor."""
    if len(before) != len(after):
        raise ValueError(
            "`before` and `after` must hold the same non-trainable variables. "
            f"Received: len(before)={len(before)}, len(after)={len(after)}"
        )
    return [ops.where(accepted, a, b) for b, a in zip(before, after, strict=True)]


def build_for(model: keras.Model, data: Any) -> None:
    """Builds `model` from a batch's shapes if it is not built yet.

    On TensorFlow without a distribution strategy, Keras builds the model
    while it traces the first training step, after the state to keep must be
    known; building it symbolically first creates that state, with no
    computation in the step. A model with no `call()` (a VAE or GAN of
    Keras's examples, whose `train_step` calls its sub-models) has nothing to
    build from a batch: its state is its sub-models', built already.
    """
    if model.built or not has_call(model):
        return
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    spec = keras.tree.map_structure(
        lambda t: keras.KerasTensor(t.shape, keras.backend.standardize_dtype(t.dtype)),
        x,
    )
    model.compute_output_spec(spec)
    model.built = True


def has_call(model: keras.Model) -> bool:
    """Whether `model` has a forward pass of its own: a functional or
    Sequential model, or a subclass that defines `call()`."""
    return type(model).call is not keras.Model.call


def is_built(model: keras.Model) -> bool:
    """Whether `model` has its variables: built, or with no `call()` of its
    own, every sub-layer built (Keras marks such a model built only once a
    step has run; its state is its sub-models')."""
    if model.built:
        return True
    return not has_call(model) and all(layer.built for layer in model.layers)
