"""Keras's "Simple MNIST convnet" (Conv2D, MaxPooling2D, Dropout, softmax;
Adam, categorical cross-entropy, `fit`), on scikit-learn's 8x8 digits.

Fault `"nan_pixel"`: one NaN pixel in one image: the batch is rejected and
explained as `bad_data`.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import layers
from sklearn.datasets import load_digits

from examples._run import Run, callbacks, guard, optimizer

BACKENDS = ("tensorflow", "jax", "torch")
FAULTS = {"nan_pixel": "bad_data"}


def data() -> tuple[np.ndarray, np.ndarray]:
    d = load_digits()
    x = (d.data / 16.0).reshape(-1, 8, 8, 1).astype("float32")
    return x, keras.utils.to_categorical(d.target, 10)


def convnet() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input(shape=(8, 8, 1)),
            layers.Conv2D(16, kernel_size=(3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Flatten(),
            layers.Dropout(0.5),
            layers.Dense(10, activation="softmax"),
        ]
    )


def train(mode: str, fault: str | None = None, seed: int = 0) -> Run:
    x, y = data()
    x_train, y_train, x_test, y_test = x[:1024], y[:1024], x[1024:1280], y[1024:1280]
    if fault == "nan_pixel":
        x_train = x_train.copy()
        x_train[200, 3, 3, 0] = np.nan
    keras.utils.set_random_seed(seed)
    model = convnet()
    opt, nan_guard = optimizer(mode, keras.optimizers.Adam(1e-2)), guard(mode)
    model.compile(loss="categorical_crossentropy", optimizer=opt, metrics=["accuracy"])
    history = model.fit(
        x_train,
        y_train,
        batch_size=64,
        epochs=4,
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
