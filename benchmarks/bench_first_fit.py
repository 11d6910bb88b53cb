"""A model's first `fit`, its trace included: what each new model costs before
its first step runs (the TensorFlow suite builds hundreds). Seconds of a fresh
16-unit MLP's first `fit` of 2 steps, arms interleaved per round: plain Adam,
`SafeOptimizer(Adam)`, the same with `flight_recorder=False`, and plain Adam
under `NaNGuard`.

On TensorFlow a `tf.function` whose first trace makes variables (Keras
builds the optimizer inside the step there) is traced twice; since
2026-12-07 SafeOptimizer's part of the first trace is its build only (`tests/safe_optimizer/test_fit.py::test_a_first_fit_traces_the_
transaction_once` counts the traces exactly).

    KERAS_BACKEND=tensorflow python benchmarks/bench_first_fit.py [--rounds 7]

Prints per arm the median [min, max] seconds and the ratio to plain Adam's
(taken per round).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
from _stats import ratio_summary  # this folder is on sys.path

import keras_nanguard as ng

ARMS: dict[str, Callable[[], tuple[keras.optimizers.Optimizer, list]]] = {
    "plain Adam": lambda: (keras.optimizers.Adam(), []),
    "SafeOptimizer": lambda: (ng.SafeOptimizer(keras.optimizers.Adam()), []),
    "SafeOptimizer, no recorder": lambda: (
        ng.SafeOptimizer(keras.optimizers.Adam(), flight_recorder=False),
        [],
    ),
    "plain Adam + NaNGuard": lambda: (keras.optimizers.Adam(), [ng.NaNGuard()]),
}


def first_fit(arm: str) -> float:
    """Seconds of a fresh model's first `fit` (2 steps) under `arm`."""
    rng = np.random.default_rng(0)
    x = rng.random((64, 8), dtype=np.float32)
    y = rng.random((64, 1), dtype=np.float32)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    optimizer, callbacks = ARMS[arm]()
    model.compile(optimizer, "mse")
    start = time.perf_counter()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=callbacks)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    for arm in ARMS:  # warm-up: the backend's own first-use costs
        first_fit(arm)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for _ in range(args.rounds):
        for arm in ARMS:
            times[arm].append(first_fit(arm))
    base = times["plain Adam"]
    print(f"backend {keras.backend.backend()}, {args.rounds} rounds")
    for arm, found in times.items():
        print(
            f"{arm:>28}: {statistics.median(found):.3f} s "
            f"[{min(found):.3f}, {max(found):.3f}], x{ratio_summary(found, base, 2)}"
        )


if __name__ == "__main__":
    main()
