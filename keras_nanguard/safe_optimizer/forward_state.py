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

import weakref
from typing import Any

import keras
from keras import ops


def forward_state(model: keras.Model) -> list[Any]:
    """The state the forward pass may write: Keras's non-trainable variables
    (metrics excluded) and, on torch, module buffers Keras does not track."""
    state: list[Any] = list(model.non_trainable_variables)
    if keras.backend.backend() == "torch":
        state += _torch_buffers(model)
    return state


# model -> (what the walk below depends on, its result). The walk costs about
# 90 µs a step on a 3-layer model; what it finds changes only when a module
# or a buffer is registered somewhere (torch's global registration hooks
# count those; the model's rebuilt `Functional` after `Sequential.add` is
# one) or the model's weights change (it is built).
_BUFFERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_registrations = [0]


def _count_registration(*args: Any) -> None:
    _registrations[0] += 1


def _torch_buffers(model: keras.Model) -> list[Any]:
    if not _registrations[0]:  # the first call: from now on, count
        from torch.nn.modules import module

        module.register_module_module_registration_hook(_count_registration)
        module.register_module_buffer_registration_hook(_count_registration)
        _registrations[0] = 1
    key = (_registrations[0], tuple(map(id, model.weights)))
    cached = _BUFFERS.get(model)
    if cached is None or cached[0] != key:
        cached = _BUFFERS[model] = (key, _walk_buffers(model))
    return cached[1]


def _walk_buffers(model: keras.Model) -> list[Any]:
    # Every Keras layer is a torch module on this backend, but Sequential and
    # functional models keep their layers in plain lists that torch does not
    # see: walk both the Keras layers and the torch submodules, each module
    # once.
    found: dict[int, Any] = {}
    stack, seen = [model], set()
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for buffer in module.buffers(recurse=False):
            found.setdefault(id(buffer), buffer)
        stack.extend(module.children())
        stack.extend(getattr(module, "layers", None) or [])
    return list(found.values())


def read(state: list[Any]) -> list[Any]:
    """Values of `state` now, unaffected by the step's later writes."""
    backend = keras.backend.backend()
    values = [v.value if isinstance(v, keras.Variable) else v for v in state]
    if backend == "torch":
        return [t.detach().clone() for t in values]
    if backend == "tensorflow":
        import tensorflow as tf

        # Copy-on-write: the buffer is copied only if the step writes it.
        return [tf.identity(t) for t in values]
    return values


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
    computation in the step.
    """
    if model.built:
        return
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    spec = keras.tree.map_structure(
        lambda t: keras.KerasTensor(t.shape, keras.backend.standardize_dtype(t.dtype)),
        x,
    )
    model.compute_output_spec(spec)
    model.built = True
