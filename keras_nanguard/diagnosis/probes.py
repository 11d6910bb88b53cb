"""The eager probes diagnose() runs: the model's leaf layers, one recorded
forward pass, gradients, the optimizer's would-be update, counterfactual
checks (clipped probabilities, scaled targets), and host-side array helpers."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_nanguard import snapshots
from keras_nanguard._backend import common
from keras_nanguard._backend import current as backend
from keras_nanguard._host_device import host_finite, host_view


# ------------------------------------------------------------ model access
def leaf_layers(model: keras.Model) -> list[tuple[str, keras.layers.Layer]]:
    out: list[tuple[str, keras.layers.Layer]] = []

    def walk(layer, prefix):
        if isinstance(layer, keras.layers.InputLayer):
            return
        subs = (
            getattr(layer, "layers", None) if isinstance(layer, keras.Model) else None
        )
        if subs:
            for sub in subs:
                walk(sub, f"{prefix}{layer.name}/")
        else:
            out.append((prefix + layer.name, layer))

    for layer in getattr(model, "layers", []):
        walk(layer, "")
    return out


def owners(leaves) -> dict[int, str]:
    return {id(v): name for name, layer in leaves for v in layer.trainable_weights}


def loss_function(model, loss, x, y, sample_weight) -> Callable[[Any], Any]:
    if loss is None:
        if getattr(model, "loss", None) is None:
            raise ValueError(
                "`loss` is needed: the model was not compiled with a loss. Pass "
                "`loss=` (a Keras loss, its name, or a callable (y_true, y_pred)). "
                "Received: loss=None"
            )

        def compiled_loss(y_pred: Any, y_true: Any = y) -> Any:
            return model.compute_loss(
                x=x, y=y_true, y_pred=y_pred, sample_weight=sample_weight, training=True
            )

        return compiled_loss
    fn = keras.losses.get(loss) if isinstance(loss, str | dict) else loss
    if not callable(fn):
        raise TypeError(
            "`loss` must be a Keras loss, its name, or a callable (y_true, y_pred). "
            f"Received: loss={loss!r}"
        )

    def loss_of(y_pred, y_true=y):
        if sample_weight is not None and isinstance(fn, keras.losses.Loss):
            value = fn(y_true, y_pred, sample_weight=sample_weight)
        else:
            value = fn(y_true, y_pred)
        value = ops.mean(value)
        extra = model.losses
        return value + ops.sum(ops.stack(extra)) if extra else value

    return loss_of


def record_forward(model, x, leaves, loss_of) -> tuple:
    """One forward pass that records every leaf layer's input and output, and
    the loss; returns `(records, y_pred, loss, gradients)`, with `gradients()`
    as `gradient_pass` gives it."""
    records: list[tuple[str, keras.layers.Layer, Any, Any]] = []
    for name, layer in leaves:
        _record_calls(name, layer, records)
    try:
        y_pred, loss, gradients = gradient_pass(model, x, loss_of)
    finally:
        for _, layer in leaves:
            del layer.call  # back to the class's method
    return records, y_pred, loss, gradients


def _record_calls(name: str, layer: keras.layers.Layer, records: list) -> None:
    original = layer.call

    def call(*args, **kwargs):
        out = original(*args, **kwargs)
        inputs = args[0] if args else next(iter(kwargs.values()), None)
        records.append((name, layer, inputs, out))
        return out

    layer.call = call


# --------------------------------------------------------------- gradients
def gradient_pass(
    model: keras.Model, x: Any, loss_of: Callable[[Any], Any], *, outputs: bool = True
) -> tuple[Any, Any, Callable[[], list[np.ndarray | None]]]:
    """The one place where gradients are taken, per backend.

    Runs one training-mode pass, `y_pred = model(x)` and `loss =
    loss_of(y_pred)`, and returns `(y_pred, loss, gradients)`: `gradients()`
    gives the gradients of that loss for `model.trainable_variables`, as NumPy
    arrays (`None` where a variable has none). TensorFlow (a `GradientTape`)
    and torch (autograd) differentiate this very pass. JAX cannot
    differentiate an eager pass: there `gradients()` takes `jax.grad` of the
    same pass re-run statelessly, as a function of the weights; with
    `outputs=False` (only the gradients are wanted) JAX skips the eager pass
    and returns `None` for `y_pred` and `loss`.
    """
    return backend.gradient_pass(model, x, loss_of, outputs)


def fresh_gradients(model, x, loss_of) -> list[np.ndarray | None]:
    """Gradients of the loss from a new forward pass on every backend."""
    return gradient_pass(model, x, loss_of, outputs=False)[2]()


numpy_grads = common.numpy_grads


# ------------------------------------------------------------------ update
def probe_update(model, optimizer, grads, leaves):
    while hasattr(optimizer, "inner_optimizer"):  # SafeOptimizer, LossScaleOptimizer
        optimizer = optimizer.inner_optimizer
    tv = model.trainable_variables
    if not optimizer.built:
        optimizer.build(tv)
    saved = [np.array(host_view(v), copy=True) for v in optimizer.variables]
    try:
        pairs = [
            (ops.convert_to_tensor(g), v)
            for g, v in zip(grads, tv, strict=True)
            if g is not None
        ]
        with backend.no_grad():
            optimizer.apply([g for g, _ in pairs], [v for _, v in pairs])
        for name, layer in leaves:
            bad = [
                w.name for w in layer.trainable_weights if not host_finite(host_view(w))
            ]
            if bad:
                return name, bad
        bad = snapshots.nonfinite_variables(optimizer.variables)
        return (None, bad) if bad else None
    finally:
        for v, value in zip(optimizer.variables, saved, strict=True):
            v.assign(value)


# ------------------------------------------------------ counterfactual tests
def clip_probabilities(y_pred, which: list[bool]) -> Any:
    """`y_pred` with its probability outputs kept away from 0 and 1."""
    eps = 1e-7
    flat = keras.tree.flatten(y_pred)
    clipped = [
        ops.clip(t, eps, 1 - eps) if w else t for t, w in zip(flat, which, strict=True)
    ]
    return keras.tree.pack_sequence_as(y_pred, clipped)


def clipped_loss_finite(loss_of, y_pred, which) -> bool:
    """Is the loss finite once the probabilities are kept away from 0 and 1?"""
    return math.isfinite(to_float(loss_of(clip_probabilities(y_pred, which))))


def clipped_gradients_finite(model, x, loss_of, which) -> bool:
    grads = fresh_gradients(
        model, x, lambda y_pred: loss_of(clip_probabilities(y_pred, which))
    )
    return all(g is None or host_finite(g) for g in grads)


def scaled_loss_finite(loss_of, y_pred, y) -> bool:
    """Does the loss overflow only because of magnitudes? Re-evaluate it with
    targets and predictions scaled down together: an overflow goes away, a
    0/0 does not. Only for float targets of some size."""
    big = max(max_abs(y_pred), max_abs(y))
    if big < 1e3 or not all(v.dtype.kind == "f" for v in host_tree(y)):
        return False
    scale = 1.0 / big
    y_small = keras.tree.map_structure(lambda t: ops.cast(t, "float32") * scale, y)
    return math.isfinite(
        to_float(loss_of(ops.cast(y_pred, "float32") * scale, y_small))
    )


# ------------------------------------------------------------ host arrays
def to_tensors(data: Any) -> Any:
    """Backend tensors, float arrays in floatx, as Keras's data adapters do."""
    if data is None:
        return None

    def convert(a):
        t = ops.convert_to_tensor(a)
        if keras.backend.is_float_dtype(keras.backend.standardize_dtype(t.dtype)):
            t = ops.cast(t, keras.config.floatx())
        return t

    return keras.tree.map_structure(convert, data)


def host_tree(data: Any) -> list[np.ndarray]:
    return [host_view(t) for t in keras.tree.flatten(data) if t is not None]


def nonfinite_arrays(data: Any) -> str:
    if data is None:
        return ""
    found = []
    for i, arr in enumerate(host_tree(data)):
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            bad = ~np.isfinite(arr)
            sample = int(np.argwhere(bad)[0][0]) if arr.ndim else 0
            found.append(
                f"array {i}: {int(bad.sum())} non-finite values "
                f"({int(np.isnan(arr).sum())} NaN), first in sample {sample}"
            )
    return "; ".join(found)


def probability_outputs(y_pred, last_layer) -> list[bool] | None:
    """Which outputs are probabilities (in [0, 1], and made by a softmax or
    sigmoid, or summing to 1 along the last axis), or `None` if none is."""
    flat = keras.tree.flatten(y_pred)
    activation = getattr(getattr(last_layer, "activation", None), "__name__", "")
    made_so = len(flat) == 1 and (
        activation in ("softmax", "sigmoid") or "Softmax" in type(last_layer).__name__
    )
    which = []
    for t in flat:
        v = host_view(t)
        in_range = (
            v.dtype.kind == "f"
            and v.size
            and np.isfinite(v).all()
            and v.min() >= 0
            and v.max() <= 1
        )
        sums_to_one = (
            v.ndim > 1 and v.shape[-1] > 1 and np.allclose(v.sum(-1), 1, atol=1e-3)
        )
        which.append(bool(in_range and (made_so or sums_to_one)))
    return which if any(which) else None


def fraction_zero(y_pred, which: list[bool]) -> float:
    probs = [
        host_view(t)
        for t, w in zip(keras.tree.flatten(y_pred), which, strict=True)
        if w
    ]
    return sum(int(np.sum(p == 0)) for p in probs) / max(1, sum(p.size for p in probs))


def max_abs(data) -> float:
    values = [v for v in host_tree(data)] if data is not None else []
    return max(
        (
            float(np.max(np.abs(v[np.isfinite(v)]), initial=0.0))
            for v in values
            if v.dtype.kind == "f"
        ),
        default=0.0,
    )


def to_float(value) -> float:
    return float(np.asarray(ops.convert_to_numpy(value)).astype(np.float64).mean())
