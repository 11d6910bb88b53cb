"""The flight recorder: what it adds to a step, and what the run diagnosis
finds on the corpus of runs.

Two parts (`--part cost`, `--part corpus`, default both):

- **cost**, exact proxies, no timing: the whole attached `fit` step
  (forward, loss, backward, SafeOptimizer's transaction) with the recorder
  off (`flight_recorder=False`), on an ordinary step (the loss and gradient
  norms), and on a probe step (weight and update norms per layer, the
  optimizer state's smallest denominator, the batch's input and output
  figures); the default cadence (`probe_every=16`) costs the ordinary step
  plus 1/16 of the probe's extra. JAX: XLA's cost analysis of the jitted
  `train_step` (`bytes accessed`); torch: the bytes of every aten op of one
  eager `train_step` (`TorchDispatchMode`) and its host reads. Models: the
  digits MLP (64-256-256-10, batch 256) and a small conv net (32x32x3, Conv
  32/64, Dense 10, batch 64), as in bench_quarantine.py.
- **corpus**: every run of `keras_nanguard.flight.corpus` under
  `NaNGuard(early_warning=True)`: the cause `explain()` names, the first bad
  step, the onset, and when the warning came; the share named right, the
  share warned before the first bad step, the median lead of the warning in
  steps and as a fraction of the steps to failure.

Usage:
    KERAS_BACKEND=jax python benchmarks/bench_flight_recorder.py
    KERAS_BACKEND=torch python benchmarks/bench_flight_recorder.py --part cost
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/

import keras
from _forced_probe import force_probe
from bench_quarantine import MODELS, _batch, torch_traffic

import keras_nanguard as ng
from tests import corpus

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


def corpus_table() -> None:
    print(f"\n### Run diagnosis on the corpus ({BACKEND})\n")
    print("| run | cause | named | first bad | onset | warned at | warning lead |")
    print("|---|---|---|---|---|---|---|")
    named = warned = diverging = 0
    leads, fractions = [], []
    for name, spec in corpus.RUNS.items():
        guard = corpus.run(name)
        found = guard.explain()
        warnings = [i for i in guard.incidents if i.kind == "divergence_warning"]
        at = warnings[0].diagnosis.at_step if warnings else None
        ok = found.cause == spec.cause
        named += ok
        lead = "-"
        if spec.cause != "healthy":
            diverging += 1
            bad = found.first_bad_step
            if at is not None and bad is not None and at < bad:
                warned += 1
                leads.append(bad - at)
                fractions.append((bad - at) / bad)
                lead = f"{bad - at} ({(bad - at) / bad:.0%})"
        print(
            f"| {name} | {spec.cause} | {found.cause if not ok else 'yes'} | "
            f"{found.first_bad_step} | {found.onset_step} | {at} | {lead} |"
        )
    print(
        f"\nNamed right: {named} of {len(corpus.RUNS)}; warned before the first "
        f"bad step: {warned} of {diverging} diverging runs; median lead "
        f"{statistics.median(leads) if leads else 0:g} steps, "
        f"{statistics.median(fractions) if fractions else 0:.0%} of the steps "
        "to failure."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("cost", "corpus", "both"), default="both")
    args = parser.parse_args()
    if args.part in ("cost", "both"):
        cost()
    if args.part in ("corpus", "both"):
        corpus_table()


if __name__ == "__main__":
    main()
