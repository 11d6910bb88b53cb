"""SafeOptimizer under `jit_compile=True` on torch: graphs compiled and wall time.

`torch.compile` recompiles a step whenever a guard on Python state fails; a
step that reads a changing Python int recompiles every step until dynamo's
limit, then runs eagerly. Counted here with dynamo's own counters (exact),
beside the wall time of whole `fit` calls (2 epochs of 32 steps, compile
included), for RMSprop with `global_clipnorm`, SafeOptimizer, and
SafeOptimizer with NaNGuard (which attaches it: one more wrapped step).

Usage:
    KERAS_BACKEND=torch python benchmarks/bench_torch_compile.py
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np

import keras_nanguard as ng


def run(make_optimizer, guard: bool) -> tuple[int, float]:
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 16)).astype("float32")
    y = x.sum(1, keepdims=True)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=make_optimizer(), loss="mse", jit_compile=True)
    callbacks = [ng.NaNGuard(verbose=0)] if guard else []
    start = time.perf_counter()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=callbacks)
    seconds = time.perf_counter() - start
    return counters["stats"]["unique_graphs"], seconds


def main() -> None:
    if keras.backend.backend() != "torch":
        raise SystemExit("Run with KERAS_BACKEND=torch.")
    configs = {
        "global_clipnorm": (
            lambda: keras.optimizers.RMSprop(1e-3, global_clipnorm=1.0),
            False,
        ),
        "safe": (
            lambda: ng.SafeOptimizer(keras.optimizers.RMSprop(1e-3), clipnorm=1.0),
            False,
        ),
        "safe + NaNGuard": (
            lambda: ng.SafeOptimizer(keras.optimizers.RMSprop(1e-3), clipnorm=1.0),
            True,
        ),
    }
    print(
        "| configuration | graphs compiled | fit wall time (64 steps, compile included) |"
    )
    print("|---|---|---|")
    for name, (make, guard) in configs.items():
        graphs, seconds = run(make, guard)
        print(f"| {name} | {graphs} | {seconds:.1f} s |")


if __name__ == "__main__":
    main()
