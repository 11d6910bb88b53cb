"""Train at a higher learning rate: a learning-rate sweep of seven arms.

Two tasks, each trained from scratch at every rate of a grid, with every arm
and several seeds:

- **gpt**: a character-level GPT (2 pre-LayerNorm blocks, width 64, 4 heads,
  context 64, no QK-norm) on Python standard library sources (`argparse`,
  `textwrap`, `shlex`: on every machine), batch 16; the final loss is the
  cross-entropy on 64 held-out windows of the last tenth of the text.
- **digits**: a small CNN with BatchNormalization (Conv 32/64/64, 3x3, each
  followed by BatchNormalization and ReLU, max-pooling, global average
  pooling, Dense 10) on scikit-learn's digits, batch 64; the final loss is
  the cross-entropy on the 360 held-out images.

Every arm is AdamW (beta_1 0.9, beta_2 0.95, weight decay 0.1), 50 warm-up
steps to the peak rate, then cosine decay to a tenth of it, 600 steps:

- `none`: nothing more.
- `clipnorm`: `global_clipnorm=1.0`.
- `zclip`: ZClip with its published defaults (alpha 0.97, z 2.5, 25 warm-up
  steps, adaptive scaling, `max_grad_norm=1.0`), as `bluorion-com/ZClip`'s
  `zclip.py` computes it, on the device.
- `skip6`: OLMo-core's `SkipStepOptimizer` rule (a step whose loss or raw
  gradient norm is more than 6 standard deviations above the mean of the
  last 128 steps is skipped whole, once 64 steps are in the window), with
  gradient clipping at 1.0 as OLMo-core's trainer clips.
- `stable_adamw`: StableAdamW (Wortsman et al. 2023, Algorithm 2): each
  tensor's learning rate divided by max(1, RMS(g^2 / max(v_hat, eps^2))).
- `safe`: `SafeOptimizer(AdamW, clipnorm=1.0)`, keras-nanguard today.
- `adaptive`: `SafeOptimizer(AdamW, clipnorm=1.0, clip="adaptive")`, the
  graded handling.

The grid starts at 1e-3 and goes up by half-decades to `--max-rate`. Per
arm: the highest rate at which every seed ends within 1.1x of the arm's best
final loss (the mean over seeds at its best rate), the same against the best
of every arm, the final loss at each rate, and the learning-rate
sensitivity of Wortsman et al. (2023): the mean over the grid of
min(final loss, initial loss), minus the best. The sweep runs on JAX (the
stateless loop of Keras's JAX training guide, jitted).

`--cost`: the step cost of each arm, exact, no timing: on JAX the XLA bytes
accessed of one jitted training step (forward, backward, optimizer) and of
one optimizer step alone; on torch the aten bytes of one step of the torch
guide's loop and its host reads, counted with a `TorchDispatchMode`. The
SafeOptimizer arms are counted at the flight recorder's default cadence (an
ordinary step plus a sixteenth of a probe step's extra), as BENCHMARKS.md
counts the recorder.

Usage:
    KERAS_BACKEND=jax python benchmarks/bench_stable_lr.py            # the sweep
    KERAS_BACKEND=jax python benchmarks/bench_stable_lr.py --quick    # minutes
    KERAS_BACKEND=jax python benchmarks/bench_stable_lr.py --cost
    KERAS_BACKEND=torch python benchmarks/bench_stable_lr.py --cost
    KERAS_BACKEND=tensorflow python benchmarks/bench_stable_lr.py --examples 0.01,0.1

`--examples`: the programs of `examples/` (convnet, LSTMs, transformer, GPT,
VAE, GAN, WGAN-GP; not the actor-critic loops) at their own rates and lengths, plain and
with `clip="adaptive"`: the loss each ends at, as a ratio to plain.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
from keras import layers, ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _forced_probe import force_probe

import keras_nanguard as ng

BACKEND = keras.backend.backend()
STEPS, WARMUP = 600, 50
# Arguments of the adaptive arm beyond its defaults (`--adaptive-args`).
ADAPTIVE_ARGS: dict = {}
ARMS = ("none", "clipnorm", "zclip", "skip6", "stable_adamw", "safe", "adaptive")


# ================================================================= the arms
def _adamw_args() -> dict:
    return {"beta_1": 0.9, "beta_2": 0.95, "weight_decay": 0.1}


def _global_norm(grads: list) -> Any:
    return ops.sqrt(sum(ops.sum(ops.square(ops.cast(g, "float32"))) for g in grads))


class ZClipAdamW(keras.optimizers.AdamW):
    """AdamW behind ZClip (`bluorion-com/ZClip`, `zclip.py`), its defaults:
    alpha 0.97, z_thresh 2.5, max_grad_norm 1.0, eps 1e-6, 25 warm-up steps,
    mode "zscore", clip_option "adaptive_scaling", clip_factor 1.0. Written on
    the device (the original reads the norm to the host every step)."""

    alpha, z_thresh, max_grad_norm, eps, warmup = 0.97, 2.5, 1.0, 1e-6, 25

    def build(self, var_list: list) -> None:
        super().build(var_list)
        # steps collected (up to warm-up), EMA mean, EMA variance
        self.zclip = self.add_variable((3,), dtype="float32", name="zclip")

    def apply(self, grads: list, trainable_variables: Any = None) -> None:
        if not self.built:
            self.build(trainable_variables)
        grads = list(grads)
        norm = _global_norm(grads)
        stats = self.zclip.value
        seen, mean, var = stats[0], stats[1], stats[2]
        warm = seen < self.warmup  # not `initialized` at the call's start
        std = ops.sqrt(var)
        z = (norm - mean) / (std + self.eps)
        spike = ops.logical_and(~warm, z > self.z_thresh)
        clip_val = mean + (self.z_thresh * std) / (z / self.z_thresh)
        adaptive = ops.where(spike, clip_val, norm)
        # `_apply_clipping`: the smaller of the adaptive clip and max_grad_norm
        # (warm-up: max_grad_norm alone); `apply_in_place_clipping`'s coef.
        effective = ops.where(warm, self.max_grad_norm, ops.minimum(adaptive, 1.0))
        coef = ops.where(norm > effective, effective / (norm + 1e-6), 1.0)
        grads = [g * ops.cast(coef, g.dtype) for g in grads]
        # Warm-up: the buffer's mean and population variance (at its end,
        # `_initialize_ema`); then the EMA of the clip value or the norm.
        count = seen + 1.0
        b_mean = mean + (norm - mean) / count
        b_var = var + ((norm - mean) * (norm - b_mean) - var) / count
        e_mean = self.alpha * mean + (1 - self.alpha) * adaptive
        e_var = self.alpha * var + (1 - self.alpha) * ops.square(adaptive - e_mean)
        self.zclip.assign(
            ops.stack(
                [
                    ops.minimum(count, float(self.warmup)),
                    ops.where(warm, b_mean, e_mean),
                    ops.where(warm, b_var, e_var),
                ]
            )
        )
        super().apply(grads, trainable_variables)


class SkipStepAdamW(keras.optimizers.AdamW):
    """AdamW under OLMo-core's `SkipStepOptimizer` rule: skipped whole (weights,
    moments, step count) when the loss or the raw gradient norm is more than
    `sigma_factor` (6) standard deviations (unbiased) above the mean of the
    last `rolling_interval_length` (128) steps, once at least 64 are known;
    every step's values enter the window. The training loop hands the loss
    in (`latest_loss`), as OLMo-core's trainer does. Clips at 1.0."""

    window, sigma, clipnorm_value = 128, 6.0, 1.0

    def build(self, var_list: list) -> None:
        super().build(var_list)
        self.losses = self.add_variable((self.window,), dtype="float32", name="losses")
        self.norms = self.add_variable((self.window,), dtype="float32", name="norms")
        self.count = self.add_variable((), dtype="int32", name="count")
        self.latest_loss = self.add_variable((), dtype="float32", name="latest_loss")

    def _within(self, ring: Any, value: Any, n: Any) -> Any:
        mask = ops.cast(ops.arange(self.window) < n, "float32")
        k = ops.cast(ops.minimum(n, self.window), "float32")
        mean = ops.sum(ring * mask) / k
        std = ops.sqrt(ops.sum(ops.square(ring - mean) * mask) / (k - 1.0))
        return value - mean <= self.sigma * std

    def apply(self, grads: list, trainable_variables: Any = None) -> None:
        if not self.built:
            self.build(trainable_variables)
        variables = list(trainable_variables or self._trainable_variables)
        grads = list(grads)
        norm = _global_norm(grads)
        loss, n = self.latest_loss.value, self.count.value
        active = n + 1 >= self.window // 2  # len(losses), the latest included
        ok = ops.logical_or(
            ~active,
            ops.logical_and(
                self._within(self.losses.value, loss, n),
                self._within(self.norms.value, norm, n),
            ),
        )
        coef = ops.minimum(1.0, self.clipnorm_value / (norm + 1e-6))
        grads = [g * ops.cast(coef, g.dtype) for g in grads]
        state = variables + [v for v in self.variables if v is not self.latest_loss]
        before = [ops.copy(v.value) for v in state]
        super().apply(grads, variables)
        for v, old in zip(state, before, strict=True):
            v.assign(ops.where(ok, v.value, old))
        slot = ops.arange(self.window) == ops.mod(n, self.window)
        self.losses.assign(ops.where(slot, loss, self.losses.value))
        self.norms.assign(ops.where(slot, norm, self.norms.value))
        self.count.assign(n + 1)


class StableAdamW(keras.optimizers.Adam):
    """StableAdamW (Wortsman et al. 2023, "Small-scale proxies for large-scale
    Transformer training instabilities", Algorithm 2): AdamW whose rate for
    each tensor is divided by max(1, RMS_t), RMS_t = sqrt(mean(g^2 /
    max(v_hat, eps^2))), the decoupled weight decay at the same rate."""

    def __init__(self, learning_rate: Any, weight_decay: float, **kwargs: Any):
        super().__init__(learning_rate, **kwargs)
        self.decay = weight_decay

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        lr = ops.cast(learning_rate, variable.dtype)
        g = ops.cast(gradient, variable.dtype)
        t = ops.cast(self.iterations + 1, variable.dtype)
        m = self._momentums[self._get_variable_index(variable)]
        v = self._velocities[self._get_variable_index(variable)]
        self.assign(m, m + (g - m) * (1 - self.beta_1))
        self.assign(v, v + (ops.square(g) - v) * (1 - self.beta_2))
        m_hat = m / (1 - ops.power(self.beta_1, t))
        v_hat = v / (1 - ops.power(self.beta_2, t))
        eps = self.epsilon
        rms = ops.sqrt(ops.mean(ops.square(g) / ops.maximum(v_hat, eps * eps)))
        eta = lr / ops.maximum(1.0, rms)
        self.assign(
            variable,
            variable
            - eta * self.decay * variable
            - eta * m_hat / (ops.sqrt(v_hat) + eps),
        )


def make_optimizer(arm: str, rate: Any) -> keras.optimizers.Optimizer:
    """The arm's optimizer at `rate` (a float or a schedule)."""
    args = _adamw_args()
    if arm == "none":
        return keras.optimizers.AdamW(rate, **args)
    if arm == "clipnorm":
        return keras.optimizers.AdamW(rate, global_clipnorm=1.0, **args)
    if arm == "zclip":
        return ZClipAdamW(rate, **args)
    if arm == "skip6":
        return SkipStepAdamW(rate, **args)
    if arm == "stable_adamw":
        return StableAdamW(rate, beta_1=0.9, beta_2=0.95, weight_decay=0.1)
    if arm == "safe":
        return ng.SafeOptimizer(keras.optimizers.AdamW(rate, **args), clipnorm=1.0)
    if arm == "adaptive":
        return ng.SafeOptimizer(
            keras.optimizers.AdamW(rate, **args),
            **{"clipnorm": 1.0, "clip": "adaptive", **ADAPTIVE_ARGS},
        )
    raise ValueError(f"`arm` must be one of {ARMS}. Received: arm={arm!r}")


def schedule(peak: float, steps: int) -> Any:
    """Linear warm-up to `peak` in `WARMUP` steps, cosine decay to peak/10."""
    return keras.optimizers.schedules.CosineDecay(
        0.0, steps - WARMUP, alpha=0.1, warmup_target=peak, warmup_steps=WARMUP
    )


# ================================================================ the tasks
CONTEXT, WIDTH, HEADS, BLOCKS = 64, 64, 4, 2


def _text() -> str:
    import argparse as a
    import inspect
    import shlex
    import textwrap

    source = "".join(inspect.getsource(m) for m in (a, textwrap, shlex))
    return "".join(c if 32 <= ord(c) < 127 or c == "\n" else " " for c in source)


class PositionEmbedding(layers.Layer):
    """A learnt embedding of each position, added to the tokens'."""

    def build(self, input_shape: tuple) -> None:
        self.positions = self.add_weight(
            shape=tuple(input_shape[1:]), initializer="uniform", name="positions"
        )

    def call(self, x: Any) -> Any:
        return x + self.positions


def gpt(vocab: int) -> keras.Model:
    """The character-level GPT: pre-LayerNorm blocks, causal attention."""
    tokens = layers.Input((CONTEXT,), dtype="int32")
    x = PositionEmbedding()(layers.Embedding(vocab, WIDTH)(tokens))
    for _ in range(BLOCKS):
        h = layers.LayerNormalization()(x)
        h = layers.MultiHeadAttention(HEADS, WIDTH // HEADS)(h, h, use_causal_mask=True)
        x = x + h
        h = layers.LayerNormalization()(x)
        h = layers.Dense(4 * WIDTH, activation="gelu")(h)
        x = x + layers.Dense(WIDTH)(h)
    x = layers.LayerNormalization()(x)
    return keras.Model(tokens, layers.Dense(vocab)(x))


def digits_cnn() -> keras.Model:
    """The small CNN with BatchNormalization."""
    x = inputs = layers.Input((8, 8, 1))
    for filters in (32, 64, 64):
        x = layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        x = layers.BatchNormalization()(x)
        x = layers.ReLU()(x)
        if filters == 32:
            x = layers.MaxPooling2D()(x)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(10)(x))


class Task:
    """A task's model, its batches (a seed's) and its held-out data."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "gpt":
            text = _text()
            chars = sorted(set(text))
            self.codes = np.array([chars.index(c) for c in text], "int32")
            self.vocab = len(chars)
            self.split = int(len(self.codes) * 0.9)
            starts = np.linspace(
                self.split, len(self.codes) - CONTEXT - 2, 64, dtype="int64"
            )
            self.test = self._windows(starts)
            self.batch = 16
        elif name == "digits":
            from sklearn.datasets import load_digits

            x, y = load_digits(return_X_y=True)
            x = (x / 16.0).astype("float32").reshape(-1, 8, 8, 1)
            y = y.astype("int32")
            order = np.random.default_rng(0).permutation(len(x))
            x, y = x[order], y[order]
            self.train, self.test = (x[:1437], y[:1437]), (x[1437:], y[1437:])
            self.batch = 64
        else:
            raise ValueError(f"`task` must be gpt or digits. Received: {name!r}")

    def _windows(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = starts[:, None] + np.arange(CONTEXT)
        return self.codes[idx], self.codes[idx + 1]

    def model(self) -> keras.Model:
        return gpt(self.vocab) if self.name == "gpt" else digits_cnn()

    def batches(self, seed: int, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
        rng = np.random.default_rng(seed)
        if self.name == "gpt":
            starts = rng.integers(0, self.split - CONTEXT - 1, (steps, self.batch))
            return [self._windows(s) for s in starts]
        x, y = self.train
        rows = rng.integers(0, len(x), (steps, self.batch))
        return [(x[r], y[r]) for r in rows]


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# ============================================================ the JAX loop
def train(task: Task, arm: str, peak: float, seed: int, steps: int) -> dict:
    """One run (the stateless loop of Keras's JAX guide): final and initial
    held-out loss, and the training losses."""
    import jax

    keras.utils.set_random_seed(seed)
    model = task.model()
    opt = make_optimizer(arm, schedule(peak, steps))
    opt.build(model.trainable_variables)
    safe = isinstance(opt, ng.SafeOptimizer)
    loss_slot = None
    if isinstance(opt, SkipStepAdamW):
        loss_slot = [id(v) for v in opt.variables].index(id(opt.latest_loss))

    def loss_of(tv: list, ntv: list, x: Any, y: Any) -> tuple:
        logits, ntv = model.stateless_call(tv, ntv, x, training=True)
        return LOSS(y, logits), ntv

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)

    @jax.jit
    def step(tv: list, ntv: list, ov: list, x: Any, y: Any) -> tuple:
        (loss, new_ntv), grads = grad_fn(tv, ntv, x, y)
        if loss_slot is not None:
            ov = list(ov)
            ov[loss_slot] = loss
        tv, ov = opt.stateless_apply(ov, grads, tv)
        if safe:
            new_ntv = opt.stateless_commit(ov, ntv, new_ntv)
        return tv, new_ntv, ov, loss

    @jax.jit
    def evaluate(tv: list, ntv: list) -> Any:
        logits, _ = model.stateless_call(tv, ntv, task.test[0], training=False)
        return LOSS(task.test[1], logits)

    tv = [v.value for v in model.trainable_variables]
    ntv = [v.value for v in model.non_trainable_variables]
    ov = [v.value for v in opt.variables]
    initial = float(evaluate(tv, ntv))
    losses = []
    for x, y in task.batches(seed, steps):
        tv, ntv, ov, loss = step(tv, ntv, ov, x, y)
        losses.append(loss)
    final = float(evaluate(tv, ntv))
    return {
        "final": final if math.isfinite(final) else math.inf,
        "initial": initial,
        "train": [float(v) for v in jax.device_get(losses)],
    }


# ================================================================ metrics
def rates_grid(max_rate: float) -> list[float]:
    """1e-3 up by half-decades to `max_rate`."""
    grid, k = [], 0
    while 10 ** (-3 + k / 2) <= max_rate * (1 + 1e-9):
        grid.append(float(f"{10 ** (-3 + k / 2):.3g}"))
        k += 1
    return grid


def summarize(results: dict, rates: list[float]) -> dict:
    """Per arm: the final loss per rate (seed mean), the highest stable rate
    against its own best and against the best of every arm, and the
    learning-rate sensitivity."""
    out = {}
    means = {
        arm: [float(np.mean([r["final"] for r in runs[str(rate)]])) for rate in rates]
        for arm, runs in results.items()
    }
    overall = min(min(m) for m in means.values())
    for arm, runs in results.items():
        best = min(means[arm])
        initial = float(np.mean([r["initial"] for rs in runs.values() for r in rs]))

        def highest(reference: float, runs: dict = runs) -> float | None:
            ok = [
                rate
                for rate in rates
                if all(r["final"] <= 1.1 * reference for r in runs[str(rate)])
            ]
            return max(ok) if ok else None

        sensitivity = float(np.mean([min(m, initial) for m in means[arm]]) - best)
        # The seeds' mean within 1.1x: on a task whose best loss is near 0
        # (digits), the seeds of one rate spread wider than 10% of it.
        in_mean = [r for r, m in zip(rates, means[arm], strict=True) if m <= 1.1 * best]
        out[arm] = {
            "final": means[arm],
            "best": best,
            "best_rate": rates[int(np.argmin(means[arm]))],
            "stable": highest(best),
            "stable_overall": highest(overall),
            "stable_mean": max(in_mean),
            "sensitivity": sensitivity,
            "initial": initial,
        }
    return out


def table(task: str, summary: dict, rates: list[float]) -> str:
    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:g}"

    head = "| arm | highest stable rate: every seed (own best) | (best of all) "
    head += "| seed mean (own best) | sensitivity | "
    head += " | ".join(f"{r:g}" for r in rates) + " |"
    lines = [f"#### {task}", "", head, "|" + "---|" * (5 + len(rates))]
    for arm, s in summary.items():
        finals = " | ".join("inf" if math.isinf(v) else f"{v:.3f}" for v in s["final"])
        lines.append(
            f"| {arm} | {fmt(s['stable'])} | {fmt(s['stable_overall'])} | "
            f"{fmt(s['stable_mean'])} | {s['sensitivity']:.3f} | {finals} |"
        )
    return "\n".join(lines)


def plot(summaries: dict, rates: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summaries), figsize=(5.5 * len(summaries), 4))
    axes = np.atleast_1d(axes)
    for ax, (task, summary) in zip(axes, summaries.items(), strict=True):
        for arm, s in summary.items():
            values = [min(v, s["initial"]) for v in s["final"]]
            style = "-o" if arm in ("adaptive", "safe") else "--."
            ax.plot(
                rates, values, style, label=arm, linewidth=2 if arm == "adaptive" else 1
            )
        ax.set_xscale("log")
        ax.set_xlabel("peak learning rate")
        ax.set_ylabel("final held-out loss (capped at the initial loss)")
        ax.set_title(task)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


# =================================================================== cost
def _cadenced(measure: Callable[[bool | None], tuple], opt: Any) -> tuple:
    """`measure(probe)` at the flight recorder's default cadence, as
    BENCHMARKS.md counts it: an ordinary step plus 1/16 of a probe step's
    extra (a SafeOptimizer's compiled step holds both in a `cond`, whose
    branches XLA's cost analysis would add up)."""
    if not isinstance(opt, ng.SafeOptimizer):
        return measure(None)
    ordinary, probe = measure(False), measure(True)
    every = opt._recorder.probe_every
    return tuple(o + (p - o) / every for o, p in zip(ordinary, probe, strict=True))


def _step_bytes_jax(task: Task, arm: str) -> tuple[float, float]:
    """XLA bytes accessed of one jitted training step and of the optimizer
    step alone (the state donated, as Keras's JAX `fit` donates it)."""
    import jax

    keras.utils.set_random_seed(0)
    model = task.model()
    opt = make_optimizer(arm, schedule(1e-3, STEPS))
    opt.build(model.trainable_variables)
    x, y = task.batches(0, 1)[0]
    tv = [v.value for v in model.trainable_variables]
    ntv = [v.value for v in model.non_trainable_variables]
    ov = [v.value for v in opt.variables]
    grads = [ops.convert_to_tensor(np.full(v.shape, 1e-3, "float32")) for v in tv]

    def loss_of(tv: list, ntv: list) -> tuple:
        logits, ntv = model.stateless_call(tv, ntv, x, training=True)
        return LOSS(y, logits), ntv

    def whole(tv: list, ntv: list, ov: list) -> tuple:
        (loss, new_ntv), grads = jax.value_and_grad(loss_of, has_aux=True)(tv, ntv)
        tv, ov = opt.stateless_apply(ov, grads, tv)
        if isinstance(opt, ng.SafeOptimizer):
            new_ntv = opt.stateless_commit(ov, ntv, new_ntv)
        return tv, new_ntv, ov, loss

    def apply_only(tv: list, ov: list, grads: list) -> tuple:
        return opt.stateless_apply(ov, grads, tv)

    def cost(fn: Callable, donate: tuple, *args: Any) -> float:
        compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
        found = compiled.cost_analysis()
        found = found[0] if isinstance(found, list) else found
        return float(found["bytes accessed"])

    def measure(probe: bool | None) -> tuple[float, float]:
        if probe is not None:
            force_probe(opt._recorder, probe)
        return (
            cost(whole, (0, 1, 2), tv, ntv, ov),
            cost(apply_only, (0, 1), tv, ov, grads),
        )

    return _cadenced(measure, opt)


def _step_bytes_torch(task: Task, arm: str) -> tuple[float, float]:
    """aten bytes and host reads of one step of the torch guide's loop (after
    a first step, which builds)."""
    import torch
    from _torch_traffic import traffic

    keras.utils.set_random_seed(0)
    model = task.model()
    opt = make_optimizer(arm, schedule(1e-3, STEPS))
    x, y = (torch.as_tensor(a) for a in task.batches(0, 1)[0])

    def one() -> None:
        logits = model(x, training=True)
        loss = LOSS(y, logits)
        if isinstance(opt, SkipStepAdamW) and opt.built:
            opt.latest_loss.assign(loss.detach())
        model.zero_grad()
        loss.backward()
        grads = [v.value.grad for v in model.trainable_variables]
        with torch.no_grad():
            opt.apply(grads, model.trainable_variables)

    one()

    def measure(probe: bool | None) -> tuple[float, float]:
        if probe is not None:
            force_probe(opt._recorder, probe)
        moved, reads = traffic(one)
        return float(moved), float(reads)

    return _cadenced(measure, opt)


def cost_table(arms: list[str], tasks: list[str]) -> str:
    lines = []
    for name in tasks:
        task = Task(name)
        rows = {
            arm: (_step_bytes_jax if BACKEND == "jax" else _step_bytes_torch)(task, arm)
            for arm in arms
        }
        base = rows["clipnorm"]
        if BACKEND == "jax":
            lines += [
                f"#### {name}: XLA bytes accessed (jax)",
                "",
                "| arm | train step | ratio to clipnorm | optimizer step | ratio to clipnorm |",
                "|---|---|---|---|---|",
            ]
            for arm, (whole, alone) in rows.items():
                lines.append(
                    f"| {arm} | {whole:,.0f} | {whole / base[0]:.3f} | "
                    f"{alone:,.0f} | {alone / base[1]:.3f} |"
                )
        else:
            lines += [
                f"#### {name}: aten bytes of one loop step (torch)",
                "",
                "| arm | bytes | ratio to clipnorm | host reads |",
                "|---|---|---|---|",
            ]
            for arm, (moved, reads) in rows.items():
                lines.append(
                    f"| {arm} | {moved:,.0f} | {moved / base[0]:.3f} | {reads} |"
                )
        lines.append("")
    return "\n".join(lines)


# ================================================================ examples
# Those whose optimizer comes from `examples._run.optimizer` (the actor-critic
# loops make theirs inline).
EXAMPLES = ("convnet", "lstm", "transformer", "gpt", "vae", "gan", "wgan_gp")


def examples_table(ratios: list[float | None]) -> str:
    """The programs of `examples/` at their own rates and lengths, plain and
    with `clip="adaptive"` at each `max_update_ratio`: the loss each ends at
    (its `check`, on fresh clean batches), as a ratio to plain."""
    import importlib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    head = "| example | plain | " + " | ".join(f"max_update_ratio={r}" for r in ratios)
    lines = [head + " |", "|---|---|" + "---|" * len(ratios)]
    for name in EXAMPLES:
        module = importlib.import_module(f"examples.{name}")
        if BACKEND not in module.BACKENDS:
            continue
        base = module.train("plain").check()
        cells = []
        for ratio in ratios:
            # The module's optimizer for mode "safe": SafeOptimizer(clip=...).
            module.optimizer = lambda mode, inner, r=ratio: ng.SafeOptimizer(
                inner, clip="adaptive", max_update_ratio=r
            )
            cells.append(f"{module.train('safe').check() / base:.3f}")
        lines.append(f"| {name} | {base:.4g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# =================================================================== main
def sweep(
    tasks: list[str],
    arms: list[str],
    rates: list[float],
    seeds: list[int],
    steps: int,
    log: Callable[[str], None],
) -> dict:
    out: dict = {}
    for name in tasks:
        task = Task(name)
        results: dict = {arm: {} for arm in arms}
        for rate in rates:
            for arm in arms:
                runs = []
                for seed in seeds:
                    start = time.perf_counter()
                    run = train(task, arm, rate, seed, steps)
                    runs.append(run)
                    log(
                        f"{name} {arm:>12} lr={rate:<7g} seed={seed} "
                        f"final={run['final']:.4f} ({time.perf_counter() - start:.0f} s)"
                    )
                results[arm][str(rate)] = runs
        out[name] = results
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="gpt,digits")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--max-rate", type=float, default=10.0)
    parser.add_argument(
        "--rates", default=None, help="comma-separated; default: the grid"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="3 arms, 1 seed, rates 1e-2, 1e-1, 1",
    )
    parser.add_argument("--cost", action="store_true")
    parser.add_argument(
        "--examples",
        default=None,
        help="comma-separated max_update_ratio values ('None' too): the "
        "programs of examples/ with clip='adaptive', against plain",
    )
    parser.add_argument(
        "--adaptive-args",
        default="{}",
        help="JSON of SafeOptimizer arguments for the adaptive arm (tuning)",
    )
    parser.add_argument("--json", default=None, help="write the runs here")
    parser.add_argument("--plot", default=None, help="write the figure here (PNG)")
    args = parser.parse_args()
    ADAPTIVE_ARGS.update(json.loads(args.adaptive_args))
    tasks = [t for t in args.tasks.split(",") if t]
    arms = [a for a in args.arms.split(",") if a]
    if args.cost:
        print(cost_table(arms, tasks))
        return
    if args.examples:
        ratios = [None if r == "None" else float(r) for r in args.examples.split(",")]
        print(examples_table(ratios))
        return
    if BACKEND != "jax":
        raise SystemExit(
            "The sweep runs on JAX: KERAS_BACKEND=jax (--cost runs on torch too)."
        )
    seeds = [int(s) for s in args.seeds.split(",")]
    steps = args.steps
    rates = (
        [float(r) for r in args.rates.split(",")]
        if args.rates
        else rates_grid(args.max_rate)
    )
    if args.quick:
        arms = [a for a in ("clipnorm", "zclip", "adaptive") if a in arms] or arms
        # 600 steps still: digits' BatchNormalization moving statistics need
        # them (at 300 its held-out loss is 5 at any rate, at 450 still 0.8).
        seeds, rates = seeds[:1], [1e-2, 1e-1, 1.0]
    start = time.perf_counter()
    results = sweep(tasks, arms, rates, seeds, steps, lambda s: print(s, flush=True))
    summaries = {name: summarize(res, rates) for name, res in results.items()}
    print(
        f"\n{len(tasks)} task(s), {len(arms)} arms, rates {rates}, seeds {seeds}, {steps} steps: {time.perf_counter() - start:.0f} s\n"
    )
    for name, summary in summaries.items():
        print(table(name, summary, rates) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "rates": rates,
                    "seeds": seeds,
                    "steps": steps,
                    "runs": results,
                    "summary": summaries,
                },
                f,
            )
    if args.plot:
        plot(summaries, rates, args.plot)


if __name__ == "__main__":
    main()
