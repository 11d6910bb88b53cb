"""What diagnose() costs, in training steps, on the conv actor from the report.

The actor (288x512x3 input, Conv2D 16/32/64 3x3 ReLU + 2x2 max-pooling,
Dense 64, 32, 2 softmax; RMSprop; batch 8) is timed in one process:

- one steady-state `model.fit` step (median over a 12-step epoch);
- one `diagnose(model, x, y, optimizer=...)` on a healthy batch, which runs
  every stage (inputs, targets, weights, per-layer forward, loss, gradients,
  the optimizer's update), the most work it ever does;
- the same on a batch whose loss hits log(0) (it stops at the loss stage).

Interleaved, median [min, max] of the per-round ratio to the training step.

Usage:
    KERAS_BACKEND=tensorflow python benchmarks/bench_diagnose.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The actor from the report (notebooks/report_models.py), as the notebooks
# and the tests build it.
sys.path.insert(
    0,
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks"
    ),
)

import numpy as np
from _stats import ratio_summary  # this folder is on sys.path
from bench_safe_optimizer import time_steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import keras
    import report_models as models

    import keras_nanguard as ng

    actor = models.actor(image=(288, 512, 3))
    actor.compile(
        optimizer=keras.optimizers.RMSprop(1e-3), loss="categorical_crossentropy"
    )
    rng = np.random.default_rng(0)
    x = rng.random((8 * 12, 288, 512, 3), dtype=np.float32)
    y = keras.utils.to_categorical(rng.integers(0, 2, len(x)), 2)
    xb, yb = x[:8], y[:8]

    def step():
        return time_steps(actor, x, y, batch=8)

    def healthy():
        start = time.perf_counter()
        report = ng.diagnose(actor, xb, yb, optimizer=actor.optimizer)
        assert report.healthy, str(report)
        return time.perf_counter() - start

    def log_of_zero():
        policy = actor.get_layer("policy")
        saved = keras.ops.convert_to_numpy(policy.kernel)
        w = np.zeros_like(saved)
        w[:, 0], w[:, 1] = 1e3, -1e3
        policy.kernel.assign(w)
        start = time.perf_counter()
        report = ng.diagnose(
            actor, xb, np.tile([[0.0, 1.0]], (8, 1)), loss=models.policy_gradient_loss
        )
        seconds = time.perf_counter() - start
        policy.kernel.assign(saved)
        assert report.causes[:1] == ["log_of_zero"], str(report)
        return seconds

    jobs = {
        "training step": step,
        "diagnose (healthy, all stages)": healthy,
        "diagnose (log(0) at the loss)": log_of_zero,
    }
    for job in jobs.values():
        job()
    times = {name: [] for name in jobs}
    for _ in range(args.rounds):
        for name, job in jobs.items():
            times[name].append(job())
    base = times["training step"]
    print(
        f"### diagnose() on the conv actor (288x512x3, batch 8), backend "
        f"{keras.backend.backend()}\n"
    )
    print("| what | time (median) | in training steps |")
    print("|---|---|---|")
    for name, t in times.items():
        print(
            f"| {name} | {1e3 * statistics.median(t):.0f} ms | "
            f"{ratio_summary(t, base, digits=2)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
