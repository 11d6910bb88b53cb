"""Stacked LSTMs in the pattern of Keras's "Sequence to sequence learning for
performing number addition" and its LSTM examples: two LSTM layers, a Dense
head, RMSprop, `fit`; here the task is summing a sequence of numbers.

Fault `"nan_target"`: a NaN target in one row: the batch is rejected and
explained as `bad_data`.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import layers

from examples._run import Run, callbacks, guard, optimizer

BACKENDS = ("tensorflow", "jax", "torch")
FAULTS = {"nan_target": "bad_data"}


def data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 1, (n, 10, 1)).astype("float32")
    return x, x.sum(axis=1).astype("float32") / 5.0


def stacked_lstms() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((10, 1)),
            layers.LSTM(16, return_sequences=True),
            layers.LSTM(16),
            layers.Dense(1),
        ]
    )


def train(mode: str, fault: str | None = None, seed: int = 0) -> Run:
    x, y = data(512, seed)
    x_test, y_test = data(128, seed + 1)
    if fault == "nan_target":
        y = y.copy()
        y[70, 0] = np.nan
    keras.utils.set_random_seed(seed)
    model = stacked_lstms()
    opt, nan_guard = optimizer(mode, keras.optimizers.RMSprop(3e-3)), guard(mode)
    model.compile(optimizer=opt, loss="mse")
    history = model.fit(
        x,
        y,
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
        lambda: float(model.evaluate(x_test, y_test, verbose=0)),
    )
