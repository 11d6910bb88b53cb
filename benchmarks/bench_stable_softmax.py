"""StableSoftmax vs keras.layers.Softmax: forward + backward on 256x1000 logits.

Each configuration is one compiled function (tf.function, jax.jit; eager on
torch, as Keras runs it) computing the layer's output and the gradient of
`sum(output * w)` with respect to the logits. They are timed interleaved in
one process; the ratio to `keras.layers.Softmax` is taken per round and
reported as median [min, max].

Usage:
    KERAS_BACKEND=tensorflow python benchmarks/bench_stable_softmax.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
from _stats import ratio_summary  # this folder is on sys.path


def _fwd_bwd(layer, w):
    """A compiled function x -> (layer(x), d sum(layer(x) * w) / dx)."""
    import keras
    from keras import ops

    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        @tf.function
        def f(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x)
                loss = tf.reduce_sum(y * w)
            return y, tape.gradient(loss, x)

        return f
    if backend == "jax":
        import jax

        def loss(x):
            y = layer(x)
            return ops.sum(y * w), y

        g = jax.jit(jax.value_and_grad(loss, has_aux=True))
        return lambda x: g(x)

    def f(x):
        x = x.detach().requires_grad_(True)
        y = layer(x)
        (y * w).sum().backward()
        return y, x.grad

    return f


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    import keras
    from keras import ops

    import keras_nanguard as ng

    rng = np.random.default_rng(0)
    x = ops.convert_to_tensor(rng.standard_normal((256, 1000)).astype("float32") * 5)
    w = ops.convert_to_tensor(rng.standard_normal((256, 1000)).astype("float32"))
    configs = {
        "keras.layers.Softmax": keras.layers.Softmax(),
        "StableSoftmax()": ng.StableSoftmax(),
        "StableSoftmax(soft_cap=30)": ng.StableSoftmax(soft_cap=30.0),
        "StableSoftmax(log_probs=True)": ng.StableSoftmax(log_probs=True),
        "StableSoftmax(min_prob=1e-4)": ng.StableSoftmax(min_prob=1e-4),
    }
    fns = {name: _fwd_bwd(layer, w) for name, layer in configs.items()}

    def run(fn):
        start = time.perf_counter()
        for _ in range(args.calls):
            _, g = fn(x)
        ops.convert_to_numpy(g[0, :1])  # wait for the device
        return (time.perf_counter() - start) / args.calls

    for fn in fns.values():
        run(fn)
    times = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            times[name].append(run(fn))
    base = times["keras.layers.Softmax"]
    print(
        f"### StableSoftmax, 256x1000 logits, forward + backward, "
        f"backend {keras.backend.backend()}\n"
    )
    print("| layer | time per call (median) | ratio to keras.layers.Softmax |")
    print("|---|---|---|")
    for name, t in times.items():
        print(
            f"| {name} | {1e3 * statistics.median(t):.3f} ms | "
            f"{ratio_summary(t, base)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
