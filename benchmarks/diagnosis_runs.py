"""A generator of training runs with known fates, written apart from the run
diagnosis, to judge `NaNGuard.explain()` and its early warning on runs it was
not tuned on (`bench_run_diagnosis.py` trains them and gives the figures).

Ten families of models, trained with `fit` as Keras's examples train them;
each family a set of settings (optimizers, schedules, data faults), some
diverging for a known cause, some stalling, some healthy:

- the *tuning* half (`TUNING`): MLPs, recurrent nets (SimpleRNN, LSTM, GRU),
  REINFORCE policies, VAEs with a KL term, multi-output models;
- the *held-out* half (`HELD_OUT`): CNNs with BatchNormalization, transformer
  language models, actor-critics (shared and separate trunks), GANs with two
  optimizers, autoencoders.

Thresholds and rules are chosen on the tuning half only; the held-out
figures are the ones that count. All data is made in code (or is
scikit-learn's digits, or the Python standard library's own sources).

>>> import diagnosis_runs as runs  # doctest: +SKIP
>>> len(runs.SPECS) >= 150  # doctest: +SKIP
True
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from keras import layers, ops

TUNING = ("mlp", "rnn", "reinforce", "vae", "multi_output")
HELD_OUT = ("cnn_bn", "transformer_lm", "actor_critic", "gan", "autoencoder")
ALL_BACKENDS = ("tensorflow", "jax", "torch")

# What a run is, by construction: a cause of `RUN_CAUSES` (it diverges, or
# for "stalled" stops learning while finite), or "healthy".


@dataclasses.dataclass(frozen=True)
class Spec:
    """One run: `train(guard, seed)` builds and fits it under `guard`."""

    name: str
    family: str
    cause: str
    train: Callable[[Any, int], None]
    backends: tuple[str, ...] = ALL_BACKENDS
    story: str = ""

    @property
    def half(self) -> str:
        return "tuning" if self.family in TUNING else "held_out"


# ------------------------------------------------------------------ data
def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


@functools.cache
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.data / 16.0).astype("float32"), d.target.astype("int32")


def digits_flat(n: int = 1792) -> tuple[np.ndarray, np.ndarray]:
    x, y = _digits()
    reps = -(-n // len(x))
    return np.tile(x, (reps, 1))[:n], np.tile(y, reps)[:n]


def digits_images(n: int = 1792) -> tuple[np.ndarray, np.ndarray]:
    x, y = digits_flat(n)
    return x.reshape(-1, 8, 8, 1), y


def regression(n: int = 2048, d: int = 8, seed: int = 0) -> tuple:
    r = _rng(seed)
    x = r.normal(size=(n, d)).astype("float32")
    w = r.normal(size=(d, 1)).astype("float32")
    y = np.tanh(x @ w) + 0.1 * r.normal(size=(n, 1)).astype("float32")
    return x, y.astype("float32")


def blobs(n: int = 2048, d: int = 16, k: int = 4, seed: int = 0) -> tuple:
    r = _rng(seed)
    centres = r.normal(size=(k, d)).astype("float32") * 2.0
    y = r.integers(0, k, n)
    x = centres[y] + r.normal(size=(n, d)).astype("float32")
    return x.astype("float32"), y.astype("int32")


def sequences(n: int = 1024, steps: int = 20, seed: int = 0, norm: bool = True):
    r = _rng(seed)
    x = r.normal(size=(n, steps, 4)).astype("float32")
    y = x[:, :, 0].sum(axis=1, keepdims=True)
    return x, (y / np.sqrt(steps) if norm else y).astype("float32")


@functools.cache
def _text_ids() -> tuple[np.ndarray, int]:
    text = inspect.getsource(textwrap) + inspect.getsource(dataclasses)
    chars = sorted(set(text))
    table = {c: i for i, c in enumerate(chars)}
    return np.array([table[c] for c in text], "int32"), len(chars)


def text_windows(n: int = 2048, context: int = 16, seed: int = 0) -> tuple:
    ids, _ = _text_ids()
    starts = _rng(seed).integers(0, len(ids) - context - 1, n)
    x = np.stack([ids[s : s + context] for s in starts])
    y = np.stack([ids[s + 1 : s + context + 1] for s in starts])
    return x, y


def replayed_actions(
    n: int = 4096, k: int = 4, d: int = 8, seed: int = 0, growth: float = 1.0
) -> tuple:
    """A policy's replayed transitions: actions sampled uniformly, action 0
    with advantage +A and the last with -A (A growing from 1 to `growth`
    through the data: unnormalised returns)."""
    r = _rng(seed)
    x = r.uniform(0, 1, size=(n, d)).astype("float32")
    actions = r.integers(0, k, n)
    scale = np.linspace(1.0, growth, n).astype("float32")
    adv = np.where(actions == 0, 1.0, np.where(actions == k - 1, -1.0, 0.0)) * scale
    y = np.zeros((n, k), "float32")
    y[np.arange(n), actions] = adv
    return x, y


def noisy_returns(n: int = 4096, k: int = 4, d: int = 8, seed: int = 0) -> tuple:
    """Transitions whose advantages are zero-mean noise around a small
    preference (a normalised, entropy-regularised actor's diet)."""
    r = _rng(seed)
    x = r.uniform(0, 1, size=(n, d)).astype("float32")
    actions = r.integers(0, k, n)
    adv = r.normal(size=n).astype("float32") + np.where(actions == 0, 0.3, 0.0)
    y = np.zeros((n, k), "float32")
    y[np.arange(n), actions] = adv
    return x, y


def nan_row(x: np.ndarray, row: int) -> np.ndarray:
    x = x.copy()
    x[row].flat[0] = np.nan
    return x


def blown_batch(x: np.ndarray, start: int, size: int, by: float = 1e30) -> np.ndarray:
    x = x.copy()
    x[start : start + size] *= by
    return x


# ------------------------------------------------------------------ losses
def policy_gradient_loss(advantage_onehot: Any, probs: Any) -> Any:
    """REINFORCE's `-A log(pi(a|s))`, as users write it."""
    return -ops.sum(advantage_onehot * ops.log(probs), axis=-1)


def entropy_pg_loss(advantage_onehot: Any, probs: Any) -> Any:
    """The same with a floor on the probabilities and an entropy bonus."""
    logp = ops.log(ops.maximum(probs, 1e-7))
    entropy = -ops.sum(probs * logp, axis=-1)
    return -ops.sum(advantage_onehot * logp, axis=-1) - 0.05 * entropy


def log_softmax_ce(y_onehot: Any, probs: Any) -> Any:
    """Cross-entropy written by hand from probabilities: log(0) when wrong
    and confident."""
    return -ops.sum(y_onehot * ops.log(probs), axis=-1)


SCCE_LOGITS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# ------------------------------------------------------------------ optimizers
def opt(kind: str, lr: Any, **kw: Any) -> keras.optimizers.Optimizer:
    return {
        "sgd": lambda: keras.optimizers.SGD(lr, **kw),
        "momentum": lambda: keras.optimizers.SGD(lr, momentum=0.9, **kw),
        "rmsprop": lambda: keras.optimizers.RMSprop(lr, **kw),
        "adam": lambda: keras.optimizers.Adam(lr, **kw),
        "adamw": lambda: keras.optimizers.AdamW(lr, **kw),
    }[kind]()


def warmup(peak: float, steps: int, start: float | None = None) -> Any:
    return keras.optimizers.schedules.PolynomialDecay(
        start if start is not None else peak / 100, steps, peak, power=1.0
    )


def cosine(peak: float, steps: int, warm: int = 0) -> Any:
    return keras.optimizers.schedules.CosineDecay(
        peak / 10 if warm else peak,
        steps,
        warmup_target=peak if warm else None,
        warmup_steps=warm,
    )


def to_zero(lr: float, steps: int = 20) -> Any:
    """A schedule decayed to (nearly) zero after `steps * 3` steps."""
    return keras.optimizers.schedules.ExponentialDecay(lr, steps, 0.01)


# ------------------------------------------------------------------ fitting
def fit(
    guard: Any,
    seed: int,
    model: Callable[[], keras.Model],
    optimizer: Callable[[], keras.optimizers.Optimizer],
    data: Callable[[], tuple],
    loss: Any,
    *,
    batch: int = 32,
    epochs: int = 1,
    safe: dict | None = None,
) -> None:
    import keras_nanguard as ng

    keras.utils.set_random_seed(seed)
    m = model()
    x, y = data()
    m.compile(ng.SafeOptimizer(optimizer(), **(safe or {})), loss=loss)
    m.fit(
        x,
        y,
        batch_size=batch,
        epochs=epochs,
        shuffle=False,
        callbacks=[guard],
        verbose=0,
    )


SPECS: dict[str, Spec] = {}


def _add(
    family: str, name: str, cause: str, story: str, backends=ALL_BACKENDS, **kw
) -> None:
    full = f"{family}/{name}"
    train = functools.partial(_fit_kw, kw)
    SPECS[full] = Spec(full, family, cause, train, tuple(backends), story)


def _fit_kw(kw: dict, guard: Any, seed: int) -> None:
    if "custom" in kw:
        kw["custom"](guard, seed)
    else:
        fit(guard, seed, **kw)


# ------------------------------------------------------------------ MLPs
def mlp(
    d: int,
    out: int,
    *,
    width: int = 32,
    depth: int = 2,
    act: str = "relu",
    init: Any = "glorot_uniform",
    bias: Any = "zeros",
    head: str | None = None,
    dtype: str | None = None,
) -> Callable[[], keras.Model]:
    def make() -> keras.Model:
        stack: list[Any] = [keras.Input((d,))]
        for _ in range(depth):
            stack.append(
                layers.Dense(
                    width,
                    act,
                    kernel_initializer=init,
                    bias_initializer=bias,
                    dtype=dtype,
                )
            )
        stack.append(layers.Dense(out, head, dtype=dtype))
        return keras.Sequential(stack)

    return make


def _onehot_digits() -> tuple:
    x, y = digits_flat()
    return x, np.eye(10, dtype="float32")[y]


def _noisy_onehot_digits() -> tuple:
    x, y = digits_flat()
    r = _rng(3)
    flip = r.uniform(size=len(y)) < 0.2
    y = np.where(flip, r.integers(0, 10, len(y)), y)
    return x, np.eye(10, dtype="float32")[y]


def _families_mlp() -> None:
    f = "mlp"
    for kind, lr in [
        ("sgd", 3.0),
        ("sgd", 10.0),
        ("momentum", 1.0),
        ("momentum", 3.0),
        ("rmsprop", 0.3),
        ("adam", 0.5),
        ("adamw", 1.0),
    ]:
        _add(
            f,
            f"lr_{kind}_{lr:g}",
            "learning_rate_too_high",
            f"A regressor at a {kind} rate of {lr:g}.",
            model=mlp(8, 1, act="tanh"),
            optimizer=functools.partial(opt, kind, lr),
            data=regression,
            loss="mse",
            epochs=4,
        )
    for kind, peak in [("sgd", 5.0), ("adam", 1.0)]:
        _add(
            f,
            f"lr_warmup_{kind}",
            "learning_rate_too_high",
            f"A digits classifier warming up to a {kind} rate of {peak:g}.",
            model=mlp(64, 10),
            optimizer=functools.partial(opt, kind, warmup(peak, 400)),
            data=digits_flat,
            loss=SCCE_LOGITS,
            epochs=8,
        )
    _add(
        f,
        "bad_data_nan_row",
        "bad_data",
        "A healthy classifier, one row of one batch NaN.",
        model=mlp(64, 10),
        optimizer=functools.partial(opt, "adam", 1e-3),
        data=lambda: (nan_row(digits_flat()[0], 1000), digits_flat()[1]),
        loss=SCCE_LOGITS,
        epochs=2,
    )
    _add(
        f,
        "bad_data_blown_batch",
        "bad_data",
        "A regressor, one batch multiplied by 1e30.",
        model=mlp(8, 1),
        optimizer=functools.partial(opt, "momentum", 1e-2),
        data=lambda: (blown_batch(regression()[0], 960, 32), regression()[1]),
        loss="mse",
        epochs=2,
    )
    for kind, lr in [("sgd", 1e-2), ("momentum", 3e-3)]:
        _add(
            f,
            f"input_scale_{kind}",
            "input_scale",
            "A regressor on raw features (std 100) at a rate for normalised ones.",
            model=mlp(8, 1, act="tanh"),
            optimizer=functools.partial(opt, kind, lr),
            data=lambda: (regression()[0] * 100.0, regression()[1]),
            loss="mse",
            epochs=2,
        )
    for kind, depth in [("sgd", 10), ("adam", 12)]:
        _add(
            f,
            f"activation_growth_{kind}",
            "activation_growth",
            "A deep ReLU net with N(0, 0.5) weights.",
            model=mlp(
                8,
                1,
                width=64,
                depth=depth,
                init=keras.initializers.RandomNormal(stddev=0.5),
            ),
            optimizer=functools.partial(opt, kind, 1e-5),
            data=regression,
            loss="mse",
        )
    _add(
        f,
        "optimizer_state_adam_beta2",
        "optimizer_state",
        "Adam with beta_2=0.5 (far below beta_1**2) and epsilon 1e-14.",
        model=mlp(8, 1),
        optimizer=lambda: keras.optimizers.Adam(1e-3, beta_2=0.5, epsilon=1e-14),
        data=_rare_feature,
        loss="mse",
        epochs=2,
    )
    _add(
        f,
        "optimizer_state_rmsprop_eps0",
        "optimizer_state",
        "RMSprop with epsilon=0 and a feature seen in the first batch only.",
        model=mlp(8, 1),
        optimizer=lambda: keras.optimizers.RMSprop(1e-3, rho=0.5, epsilon=0.0),
        data=_rare_feature,
        loss="mse",
        epochs=1,
    )
    _add(
        f,
        "policy_collapse_hand_ce",
        "policy_collapse",
        "A softmax classifier with a hand-written log(p) loss, noisy labels "
        "and a high rate: confident and wrong, log(0).",
        model=mlp(64, 10, head="softmax"),
        optimizer=functools.partial(opt, "rmsprop", 3e-2),
        data=_noisy_onehot_digits,
        loss=log_softmax_ce,
        epochs=6,
    )
    _add(
        f,
        "stalled_schedule_to_zero",
        "stalled",
        "A classifier whose decay schedule reaches zero in 60 steps.",
        model=mlp(64, 10),
        optimizer=functools.partial(opt, "sgd", to_zero(0.01, 20)),
        data=digits_flat,
        loss=SCCE_LOGITS,
        epochs=6,
    )
    _add(
        f,
        "stalled_dead_relu",
        "stalled",
        "A ReLU classifier whose units start dead (bias -10).",
        model=mlp(64, 10, bias=keras.initializers.Constant(-10.0)),
        optimizer=functools.partial(opt, "adam", 1e-3),
        data=digits_flat,
        loss=SCCE_LOGITS,
        epochs=6,
    )
    _add(
        f,
        "stalled_bfloat16",
        "stalled",
        "A bfloat16 regressor with Adam 1e-5: every update rounds to nothing.",
        model=mlp(8, 1, dtype="bfloat16"),
        optimizer=functools.partial(opt, "adam", 1e-5),
        data=regression,
        loss="mse",
        epochs=4,
    )
    _add(
        f,
        "stalled_clipped",
        "stalled",
        "SGD with global_clipnorm=1e-6: each update clipped to nothing.",
        model=mlp(64, 10),
        optimizer=lambda: keras.optimizers.SGD(0.01, global_clipnorm=1e-6),
        data=digits_flat,
        loss=SCCE_LOGITS,
        epochs=6,
    )
    # healthy
    for kind, lr in [
        ("adam", 1e-3),
        ("momentum", 1e-2),
        ("rmsprop", 1e-3),
        ("adamw", 3e-3),
    ]:
        _add(
            f,
            f"healthy_{kind}",
            "healthy",
            "A digits classifier from logits.",
            model=mlp(64, 10),
            optimizer=functools.partial(opt, kind, lr),
            data=digits_flat,
            loss=SCCE_LOGITS,
            epochs=4,
        )
    _add(
        f,
        "healthy_confident_softmax",
        "healthy",
        "A digits MLP from probabilities (Adam 1e-2, 30 epochs): 100% "
        "accuracy, its smallest probability below 1e-14.",
        model=mlp(64, 10, width=64, depth=1, head="softmax"),
        optimizer=functools.partial(opt, "adam", 1e-2),
        data=digits_flat,
        loss="sparse_categorical_crossentropy",
        epochs=30,
    )
    _add(
        f,
        "healthy_confident_sigmoid",
        "healthy",
        "A binary sigmoid classifier (digit 0 or not), confident.",
        model=mlp(64, 1, head="sigmoid"),
        optimizer=functools.partial(opt, "adam", 1e-2),
        data=lambda: (digits_flat()[0], (digits_flat()[1] == 0).astype("float32")),
        loss="binary_crossentropy",
        epochs=10,
    )
    _add(
        f,
        "healthy_long_cosine",
        "healthy",
        "5,600 steps of a digits classifier, warm-up and cosine decay to 0.",
        model=mlp(64, 10),
        optimizer=functools.partial(opt, "adamw", cosine(3e-3, 5600, warm=200)),
        data=digits_flat,
        loss=SCCE_LOGITS,
        epochs=100,
    )
    _add(
        f,
        "healthy_regression_floor",
        "healthy",
        "A regressor that reaches its noise floor early and stays there.",
        model=mlp(8, 1, act="tanh"),
        optimizer=functools.partial(opt, "adam", 1e-2),
        data=regression,
        loss="mse",
        epochs=8,
    )


def _rare_feature() -> tuple:
    x, y = regression(n=4096)
    x[32:, -1] = 0.0
    return x, y


# ------------------------------------------------------------------ RNNs
def rnn(
    cell: str, steps: int = 20, act: str = "tanh", gain: float = 1.0, units: int = 16
):
    def make() -> keras.Model:
        kw: dict[str, Any] = {
            "recurrent_initializer": keras.initializers.Orthogonal(gain)
        }
        if cell == "SimpleRNN":
            kw["activation"] = act
        return keras.Sequential(
            [
                keras.Input((steps, 4)),
                getattr(layers, cell)(units, **kw),
                layers.Dense(1),
            ]
        )

    return make


def _families_rnn() -> None:
    f = "rnn"
    for act, gain, lr, steps in [
        ("linear", 1.0, 5e-4, 40),
        ("linear", 1.1, 2e-4, 40),
        ("relu", 1.3, 1e-3, 30),
    ]:
        _add(
            f,
            f"exploding_simple_{act}_{gain:g}",
            "exploding_recurrence",
            f"A {act} SimpleRNN over {steps} steps, recurrent gain {gain:g}.",
            model=rnn("SimpleRNN", steps, act, gain),
            optimizer=functools.partial(opt, "sgd", lr),
            data=functools.partial(sequences, steps=steps, norm=False),
            loss="mse",
            epochs=6,
        )
    for cell, kind, lr in [
        ("LSTM", "sgd", 30.0),
        ("LSTM", "adam", 1.0),
        ("GRU", "momentum", 10.0),
        ("GRU", "rmsprop", 1.0),
        ("SimpleRNN", "adam", 0.5),
    ]:
        _add(
            f,
            f"lr_{cell.lower()}_{kind}_{lr:g}",
            "learning_rate_too_high",
            f"A {cell} at a {kind} rate of {lr:g}.",
            model=rnn(cell),
            optimizer=functools.partial(opt, kind, lr),
            data=sequences,
            loss="mse",
            epochs=6,
        )
    _add(
        f,
        "bad_data_nan_sequence",
        "bad_data",
        "An LSTM regressor, one NaN in one sequence.",
        model=rnn("LSTM"),
        optimizer=functools.partial(opt, "adam", 1e-3),
        data=lambda: (nan_row(sequences()[0], 500), sequences()[1]),
        loss="mse",
        epochs=2,
    )
    _add(
        f,
        "input_scale_gru",
        "input_scale",
        "A GRU on raw sequences (std 300), SGD.",
        model=rnn("GRU"),
        optimizer=functools.partial(opt, "sgd", 0.05),
        data=lambda: (sequences()[0] * 300.0, sequences()[1]),
        loss="mse",
        epochs=4,
    )
    _add(
        f,
        "optimizer_state_lstm",
        "optimizer_state",
        "An LSTM with Adam beta_2=0.3, epsilon 1e-15.",
        model=rnn("LSTM"),
        optimizer=lambda: keras.optimizers.Adam(1e-3, beta_2=0.3, epsilon=1e-15),
        data=sequences,
        loss="mse",
        epochs=6,
    )
    _add(
        f,
        "stalled_lstm_schedule",
        "stalled",
        "An LSTM whose schedule decays to zero in 60 steps.",
        model=rnn("LSTM"),
        optimizer=functools.partial(opt, "adam", to_zero(1e-3, 20)),
        data=sequences,
        loss="mse",
        epochs=6,
    )
    for cell, kind, lr in [
        ("LSTM", "adam", 3e-3),
        ("GRU", "rmsprop", 1e-3),
        ("SimpleRNN", "adam", 1e-3),
        ("LSTM", "momentum", 1e-2),
    ]:
        _add(
            f,
            f"healthy_{cell.lower()}_{kind}",
            "healthy",
            f"A {cell} regressor that trains as it should.",
            model=rnn(cell),
            optimizer=functools.partial(opt, kind, lr),
            data=sequences,
            loss="mse",
            epochs=6,
        )


# ------------------------------------------------------------------ REINFORCE
def policy(d: int = 8, k: int = 4, width: int = 32) -> Callable[[], keras.Model]:
    return mlp(d, k, width=width, depth=2, act="tanh", head="softmax")


def _families_reinforce() -> None:
    f = "reinforce"
    for kind, lr, growth in [
        ("rmsprop", 1e-2, 1.0),
        ("adam", 1e-2, 1.0),
        ("sgd", 0.5, 1.0),
        ("rmsprop", 1e-3, 20.0),
        ("momentum", 0.05, 10.0),
    ]:
        _add(
            f,
            f"policy_collapse_{kind}_{growth:g}",
            "policy_collapse",
            "A softmax policy on replayed actions, one always with a negative "
            f"advantage (growing x{growth:g}): its probability reaches 0.",
            model=policy(),
            optimizer=functools.partial(opt, kind, lr),
            data=functools.partial(replayed_actions, growth=growth),
            loss=policy_gradient_loss,
            epochs=2,
        )
    for kind, lr in [("sgd", 300.0), ("adam", 3.0)]:
        _add(
            f,
            f"lr_{kind}_{lr:g}",
            "learning_rate_too_high",
            "An entropy-regularised policy at a rate far too high.",
            model=policy(),
            optimizer=functools.partial(opt, kind, lr),
            data=noisy_returns,
            loss=entropy_pg_loss,
            epochs=2,
        )
    _add(
        f,
        "bad_data_nan_advantage",
        "bad_data",
        "A healthy policy, one NaN advantage.",
        model=policy(),
        optimizer=functools.partial(opt, "rmsprop", 1e-3),
        data=lambda: (noisy_returns()[0], nan_row(noisy_returns()[1], 2000)),
        loss=entropy_pg_loss,
        epochs=1,
    )
    for kind, lr in [("rmsprop", 1e-3), ("adam", 3e-4), ("sgd", 1e-2)]:
        _add(
            f,
            f"healthy_{kind}",
            "healthy",
            "An entropy-regularised policy on noisy advantages.",
            model=policy(),
            optimizer=functools.partial(opt, kind, lr),
            data=noisy_returns,
            loss=entropy_pg_loss,
            epochs=2,
        )
    _add(
        f,
        "healthy_confident_actor",
        "healthy",
        "The collapsing actor's data with a floor and an entropy bonus.",
        model=policy(),
        optimizer=functools.partial(opt, "rmsprop", 1e-3),
        data=replayed_actions,
        loss=entropy_pg_loss,
        epochs=2,
    )
    _add(
        f,
        "healthy_long",
        "healthy",
        "6,400 steps of an entropy-regularised policy.",
        model=policy(),
        optimizer=functools.partial(opt, "adam", 3e-4),
        data=lambda: noisy_returns(n=8192),
        loss=entropy_pg_loss,
        epochs=25,
    )


# ------------------------------------------------------------------ VAE
class Sampling(layers.Layer):
    """z = mean + exp(log_var / 2) * eps, adding the KL term as a loss."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(7)

    def call(self, inputs: Any) -> Any:
        mean, log_var = inputs
        kl = -0.5 * ops.mean(
            ops.sum(1 + log_var - ops.square(mean) - ops.exp(log_var), axis=1)
        )
        self.add_loss(kl / 64.0)
        eps = keras.random.normal(ops.shape(mean), seed=self.seed_generator)
        return mean + ops.exp(0.5 * log_var) * eps


def vae(init: Any = "glorot_uniform") -> Callable[[], keras.Model]:
    def make() -> keras.Model:
        x = keras.Input((64,))
        h = layers.Dense(32, "relu", kernel_initializer=init)(x)
        z = Sampling()([layers.Dense(4)(h), layers.Dense(4)(h)])
        h = layers.Dense(32, "relu", kernel_initializer=init)(z)
        return keras.Model(x, layers.Dense(64, "sigmoid")(h))

    return make


def _families_vae() -> None:
    f = "vae"
    both = lambda: (digits_flat()[0], digits_flat()[0])  # noqa: E731
    for kind, lr in [("adam", 0.3), ("rmsprop", 0.3), ("sgd", 30.0)]:
        _add(
            f,
            f"lr_{kind}_{lr:g}",
            "learning_rate_too_high",
            f"A VAE at a {kind} rate of {lr:g}.",
            model=vae(),
            optimizer=functools.partial(opt, kind, lr),
            data=both,
            loss="binary_crossentropy",
            epochs=4,
        )
    _add(
        f,
        "bad_data_nan_image",
        "bad_data",
        "A VAE, one NaN pixel.",
        model=vae(),
        optimizer=functools.partial(opt, "adam", 1e-3),
        data=lambda: (nan_row(digits_flat()[0], 900), digits_flat()[0]),
        loss="binary_crossentropy",
        epochs=2,
    )
    _add(
        f,
        "optimizer_state_adam",
        "optimizer_state",
        "A VAE with Adam beta_2=0.4, epsilon 1e-15.",
        model=vae(),
        optimizer=lambda: keras.optimizers.Adam(1e-3, beta_2=0.4, epsilon=1e-15),
        data=both,
        loss="binary_crossentropy",
        epochs=4,
    )
    for kind, lr in [("adam", 1e-3), ("rmsprop", 1e-3), ("adamw", 3e-3)]:
        _add(
            f,
            f"healthy_{kind}",
            "healthy",
            "A VAE on digits that trains as it should.",
            model=vae(),
            optimizer=functools.partial(opt, kind, lr),
            data=both,
            loss="binary_crossentropy",
            epochs=4,
        )


# ------------------------------------------------------------------ multi-output
def two_heads() -> keras.Model:
    x = keras.Input((64,))
    h = layers.Dense(32, "relu")(x)
    cls = layers.Dense(10, name="digit")(h)
    reg = layers.Dense(1, name="ink")(h)
    return keras.Model(x, {"digit": cls, "ink": reg})


def _two_targets(x_scale: float = 1.0, nan_at: int | None = None) -> tuple:
    x, y = digits_flat()
    ink = x.mean(axis=1, keepdims=True).astype("float32") * 10
    if nan_at is not None:
        ink = nan_row(ink, nan_at)
    return x * x_scale, {"digit": y, "ink": ink}


def _families_multi() -> None:
    f = "multi_output"
    loss = {"digit": SCCE_LOGITS, "ink": "mse"}
    for kind, lr in [("sgd", 5.0), ("adam", 0.5), ("momentum", 2.0)]:
        _add(
            f,
            f"lr_{kind}_{lr:g}",
            "learning_rate_too_high",
            "A two-headed model at a rate far too high.",
            model=two_heads,
            optimizer=functools.partial(opt, kind, lr),
            data=_two_targets,
            loss=loss,
            epochs=4,
        )
    _add(
        f,
        "bad_data_nan_target",
        "bad_data",
        "A two-headed model, one NaN regression target.",
        model=two_heads,
        optimizer=functools.partial(opt, "adam", 1e-3),
        data=lambda: _two_targets(nan_at=1100),
        loss=loss,
        epochs=2,
    )
    _add(
        f,
        "input_scale_raw",
        "input_scale",
        "A two-headed model on raw 0-255 pixels, SGD.",
        model=two_heads,
        optimizer=functools.partial(opt, "sgd", 1e-3),
        data=lambda: _two_targets(x_scale=255.0),
        loss=loss,
        epochs=4,
    )
    for kind, lr in [("adam", 1e-3), ("rmsprop", 1e-3), ("momentum", 1e-2)]:
        _add(
            f,
            f"healthy_{kind}",
            "healthy",
            "A two-headed model that trains as it should.",
            model=two_heads,
            optimizer=functools.partial(opt, kind, lr),
            data=_two_targets,
            loss=loss,
            epochs=4,
        )


# ------------------------------------------------------------------ CNN + BN
def cnn_bn(head_init: Any = "glorot_uniform", bn: bool = True) -> Callable:
    def make() -> keras.Model:
        stack: list[Any] = [keras.Input((8, 8, 1)), layers.Conv2D(8, 3, padding="same")]
        if bn:
            stack.append(layers.BatchNormalization())
        stack += [
            layers.Activation("relu"),
            layers.MaxPooling2D(),
            layers.Conv2D(16, 3, padding="same"),
        ]
        if bn:
            stack.append(layers.BatchNormalization())
        stack += [
            layers.Activation("relu"),
            layers.Flatten(),
            layers.Dense(32, "relu", kernel_initializer=head_init),
            layers.Dense(32, "relu", kernel_initializer=head_init),
            layers.Dense(10, kernel_initializer=head_init),
        ]
        return keras.Sequential(stack)

    return make


def _families_cnn() -> None:
    f = "cnn_bn"
    for kind, lr in [
        ("sgd", 5.0),
        ("sgd", 20.0),
        ("momentum", 2.0),
        ("momentum", 5.0),
        ("rmsprop", 0.3),
        ("rmsprop", 1.0),
        ("adam", 0.5),
        ("adamw", 1.0),
    ]:
        _add(
            f,
            f"lr_{kind}_{lr:g}",
            "learning_rate_too_high",
            f"A digits CNN with BatchNormalization at a {kind} rate of {lr:g}.",
            model=cnn_bn(),
            optimizer=functools.partial(opt, kind, lr),
            data=digits_images,
            loss=SCCE_LOGITS,
            epochs=4,
        )
    _add(
        f,
        "lr_warmup_adam",
        "learning_rate_too_high",
        "A digits CNN warming up to an Adam rate of 2.",
        model=cnn_bn(),
        optimizer=functools.partial(opt, "adam", warmup(2.0, 300)),
        data=digits_images,
        loss=SCCE_LOGITS,
        epochs=6,
    )
    _add(
        f,
        "bad_data_nan_pixel",
        "bad_data",
        "A digits CNN, one NaN pixel.",
        model=cnn_bn(),
        optimizer=functools.partial(opt, "adam", 1e-3),
        data=lambda: (nan_row(digits_images()[0], 1200), digits_images()[1]),
        loss=SCCE_LOGITS,
        epochs=2,
    )
    _add(
        f,
        "bad_data_blown_batch",
        "bad_data",
        "A digits CNN, one batch multiplied by 1e30.",
        model=cnn_bn(),
        optimizer=functools.partial(opt, "momentum", 1e-2),
        data=lambda: (blown_batch(digits_images()[0], 640, 32), digits_images()[1]),
        loss=SCCE_LOGITS,
        epochs=2,
    )
    for kind, lr in [("sgd", 1e-3), ("momentum", 1e-3)]:
        _add(
            f,
            f"input_scale_{kind}",
            "input_scale",
            "A digits CNN without BatchNormalization on raw 0-255 pixels.",
            model=cnn_bn(bn=False),
            optimizer=functools.partial(opt, kind, lr),
            data=lambda: (digits_images()[0] * 255.0, digits_images()[1]),
            loss=SCCE_LOGITS,
            epochs=4,
        )
    _add(
        f,
        "activation_growth_head",
        "activation_growth",
        "A CNN whose dense head starts with N(0, 2) weights.",
        model=cnn_bn(head_init=keras.initializers.RandomNormal(stddev=2.0)),
        optimizer=functools.partial(opt, "sgd", 1e-2),
        data=digits_images,
        loss=SCCE_LOGITS,
        epochs=2,
    )
    _add(
        f,
        "optimizer_state_adam",
        "optimizer_state",
        "A CNN with Adam beta_2=0.3, epsilon 1e-15.",
        model=cnn_bn(),
        optimizer=lambda: keras.optimizers.Adam(1e-3, beta_2=0.3, epsilon=1e-15),
        data=digits_images,
        loss=SCCE_LOGITS,
        epochs=4,
    )
    _add(
        f,
        "stalled_schedule_to_zero",
        "stalled",
        "A CNN whose schedule reaches zero in 60 steps.",
        model=cnn_bn(),
        optimizer=functools.partial(opt, "momentum", to_zero(1e-3, 20)),
        data=digits_images,
        loss=SCCE_LOGITS,
        epochs=6,
    )
    _add(
        f,
        "stalled_clipped",
        "stalled",
        "A CNN with SGD clipped to 1e-6.",
        model=cnn_bn(),
        optimizer=lambda: keras.optimizers.SGD(0.01, global_clipnorm=1e-6),
        data=digits_images,
        loss=SCCE_LOGITS,
        epochs=6,
    )
    for kind, lr in [
        ("adam", 1e-3),
        ("momentum", 1e-2),
        ("rmsprop", 1e-3),
        ("adamw", 3e-3),
    ]:
        _add(
            f,
            f"healthy_{kind}",
            "healthy",
            "A digits CNN with BatchNormalization that trains as it should.",
            model=cnn_bn(),
            optimizer=functools.partial(opt, kind, lr),
            data=digits_images,
            loss=SCCE_LOGITS,
            epochs=6,
        )
    _add(
        f,
        "healthy_long",
        "healthy",
        "5,600 steps of the CNN, Adam with a cosine decay.",
        model=cnn_bn(),
        optimizer=functools.partial(opt, "adam", cosine(3e-3, 5600)),
        data=digits_images,
        loss=SCCE_LOGITS,
        epochs=100,
    )


# ------------------------------------------------------------------ transformer LM
class TokenAndPosition(layers.Layer):
    """Token and position embeddings, the positions made in `call` (as in
    Keras's miniature GPT example)."""

    def __init__(self, context: int, vocab: int, dim: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tokens = layers.Embedding(vocab, dim)
        self.positions = layers.Embedding(context, dim)

    def call(self, x: Any) -> Any:
        positions = ops.arange(0, ops.shape(x)[-1])
        return self.tokens(x) + self.positions(positions)


def lm(context: int = 16, dim: int = 32) -> Callable[[], keras.Model]:
    _, vocab = _text_ids()

    def make() -> keras.Model:
        x = keras.Input((context,), dtype="int32")
        h = TokenAndPosition(context, vocab, dim)(x)
        a = layers.MultiHeadAttention(2, dim // 2)(h, h, use_causal_mask=True)
        h = layers.LayerNormalization()(h + a)
        ff = layers.Dense(dim, kernel_initializer="glorot_uniform")(
            layers.Dense(2 * dim, "gelu")(h)
        )
        h = layers.LayerNormalization()(h + ff)
        return keras.Model(x, layers.Dense(vocab)(h))

    return make


def _families_lm() -> None:
    f = "transformer_lm"
    for kind, lr in [
        ("sgd", 100.0),
        ("momentum", 10.0),
        ("adam", 1.0),
        ("adamw", 3.0),
        ("rmsprop", 1.0),
    ]:
        _add(
            f,
            f"lr_{kind}_{lr:g}",
            "learning_rate_too_high",
            f"A character language model at a {kind} rate of {lr:g}.",
            model=lm(),
            optimizer=functools.partial(opt, kind, lr),
            data=text_windows,
            loss=SCCE_LOGITS,
            epochs=4,
        )
    _add(
        f,
        "lr_warmup_adamw",
        "learning_rate_too_high",
        "A character LM warming up to an AdamW rate of 3.",
        model=lm(),
        optimizer=lambda: keras.optimizers.AdamW(warmup(3.0, 200), beta_2=0.95),
        data=text_windows,
        loss=SCCE_LOGITS,
        epochs=6,
    )
    _add(
        f,
        "optimizer_state_adamw",
        "optimizer_state",
        "A character LM with AdamW beta_2=0.3, epsilon 1e-15.",
        model=lm(),
        optimizer=lambda: keras.optimizers.AdamW(1e-3, beta_2=0.3, epsilon=1e-15),
        data=text_windows,
        loss=SCCE_LOGITS,
        epochs=4,
    )
    _add(
        f,
        "stalled_schedule_to_zero",
        "stalled",
        "A character LM whose schedule reaches zero in 60 steps.",
        model=lm(),
        optimizer=functools.partial(opt, "adam", to_zero(1e-3, 20)),
        data=text_windows,
        loss=SCCE_LOGITS,
        epochs=4,
    )
    _add(
        f,
        "stalled_rate_too_high",
        "stalled",
        "A character LM at Adam 0.05: stuck near the letters' frequencies.",
        model=lm(),
        optimizer=functools.partial(opt, "adam", 0.05),
        data=text_windows,
        loss=SCCE_LOGITS,
        epochs=4,
    )
    for kind, lr in [("adam", 1e-3), ("adamw", 3e-3), ("rmsprop", 1e-3)]:
        _add(
            f,
            f"healthy_{kind}",
            "healthy",
            "A character LM that trains as it should.",
            model=lm(),
            optimizer=functools.partial(opt, kind, lr),
            data=text_windows,
            loss=SCCE_LOGITS,
            epochs=4,
        )
    _add(
        f,
        "healthy_long_warmup_cosine",
        "healthy",
        "5,120 steps of a character LM, AdamW warm-up and cosine decay.",
        model=lm(),
        optimizer=lambda: keras.optimizers.AdamW(
            cosine(3e-3, 5120, warm=100), beta_2=0.95
        ),
        data=lambda: text_windows(n=4096),
        loss=SCCE_LOGITS,
        epochs=40,
    )


# ------------------------------------------------------------------ actor-critic
def actor_critic(shared: bool, d: int = 8, k: int = 4) -> Callable[[], keras.Model]:
    def make() -> keras.Model:
        x = keras.Input((d,))
        if shared:
            h = layers.Dense(32, "tanh")(layers.Dense(32, "tanh")(x))
            hp = hv = h
        else:
            hp = layers.Dense(32, "tanh")(layers.Dense(32, "tanh")(x))
            hv = layers.Dense(32, "tanh")(layers.Dense(32, "tanh")(x))
        return keras.Model(
            x,
            {
                "policy": layers.Dense(k, "softmax", name="policy")(hp),
                "value": layers.Dense(1, name="value")(hv),
            },
        )

    return make


def _ac_data(
    growth: float = 1.0, noisy: bool = False, x_scale: float = 1.0, nan_at=None
):
    def make() -> tuple:
        x, adv = noisy_returns() if noisy else replayed_actions(growth=growth)
        returns = adv.sum(axis=1, keepdims=True) * 2.0 + 1.0
        if nan_at is not None:
            returns = nan_row(returns, nan_at)
        return x * x_scale, {"policy": adv, "value": returns.astype("float32")}

    return make


def _families_ac() -> None:
    f = "actor_critic"
    collapse = {"policy": policy_gradient_loss, "value": "mse"}
    healthy = {"policy": entropy_pg_loss, "value": "mse"}
    for shared in (True, False):
        trunk = "shared" if shared else "separate"
        for kind, lr, growth in [("rmsprop", 1e-2, 1.0), ("adam", 3e-3, 10.0)]:
            _add(
                f,
                f"policy_collapse_{trunk}_{kind}",
                "policy_collapse",
                f"An actor-critic ({trunk} trunk) whose policy collapses under "
                f"growing advantages (x{growth:g}).",
                model=actor_critic(shared),
                optimizer=functools.partial(opt, kind, lr),
                data=_ac_data(growth),
                loss=collapse,
                epochs=2,
            )
        _add(
            f,
            f"lr_{trunk}_sgd",
            "learning_rate_too_high",
            f"An actor-critic ({trunk} trunk) at an SGD rate of 30.",
            model=actor_critic(shared),
            optimizer=functools.partial(opt, "sgd", 30.0),
            data=_ac_data(noisy=True),
            loss=healthy,
            epochs=2,
        )
        _add(
            f,
            f"lr_{trunk}_adam",
            "learning_rate_too_high",
            f"An actor-critic ({trunk} trunk) at an Adam rate of 3.",
            model=actor_critic(shared),
            optimizer=functools.partial(opt, "adam", 3.0),
            data=_ac_data(noisy=True),
            loss=healthy,
            epochs=2,
        )
        _add(
            f,
            f"bad_data_nan_return_{trunk}",
            "bad_data",
            f"An actor-critic ({trunk} trunk), one NaN return.",
            model=actor_critic(shared),
            optimizer=functools.partial(opt, "adam", 1e-3),
            data=_ac_data(noisy=True, nan_at=1500),
            loss=healthy,
            epochs=1,
        )
        _add(
            f,
            f"input_scale_{trunk}",
            "input_scale",
            f"An actor-critic ({trunk} trunk) on raw observations (x300), SGD.",
            model=actor_critic(shared),
            optimizer=functools.partial(opt, "sgd", 3e-2),
            data=_ac_data(noisy=True, x_scale=300.0),
            loss=healthy,
            epochs=2,
        )
        for kind, lr in [("adam", 1e-3), ("rmsprop", 1e-3)]:
            _add(
                f,
                f"healthy_{trunk}_{kind}",
                "healthy",
                f"An entropy-regularised actor-critic ({trunk} trunk).",
                model=actor_critic(shared),
                optimizer=functools.partial(opt, kind, lr),
                data=_ac_data(noisy=True),
                loss=healthy,
                epochs=2,
            )


# ------------------------------------------------------------------ GAN
def _gan(d_opt: Callable, g_opt: Callable, nan_at: int | None = None) -> Callable:
    def train(guard: Any, seed: int) -> None:
        import keras_nanguard as ng
        from examples import gan

        images = digits_images(1024)[0].copy()
        if nan_at is not None:
            images[nan_at, 4, 4, 0] = np.nan
        keras.utils.set_random_seed(seed)
        model = gan.GAN(*gan.networks(), latent_dim=gan.LATENT)
        model.compile(
            ng.SafeOptimizer(d_opt()),
            ng.SafeOptimizer(g_opt()),
            keras.losses.BinaryCrossentropy(from_logits=True),
        )
        model.fit(
            images, epochs=6, batch_size=32, shuffle=False, callbacks=[guard], verbose=0
        )

    return train


def _families_gan() -> None:
    f = "gan"
    tf_only = ("tensorflow",)
    adam = functools.partial(opt, "adam", 3e-4)
    for name, d, g in [
        ("lr_discriminator_sgd", functools.partial(opt, "sgd", 50.0), adam),
        (
            "lr_both_adam",
            functools.partial(opt, "adam", 1.0),
            functools.partial(opt, "adam", 1.0),
        ),
        ("lr_generator_momentum", adam, functools.partial(opt, "momentum", 20.0)),
    ]:
        _add(
            f,
            name,
            "learning_rate_too_high",
            "A GAN with a rate far too high.",
            tf_only,
            custom=_gan(d, g),
        )
    _add(
        f,
        "bad_data_nan_image",
        "bad_data",
        "A GAN, one NaN pixel.",
        tf_only,
        custom=_gan(adam, adam, nan_at=500),
    )
    _add(
        f,
        "optimizer_state_adam",
        "optimizer_state",
        "A GAN whose discriminator's Adam has beta_2=0.3, epsilon 1e-15.",
        tf_only,
        custom=_gan(
            lambda: keras.optimizers.Adam(1e-3, beta_2=0.3, epsilon=1e-15), adam
        ),
    )
    for name, d, g in [
        ("healthy_adam", adam, adam),
        (
            "healthy_rmsprop",
            functools.partial(opt, "rmsprop", 1e-4),
            functools.partial(opt, "rmsprop", 1e-4),
        ),
    ]:
        _add(
            f,
            name,
            "healthy",
            "A GAN that trains as Keras's example does.",
            tf_only,
            custom=_gan(d, g),
        )


# ------------------------------------------------------------------ autoencoder
def autoencoder(init: Any = "glorot_uniform", depth: int = 1) -> Callable:
    def make() -> keras.Model:
        stack: list[Any] = [keras.Input((64,))]
        stack += [
            layers.Dense(32, "relu", kernel_initializer=init) for _ in range(depth)
        ]
        stack += [
            layers.Dense(8, "relu", kernel_initializer=init),
            layers.Dense(32, "relu"),
            layers.Dense(64, "sigmoid"),
        ]
        return keras.Sequential(stack)

    return make


def _families_ae() -> None:
    f = "autoencoder"
    both = lambda: (digits_flat()[0], digits_flat()[0])  # noqa: E731
    for kind, lr in [
        ("sgd", 200.0),
        ("momentum", 50.0),
        ("adam", 0.5),
        ("rmsprop", 0.5),
    ]:
        _add(
            f,
            f"lr_{kind}_{lr:g}",
            "learning_rate_too_high",
            f"A digits autoencoder at a {kind} rate of {lr:g}.",
            model=autoencoder(),
            optimizer=functools.partial(opt, kind, lr),
            data=both,
            loss="binary_crossentropy",
            epochs=4,
        )
    _add(
        f,
        "bad_data_nan_pixel",
        "bad_data",
        "An autoencoder, one NaN pixel.",
        model=autoencoder(),
        optimizer=functools.partial(opt, "adam", 1e-3),
        data=lambda: (nan_row(digits_flat()[0], 700), digits_flat()[0]),
        loss="binary_crossentropy",
        epochs=2,
    )
    _add(
        f,
        "input_scale_raw",
        "input_scale",
        "An autoencoder fed raw 0-255 pixels, SGD.",
        model=autoencoder(),
        optimizer=functools.partial(opt, "sgd", 1e-2),
        data=lambda: (digits_flat()[0] * 255.0, digits_flat()[0]),
        loss="mse",
        epochs=4,
    )
    _add(
        f,
        "activation_growth_init",
        "activation_growth",
        "A deep autoencoder with N(0, 1) weights.",
        model=autoencoder(keras.initializers.RandomNormal(stddev=1.0), depth=6),
        optimizer=functools.partial(opt, "sgd", 1e-3),
        data=lambda: (digits_flat()[0], digits_flat()[0]),
        loss="mse",
        epochs=2,
    )
    _add(
        f,
        "stalled_dead_relu",
        "stalled",
        "An autoencoder whose bottleneck units start dead.",
        model=lambda: keras.Sequential(
            [
                keras.Input((64,)),
                layers.Dense(
                    8, "relu", bias_initializer=keras.initializers.Constant(-20.0)
                ),
                layers.Dense(64, "sigmoid"),
            ]
        ),
        optimizer=functools.partial(opt, "adam", 1e-3),
        data=both,
        loss="binary_crossentropy",
        epochs=6,
    )
    for kind, lr in [
        ("adam", 1e-3),
        ("rmsprop", 1e-3),
        ("momentum", 0.1),
        ("adamw", 3e-3),
    ]:
        _add(
            f,
            f"healthy_{kind}",
            "healthy",
            "A digits autoencoder that trains as it should.",
            model=autoencoder(),
            optimizer=functools.partial(opt, kind, lr),
            data=both,
            loss="binary_crossentropy",
            epochs=6,
        )


for _make in (
    _families_mlp,
    _families_rnn,
    _families_reinforce,
    _families_vae,
    _families_multi,
    _families_cnn,
    _families_lm,
    _families_ac,
    _families_gan,
    _families_ae,
):
    _make()


def _more() -> None:
    """Settings that complete the families (the counts the issue asks:
    100 diverging runs or more, 50 healthy)."""
    for act, gain, kind, lr in [
        ("linear", 1.0, "momentum", 1e-4),
        ("relu", 1.5, "sgd", 5e-4),
    ]:
        _add(
            "rnn",
            f"exploding_simple_{act}_{gain:g}_{kind}",
            "exploding_recurrence",
            f"A {act} SimpleRNN over 40 steps, recurrent gain {gain:g}, {kind}.",
            model=rnn("SimpleRNN", 40, act, gain),
            optimizer=functools.partial(opt, kind, lr),
            data=functools.partial(sequences, steps=40, norm=False),
            loss="mse",
            epochs=6,
        )
    both = lambda: (digits_flat()[0], digits_flat()[0])  # noqa: E731
    _add(
        "vae",
        "activation_growth_init",
        "activation_growth",
        "A VAE with N(0, 3) weights.",
        model=vae(keras.initializers.RandomNormal(stddev=3.0)),
        optimizer=functools.partial(opt, "sgd", 1e-3),
        data=both,
        loss="binary_crossentropy",
        epochs=2,
    )
    _add(
        "vae",
        "lr_momentum_5",
        "learning_rate_too_high",
        "A VAE at a momentum rate of 5.",
        model=vae(),
        optimizer=functools.partial(opt, "momentum", 5.0),
        data=both,
        loss="binary_crossentropy",
        epochs=4,
    )
    _add(
        "cnn_bn",
        "activation_growth_head_3",
        "activation_growth",
        "A CNN whose dense head starts with N(0, 3) weights, Adam.",
        model=cnn_bn(head_init=keras.initializers.RandomNormal(stddev=3.0)),
        optimizer=functools.partial(opt, "adam", 1e-4),
        data=digits_images,
        loss=SCCE_LOGITS,
        epochs=2,
    )
    _add(
        "reinforce",
        "input_scale_raw",
        "input_scale",
        "An entropy-regularised policy on raw observations (x300), SGD.",
        model=policy(),
        optimizer=functools.partial(opt, "sgd", 0.05),
        data=lambda: (noisy_returns()[0] * 300.0, noisy_returns()[1]),
        loss=entropy_pg_loss,
        epochs=2,
    )
    _add(
        "reinforce",
        "optimizer_state_adam",
        "optimizer_state",
        "A policy whose Adam has beta_2=0.3 and epsilon 1e-15.",
        model=policy(),
        optimizer=lambda: keras.optimizers.Adam(1e-3, beta_2=0.3, epsilon=1e-15),
        data=noisy_returns,
        loss=entropy_pg_loss,
        epochs=2,
    )
    _add(
        "vae",
        "input_scale_raw",
        "input_scale",
        "A VAE fed raw 0-255 pixels, SGD.",
        model=vae(),
        optimizer=functools.partial(opt, "sgd", 1e-2),
        data=lambda: (digits_flat()[0] * 255.0, digits_flat()[0]),
        loss="binary_crossentropy",
        epochs=4,
    )
    _add(
        "multi_output",
        "optimizer_state_rmsprop_eps0",
        "optimizer_state",
        "A two-headed model, RMSprop epsilon=0: the digits' blank corner "
        "pixels give their weights a zero gradient, sqrt(v) decays to 0.",
        model=two_heads,
        optimizer=lambda: keras.optimizers.RMSprop(1e-3, rho=0.5, epsilon=0.0),
        data=_two_targets,
        loss={"digit": SCCE_LOGITS, "ink": "mse"},
        epochs=4,
    )
    _add(
        "autoencoder",
        "optimizer_state_adam_eps0",
        "optimizer_state",
        "An autoencoder, Adam with beta_2=0.5 and epsilon=0 (the blank pixels).",
        model=autoencoder(),
        optimizer=lambda: keras.optimizers.Adam(1e-3, beta_2=0.5, epsilon=0.0),
        data=both,
        loss="binary_crossentropy",
        epochs=4,
    )
    _add(
        "autoencoder",
        "lr_adamw_1",
        "learning_rate_too_high",
        "A digits autoencoder at an AdamW rate of 1.",
        model=autoencoder(),
        optimizer=functools.partial(opt, "adamw", 1.0),
        data=both,
        loss="binary_crossentropy",
        epochs=4,
    )
    healthy = [
        (
            "reinforce",
            "healthy_momentum",
            policy(),
            functools.partial(opt, "momentum", 1e-3),
            noisy_returns,
            entropy_pg_loss,
        ),
        (
            "vae",
            "healthy_momentum",
            vae(),
            functools.partial(opt, "momentum", 0.05),
            both,
            "binary_crossentropy",
        ),
        (
            "multi_output",
            "healthy_adamw",
            two_heads,
            functools.partial(opt, "adamw", 3e-3),
            _two_targets,
            {"digit": SCCE_LOGITS, "ink": "mse"},
        ),
        (
            "autoencoder",
            "healthy_sgd",
            autoencoder(),
            functools.partial(opt, "sgd", 1.0),
            both,
            "binary_crossentropy",
        ),
        (
            "rnn",
            "healthy_gru_adam",
            rnn("GRU"),
            functools.partial(opt, "adam", 3e-3),
            sequences,
            "mse",
        ),
        (
            "transformer_lm",
            "healthy_momentum",
            lm(),
            functools.partial(opt, "momentum", 0.1),
            text_windows,
            SCCE_LOGITS,
        ),
        (
            "actor_critic",
            "healthy_shared_adamw",
            actor_critic(True),
            functools.partial(opt, "adamw", 1e-3),
            _ac_data(noisy=True),
            {"policy": entropy_pg_loss, "value": "mse"},
        ),
        (
            "actor_critic",
            "healthy_separate_adamw",
            actor_critic(False),
            functools.partial(opt, "adamw", 1e-3),
            _ac_data(noisy=True),
            {"policy": entropy_pg_loss, "value": "mse"},
        ),
        (
            "cnn_bn",
            "healthy_confident_softmax",
            lambda: keras.Sequential([cnn_bn()(), layers.Softmax()]),
            functools.partial(opt, "adam", 3e-3),
            digits_images,
            "sparse_categorical_crossentropy",
        ),
    ]
    for family, name, model, optimizer, data, loss in healthy:
        _add(
            family,
            name,
            "healthy",
            "Trains as it should.",
            model=model,
            optimizer=optimizer,
            data=data,
            loss=loss,
            epochs=6,
        )


_more()


def _sweeps() -> None:
    """Per family, SGD warming up past its stable rate (the most common
    divergence, and one that drifts before it fails), and bad batches at
    another place in the data."""
    both = lambda: (digits_flat()[0], digits_flat()[0])  # noqa: E731
    ac = {"policy": entropy_pg_loss, "value": "mse"}
    families = {
        # family: (model, data, loss, the SGD rate it diverges at, steps/epoch)
        "mlp": (mlp(8, 1, act="tanh"), regression, "mse", 2.0, 64),
        "rnn": (rnn("LSTM"), sequences, "mse", 20.0, 32),
        "vae": (vae(), both, "binary_crossentropy", 100.0, 56),
        "multi_output": (
            two_heads,
            _two_targets,
            {"digit": SCCE_LOGITS, "ink": "mse"},
            3.0,
            56,
        ),
        "cnn_bn": (cnn_bn(), digits_images, SCCE_LOGITS, 3.0, 56),
        "transformer_lm": (lm(), text_windows, SCCE_LOGITS, 50.0, 64),
        "actor_critic": (actor_critic(True), _ac_data(noisy=True), ac, 10.0, 128),
        "autoencoder": (autoencoder(), both, "binary_crossentropy", 100.0, 56),
    }
    for family, (model, data, loss, rate, per_epoch) in families.items():
        epochs = -(-400 // per_epoch)
        for kind, peak in [
            ("sgd", 3 * rate),
            ("sgd", 30 * rate),
            ("momentum", 3 * rate / 10),
        ]:
            _add(
                family,
                f"lr_warmup_{kind}_{peak:g}",
                "learning_rate_too_high",
                f"A warm-up of {kind} from {peak / 100:g} to {peak:g} over 300 steps.",
                model=model,
                optimizer=functools.partial(opt, kind, warmup(peak, 300)),
                data=data,
                loss=loss,
                epochs=epochs,
            )

        if family == "transformer_lm":
            continue  # token ids: nothing to make NaN

        def late_nan(data=data) -> tuple:
            x, y = data()
            return nan_row(x, min(32 * 40, len(x) // 2) + 5), y

        _add(
            family,
            "bad_data_nan_late",
            "bad_data",
            "A healthy run, one NaN input in a later batch.",
            model=model,
            optimizer=functools.partial(opt, "adam", 1e-3),
            data=late_nan,
            loss=loss,
            epochs=2,
        )
    for k, kind, lr in [(2, "rmsprop", 3e-3), (8, "adam", 1e-2)]:
        _add(
            "reinforce",
            f"policy_collapse_{k}_actions_{kind}",
            "policy_collapse",
            f"A softmax policy over {k} actions on replayed actions, one with "
            "a negative advantage always.",
            model=policy(k=k),
            optimizer=functools.partial(opt, kind, lr),
            data=functools.partial(replayed_actions, k=k),
            loss=policy_gradient_loss,
            epochs=2,
        )


_sweeps()


def _healthy_more() -> None:
    """Two more healthy kinds: plain SGD on an MLP, a sigmoid autoencoder
    with Adam for twice as long."""
    _add(
        "mlp",
        "healthy_sgd",
        "healthy",
        "A digits classifier with plain SGD.",
        model=mlp(64, 10),
        optimizer=functools.partial(opt, "sgd", 0.05),
        data=digits_flat,
        loss=SCCE_LOGITS,
        epochs=6,
    )
    _add(
        "autoencoder",
        "healthy_adam_long",
        "healthy",
        "A digits autoencoder, Adam 1e-3 for 1,120 steps.",
        model=autoencoder(),
        optimizer=functools.partial(opt, "adam", 1e-3),
        data=lambda: (digits_flat()[0], digits_flat()[0]),
        loss="binary_crossentropy",
        epochs=20,
    )


_healthy_more()
