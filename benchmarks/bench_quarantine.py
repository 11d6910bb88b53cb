"""Per-sample quarantine: what a step costs, and what it saves on bad data.

Two parts (`--part cost`, `--part digits`, default both):

- **cost**, exact proxies, no timing: the whole attached `fit` step
  (forward, loss, backward, SafeOptimizer's transaction) with quarantine off
  and on, on a clean batch and on a batch with bad rows.
  JAX: XLA's cost analysis of the jitted `train_step`
  (`bytes accessed`). torch: the bytes read and written by every aten op of
  one eager `train_step`, counted with a `TorchDispatchMode`, and the host
  reads (`aten._local_scalar_dense`).
  Models: the digits MLP (64-256-256-10, batch 256) and a small conv net
  (32x32x3 images, Conv 32/64, Dense 10, batch 64).
- **digits**: scikit-learn's digits (1,797 8x8 images; 1,437 to train),
  1% of the training rows poisoned (a NaN pixel), batch 256, Adam(1e-3),
  30 epochs, shuffled: test accuracy of the clean run, of SafeOptimizer
  rejecting each batch with a bad row (today's behaviour without
  quarantine) and of the same run with `quarantine=True`, with the rejected
  steps and quarantined rows.

Usage:
    KERAS_BACKEND=jax python benchmarks/bench_quarantine.py
    KERAS_BACKEND=torch python benchmarks/bench_quarantine.py --part cost
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
from _torch_traffic import traffic  # this folder is on sys.path

import keras_nanguard as ng

BACKEND = keras.backend.backend()


# ------------------------------------------------------------------ models
def _mlp() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def _conv() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )


MODELS = {
    "digits MLP, batch 256": (_mlp, (64,), 256),
    "conv, batch 64": (_conv, (32, 32, 3), 64),
}


def _compiled(make, quarantine: bool) -> tuple[keras.Model, ng.SafeOptimizer]:
    keras.utils.set_random_seed(0)
    model = make()
    opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    opt.attach(model, quarantine=quarantine)
    return model, opt


def _batch(shape: tuple, n: int, bad: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, *shape)).astype("float32")
    y = rng.integers(0, 10, n).astype("int32")
    if bad:
        x = ng.faults.poison(x, rows=list(range(bad)))
    return x, y


# ------------------------------------------------------------------ cost
def jax_bytes(model: keras.Model, data: tuple) -> float:
    import jax

    model.train_on_batch(*data)  # builds the model, the optimizer, the metrics
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    compiled = jax.jit(model.train_step).lower(state, data).compile()
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):
        analysis = analysis[0]
    return float(analysis["bytes accessed"])


def torch_traffic(model: keras.Model, data: tuple) -> tuple[float, int]:
    import torch

    model.train_on_batch(*data)  # builds everything: buffers are made once
    tensors = tuple(torch.as_tensor(a) for a in data)
    return traffic(lambda: model.train_step(tensors))


def cost() -> None:
    if BACKEND not in ("jax", "torch"):
        raise SystemExit("the cost part needs KERAS_BACKEND=jax or torch")
    unit = "XLA bytes accessed" if BACKEND == "jax" else "aten bytes"
    print(f"\n### Step cost ({BACKEND}: {unit} of one attached train step)\n")
    print(
        "| model | quarantine | batch | bytes | ratio to quarantine off | host reads |"
    )
    print("|---|---|---|---|---|---|")
    for name, (make, shape, n) in MODELS.items():
        base = None
        for quarantine, bad, label in (
            (False, 0, "clean"),
            (True, 0, "clean"),
            (True, max(1, n // 100), f"{max(1, n // 100)} bad rows"),
        ):
            keras.utils.clear_session()
            model, _ = _compiled(make, quarantine)
            data = _batch(shape, n, bad)
            if BACKEND == "jax":
                value, reads = jax_bytes(model, data), "-"
            else:
                value, reads = torch_traffic(model, data)
            base = value if base is None else base
            on = "on" if quarantine else "off"
            print(
                f"| {name} | {on} | {label} | {value / 1e6:.3f} MB | "
                f"{value / base:.4f} | {reads} |"
            )


# ------------------------------------------------------------------ digits
def digits() -> None:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    y = y.astype("int32")
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x))
    x, y = x[order], y[order]
    x_train, y_train, x_test, y_test = x[:1437], y[:1437], x[1437:], y[1437:]
    bad = rng.choice(len(x_train), size=len(x_train) // 100, replace=False)
    x_bad = x_train.copy()
    x_bad[bad, 10] = np.nan
    print(
        f"\n### Digits, {len(bad)} of {len(x_train)} training rows poisoned "
        f"(1%), batch 256, 30 epochs ({BACKEND})\n"
    )
    print("| run | test accuracy | rejected steps | quarantined rows | steps |")
    print("|---|---|---|---|---|")
    for label, data, quarantine in (
        ("clean data, SafeOptimizer", x_train, False),
        ("1% bad rows, whole-batch rejection", x_bad, False),
        ("1% bad rows, quarantine=True", x_bad, True),
    ):
        keras.utils.clear_session()
        model, opt = _compiled(_mlp, quarantine)
        keras.utils.set_random_seed(1)
        model.fit(data, y_train, batch_size=256, epochs=30, verbose=0)
        _, accuracy = model.evaluate(x_test, y_test, verbose=0)
        c = opt.counters()
        print(
            f"| {label} | {accuracy:.1%} | {c['skipped_steps']} | "
            f"{c['quarantined_samples']} | {30 * -(-len(x_train) // 256)} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("cost", "digits", "both"), default="both")
    args = parser.parse_args()
    if args.part in ("cost", "both"):
        cost()
    if args.part in ("digits", "both"):
        digits()


if __name__ == "__main__":
    main()
