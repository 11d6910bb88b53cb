"""The flight recorder: what it adds to a step, in exact proxies, no timing.

The whole attached `fit` step (forward, loss, backward, SafeOptimizer's
transaction) with the recorder off (`flight_recorder=False`), on an ordinary
step (the loss and gradient norms), and on a probe step (weight and update
norms per layer, the optimizer state's smallest denominator, the batch's
input and output figures); the default cadence (`probe_every=16`) costs the
ordinary step plus 1/16 of the probe's extra. JAX: XLA's cost analysis of
the jitted `train_step` (`bytes accessed`); torch: the bytes of every aten
op of one eager `train_step` (`TorchDispatchMode`) and its host reads.
Models: the digits MLP (64-256-256-10, batch 256) and a small conv net
(32x32x3, Conv 32/64, Dense 10, batch 64), as in bench_quarantine.py.

What the run diagnosis finds is measured by `bench_run_diagnosis.py`, on
runs it was not tuned on; `tests/diagnosis/test_run_corpus.py` holds it to
the corpus of the tests.

Usage:
    KERAS_BACKEND=jax python benchmarks/bench_flight_recorder.py
    KERAS_BACKEND=torch python benchmarks/bench_flight_recorder.py
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
from _forced_probe import force_probe
from bench_quarantine import MODELS, _batch, torch_traffic

import keras_nanguard as ng

BACKEND = keras.backend.backend()


def _compiled(make, recorder: bool, force: bool | None):
    keras.utils.set_random_seed(0)
    model = make()
    opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-3), flight_recorder=recorder)
    force_probe(opt._recorder, force)
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    opt.attach(model)
    return model


def jax_bytes(model: keras.Model, data: tuple) -> float:
    """XLA's bytes accessed of the train step, jitted as Keras's `fit` jits
    it: the state donated (`donate_argnums=0`), so that the recorder's ring
    rows are written in place, as in training."""
    import jax

    model.train_on_batch(*data)  # builds the model, the optimizer, the metrics
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    step = jax.jit(model.train_step, donate_argnums=0)
    analysis = step.lower(state, data).compile().cost_analysis()
    if isinstance(analysis, list):
        analysis = analysis[0]
    return float(analysis["bytes accessed"])


def cost() -> None:
    if BACKEND not in ("jax", "torch"):
        raise SystemExit("the cost part needs KERAS_BACKEND=jax or torch")
    unit = "XLA bytes accessed" if BACKEND == "jax" else "aten bytes"
    print(f"\n### Recorder cost ({BACKEND}: {unit} of one attached train step)\n")
    print("| model | step | bytes | ratio to recorder off | host reads |")
    print("|---|---|---|---|---|")
    for name, (make, shape, n) in MODELS.items():
        figures = {}
        for label, recorder, force in (
            ("recorder off", False, None),
            ("ordinary step", True, False),
            ("probe step", True, True),
        ):
            keras.utils.clear_session()
            model = _compiled(make, recorder, force)
            data = _batch(shape, n, 0)
            if BACKEND == "jax":
                value, reads = jax_bytes(model, data), "-"
            else:
                value, reads = torch_traffic(model, data)
            figures[label] = value
            base = figures["recorder off"]
            print(
                f"| {name} | {label} | {value / 1e6:.3f} MB | "
                f"{value / base:.4f} | {reads} |"
            )
        base, plain = figures["recorder off"], figures["ordinary step"]
        every = 16
        amortised = plain + (figures["probe step"] - plain) / every
        print(
            f"| {name} | default cadence (1 probe in {every}) | "
            f"{amortised / 1e6:.3f} MB | {amortised / base:.4f} | |"
        )


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    cost()


if __name__ == "__main__":
    main()
