"""The GPU cost table of issue 12: `model.fit` ms/step, ratios to the same
optimizer with `global_clipnorm`, on JAX and torch.

Rows: a 90M-parameter dense model (10 x 3162, batch 256), the MLP
784-256-256-10 (batch 128), the conv actor (288x512x3) at batch 8 and 64.
Columns: RMSprop(1e-3, global_clipnorm=1.0) in ms/step; then, as ratios to
it, SafeOptimizer(RMSprop, clipnorm=1.0), LossScaleOptimizer(RMSprop), and
SafeOptimizer + NaNGuard() (a new NaNGuard for every `fit`; its first
snapshot, taken in `on_train_begin`, is timed apart and left out of the
steady state, and reported in its own column). Each round runs every
configuration once, in turn; ratios are per round, reported as median
[min, max]. Wall time of whole `fit` calls (no per-step timer callback, which
would make Keras dispatch batch ends synchronously).

Usage (one backend per process; the script starts them):
    python benchmarks/bench_gpu_table.py                 # jax and torch
    python benchmarks/bench_gpu_table.py --smoke         # tiny sizes, CPU check
    python benchmarks/bench_gpu_table.py --backends jax --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
from _stats import ratio_summary  # this folder is on sys.path

CONFIGS = ("global_clipnorm", "safe", "loss_scale", "safe_nanguard")
# name: (batch, steps per fit, builder arguments)
MODELS = {
    "dense 90M params (10 x 3162), batch 256": ("dense", 256, 30, 3162),
    "MLP 784-256-256-10, batch 128": ("mlp", 128, 200, None),
    "conv actor (288x512x3), batch 8": ("conv", 8, 60, None),
    "conv actor, batch 64": ("conv", 64, 30, None),
}
SMOKE = {  # same code paths, CPU-sized
    "dense (10 x 64), batch 32": ("dense", 32, 6, 64),
    "MLP 784-256-256-10, batch 16": ("mlp", 16, 6, None),
    "conv actor (36x64x3), batch 4": ("conv_small", 4, 4, None),
}


def build(kind: str, width: int | None):
    import keras

    if kind == "dense":
        return (
            keras.Sequential(
                [keras.Input((width,))]
                + [keras.layers.Dense(width, activation="relu") for _ in range(9)]
                + [keras.layers.Dense(10)]
            ),
            (width,),
            10,
        )
    if kind == "mlp":
        return (
            keras.Sequential(
                [
                    keras.Input((784,)),
                    keras.layers.Dense(256, activation="relu"),
                    keras.layers.Dense(256, activation="relu"),
                    keras.layers.Dense(10),
                ]
            ),
            (784,),
            10,
        )
    shape = (288, 512, 3) if kind == "conv" else (36, 64, 3)
    layers = [keras.Input(shape)]
    for filters in (16, 32, 64):
        layers += [
            keras.layers.Conv2D(filters, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
        ]
    layers += [
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(2),
    ]
    return keras.Sequential(layers), shape, 2


def optimizer(config: str):
    import keras

    import keras_nanguard as ng

    if config == "global_clipnorm":
        return keras.optimizers.RMSprop(1e-3, global_clipnorm=1.0)
    if config == "loss_scale":
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.RMSprop(1e-3))
    return ng.SafeOptimizer(keras.optimizers.RMSprop(1e-3), clipnorm=1.0)


def _stopwatch(log: dict, key: str):
    import keras

    class Stopwatch(keras.callbacks.Callback):
        """Records when `on_train_begin` reaches it: listed before and after
        NaNGuard, two of them time NaNGuard's `on_train_begin` (its first
        snapshot)."""

        def on_train_begin(self, logs=None):
            log[key] = time.perf_counter()

    return Stopwatch()


def timed_fit(model, x, y, batch: int, n: int, guard: bool) -> tuple[float, float]:
    """Seconds of one `fit` over `n` batches, less NaNGuard's first snapshot,
    and that snapshot's seconds."""
    import keras_nanguard as ng

    marks: dict = {}
    callbacks = []
    if guard:
        callbacks = [
            _stopwatch(marks, "before"),
            ng.NaNGuard(verbose=0),
            _stopwatch(marks, "after"),
        ]
    start = time.perf_counter()
    model.fit(
        x[: n * batch],
        y[: n * batch],
        batch_size=batch,
        epochs=1,
        verbose=0,
        shuffle=False,
        callbacks=callbacks,
    )
    total = time.perf_counter() - start
    first = marks["after"] - marks["before"] if marks else 0.0
    return total - first, first


def run_backend(rounds: int, smoke: bool) -> dict:
    import keras

    results = {}
    for name, (kind, batch, steps, width) in (SMOKE if smoke else MODELS).items():
        keras.utils.clear_session()
        rng = np.random.default_rng(0)
        models = {}
        for config in CONFIGS:
            keras.utils.set_random_seed(0)
            model, shape, classes = build(kind, width)
            model.compile(
                optimizer=optimizer(config),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
            models[config] = model
        x = rng.random((batch * steps, *shape), dtype=np.float32)
        y = rng.integers(0, classes, batch * steps).astype("int32")
        guarded = {c: c == "safe_nanguard" for c in CONFIGS}
        for config in CONFIGS:  # compile and warm up
            timed_fit(models[config], x, y, batch, 3, guarded[config])
        per_round = {c: [] for c in CONFIGS}
        first_snapshot = []
        for _ in range(rounds):
            for config in CONFIGS:
                steady, first = timed_fit(
                    models[config], x, y, batch, steps, guarded[config]
                )
                per_round[config].append(steady / steps)
                if guarded[config]:
                    first_snapshot.append(first)
        results[name] = {
            "per_round": per_round,
            "first_snapshot": first_snapshot,
            "params": models["safe"].count_params(),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="jax,torch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        print(json.dumps(run_backend(args.rounds, args.smoke)))
        return
    rows = []
    for backend in args.backends.split(","):
        cmd = [sys.executable, __file__, "--_child", "--rounds", str(args.rounds)]
        if args.smoke:
            cmd.append("--smoke")
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{backend} failed:\n{out.stderr[-4000:]}")
        for name, r in json.loads(out.stdout.strip().splitlines()[-1]).items():
            rows.append((name, backend, r))
    print(
        "| model | backend | ms/step `global_clipnorm` | SafeOptimizer(clipnorm=1)"
        " | LossScaleOptimizer | SafeOptimizer + NaNGuard() | NaNGuard / "
        "SafeOptimizer | NaNGuard first snapshot |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, backend, r in rows:
        pr = r["per_round"]
        base = pr["global_clipnorm"]
        first = 1e3 * float(np.median(r["first_snapshot"]))
        print(
            f"| {name} | {backend} | {1e3 * float(np.median(base)):.2f} "
            f"| {ratio_summary(pr['safe'], base)} "
            f"| {ratio_summary(pr['loss_scale'], base)} "
            f"| {ratio_summary(pr['safe_nanguard'], base)} "
            f"| {ratio_summary(pr['safe_nanguard'], pr['safe'])} "
            f"| {first:.1f} ms |"
        )


if __name__ == "__main__":
    main()
