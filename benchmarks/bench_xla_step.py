"""A TensorFlow GradientTape step compiled with XLA (`tf.function(
jit_compile=True)`, what `fit` compiles on a GPU by default): milliseconds
per step, plain Adam and SafeOptimizer(Adam), arms interleaved.

Before commit c404098 the flight recorder read a row of its ring known on
the device only with a strided slice, whose begin XLA takes as a constant:
the step counter entered the program by value and each step was compiled
again. `tests/safe_optimizer/test_step_kernels.py::
test_an_xla_step_is_the_same_program_at_every_step` guards it exactly.

    python benchmarks/bench_xla_step.py [--rounds 3] [--steps 20]

Prints the median [min, max] over rounds of each arm's milliseconds per
step and of the ratio safe / plain (taken per round).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import tensorflow as tf
from _stats import ratio_summary  # this folder is on sys.path

import keras_nanguard as ng


def compiled_step(safe: bool) -> Callable[[Any, Any], Any]:
    """An MLP 32-64-10's step, as in Keras's custom-loop guide, in XLA."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    inner = keras.optimizers.Adam(1e-3)
    opt = ng.SafeOptimizer(inner) if safe else inner
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=True)
    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
        return loss

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((64, 32)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, 64).astype("int32"))
    steps = {arm: compiled_step(arm == "safe") for arm in ("plain", "safe")}
    for step in steps.values():  # compiles, then two steps more
        for _ in range(3):
            step(x, y).numpy()
    times: dict[str, list[float]] = {arm: [] for arm in steps}
    for _ in range(args.rounds):
        for arm, step in steps.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                loss = step(x, y)
            loss.numpy()
            times[arm].append((time.perf_counter() - start) / args.steps * 1e3)

    def ms(values: list[float]) -> str:
        return f"{np.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"

    ratio = ratio_summary(times["safe"], times["plain"], digits=2)
    print("| plain ms/step | safe ms/step | safe / plain |")
    print("|---|---|---|")
    print(f"| {ms(times['plain'])} | {ms(times['safe'])} | {ratio} |")


if __name__ == "__main__":
    main()
