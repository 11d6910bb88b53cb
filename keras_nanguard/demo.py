"""The demo: the same model trained with and without keras-nanguard, side by side.

Run it with `python -m keras_nanguard.demo` (or `keras-nanguard-demo`). On data
made in code, one small classifier is trained three times from the same
initial weights:

- plain `RMSprop`, with two faults injected: one sample of batch 7 is NaN in
  every epoch (a corrupted record), and the learning rate is `inf` for three
  steps (a warm-up schedule dividing by zero);
- `SafeOptimizer(RMSprop)`, with the same faults;
- plain `RMSprop` without faults, as the reference.

Then 1% of the training rows get a NaN feature (a data set with a few
corrupted records, read shuffled): `SafeOptimizer` rejects every batch that
holds one (47% of batches of 64), with `attach(model, quarantine=True)` it
leaves out the bad rows only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import keras


def _data(seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    centers = rng.normal(0.0, 2.0, size=(4, 20))
    labels = rng.integers(0, 4, size=5000)
    x = centers[labels] + rng.normal(0.0, 2.5, size=(5000, 20))
    x = x.astype("float32")
    labels = labels.astype("int32")
    return x[:4000], labels[:4000], x[4000:], labels[4000:]


def mlp(inputs: int, classes: int) -> keras.Sequential:
    """The demo's classifier: `inputs` features, two Dense layers of 64 ReLU
    units, `classes` logits. Its weights come from Keras's global seed: set
    it first (`keras.utils.set_random_seed`) for the same model each time.

    The tests, benchmarks and notebooks that train this small MLP (on the
    digits: `mlp(64, 10)`) build it here, so that it is one model everywhere.
    """
    import keras

    return keras.Sequential(
        [
            keras.Input((inputs,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(classes),
        ]
    )


def _first_bad_weights_callback():
    import keras

    class FirstBadWeights(keras.callbacks.Callback):
        """Records the first step after which some weight is NaN or inf."""

        def __init__(self) -> None:
            super().__init__()
            self.step = 0
            self.first_bad: int | None = None

        def on_train_batch_end(self, batch, logs=None):
            if self.first_bad is None and not all(
                np.isfinite(keras.ops.convert_to_numpy(w)).all()
                for w in self.model.weights
            ):
                self.first_bad = self.step
            self.step += 1

    return FirstBadWeights()


SPIKE_STEPS = [40, 41, 42]  # the learning-rate spike (plain and safe runs)
BAD_BATCH = 7  # the poisoned batch of each epoch (plain and safe runs)


def run(epochs: int = 3, batch_size: int = 64, verbose: bool = True) -> dict:
    """Trains the three runs and returns their figures (also printed)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    x, y, x_test, y_test = _data()
    keras.utils.set_random_seed(0)
    model = mlp(20, 4)
    steps_per_epoch = len(x) // batch_size
    n = steps_per_epoch * batch_size
    results = {
        kind: _train(kind, model, (x[:n], y[:n]), (x_test, y_test), batch_size, epochs)
        for kind in ("plain", "safe", "reference")
    }
    bad = np.random.default_rng(1).choice(n, size=n // 100, replace=False)
    x_bad = x[:n].copy()
    x_bad[bad, 3] = np.nan
    rows = {
        kind: _train_bad_rows(
            model, (x_bad, y[:n]), (x_test, y_test), batch_size, epochs, kind
        )
        for kind in ("rejection", "quarantine")
    }
    results["bad_rows"] = {"rows": len(bad), **rows}
    if verbose:
        from keras_nanguard._backend import current as backend

        _print(results, epochs, steps_per_epoch, SPIKE_STEPS, backend.NAME)
        _print_bad_rows(results["bad_rows"], results["reference"], n)
    return results


def _train_bad_rows(
    model: Any, train: tuple, test: tuple, batch_size: int, epochs: int, kind: str
) -> dict:
    """A SafeOptimizer run on data with bad rows, without or with quarantine."""
    import keras

    import keras_nanguard as ng

    net = keras.models.clone_model(model)
    net.set_weights(model.get_weights())
    opt = ng.SafeOptimizer(keras.optimizers.RMSprop(1e-3), clipnorm=1.0)
    net.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    opt.attach(net, quarantine=kind == "quarantine")
    keras.utils.set_random_seed(2)  # the same shuffles in both runs
    net.fit(*train, batch_size=batch_size, epochs=epochs, verbose=0)
    _, acc = net.evaluate(*test, verbose=0)
    c = opt.counters()
    return {
        "test_accuracy": float(acc),
        "skipped_steps": c["skipped_steps"],
        "quarantined_samples": c["quarantined_samples"],
    }


def _train(
    kind: str, model: Any, train: tuple, test: tuple, batch_size: int, epochs: int
) -> dict:
    """One run from `model`'s initial weights: "plain" and "safe" (under a
    SafeOptimizer) with the faults, "reference" without them."""
    import keras

    import keras_nanguard as ng

    net = keras.models.clone_model(model)
    net.set_weights(model.get_weights())
    inner = keras.optimizers.RMSprop(1e-3)
    opt = ng.SafeOptimizer(inner, clipnorm=1.0) if kind == "safe" else inner
    net.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    watch = _first_bad_weights_callback()
    callbacks = [watch]
    if kind != "reference":
        spike = ng.faults.LearningRateSpike(at_steps=SPIKE_STEPS, factor=float("inf"))
        callbacks.append(spike)
    bad_batches = [] if kind == "reference" else [BAD_BATCH]
    data = ng.faults.PoisonedBatches(
        *train, batch_size=batch_size, bad_batches=bad_batches
    )
    start = time.perf_counter()
    net.fit(data, epochs=epochs, verbose=0, shuffle=False, callbacks=callbacks)
    seconds = time.perf_counter() - start
    loss, acc = net.evaluate(*test, verbose=0)
    out = {
        "first_bad_weights": watch.first_bad,
        "test_loss": float(loss),
        "test_accuracy": float(acc),
        "seconds": seconds,
    }
    if isinstance(opt, ng.SafeOptimizer):
        out.update(opt.counters())
        out["last_rejection"] = opt.describe_last_rejection()
    return out


def _print(results: dict, epochs: int, steps: int, spike: list[int], backend: str):
    plain, safe, ref = results["plain"], results["safe"], results["reference"]

    def step(s: int | None) -> str:
        return "never" if s is None else f"step {s}"

    def pct(a: float) -> str:
        return f"{100 * a:.1f}%"

    rows = [
        (
            "first non-finite weights",
            step(plain["first_bad_weights"]),
            step(safe["first_bad_weights"]),
            step(ref["first_bad_weights"]),
        ),
        (
            "steps rejected",
            "-",
            f"{safe['skipped_steps']} ({safe['nonfinite_gradient_steps']} NaN gradient, "
            f"{safe['nonfinite_update_steps']} overflowing update)",
            "-",
        ),
        (
            "test loss",
            f"{plain['test_loss']:.4g}",
            f"{safe['test_loss']:.4g}",
            f"{ref['test_loss']:.4g}",
        ),
        (
            "test accuracy",
            pct(plain["test_accuracy"]),
            pct(safe["test_accuracy"]),
            pct(ref["test_accuracy"]),
        ),
        (
            "training time (with compile)",
            f"{plain['seconds']:.1f} s",
            f"{safe['seconds']:.1f} s",
            f"{ref['seconds']:.1f} s",
        ),
    ]
    head = ("", "RMSprop + faults", "SafeOptimizer + faults", "RMSprop, no faults")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    print(f"keras-nanguard demo (Keras backend: {backend})")
    print(
        f"MLP 20-64-64-4 on 4,000 samples made in code, RMSprop(1e-3), {epochs} "
        f"epochs of {steps} steps (steps counted from 0)."
    )
    print(
        "Faults: a NaN sample in batch 7 of every epoch; learning rate = inf at "
        f"steps {spike[0]}-{spike[-1]}.\n"
    )
    for r in [head, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    print(f"\nSafeOptimizer's last rejection: {safe['last_rejection']}.")


def _print_bad_rows(bad: dict, reference: dict, n: int) -> None:
    rejection, quarantine = bad["rejection"], bad["quarantine"]
    print(
        f"\nBad rows: {bad['rows']} of the {n:,} training rows (1%) have a NaN "
        "feature; fit shuffles them into its batches.\n"
    )
    rows = [
        ("", "SafeOptimizer", "+ attach(quarantine=True)", "no faults (above)"),
        (
            "steps rejected",
            str(rejection["skipped_steps"]),
            str(quarantine["skipped_steps"]),
            "-",
        ),
        ("rows left out", "-", str(quarantine["quarantined_samples"]), "-"),
        (
            "test accuracy",
            f"{100 * rejection['test_accuracy']:.1f}%",
            f"{100 * quarantine['test_accuracy']:.1f}%",
            f"{100 * reference['test_accuracy']:.1f}%",
        ),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1. Received: --epochs={args.epochs}")
    results = run(epochs=args.epochs)
    ok = (
        results["plain"]["first_bad_weights"] is not None
        and results["safe"]["first_bad_weights"] is None
        and results["bad_rows"]["quarantine"]["skipped_steps"] == 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
