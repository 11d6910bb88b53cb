"""Keras's "Transfer learning & fine-tuning" guide, with per-layer optimizers:
a base model trained on one task (here digits 0-4), its BatchNormalization
frozen (`trainable = False`, `base(inputs, training=False)`), a new head for
another task (digits 5-9),
then fine-tuning the whole model with `keras.optimizers.MultiOptimizer`: the
base on Adam at a small rate, the head on SGD with momentum at a large one.
On scikit-learn's 8x8 digits, no download.

Fault `"nan_pixel"`: one NaN pixel in one image of the fine-tuning data: the
batch is rejected by every sub-optimizer at once and explained as `bad_data`.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import layers
from sklearn.datasets import load_digits

from examples._run import Run, callbacks, guard, optimizer

BACKENDS = ("tensorflow", "jax", "torch")
FAULTS = {"nan_pixel": "bad_data"}


def data(digits: range) -> tuple[np.ndarray, np.ndarray]:
    """The images of `digits`, scaled to [0, 1], and their labels from 0."""
    d = load_digits()
    keep = np.isin(d.target, list(digits))
    x = (d.data[keep] / 16.0).reshape(-1, 8, 8, 1).astype("float32")
    return x, (d.target[keep] - digits.start).astype("int32")


def base_model() -> keras.Model:
    """The base: a small convnet with BatchNormalization, trained on digits
    0-4 (the guide's pretrained Xception, at CPU size)."""
    inputs = keras.Input((8, 8, 1))
    h = layers.Conv2D(16, 3, padding="same", name="conv_1")(inputs)
    h = layers.BatchNormalization(name="norm_1")(h)
    h = layers.Activation("relu")(h)
    h = layers.MaxPooling2D(2)(h)
    h = layers.Conv2D(32, 3, padding="same", name="conv_2")(h)
    h = layers.Activation("relu")(h)
    outputs = layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, outputs, name="base")


def pretrained_base() -> keras.Model:
    base = base_model()
    x, y = data(range(0, 5))
    top = keras.Sequential([base, layers.Dense(5)])
    top.compile(
        keras.optimizers.Adam(1e-2),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    top.fit(x, y, batch_size=64, epochs=3, verbose=0, shuffle=False)
    return base


def per_layer_optimizer() -> keras.optimizers.MultiOptimizer:
    """The base at a small rate, the new head at a large one."""
    chosen = keras.optimizers.OptimizerMap(keras.optimizers.Adam(1e-4))
    chosen["head/.*"] = keras.optimizers.SGD(0.05, momentum=0.9)
    return keras.optimizers.MultiOptimizer(chosen)


def train(mode: str, fault: str | None = None, seed: int = 0) -> Run:
    keras.utils.set_random_seed(seed)
    base = pretrained_base()
    for layer in base.layers:  # the guide's advice: BatchNormalization frozen
        if isinstance(layer, layers.BatchNormalization):
            layer.trainable = False  # (Keras then runs it in inference mode)
    inputs = keras.Input((8, 8, 1))
    h = base(inputs, training=False)  # BatchNormalization stays in inference
    outputs = layers.Dense(5, name="head")(layers.Dropout(0.2)(h))
    model = keras.Model(inputs, outputs)
    x, y = data(range(5, 10))
    x_train, y_train, x_test, y_test = x[:768], y[:768], x[768:], y[768:]
    if fault == "nan_pixel":
        x_train = x_train.copy()
        x_train[200, 3, 3, 0] = np.nan
    opt, nan_guard = optimizer(mode, per_layer_optimizer()), guard(mode)
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(
        x_train,
        y_train,
        batch_size=32,
        epochs=3,
        verbose=0,
        shuffle=False,
        callbacks=callbacks(nan_guard),
    )
    return Run(
        model,
        history.history["loss"],
        nan_guard,
        [opt],
        lambda: float(model.evaluate(x_test, y_test, verbose=0)[0]),
    )
