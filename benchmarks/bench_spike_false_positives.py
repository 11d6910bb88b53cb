"""False rejections of spike skipping in clean training (issue 18, finding 8).

    KERAS_BACKEND=jax python benchmarks/bench_spike_false_positives.py

The digits MLP (64-64-10, Adam 1e-3, batches of 32) trains 3,000 clean
steps with `SafeOptimizer(spike_factor=10, spike_window=128)` in three
scenarios: `full` (1,600 samples, 50 full batches an epoch, not shuffled),
`shuffled` (the same, shuffled each epoch) and `short` (1,573 samples, 49
batches of 32 and one of 5, shuffled each epoch). The loop calls
`train_on_batch` per step and reads the counter `last_grad_norm` after
each, so every step's raw norm is recorded, the rejected ones too (a host
read per step: fine in a benchmark, not in training). Per scenario it
prints:

- `new`: the steps the optimizer rejected on the device, and how many of
  them a float64 replay of the same rule on the recorded norms rejects;
- `old` and `MAD`: the steps that the mean + 6 standard deviations of the
  raw norms (keras-nanguard 0.2, as OLMo-core) and 6 robust standard
  deviations of the log-norm (median and MAD) would have rejected, replayed
  on the same norms (a rejected step writes its threshold into the window,
  as on the device);
- `x100 probes`: how many of three gradients 100 times that of a batch are
  rejected, probed on the device after steps 1,000, 2,000 and 3,000
  (`train_on_batch` with sample weights of 100; a rejected probe changes
  nothing but the window);
- `x100 of median` and `x100 of own`: in what share of the steps a norm 100
  times the window's median, or 100 times that step's own norm, would be
  rejected, replayed for each rule;
- `largest clean`: the largest clean norm as a multiple of the window's 90th
  percentile (the margin below `spike_factor`) and of its median;

and then each probe and each step rejected on the device.
With a folder as argument, it saves each scenario's norms there.
"""

from __future__ import annotations

import os
import sys

# This checkout's keras_nanguard, not an installed one (run as a script, the
# path starts at benchmarks/; an installed 0.2 has the old rule only).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras
import numpy as np
from keras import ops
from sklearn.datasets import load_digits

import keras_nanguard as ng
from keras_nanguard.demo import mlp

FACTOR, SIGMA, WINDOW, STEPS, BATCH = 10.0, 6.0, 128, 3000, 32
PROBES = (1000, 2000, 3000)
SCENARIOS = ("full", "shuffled", "short")


def new_threshold(window: np.ndarray) -> float:
    return float(FACTOR * np.quantile(window, 0.9))


def old_threshold(window: np.ndarray) -> float:
    return float(window.mean() + SIGMA * window.std())


def mad_threshold(window: np.ndarray) -> float:
    logs = np.log(np.maximum(window, 1e-30))
    centre = np.median(logs)
    return float(np.exp(centre + SIGMA * 1.4826 * np.median(np.abs(logs - centre))))


def replay(norms: np.ndarray, threshold) -> tuple[int, float, float]:
    """Rejections of a rule on a sequence of norms, and the shares of steps
    where 100 times the window's median, and 100 times the step's own norm,
    are above its threshold."""
    window = np.zeros(WINDOW)
    rejected = of_median = of_own = 0
    for step, norm in enumerate(norms):
        limit = threshold(window)
        full = step >= WINDOW
        spike = full and norm > limit
        rejected += spike
        of_median += full and 100 * np.median(window) > limit
        of_own += full and 100 * norm > limit
        window[step % WINDOW] = limit if spike else norm
    judged = len(norms) - WINDOW
    return rejected, of_median / judged, of_own / judged


def largest(norms: np.ndarray) -> tuple[float, float]:
    """The largest clean norm over the window's 90th percentile and median."""
    q90 = [np.quantile(norms[i - WINDOW : i], 0.9) for i in range(WINDOW, len(norms))]
    med = [np.median(norms[i - WINDOW : i]) for i in range(WINDOW, len(norms))]
    rest = norms[WINDOW:]
    return float(np.max(rest / q90)), float(np.max(rest / med))


def _read(variable) -> float:
    return float(ops.convert_to_numpy(variable))


def run(scenario: str) -> list[str]:
    digits = load_digits()
    n = 1573 if scenario == "short" else 1600
    order = np.random.default_rng(0).permutation(len(digits.data))[:n]
    x = (digits.data[order] / 16.0).astype("float32")
    y = digits.target[order].astype("int32")
    keras.utils.set_random_seed(0)
    model = mlp(64, 10)
    opt = ng.SafeOptimizer(
        keras.optimizers.Adam(1e-3), spike_factor=FACTOR, spike_window=WINDOW
    )
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(1)
    norms, rejected, probes, details = [], [], [], []
    while len(norms) < STEPS:
        epoch = np.arange(n) if scenario == "full" else rng.permutation(n)
        for start in range(0, n, BATCH):
            batch = epoch[start : start + BATCH]
            before = _read(opt.spike_steps)
            model.train_on_batch(x[batch], y[batch])
            norms.append(_read(opt.last_grad_norm))
            rejected.append(_read(opt.spike_steps) > before)
            if rejected[-1]:
                threshold, reference = ops.convert_to_numpy(opt.last_spike)
                details.append(
                    f"{scenario} step {len(norms) - 1} (batch of {len(batch)}): "
                    f"norm {norms[-1]:.4g}, 90th percentile {reference:.4g}, "
                    f"threshold {threshold:.4g}"
                )
            if len(norms) in PROBES:
                before = _read(opt.spike_steps)
                window = ops.convert_to_numpy(opt.spike_norms)
                weights = np.full(BATCH, 100.0)
                model.train_on_batch(x[:BATCH], y[:BATCH], sample_weight=weights)
                probes.append(_read(opt.spike_steps) > before)
                norm, median = _read(opt.last_grad_norm), np.median(window)
                details.append(
                    f"{scenario} probe after step {len(norms)}: norm {norm:.4g} = "
                    f"{norm / median:.3g} x the median, threshold "
                    f"{new_threshold(window) / median:.3g} x the median, "
                    f"{'rejected' if probes[-1] else 'accepted'}"
                )
            if len(norms) == STEPS:
                break
    norms_ = np.array(norms)
    new = replay(norms_, new_threshold)
    old = replay(norms_, old_threshold)
    mad = replay(norms_, mad_threshold)
    of_q90, of_median = largest(norms_)
    print(
        f"| {keras.backend.backend()} | {scenario} | {sum(rejected)} "
        f"({new[0]} replayed) | {old[0]} | {mad[0]} | {sum(probes)}/3 | "
        f"{new[1]:.3f} / {old[1]:.3f} / {mad[1]:.3f} | "
        f"{new[2]:.3f} / {old[2]:.3f} / {mad[2]:.3f} | "
        f"{of_q90:.2f} / {of_median:.1f} |",
        flush=True,
    )
    if len(sys.argv) > 1:  # a folder to keep the norms in, for replays
        np.save(f"{sys.argv[1]}/{keras.backend.backend()}_{scenario}.npy", norms_)
    return details


if __name__ == "__main__":
    print(
        f"keras-nanguard {ng.__version__} from {os.path.dirname(ng.__file__)}\n"
        f"{STEPS} clean steps, spike_factor={FACTOR:g}, spike_window={WINDOW}; "
        f"replays of mean + {SIGMA:g} std (old) and {SIGMA:g} log-MAD (MAD)\n"
        "| backend | scenario | rejections, new | old | MAD | x100 probes "
        "rejected | x100 of median rejected, new / old / MAD | x100 of own "
        "norm rejected, new / old / MAD | largest clean / 90th pct / median |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    details = [line for scenario in SCENARIOS for line in run(scenario)]
    print("", *details, sep="\n")
