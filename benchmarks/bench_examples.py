"""Step time of small models in the patterns of `examples/`: plain Keras,
`SafeOptimizer`, and `SafeOptimizer` with `NaNGuard()` (defaults: early
warning on), and `NaNGuard(early_warning=False)`, interleaved in one process.

Each model is compiled and fitted once per arm (the compile), then each
round times one `fit` of `--epochs` epochs per arm in turn; the figure is the
ratio to plain in the same round, median [min, max] over `--rounds`. Models:
the two stacked LSTMs of `examples/lstm.py` (the addition-like task, batch
32), the convnet of `examples/convnet.py` (digits, batch 64) and the
transformer classifier of `examples/transformer.py` (batch 32). Targets
(issue 28): SafeOptimizer <= 1.10x, NaNGuard <= 1.15x.

On JAX, `--kernels` prints instead an exact proxy of the step's fixed cost:
the kernels (XLA fusions) of one compiled train step, plain and with
SafeOptimizer with and without its flight recorder, and the bytes XLA's cost
analysis counts. On a CPU a small model's step is mostly kernel launches.

Usage:
    KERAS_BACKEND=jax python benchmarks/bench_examples.py
    KERAS_BACKEND=tensorflow python benchmarks/bench_examples.py
    KERAS_BACKEND=jax python benchmarks/bench_examples.py --kernels
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import keras
import numpy as np
from _stats import ratio_summary  # this folder is on sys.path
from keras import layers

import keras_nanguard as ng
from examples import convnet, lstm, transformer

ARMS = ("plain", "safe", "guard", "guard, no early warning")


def _lstm() -> tuple[keras.Model, np.ndarray, np.ndarray, int]:
    x, y = lstm.data(2048, 0)
    return lstm.stacked_lstms(), x, y, 32


def _convnet() -> tuple[keras.Model, np.ndarray, np.ndarray, int]:
    x, y = convnet.data()
    return convnet.convnet(), x, y, 64


def _transformer() -> tuple[keras.Model, np.ndarray, np.ndarray, int]:
    x, y = transformer.data(1024, 0)
    inputs = layers.Input(shape=(transformer.LENGTH,))
    h = transformer.TokenAndPositionEmbedding(
        transformer.LENGTH, transformer.VOCAB, 16
    )(inputs)
    h = transformer.TransformerBlock(16, 2, 16)(h)
    h = layers.GlobalAveragePooling1D()(h)
    outputs = layers.Dense(2, activation="softmax")(h)
    return keras.Model(inputs, outputs), x, y, 32


MODELS = {"two LSTMs": _lstm, "convnet": _convnet, "transformer": _transformer}
LOSSES = {
    "two LSTMs": "mse",
    "convnet": "categorical_crossentropy",
    "transformer": "sparse_categorical_crossentropy",
}


def _arm(name: str, arm: str):
    keras.utils.set_random_seed(0)
    model, x, y, batch = MODELS[name]()
    opt = keras.optimizers.Adam(1e-3)
    model.compile(opt if arm == "plain" else ng.SafeOptimizer(opt), LOSSES[name])
    callbacks = []
    if arm.startswith("guard"):
        callbacks = [ng.NaNGuard(verbose=0, early_warning=arm == "guard")]

    def fit(epochs: int) -> float:
        start = time.perf_counter()
        model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, callbacks=callbacks)
        return time.perf_counter() - start

    fit(1)  # compiles
    return fit, len(x) // batch


def _kernels(name: str, arm: str) -> tuple[int, float]:
    """Fusions in the entry computation of one compiled train step, and the
    bytes XLA's cost analysis counts (JAX)."""
    import re

    import jax

    keras.utils.set_random_seed(0)
    model, x, y, batch = MODELS[name]()
    opt = keras.optimizers.Adam(1e-3)
    if arm != "plain":
        opt = ng.SafeOptimizer(opt, flight_recorder=arm == "safe")
    model.compile(opt, LOSSES[name])
    model.fit(x[:batch], y[:batch], batch_size=batch, verbose=0)  # builds
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    compiled = jax.jit(model.train_step).lower(state, (x[:batch], y[:batch])).compile()
    text = compiled.as_text()
    entry = text[text.index("ENTRY") :]
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return len(re.findall(r" fusion\(", entry)), float(analysis["bytes accessed"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kernels", action="store_true")
    args = parser.parse_args()
    print(f"keras {keras.__version__}, backend {keras.backend.backend()}")
    if args.kernels:
        arms = ("plain", "safe, no recorder", "safe")
        print("\n| model | " + " | ".join(f"{a}: kernels, bytes" for a in arms) + " |")
        print("|---|" + "---|" * len(arms))
        for name in MODELS:
            found = [_kernels(name, arm) for arm in arms]
            cells = [f"{k}, {b / 1e6:.2f} MB" for k, b in found]
            print(f"| {name} | " + " | ".join(cells) + " |")
        return
    print("\n| model | steps timed | plain s/step | " + " | ".join(ARMS[1:]) + " |")
    print("|---|---|---|" + "---|" * (len(ARMS) - 1))
    for name in MODELS:
        fits = {}
        for arm in ARMS:
            fits[arm], steps = _arm(name, arm)
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for _ in range(args.rounds):
            for arm in ARMS:
                times[arm].append(fits[arm](args.epochs))
        per_step = min(times["plain"]) / (steps * args.epochs)
        ratios = [ratio_summary(times[arm], times["plain"]) for arm in ARMS[1:]]
        print(
            f"| {name} | {steps * args.epochs} | {per_step * 1e3:.2f} ms | "
            + " | ".join(ratios)
            + " |"
        )


if __name__ == "__main__":
    main()
