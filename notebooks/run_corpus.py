"""A corpus of training runs with known fates, made in code: what the tests and
the notebook `04_diagnosing` hold `NaNGuard.explain()` and its early warning
to (the held-out evaluation, on runs written apart from the rules, is
`benchmarks/diagnosis_runs.py`).

Each run is a `Run`: a model (MLPs, a CNN, a recurrent net, an actor's
softmax policy, a transformer block), its data (made here, seeded), an
optimizer and the cause it diverges from, or `"healthy"`. They are small
enough for CI (a few hundred steps of tiny models) and run the same on
TensorFlow, JAX and PyTorch through `model.fit`:

>>> import run_corpus as corpus  # notebooks/ on the path
>>> sorted(corpus.RUNS)[:2]
['activation_growth_deep', 'activation_growth_mlp']

`run(name)` trains one run under a `NaNGuard(policy="stop",
early_warning=True)` and returns the guard (its `explain()`, its incidents).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

Data = tuple[np.ndarray, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of the corpus.

    Attributes:
        cause: the cause it diverges from (a `RUN_CAUSES` name), or
            `"healthy"`.
        model: makes the model (called under a fixed seed).
        optimizer: makes the inner optimizer.
        data: makes `(x, y)`, fed in order (no shuffling).
        loss: the loss to compile with.
        batch_size, epochs: of `fit`.
        story: what happens, in words.
    """

    cause: str
    model: Callable[[], keras.Model]
    optimizer: Callable[[], keras.optimizers.Optimizer]
    data: Callable[[], Data]
    loss: Any
    batch_size: int
    epochs: int
    story: str


# ------------------------------------------------------------------ data
def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _regression(n: int = 2048, d: int = 8, scale: float = 1.0, seed: int = 0) -> Data:
    r = _rng(seed)
    x = r.normal(size=(n, d)).astype("float32")
    w = r.normal(size=(d, 1)).astype("float32")
    y = np.tanh(x @ w) + 0.1 * r.normal(size=(n, 1)).astype("float32")
    return (scale * x).astype("float32"), y.astype("float32")


def _linear(n: int = 1280, d: int = 6, seed: int = 0) -> Data:
    r = _rng(seed)
    x = r.normal(size=(n, d)).astype("float32")
    return x, (x @ r.normal(size=(d, 1))).astype("float32")


def _classes(n: int = 2048, d: int = 16, k: int = 4, seed: int = 0) -> Data:
    r = _rng(seed)
    centres = r.normal(size=(k, d)).astype("float32") * 2.0
    y = r.integers(0, k, n)
    x = centres[y] + r.normal(size=(n, d)).astype("float32")
    return x.astype("float32"), y.astype("int32")


def _images(
    n: int = 1024, size: int = 8, k: int = 4, seed: int = 0, noise: float = 0.0
) -> Data:
    r = _rng(seed)
    y = r.integers(0, k, n)
    x = r.uniform(0, 0.3, size=(n, size, size, 1)).astype("float32")
    for c in range(k):  # class c: a bright quadrant
        rows = y == c
        a, b = divmod(c, 2)
        h = size // 2
        x[rows, a * h : (a + 1) * h, b * h : (b + 1) * h, 0] += 0.6
    flipped = r.uniform(size=n) < noise  # labels no model can learn
    y = np.where(flipped, r.integers(0, k, n), y)
    return x, y.astype("int32")


def _sequences(
    n: int = 1024, steps: int = 30, seed: int = 0, normalised: bool = True
) -> Data:
    r = _rng(seed)
    x = r.normal(size=(n, steps, 4)).astype("float32")
    y = x[:, :, 0].sum(axis=1, keepdims=True)
    if normalised:
        y = y / np.sqrt(steps)
    return x, y.astype("float32")


def _tokens(n: int = 1024, length: int = 12, dim: int = 16, seed: int = 0) -> Data:
    r = _rng(seed)
    y = r.integers(0, 4, n)
    x = r.normal(size=(n, length, dim)).astype("float32") * 0.5
    x[np.arange(n), r.integers(0, length, n), y] += 3.0  # one token tells
    return x, y.astype("int32")


def _replayed_actions(
    n: int = 4096, k: int = 4, seed: int = 0, image: bool = False
) -> Data:
    """An actor's replayed transitions: actions sampled uniformly (a
    behaviour policy, a replay buffer), action 0 with advantage +1 and the
    last action with advantage -1, every time: minimising `-A log(pi)`
    pushes the last action's logit down without bound, until its
    probability is exactly 0 and `log(0)` is -inf."""
    r = _rng(seed)
    shape = (n, 8, 8, 3) if image else (n, 8)
    x = r.uniform(0, 1, size=shape).astype("float32")
    actions = r.integers(0, k, n)
    y = np.zeros((n, k), "float32")
    advantage = np.where(actions == 0, 1.0, np.where(actions == k - 1, -1.0, 0.0))
    y[np.arange(n), actions] = advantage
    return x, y


def _growing_scale(data: Data, end: float) -> Data:
    """The inputs' scale grows from 1 to `end` through the data (a sensor
    whose raw values drift; nobody normalised them)."""
    x, y = data
    shape = (len(x),) + (1,) * (x.ndim - 1)
    return (x * np.linspace(1.0, end, len(x), dtype="float32").reshape(shape)), y


def _rare_feature(n: int = 8192, d: int = 8, seed: int = 0) -> Data:
    """Regression data whose last feature is non-zero only in the first
    batch: its weights' second moment decays towards zero ever after."""
    x, y = _regression(n, d, seed=seed)
    x[32:, -1] = 0.0
    return x, y


def _rare_pixel_images(n: int = 8192, seed: int = 0) -> Data:
    x, y = _images(n, seed=seed)
    x = np.concatenate([x, np.zeros_like(x)], axis=-1)  # a channel seen once
    x[:32, :, :, 1] = 1.0
    return x, y


def _with_nan_batches(data: Data, batches: tuple[int, ...], batch: int) -> Data:
    x, y = data
    x = x.copy()
    for b in batches:
        x[b * batch + 3].flat[0] = np.nan
    return x, y


def _with_spike(data: Data, b: int, batch: int) -> Data:
    """One batch of wrong labels: a clean loss spike the run recovers from."""
    x, y = data
    y = y.copy()
    y[b * batch : (b + 1) * batch] = (y[b * batch : (b + 1) * batch] + 1) % 4
    return x, y


def _growing_targets(
    n: int = 4096, d: int = 8, seed: int = 0, growth: float = 3.0
) -> Data:
    """Targets whose scale grows slowly through the data (x1 to x3): the
    gradient norm grows with it, harmlessly."""
    x, y = _regression(n, d, seed=seed)
    y = y * np.linspace(1.0, growth, n, dtype="float32")[:, None]
    return x, y


# ------------------------------------------------------------------ models
def _mlp(
    d: int,
    out: int,
    *,
    width: int = 32,
    depth: int = 2,
    activation: str = "tanh",
    init: Any = "glorot_uniform",
    head: str | None = None,
    out_init: Any = "glorot_uniform",
) -> Callable[[], keras.Model]:
    def make() -> keras.Model:
        layers: list[Any] = [keras.Input((d,))]
        for _ in range(depth):
            layers.append(
                keras.layers.Dense(
                    width, activation=activation, kernel_initializer=init
                )
            )
        layers.append(
            keras.layers.Dense(out, activation=head, kernel_initializer=out_init)
        )
        return keras.Sequential(layers)

    return make


def _cnn(
    channels: int = 1, out: int = 4, head: str | None = None, activation: str = "relu"
) -> Callable:
    def make() -> keras.Model:
        return keras.Sequential(
            [
                keras.Input((8, 8, channels)),
                keras.layers.Conv2D(8, 3, activation=activation, padding="same"),
                keras.layers.MaxPooling2D(),
                keras.layers.Conv2D(16, 3, activation=activation, padding="same"),
                keras.layers.Flatten(),
                keras.layers.Dense(16, activation=activation),
                keras.layers.Dense(out, activation=head),
            ]
        )

    return make


def _rnn(activation: str = "tanh", gain: float = 1.0, steps: int = 30) -> Callable:
    def make() -> keras.Model:
        return keras.Sequential(
            [
                keras.Input((steps, 4)),
                keras.layers.SimpleRNN(
                    16,
                    activation=activation,
                    recurrent_initializer=keras.initializers.Orthogonal(gain),
                ),
                keras.layers.Dense(1),
            ]
        )

    return make


def _transformer(length: int = 12, dim: int = 16) -> Callable:
    def make() -> keras.Model:
        inputs = keras.Input((length, dim))
        att = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(inputs, inputs)
        h = keras.layers.LayerNormalization()(inputs + att)
        ff = keras.layers.Dense(32, activation="relu")(h)
        h = keras.layers.LayerNormalization()(h + keras.layers.Dense(dim)(ff))
        pooled = keras.layers.GlobalAveragePooling1D()(h)
        return keras.Model(inputs, keras.layers.Dense(4)(pooled))

    return make


# ------------------------------------------------------------------ losses
def entropy_regularised_loss(advantage_onehot: Any, probs: Any) -> Any:
    """`policy_gradient_loss` minus 0.05 times the policy's entropy (A2C's
    entropy bonus), with a floor on the probabilities."""
    from keras import ops

    logp = ops.log(ops.maximum(probs, 1e-7))
    entropy = -ops.sum(probs * logp, axis=-1)
    return -ops.sum(advantage_onehot * logp, axis=-1) - 0.05 * entropy


def policy_gradient_loss(advantage_onehot: Any, probs: Any) -> Any:
    """REINFORCE's loss, written as users write it: `-A * log(pi(a|s))`,
    summed over the actions (the one-hot advantage picks the taken one)."""
    from keras import ops

    return -ops.sum(advantage_onehot * ops.log(probs), axis=-1)


def _warmup(start: float, end: float, steps: int) -> Any:
    # An increasing PolynomialDecay is a linear warm-up.
    return keras.optimizers.schedules.PolynomialDecay(start, steps, end, power=1.0)


SCCE = "sparse_categorical_crossentropy"
SCCE_LOGITS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _deep_relu(depth: int) -> Callable[[], keras.Model]:
    # N(0, 0.5) weights on 64 ReLU units: each layer multiplies its input
    # by about 0.5 * sqrt(64 / 2) = 2.8 (He's would be 0.18). The weights
    # are NumPy's, the same on every machine: a CI machine's torch drew
    # others, and that run stayed finite where ours diverged.
    def make() -> keras.Model:
        r = _rng(7)  # the same weights at each call

        def init(shape: Any, dtype: Any = None) -> np.ndarray:
            return (0.5 * r.normal(size=shape)).astype("float32")

        return _mlp(
            8, 1, width=64, depth=depth, activation="relu", init=init, out_init=init
        )()

    return make


def _digits() -> Data:
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.data / 16.0).astype("float32"), d.target.astype("int32")


def _digits_mlp() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def _count_targets(data: Data) -> Data:
    x, y = data
    return x, y.astype("float32")[:, None]


RUNS: dict[str, Run] = {
    # ------------------------------------------------ learning rate too high
    "lr_warmup_mlp": Run(
        "learning_rate_too_high",
        _mlp(8, 1),
        lambda: keras.optimizers.SGD(_warmup(0.01, 3.0, 400)),
        _regression,
        "mse",
        16,
        3,
        "An MLP regressor whose learning-rate warm-up climbs far too high.",
    ),
    "lr_warmup_cnn": Run(
        "learning_rate_too_high",
        _cnn(out=1, activation="tanh"),
        lambda: keras.optimizers.SGD(_warmup(0.001, 1.0, 300)),
        lambda: _count_targets(_images()),
        "mse",
        16,
        6,
        "A small tanh CNN regressor whose warm-up goes to a rate of 1.",
    ),
    "lr_warmup_transformer": Run(
        "learning_rate_too_high",
        _transformer(),
        lambda: keras.optimizers.SGD(_warmup(0.01, 10.0, 300), momentum=0.9),
        _tokens,
        SCCE_LOGITS,
        16,
        6,
        "A transformer block trained with a warm-up to an SGD rate of 10.",
    ),
    "lr_warmup_critic": Run(
        "learning_rate_too_high",
        _mlp(8, 1, width=64),
        lambda: keras.optimizers.SGD(_warmup(0.01, 3.0, 300), momentum=0.9),
        _regression,
        "mse",
        16,
        3,
        "An actor-critic's critic (a value regressor) with momentum SGD "
        "warming up to 3.",
    ),
    # ------------------------------------------------ bad data
    "bad_data_nan_batches": Run(
        "bad_data",
        _mlp(16, 4),
        lambda: keras.optimizers.Adam(1e-3),
        lambda: _with_nan_batches(_classes(), (60, 90, 100), 16),
        SCCE_LOGITS,
        16,
        1,
        "A healthy classifier fed three batches with a NaN feature.",
    ),
    # ------------------------------------------------ input scale
    "input_scale_mlp": Run(
        "input_scale",
        _mlp(8, 1, activation="linear"),
        lambda: keras.optimizers.SGD(_warmup(1e-6, 1e-2, 400)),
        lambda: _regression(scale=40.0),
        "mse",
        16,
        3,
        "A regressor on raw, unnormalised features (std 40) with a warm-up "
        "that would suit normalised ones.",
    ),
    "input_scale_cnn": Run(
        "input_scale",
        _cnn(out=1, activation="linear"),
        lambda: keras.optimizers.SGD(_warmup(1e-7, 1e-3, 300)),
        lambda: (_images()[0] * 255.0, _count_targets(_images())[1]),
        "mse",
        16,
        6,
        "A CNN on raw 0-255 pixel values.",
    ),
    # ------------------------------------------------ activation growth
    "activation_growth_deep": Run(
        "activation_growth",
        _deep_relu(12),
        lambda: keras.optimizers.SGD(1e-6),
        _regression,
        "mse",
        16,
        1,
        "A 12-layer ReLU MLP initialised with N(0, 0.5) weights: each layer "
        "multiplies its input by ~2.8, the output is 10^5 times the input, "
        "and the first update overflows.",
    ),
    "activation_growth_mlp": Run(
        "activation_growth",
        _deep_relu(10),
        lambda: keras.optimizers.SGD(1e-6),
        _regression,
        "mse",
        16,
        1,
        "The same with 10 layers.",
    ),
    # ------------------------------------------------ policy collapse
    "policy_collapse_actor": Run(
        "policy_collapse",
        _mlp(8, 4, head="softmax"),
        lambda: keras.optimizers.RMSprop(1e-2),
        _replayed_actions,
        policy_gradient_loss,
        16,
        1,
        "An actor's softmax policy trained on replayed actions, one of them "
        "always with a negative advantage: its probability goes to exactly 0 "
        "and log(0) is -inf.",
    ),
    "policy_collapse_cnn_actor": Run(
        "policy_collapse",
        _cnn(3, 2, head="softmax"),
        lambda: keras.optimizers.RMSprop(2e-4),
        lambda: _replayed_actions(n=8192, k=2, image=True),
        policy_gradient_loss,
        16,
        1,
        "The image actor (Conv2D + Dense, softmax over 2 actions) of the "
        "user's report, scaled down, on the same kind of data.",
    ),
    # ------------------------------------------------ optimizer state
    "optimizer_state_rmsprop_mlp": Run(
        "optimizer_state",
        _mlp(8, 1),
        lambda: keras.optimizers.RMSprop(1e-3, rho=0.5, epsilon=0.0),
        _rare_feature,
        "mse",
        32,
        1,
        "RMSprop with epsilon=0 on a feature seen in the first batch only: "
        "its second moment decays to zero and g / sqrt(v) is 0 / 0. (Adam "
        "with epsilon=0 fails the same way on JAX and torch; TensorFlow's "
        "flush-to-zero keeps its v at the smallest normal float.)",
    ),
    "optimizer_state_rmsprop": Run(
        "optimizer_state",
        _cnn(2, activation="tanh"),
        lambda: keras.optimizers.RMSprop(1e-3, rho=0.5, epsilon=0.0),
        _rare_pixel_images,
        SCCE_LOGITS,
        32,
        1,
        "RMSprop with epsilon=0 on a CNN, an input channel seen once: 0 / sqrt(0).",
    ),
    "optimizer_state_momentum": Run(
        "optimizer_state",
        _mlp(8, 1),
        lambda: keras.optimizers.RMSprop(1e-3, rho=0.5, momentum=0.9, epsilon=0.0),
        _rare_feature,
        "mse",
        32,
        1,
        "The same with momentum 0.9.",
    ),
    # ------------------------------------------------ exploding recurrence
    "exploding_recurrence_warmup": Run(
        "exploding_recurrence",
        _rnn("linear", 0.9, steps=40),
        lambda: keras.optimizers.SGD(_warmup(1e-5, 1e-3, 400)),
        lambda: _sequences(steps=40, normalised=False),
        "mse",
        16,
        8,
        "A linear SimpleRNN summing 40 steps: as its recurrent weights near "
        "1, gradients through time explode.",
    ),
    "exploding_recurrence_long": Run(
        "exploding_recurrence",
        _rnn("linear", 0.85, steps=40),
        lambda: keras.optimizers.SGD(2e-4),
        lambda: _sequences(steps=40, normalised=False),
        "mse",
        16,
        8,
        "The same task at a constant rate: it trains for 300 steps first.",
    ),
    # ------------------------------------------------ stalled
    "stalled_schedule_to_zero": Run(
        "stalled",
        _mlp(16, 4),
        lambda: keras.optimizers.SGD(
            keras.optimizers.schedules.ExponentialDecay(1e-3, 20, 0.01)
        ),
        _classes,
        SCCE_LOGITS,
        16,
        2,
        "A classifier whose decay schedule reaches zero within 60 steps, "
        "long before it has learnt anything.",
    ),
    "stalled_clipped_to_nothing": Run(
        "stalled",
        _mlp(16, 4),
        lambda: keras.optimizers.SGD(0.01, global_clipnorm=1e-6),
        _classes,
        SCCE_LOGITS,
        16,
        2,
        "SGD with global_clipnorm=1e-6: every update is scaled to nothing.",
    ),
    # ------------------------------------------------ healthy
    "healthy_confident_classifier": Run(
        "healthy",
        _digits_mlp,
        lambda: keras.optimizers.Adam(3e-3),
        _digits,
        "sparse_categorical_crossentropy",
        32,
        40,
        "A digits MLP from softmax probabilities, Adam 3e-3: 100% training "
        "accuracy, its smallest probability far below 1e-14, as a confident "
        "classifier's is.",
    ),
    "healthy_mlp": Run(
        "healthy",
        _mlp(16, 4),
        lambda: keras.optimizers.Adam(1e-3),
        _classes,
        SCCE_LOGITS,
        16,
        2,
        "A classifier that trains as it should.",
    ),
    "healthy_cnn": Run(
        "healthy",
        _cnn(),
        lambda: keras.optimizers.Adam(1e-3),
        _images,
        SCCE_LOGITS,
        16,
        3,
        "A small CNN that trains as it should.",
    ),
    "healthy_rnn": Run(
        "healthy",
        _rnn("tanh", 1.0),
        lambda: keras.optimizers.Adam(1e-3),
        _sequences,
        "mse",
        16,
        3,
        "A tanh SimpleRNN that trains as it should.",
    ),
    "healthy_actor": Run(
        "healthy",
        _mlp(8, 4, head="softmax"),
        lambda: keras.optimizers.RMSprop(1e-3),
        _replayed_actions,
        entropy_regularised_loss,
        16,
        1,
        "The collapsing actor's data with an entropy bonus and a floor on "
        "the probabilities: it grows confident, and stays finite.",
    ),
    "healthy_loss_spike": Run(
        "healthy",
        _mlp(16, 4),
        lambda: keras.optimizers.Adam(1e-3),
        lambda: _with_spike(_classes(), 80, 16),
        SCCE_LOGITS,
        16,
        2,
        "A classifier with one batch of wrong labels: the loss spikes once "
        "per epoch and recovers.",
    ),
    "healthy_slow_growth": Run(
        "healthy",
        _mlp(8, 1),
        lambda: keras.optimizers.SGD(0.01),
        lambda: _growing_targets(growth=10.0),
        "mse",
        16,
        1,
        "A regressor whose targets grow tenfold through the data: its "
        "gradient norm grows slowly with them, harmlessly.",
    ),
    "healthy_high_rate": Run(
        "healthy",
        _mlp(6, 1, width=8, depth=1, activation="relu"),
        lambda: keras.optimizers.SGD(0.05),
        _linear,
        "mse",
        16,
        2,
        "A small ReLU regressor at a high but workable rate: its early "
        "update-to-weight ratios reach 0.2 while its loss falls.",
    ),
    "healthy_transformer": Run(
        "healthy",
        _transformer(),
        lambda: keras.optimizers.Adam(1e-3),
        _tokens,
        SCCE_LOGITS,
        16,
        3,
        "A transformer block that trains as it should.",
    ),
}


def run(
    name: str, *, early_warning: bool | str = True, seed: int = 1, model_out=None
) -> Any:
    """Trains the corpus run `name` and returns its `NaNGuard` (and puts the
    model in `model_out`, a list, if given)."""
    import keras_nanguard as ng

    spec = RUNS[name]
    keras.utils.set_random_seed(seed)
    model = spec.model()
    if model_out is not None:
        model_out.append(model)
    x, y = spec.data()
    optimizer = ng.SafeOptimizer(spec.optimizer())
    model.compile(optimizer=optimizer, loss=spec.loss)
    guard = ng.NaNGuard(policy="stop", early_warning=early_warning, verbose=0)
    model.fit(
        x,
        y,
        batch_size=spec.batch_size,
        epochs=spec.epochs,
        shuffle=False,
        callbacks=[guard],
        verbose=0,
    )
    return guard
