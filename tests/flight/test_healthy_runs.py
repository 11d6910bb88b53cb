"""The early warning is on by default, so it must be silent on healthy
training: a confident classifier trained to 100% accuracy (its smallest
softmax probability far below 1e-14, as it should be) is not a policy
collapsing."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from sklearn.datasets import load_digits

import keras_nanguard as ng


@pytest.mark.slow
def test_a_confident_classifier_is_healthy_and_never_warned():
    d = load_digits()
    x, y = (d.data / 16.0).astype("float32"), d.target
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(
        ng.SafeOptimizer(keras.optimizers.Adam(1e-2)),
        "sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    guard = ng.NaNGuard(verbose=0)
    history = model.fit(x, y, epochs=30, batch_size=32, verbose=0, callbacks=[guard])
    assert history.history["accuracy"][-1] == 1.0
    # Confident: some probability is far below the warning threshold.
    probs = keras.ops.convert_to_numpy(model.predict(x, verbose=0))
    assert probs.min() < 1e-14
    assert guard.incidents == []
    found = guard.explain()
    assert (found.cause, found.first_bad_step) == ("healthy", None), str(found)
    assert np.isfinite(history.history["loss"]).all()
