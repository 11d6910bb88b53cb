"""What NaNGuard costs on a healthy run, and what one snapshot costs by size.

1. Time per step of `model.fit` (wall time of a whole one-epoch fit divided
   by its steps) on the MLP 784-256-256-10 (batch 128), with
   SafeOptimizer(RMSprop), without a callback and with `NaNGuard()` (default
   settings), interleaved in one process; ratio per round, median [min, max].
2. Time of one in-memory snapshot (read + verify every weight and optimizer
   variable): the first, which allocates the host buffers, and later ones,
   which reuse them as NaNGuard does; and of one on-disk write (atomic .npz),
   for dense models of about 1M, 10M and 100M parameters with RMSprop.

Usage:
    KERAS_BACKEND=tensorflow python benchmarks/bench_nan_guard.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
from _stats import ratio_summary  # this folder is on sys.path

SIZES = {"1M": 316, "10M": 1000, "100M": 3162}  # width of 10 square layers


def _mlp():
    import keras

    import keras_nanguard as ng

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=ng.SafeOptimizer(keras.optimizers.RMSprop(1e-3), clipnorm=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def overhead(rounds: int, steps: int) -> dict:
    import keras_nanguard as ng

    rng = np.random.default_rng(0)
    x = rng.random((128 * steps, 784), dtype=np.float32)
    y = rng.integers(0, 10, len(x)).astype("int32")
    models = {"no callback": _mlp(), "NaNGuard()": _mlp()}
    guards = {"no callback": None, "NaNGuard()": ng.NaNGuard(verbose=0)}
    per_round = {k: [] for k in models}

    def run(name, n):
        # Wall time of the whole fit, not per-batch callbacks: a timing
        # callback would itself turn off Keras's asynchronous batch-end
        # dispatch (JAX, torch), hiding what NaNGuard's synchronous one costs.
        callbacks = [guards[name]] if guards[name] else []
        start = time.perf_counter()
        models[name].fit(
            x[: 128 * n],
            y[: 128 * n],
            batch_size=128,
            epochs=1,
            verbose=0,
            shuffle=False,
            callbacks=callbacks,
        )
        return (time.perf_counter() - start) / n

    for name in models:
        run(name, 20)  # compile and warm up
    for _ in range(rounds):
        for name in models:
            per_round[name].append(run(name, steps))
    guard = guards["NaNGuard()"]
    return {
        "per_round": per_round,
        "snapshots": guard.snapshots_taken,
        "snapshot_ms": 1e3 * guard.snapshot.seconds,
    }


def snapshot_cost(sizes: list[str], repeats: int) -> list[tuple]:
    import keras

    from keras_nanguard import snapshots

    rows = []
    for size in sizes:
        width = SIZES[size]
        keras.utils.clear_session()
        model = keras.Sequential(
            [keras.Input((width,))]
            + [keras.layers.Dense(width, use_bias=True) for _ in range(10)]
        )
        model.compile(optimizer=keras.optimizers.RMSprop(1e-3), loss="mse")
        model.optimizer.build(model.trainable_variables)
        params = model.count_params()
        start = time.perf_counter()
        snap, _ = snapshots.take(model, 0, 0)  # allocates the host buffers
        first = time.perf_counter() - start
        steady, disk = [], []
        with tempfile.TemporaryDirectory() as d:
            for _ in range(repeats):
                start = time.perf_counter()
                snap, _ = snapshots.take(model, 0, 0, into=snap)  # as NaNGuard does
                steady.append(time.perf_counter() - start)
                start = time.perf_counter()
                snapshots.save(snap, d)
                disk.append(time.perf_counter() - start)
        rows.append(
            (
                size,
                params,
                snap.nbytes,
                first,
                statistics.median(steady),
                statistics.median(disk),
            )
        )
        del snap, model
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sizes", default="1M,10M,100M")
    args = parser.parse_args()
    import keras

    res = overhead(args.rounds, args.steps)
    base = res["per_round"]["no callback"]
    print(
        f"### NaNGuard overhead, MLP 784-256-256-10, backend {keras.backend.backend()}\n"
    )
    print("| configuration | step time (median) | ratio to no callback |")
    print("|---|---|---|")
    for name, times in res["per_round"].items():
        print(
            f"| {name} | {1e3 * statistics.median(times):.3f} ms | "
            f"{ratio_summary(times, base)} |"
        )
    print(
        f"\nSnapshots taken in the last run: {res['snapshots']} "
        f"(last one {res['snapshot_ms']:.2f} ms).\n"
    )
    print(f"### Snapshot cost by model size, backend {keras.backend.backend()}\n")
    print(
        "| model | parameters | snapshot size | first snapshot (allocates) "
        "| each later snapshot | + write to disk (atomic) |"
    )
    print("|---|---|---|---|---|---|")
    rows = snapshot_cost(args.sizes.split(","), 3)
    for size, params, nbytes, first, steady, disk in rows:
        print(
            f"| dense {size} | {params:,} | {nbytes / 2**20:.0f} MB | "
            f"{1e3 * first:.1f} ms | {1e3 * steady:.1f} ms | {1e3 * disk:.1f} ms |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
