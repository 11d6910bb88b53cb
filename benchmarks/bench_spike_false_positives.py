"""False rejections of spike skipping in clean training (issue 18, finding 8).

    KERAS_BACKEND=jax python benchmarks/bench_spike_false_positives.py

The digits MLP (64-64-10, Adam 1e-3, batches of 32) trains 3,000 clean
steps with `SafeOptimizer(spike_sigma=6, spike_window=128)` in two
scenarios: `full` (1,600 samples, 50 full batches an epoch, not shuffled)
and `short` (1,573 samples, 49 batches of 32 and one of 5, shuffled each
epoch). The loop calls `train_on_batch` per step and reads the counter
`last_grad_norm` after each, so every step's raw norm is recorded, the
rejected ones too (a host read per step: fine in a benchmark, not in
training). Per scenario it prints:

- `new`: the steps the optimizer rejected on the device, and how many of
  them a float64 replay of the same rule on the recorded norms rejects;
- `old`: the steps that the mean + 6 standard deviations of the raw norms
  (keras-nanguard 0.2) would have rejected, replayed on the same norms (a
  rejected step writes its threshold into the window, as on the device);
- `x100`: how many of three gradients 100 times that of a batch are
  rejected, probed on the device after steps 1,000, 2,000 and 3,000
  (`train_on_batch` with sample weights of 100; a rejected probe changes
  nothing but the window);
- `x100 of median`: in what share of the steps a norm 100 times the window's
  median would be rejected, replayed for each rule;

and then each probe (its norm and the threshold, as multiples of the
window's median) and each step rejected on the device (index, batch size,
norm, the window's median and threshold, robust z-score of the log-norm).
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

SIGMA, WINDOW, STEPS, BATCH = 6.0, 128, 3000, 32
PROBES = (1000, 2000, 3000)


def old_threshold(window: np.ndarray) -> float:
    return float(window.mean() + SIGMA * window.std())


def new_threshold(window: np.ndarray) -> float:
    logs = np.log(np.maximum(window, 1e-30))
    centre = np.median(logs)
    return float(np.exp(centre + SIGMA * 1.4826 * np.median(np.abs(logs - centre))))


def replay(norms: np.ndarray, threshold) -> tuple[int, float]:
    """Rejections of a rule on a sequence of norms, and the share of steps
    where 100 times the window's median is above its threshold."""
    window = np.zeros(WINDOW)
    rejected = caught = 0
    for step, norm in enumerate(norms):
        limit = threshold(window)
        full = step >= WINDOW
        spike = full and norm > limit
        rejected += spike
        caught += full and 100 * np.median(window) > limit
        window[step % WINDOW] = limit if spike else norm
    return rejected, caught / (len(norms) - WINDOW)


def _read(variable) -> float:
    return float(ops.convert_to_numpy(variable))


def run(scenario: str) -> list[str]:
    digits = load_digits()
    n = 1600 if scenario == "full" else 1573
    order = np.random.default_rng(0).permutation(len(digits.data))[:n]
    x = (digits.data[order] / 16.0).astype("float32")
    y = digits.target[order].astype("int32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    opt = ng.SafeOptimizer(
        keras.optimizers.Adam(1e-3), spike_sigma=SIGMA, spike_window=WINDOW
    )
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(1)
    # Per step: raw norm, rejected on the device, batch size, window before.
    norms, rejected, sizes, windows, probes, figures = [], [], [], [], [], {}
    details: list[str] = []
    while len(norms) < STEPS:
        epoch = rng.permutation(n) if scenario == "short" else np.arange(n)
        for start in range(0, n, BATCH):
            batch = epoch[start : start + BATCH]
            before = _read(opt.spike_steps)
            windows.append(ops.convert_to_numpy(opt.spike_norms))
            model.train_on_batch(x[batch], y[batch])
            norms.append(_read(opt.last_grad_norm))
            rejected.append(_read(opt.spike_steps) > before)
            if rejected[-1]:
                figures[len(norms) - 1] = ops.convert_to_numpy(opt.last_spike)
            sizes.append(len(batch))
            if len(norms) in PROBES:
                before = _read(opt.spike_steps)
                weights = np.full(BATCH, 100.0)
                model.train_on_batch(x[:BATCH], y[:BATCH], sample_weight=weights)
                probes.append(_read(opt.spike_steps) > before)
                window = ops.convert_to_numpy(opt.spike_norms)
                details.append(
                    f"{scenario} probe after step {len(norms)}: norm "
                    f"{_read(opt.last_grad_norm):.4g} = "
                    f"{_read(opt.last_grad_norm) / np.median(window):.3g} x the "
                    f"median, threshold {new_threshold(window):.4g} = "
                    f"{new_threshold(window) / np.median(window):.3g} x the median, "
                    f"{'rejected' if probes[-1] else 'accepted'}"
                )
            if len(norms) == STEPS:
                break
    norms_ = np.array(norms)
    old, old_caught = replay(norms_, old_threshold)
    new_replayed, new_caught = replay(norms_, new_threshold)
    print(
        f"| {keras.backend.backend()} | {scenario} | {old} | {sum(rejected)} "
        f"({new_replayed} replayed) | {sum(probes)}/3 | "
        f"{old_caught:.3f} | {new_caught:.3f} |",
        flush=True,
    )
    if len(sys.argv) > 1:  # a folder to keep the norms in, for replays
        np.save(f"{sys.argv[1]}/{keras.backend.backend()}_{scenario}.npy", norms_)
    for step in np.flatnonzero(rejected):
        logs = np.log(np.maximum(windows[step], 1e-30))
        centre = np.median(logs)
        scale = 1.4826 * np.median(np.abs(logs - centre))
        details.append(
            f"{scenario} step {step} (epoch step {step % len(range(0, n, BATCH))}, "
            f"batch of {sizes[step]}): norm {norms[step]:.4g}, median "
            f"{np.exp(centre):.4g}, threshold {new_threshold(windows[step]):.4g}, "
            f"z {(np.log(norms[step]) - centre) / scale:.2f}; on the device: "
            f"threshold {figures[step][0]:.4g}, median {figures[step][1]:.4g}, "
            f"scale {figures[step][2]:.4g}"
        )
    return details


if __name__ == "__main__":
    print(
        f"keras-nanguard {ng.__version__} from {os.path.dirname(ng.__file__)}\n"
        f"{STEPS} clean steps, spike_sigma={SIGMA:g}, spike_window={WINDOW}\n"
        "| backend | scenario | old rejections | new rejections | x100 probes "
        "rejected (new) | x100 of median rejected, old | new |\n"
        "|---|---|---|---|---|---|---|"
    )
    details = [line for scenario in ("full", "short") for line in run(scenario)]
    print("", *details, sep="\n")
