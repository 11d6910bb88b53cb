"""One job, two processes: what SafeOptimizer and NaNGuard cost per step.

JAX (`--engine jax`): 2 processes x 2 CPU devices over gloo,
`keras.distribution.DataParallel` across processes, each process feeding its
half of every global batch; the digits-sized MLP (64-256-256-10, global batch
256), Adam(1e-3). Arms: plain Keras, `SafeOptimizer` (its defaults, flight
recorder on), and `NaNGuard` with its defaults around the SafeOptimizer.
Each round runs one epoch of `fit` per arm, in turn (`--steps` steps); the
first round compiles and is not counted. Reported: the ratio of each arm's
seconds to plain Keras's of the same round, median [min, max] over rounds.

torch (`--engine torch`): 2 gloo processes, the DistributedDataParallel loop
of Keras's guide, plain Adam against SafeOptimizer(Adam); the same ratio, and
the host reads per step (`aten._local_scalar_dense`, counted exactly with a
`TorchDispatchMode`) of the whole loop step and of `opt.apply` alone.

Usage:
    python benchmarks/bench_processes.py --engine jax
    python benchmarks/bench_processes.py --engine torch
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

GLOBAL = 256


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("jax", "torch"), default="jax")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    os.environ["BENCH_ROUNDS"], os.environ["BENCH_STEPS"] = (
        str(args.rounds),
        str(args.steps),
    )
    os.environ["KERAS_BACKEND"] = args.engine  # the workers'

    sys.path.insert(0, str(Path(__file__).parent))
    from _launch import run_job
    from _stats import ratio_summary

    with tempfile.TemporaryDirectory() as out:
        run_job(Path(__file__).resolve(), 2, Path(out), timeout=1800)
        found = json.loads((Path(out) / "bench0.json").read_text())

    base = found.pop("plain")
    print(f"engine {args.engine}: {args.rounds} rounds of {args.steps} steps")
    print("| arm | seconds per step (median) | ratio to plain Keras |")
    print("|---|---|---|")
    print(f"| plain Keras | {sorted(base)[len(base) // 2] / args.steps:.4f} | 1 |")
    reads = found.pop("host_reads", None)
    for arm, times in found.items():
        per_step = sorted(times)[len(times) // 2] / args.steps
        print(f"| {arm} | {per_step:.4f} | {ratio_summary(times, base)} |")
    if reads is not None:
        print(
            f"host reads per step: whole loop step {reads['step']}, "
            f"opt.apply {reads['apply']}"
        )


def worker() -> None:
    """One process of the job (run by tests/launch.py)."""
    index, count, out_dir, port = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:5]
    rounds, steps = int(os.environ["BENCH_ROUNDS"]), int(os.environ["BENCH_STEPS"])
    engine = "torch" if os.environ.get("KERAS_BACKEND") == "torch" else "jax"
    found = (_jax if engine == "jax" else _torch)(index, count, port, rounds, steps)
    if index == 0:
        (Path(out_dir) / "bench0.json").write_text(json.dumps(found))


def _data(index, count, steps):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((steps * GLOBAL, 64)).astype("float32")
    y = rng.integers(0, 10, steps * GLOBAL)
    half = GLOBAL // count
    rows = np.concatenate(
        [
            np.arange(b * GLOBAL + index * half, b * GLOBAL + (index + 1) * half)
            for b in range(steps)
        ]
    )
    return x[rows], y[rows], half


def _mlp():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def _jax(index, count, port, rounds, steps):
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import keras

    keras.distribution.initialize(f"127.0.0.1:{port}", count, index)
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(
            devices=keras.distribution.list_devices(), auto_shard_dataset=False
        )
    )
    import keras_nanguard as ng

    x, y, half = _data(index, count, steps)

    def arm(name):
        model = _mlp()
        if name == "plain":
            optimizer = keras.optimizers.Adam(1e-3)
        else:
            optimizer = ng.SafeOptimizer(keras.optimizers.Adam(1e-3))
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        callbacks = [ng.NaNGuard(verbose=0)] if name == "NaNGuard" else []
        return model, callbacks

    arms = {name: arm(name) for name in ("plain", "SafeOptimizer", "NaNGuard")}
    times = {name: [] for name in arms}
    for r in range(rounds + 1):
        for name, (model, callbacks) in arms.items():
            start = time.perf_counter()
            model.fit(
                x,
                y,
                batch_size=half,
                epochs=1,
                shuffle=False,
                verbose=0,
                callbacks=callbacks,
            )
            if r:  # the first round compiles
                times[name].append(time.perf_counter() - start)
    return times


def _reads():
    """A TorchDispatchMode counting host reads (`aten._local_scalar_dense`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ == "_local_scalar_dense":
                self.count += 1
            return func(*args, **(kwargs or {}))

    return Reads()


def _torch(index, count, port, rounds, steps):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=count
    )
    import keras
    from torch.nn.parallel import DistributedDataParallel

    import keras_nanguard as ng

    x, y, half = _data(index, count, steps)
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def arm(name):
        model = _mlp()
        opt = keras.optimizers.Adam(1e-3)
        if name == "SafeOptimizer":
            opt = ng.SafeOptimizer(opt)
        opt.build(model.trainable_variables)
        return model, DistributedDataParallel(model), opt

    def step(model, ddp, opt, b, reads=None):
        part = slice(b * half, (b + 1) * half)
        loss = loss_fn(ys[part], ddp(xs[part]))
        model.zero_grad()
        loss.backward()
        grads = [v.value.grad for v in model.trainable_variables]
        if reads is None:
            opt.apply(grads, model.trainable_variables)
            return
        with reads:
            opt.apply(grads, model.trainable_variables)

    arms = {name: arm(name) for name in ("plain", "SafeOptimizer")}
    times = {name: [] for name in arms}
    for r in range(rounds + 1):
        for name, (model, ddp, opt) in arms.items():
            start = time.perf_counter()
            for b in range(steps):
                step(model, ddp, opt, b)
            if r:
                times[name].append(time.perf_counter() - start)
    model, ddp, opt = arms["SafeOptimizer"]
    whole, apply = _reads(), _reads()
    with whole:
        step(model, ddp, opt, 0)
    step(model, ddp, opt, 1, reads=apply)
    times["host_reads"] = {"step": whole.count, "apply": apply.count}
    dist.destroy_process_group()
    return times


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1].isdigit():
        worker()
    else:
        main()
