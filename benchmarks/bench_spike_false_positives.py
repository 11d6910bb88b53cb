"""False rejections of spike skipping in clean training (issue 18, finding 8).

    KERAS_BACKEND=jax python benchmarks/bench_spike_false_positives.py

The digits MLP (64-64-10, Adam 1e-3, batches of 32) trains 3,000 clean
steps with `SafeOptimizer(spike_sigma=6, spike_window=128)` in two
scenarios: `full` (1,600 samples, 50 full batches an epoch, not shuffled)
and `short` (1,573 samples, 49 batches of 32 and one of 5, shuffled). Per
scenario it prints:

- `new`: the steps the optimizer rejected on the device (the median and MAD
  of the log-norms, keras-nanguard 0.3);
- `old`: the steps that the mean + 6 standard deviations of the raw norms
  (keras-nanguard 0.2) would have rejected, replayed on the same clean norms
  (read back each step from the logs; a rejected step writes its threshold
  into the window, as on the device);
- `x100`: whether a gradient 100 times that of a batch is rejected, probed
  on the device after steps 1,000, 2,000 and 3,000 (`train_on_batch` with
  sample weights of 100; the probes are rejected, so they change nothing
  but the window);
- `x100 of median`: in what share of the steps a norm 100 times the window's
  median would be rejected, replayed for each statistic.
"""

from __future__ import annotations

import keras
import numpy as np
from sklearn.datasets import load_digits

import keras_nanguard as ng

SIGMA, WINDOW, STEPS = 6.0, 128, 3000


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


class _Norms(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.norms: list[float] = []

    def on_train_batch_end(self, batch, logs=None):  # a host read: fine here
        self.norms.append(float(logs["nanguard_grad_norm"]))


def run(scenario: str) -> None:
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
    opt.attach(model)  # logs nanguard_grad_norm
    recorder, probes = _Norms(), []
    for _ in range(3):  # 20 epochs of 50 steps, then a x100 probe
        model.fit(
            x,
            y,
            batch_size=32,
            epochs=20,
            shuffle=scenario == "short",
            verbose=0,
            callbacks=[recorder],
        )
        before = opt.counters()["spike_steps"]
        model.train_on_batch(x[:32], y[:32], sample_weight=np.full(32, 100.0))
        probes.append(opt.counters()["spike_steps"] > before)
    norms = np.array(recorder.norms)
    assert len(norms) == STEPS
    c = opt.counters()
    new = c["spike_steps"] - sum(probes)
    old, old_caught = replay(norms, old_threshold)
    new_replayed, new_caught = replay(norms, new_threshold)
    print(
        f"| {keras.backend.backend()} | {scenario} | {old} | {new} "
        f"({new_replayed} replayed) | {sum(probes)}/3 | "
        f"{old_caught:.3f} | {new_caught:.3f} |"
    )


if __name__ == "__main__":
    print(
        f"{STEPS} clean steps, spike_sigma={SIGMA:g}, spike_window={WINDOW}\n"
        "| backend | scenario | old rejections | new rejections | x100 probes "
        "rejected (new) | x100 of median rejected, old | new |\n"
        "|---|---|---|---|---|---|---|"
    )
    for scenario in ("full", "short"):
        run(scenario)
