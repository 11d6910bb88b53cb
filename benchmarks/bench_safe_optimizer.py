"""What SafeOptimizer costs: steady-state `model.fit` step time and peak memory.

Times, interleaved in one process, the steady-state `model.fit` step of

- the inner optimizer alone (RMSprop);
- the inner optimizer with `global_clipnorm`;
- `LossScaleOptimizer(inner)`;
- `SafeOptimizer(inner, clipnorm=...)` (the full transaction);
- with `--spike`, the same with `spike_factor=10` (`safe_spike`),

on the MLP 784-256-256-10 (batch 128) and on the conv actor from the user's
report (288x512x3 input, Conv2D 16/32/64 3x3 ReLU + 2x2 max-pooling, Dense 64,
32, 2 softmax; batch 8). Each round times every configuration once, in turn,
so drift hits all of them alike; ratios are per round, to the first
configuration, and reported as median [min, max] over rounds.

Peak memory: each configuration trains in its own subprocess and reports its
peak resident set size (VmHWM, Linux); the extra memory of a configuration is
its peak minus the inner optimizer's (and minus global_clipnorm's), compared
with the size of one copy of weights + optimizer state.

Usage:
    KERAS_BACKEND=tensorflow python benchmarks/bench_safe_optimizer.py
    KERAS_BACKEND=jax python benchmarks/bench_safe_optimizer.py --models mlp
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
from _stats import ratio_summary  # this folder is on sys.path

CONFIGS = ["inner", "global_clipnorm", "loss_scale", "safe"]
MODELS = {
    "mlp": {"batch": 128, "steps": 300},
    "conv_actor": {"batch": 8, "steps": 12},
    # Dense models of ~1M, 10M and 100M parameters: 10 square layers.
    "dense_1m": {"batch": 64, "steps": 100, "width": 316},
    "dense_10m": {"batch": 64, "steps": 30, "width": 1000},
    "dense_100m": {"batch": 64, "steps": 6, "width": 3162},
}


def build_model(name: str):
    import keras

    if name.startswith("dense_"):
        width = MODELS[name]["width"]
        return keras.Sequential(
            [keras.Input((width,))]
            + [keras.layers.Dense(width, activation="relu") for _ in range(9)]
            + [keras.layers.Dense(10, activation="softmax")]
        )
    if name == "mlp":
        return keras.Sequential(
            [
                keras.Input((784,)),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )
    return keras.Sequential(
        [
            keras.Input((288, 512, 3)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(2, activation="softmax"),
        ]
    )


def make_optimizer(config: str):
    import keras

    import keras_nanguard as ng

    if config == "inner":
        return keras.optimizers.RMSprop(1e-3)
    if config == "global_clipnorm":
        return keras.optimizers.RMSprop(1e-3, global_clipnorm=1.0)
    if config == "loss_scale":
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.RMSprop(1e-3))
    if config == "safe":
        return ng.SafeOptimizer(keras.optimizers.RMSprop(1e-3), clipnorm=1.0)
    if config == "safe_spike":
        return ng.SafeOptimizer(
            keras.optimizers.RMSprop(1e-3), clipnorm=1.0, spike_factor=10.0
        )
    raise ValueError(config)


def data(name: str, n: int):
    rng = np.random.default_rng(0)
    if name == "conv_actor":
        x = rng.random((n, 288, 512, 3), dtype=np.float32)
        y = rng.integers(0, 2, n).astype("int32")
    else:
        width = MODELS[name].get("width", 784)
        x = rng.random((n, width), dtype=np.float32)
        y = rng.integers(0, 10, n).astype("int32")
    return x, y


def compiled_model(name: str, config: str):
    import keras

    keras.utils.set_random_seed(0)
    with _strategy_scope():
        model = build_model(name)
        model.compile(
            optimizer=make_optimizer(config), loss="sparse_categorical_crossentropy"
        )
    return model


_STRATEGY = None


def _strategy_scope():
    """MirroredStrategy over 2 logical CPUs with --mirrored (TensorFlow)."""
    import contextlib

    if os.environ.get("NANGUARD_BENCH_MIRRORED") != "1":
        return contextlib.nullcontext()
    import tensorflow as tf

    global _STRATEGY
    if _STRATEGY is None:
        # One strategy for the whole process: collective-op keys are unique
        # only within one strategy, and several would collide.
        devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
        _STRATEGY = tf.distribute.MirroredStrategy(devices)
    return _STRATEGY.scope()


def _configure_devices():
    if os.environ.get("NANGUARD_BENCH_MIRRORED") == "1":
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )


def _step_timer():
    import keras

    class StepTimer(keras.callbacks.Callback):
        """Wall time between consecutive batch ends (the first one is skipped,
        so `fit`'s start-up is not counted)."""

        def on_train_begin(self, logs=None):
            self.times, self.last = [], None

        def on_train_batch_end(self, batch, logs=None):
            now = time.perf_counter()
            if self.last is not None:
                self.times.append(now - self.last)
            self.last = now

    return StepTimer()


def time_steps(model, x, y, batch: int) -> float:
    """Median seconds per steady-state step of one `fit` epoch over (x, y)."""
    timer = _step_timer()
    model.fit(
        x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=[timer]
    )
    return statistics.median(timer.times)


def bench_time(name: str, rounds: int) -> dict:
    spec = MODELS[name]
    x, y = data(name, spec["batch"] * spec["steps"])
    models = {c: compiled_model(name, c) for c in CONFIGS}
    for m in models.values():  # compile and warm up
        time_steps(m, x[: 3 * spec["batch"]], y[: 3 * spec["batch"]], spec["batch"])
    per_round = {c: [] for c in CONFIGS}
    for _ in range(rounds):
        for c in CONFIGS:
            per_round[c].append(time_steps(models[c], x, y, spec["batch"]))
    n_params = sum(int(np.prod(v.shape)) for v in models["inner"].trainable_variables)
    return {"params": n_params, "per_round": per_round}


def _peak_rss_mb() -> float:
    # VmHWM, not ru_maxrss: a child started from a big parent inherits the
    # parent's ru_maxrss on Linux, while VmHWM starts afresh at exec.
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _peak_rss_child(name: str, config: str) -> None:
    # Little data, so that the peak is set by the training step, not by
    # converting the inputs.
    spec = MODELS[name]
    x, y = data(name, spec["batch"] * 3)
    model = compiled_model(name, config)
    model.fit(x, y, batch_size=spec["batch"], epochs=3, verbose=0, shuffle=False)
    state = sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
        for v in model.trainable_variables + model.optimizer.variables
        if "float" in str(v.dtype)
    )
    print(
        json.dumps(
            {
                "peak_rss_mb": _peak_rss_mb(),
                "state_mb": state / 2**20,
            }
        )
    )


def bench_memory(name: str) -> dict:
    out = {}
    for c in CONFIGS:
        proc = subprocess.run(
            [sys.executable, __file__, "--_child", name, c],
            capture_output=True,
            text=True,
            check=True,
            env=os.environ,
        )
        out[c] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def report(name: str, timing: dict, memory: dict | None) -> str:
    import keras

    base = timing["per_round"]["inner"]
    clip = timing["per_round"]["global_clipnorm"]
    mirrored = os.environ.get("NANGUARD_BENCH_MIRRORED") == "1"
    lines = [
        f"### {name} ({timing['params']:,} parameters), backend {keras.backend.backend()}"
        + (", MirroredStrategy on 2 logical CPUs" if mirrored else ""),
        "",
        "| configuration | step time (median) | ratio to inner | ratio to inner + global_clipnorm |"
        + (
            " peak RSS | extra vs inner | extra vs inner + global_clipnorm |"
            if memory
            else ""
        ),
        "|---|---|---|---|" + ("---|---|---|" if memory else ""),
    ]
    for c in CONFIGS:
        t = timing["per_round"][c]
        row = (
            f"| {c} | {1e3 * statistics.median(t):.2f} ms "
            f"| {ratio_summary(t, base)} | {ratio_summary(t, clip)} |"
        )
        if memory:
            peak = memory[c]["peak_rss_mb"]
            row += (
                f" {peak:.0f} MB | {peak - memory['inner']['peak_rss_mb']:+.0f} MB "
                f"| {peak - memory['global_clipnorm']['peak_rss_mb']:+.0f} MB |"
            )
        lines.append(row)
    if memory:
        lines.append("")
        lines.append(
            f"One copy of weights + optimizer state: {memory['inner']['state_mb']:.1f} MB."
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,conv_actor")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument(
        "--mirrored",
        action="store_true",
        help="TensorFlow: train under MirroredStrategy on 2 logical CPUs",
    )
    parser.add_argument(
        "--spike",
        action="store_true",
        help="also time SafeOptimizer with spike_factor=10 (safe_spike)",
    )
    parser.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.spike:
        CONFIGS.append("safe_spike")
    if args.mirrored:
        os.environ["NANGUARD_BENCH_MIRRORED"] = "1"  # children inherit it
    _configure_devices()
    if args._child:
        _peak_rss_child(*args._child)
        return 0
    for name in args.models.split(","):
        if name not in MODELS:
            parser.error(f"--models must be among {sorted(MODELS)}. Received: {name!r}")
        timing = bench_time(name, args.rounds)
        memory = None if args.no_memory else bench_memory(name)
        print(report(name, timing, memory), flush=True)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
