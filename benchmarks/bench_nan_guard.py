"""What NaNGuard costs on a healthy run, and what one snapshot costs by size.

1. Steady-state time per step of `model.fit` on the MLP 784-256-256-10
   (batch 128), SafeOptimizer(RMSprop) alone, with an empty async-safe
   batch-end callback (what Keras's batch-end dispatch costs by itself) and
   with `NaNGuard()` (default settings), interleaved in one process; ratio per round, median [min,
   max]. The steady state leaves out what NaNGuard does once per fit or
   epoch on the training thread (the first snapshot at `on_train_begin`,
   the checks at `on_epoch_end` and `on_train_end`), which is reported
   apart. No timing callback: one would turn off Keras's asynchronous
   batch-end dispatch (JAX, torch), which NaNGuard keeps on.
2. Time of one in-memory snapshot: on the host (read + verify every weight
   and optimizer variable; the first allocates the buffers, later ones reuse
   them), and on JAX/torch on the device as NaNGuard takes it (copy, then
   one read of the finiteness flag); and of one on-disk write (atomic .npz),
   for dense models of about 1M, 10M and 100M parameters with RMSprop.

Usage:
    KERAS_BACKEND=tensorflow python benchmarks/bench_nan_guard.py
    KERAS_BACKEND=jax python benchmarks/bench_nan_guard.py --sizes 1M
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


def _timed_guard():
    """A NaNGuard that times its once-per-fit and once-per-epoch hooks (all
    on the training thread); its batch hooks are NaNGuard's own."""
    import keras_nanguard as ng

    class TimedGuard(ng.NaNGuard):
        def on_train_begin(self, logs=None):
            self.once = {"train_begin": 0.0, "epoch_end": 0.0, "train_end": 0.0}
            # CPU seconds of the thread running each batch hook (a wait for
            # the lock or for Keras's workers costs none): the host work
            # NaNGuard adds per step, snapshots included, less noisy than
            # wall time.
            self.cpu = {"batch_begin": 0.0, "batch_end": 0.0}
            start = time.perf_counter()
            super().on_train_begin(logs)
            self.once["train_begin"] += time.perf_counter() - start

        def on_train_batch_begin(self, batch, logs=None):
            start = time.thread_time()
            super().on_train_batch_begin(batch, logs)
            self.cpu["batch_begin"] += time.thread_time() - start

        def on_train_batch_end(self, batch, logs=None):
            start = time.thread_time()
            super().on_train_batch_end(batch, logs)
            self.cpu["batch_end"] += time.thread_time() - start

        def on_epoch_end(self, epoch, logs=None):
            start = time.perf_counter()
            super().on_epoch_end(epoch, logs)
            self.once["epoch_end"] += time.perf_counter() - start

        def on_train_end(self, logs=None):
            start = time.perf_counter()
            super().on_train_end(logs)
            self.once["train_end"] += time.perf_counter() - start

    return TimedGuard(verbose=0)


def overhead(rounds: int, steps: int) -> dict:
    rng = np.random.default_rng(0)
    x = rng.random((128 * steps, 784), dtype=np.float32)
    y = rng.integers(0, 10, len(x)).astype("int32")
    import keras

    class Listening(keras.callbacks.Callback):
        """Does nothing at a batch end, async-safe: what Keras's dispatch of
        batch ends (a worker thread, the logs made Python numbers) costs."""

        async_safe = True

        def on_train_batch_end(self, batch, logs=None):
            pass

    alone, guarded = "SafeOptimizer alone", "SafeOptimizer + NaNGuard()"
    attached = "SafeOptimizer attached (NaNGuard's step, no callback)"
    listened = "SafeOptimizer attached + an empty batch-end callback"
    models = {alone: _mlp(), attached: _mlp(), listened: _mlp(), guarded: _mlp()}
    for name in (attached, listened):  # the step NaNGuard's `attach` makes
        models[name].optimizer.attach(models[name])
    per_round = {k: [] for k in models}
    once, cpu = [], []

    def run(name, n):
        # A new NaNGuard per fit, as a user's script has: its first snapshot
        # is in `once`, not in the steady state.
        guard = _timed_guard() if name == guarded else None
        callbacks = [guard] if guard else [Listening()] if name == listened else []
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
        wall = time.perf_counter() - start
        if guard is None:
            return wall / n, None
        guard.cpu = {k: v / n for k, v in guard.cpu.items()}
        return (wall - sum(guard.once.values())) / n, guard

    for name in models:
        run(name, 20)  # compile and warm up
    for _ in range(rounds):
        for name in models:
            step, guard = run(name, steps)
            per_round[name].append(step)
            if guard is not None:
                once.append(guard.once)
                cpu.append(guard.cpu)
    return {
        "per_round": per_round,
        "once": once,
        "cpu": cpu,
        "guard": guard,
        "alone": alone,
        "listened": listened,
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
        device = None
        if keras.backend.backend() in ("jax", "torch"):
            times = []
            snap = None
            for _ in range(repeats + 1):  # the first allocates
                start = time.perf_counter()
                snap, _ = snapshots.capture(model, 0, 0, into=snap)
                snapshots.verify(snap)  # one read of the flag (waits for the copy)
                times.append(time.perf_counter() - start)
            device = (times[0], statistics.median(times[1:]))
            del snap
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
                device,
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
    base = res["per_round"][res["alone"]]
    backend = keras.backend.backend()
    print(
        f"### NaNGuard steady-state overhead, MLP 784-256-256-10, backend {backend}\n"
    )
    print(
        f"{args.rounds} interleaved rounds of one-epoch fits of {args.steps} steps.\n"
    )
    listened = res["per_round"][res["listened"]]
    print(
        "| configuration | step time (median) | ratio to SafeOptimizer alone "
        "| ratio to the empty callback |"
    )
    print("|---|---|---|---|")
    for name, times in res["per_round"].items():
        print(
            f"| {name} | {1e3 * statistics.median(times):.3f} ms | "
            f"{ratio_summary(times, base)} | {ratio_summary(times, listened)} |"
        )
    alone_ms = 1e3 * statistics.median(base)
    print("\nNaNGuard's batch hooks, CPU time of their thread per step (median):\n")
    for key in ("batch_begin", "batch_end"):
        us = statistics.median(1e6 * c[key] for c in res["cpu"])
        print(
            f"- `on_train_{key}`: {us:.1f} µs "
            f"({us / 10 / alone_ms:.2f} % of SafeOptimizer alone's step)"
        )
    print("\nOnce per fit / epoch, apart from the steady state (median over fits):\n")
    for key in ("train_begin", "epoch_end", "train_end"):
        ms = statistics.median(1e3 * o[key] for o in res["once"])
        print(f"- `on_{key}`: {ms:.2f} ms")
    guard = res["guard"]
    print(
        f"\nSnapshots taken in the last fit: {guard.snapshots_taken} "
        f"(last one {1e3 * guard.snapshot.seconds:.2f} ms).\n"
    )
    print(f"### Snapshot cost by model size, backend {backend}\n")
    print(
        "| model | parameters | snapshot size | host: first (allocates) "
        "| host: each later | + write to disk (atomic) | device: first | device: each later |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = snapshot_cost(args.sizes.split(","), 3)
    for size, params, nbytes, first, steady, disk, device in rows:
        dev = (
            "n/a | n/a"
            if device is None
            else (f"{1e3 * device[0]:.1f} ms | {1e3 * device[1]:.1f} ms")
        )
        print(
            f"| dense {size} | {params:,} | {nbytes / 2**20:.0f} MB | "
            f"{1e3 * first:.1f} ms | {1e3 * steady:.1f} ms | {1e3 * disk:.1f} ms "
            f"| {dev} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
