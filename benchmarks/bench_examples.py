"""Step time of small models in the patterns of `examples/`, against what
users add instead, interleaved in one process.

Arms: `plain` (Adam), `clipnorm` (Adam with `global_clipnorm=1.0`: what
`SafeOptimizer` replaces), `terminate` (Adam and `TerminateOnNaN()`: what
`NaNGuard` replaces), `safe` (`SafeOptimizer(Adam)`), `guard`
(`SafeOptimizer(Adam)` with `NaNGuard()`, its defaults: early warning on)
and `guard, no early warning`. Each model is compiled and fitted once per
arm (the compile), then each round times one `fit` of `--epochs` epochs per
arm in turn; a figure is the ratio of two arms in the same round, median
[min, max] over `--rounds`: each arm over plain (issue 52: safe <= 1.30,
guard <= 1.75 on JAX), then safe / clipnorm and guard / terminate (issue 54:
<= 1.05 and <= 1.00). Models: the two stacked LSTMs of `examples/lstm.py`
(batch 32), the convnet of `examples/convnet.py` (digits, batch 64), the
transformer classifier of `examples/transformer.py` (batch 32) and the GPT of
`examples/gpt.py` (batch 32). `--busy N` starts N processes that spin on the
CPU for the whole run (a shared notebook or CI machine). `--multi`: every
arm's Adam is a `MultiOptimizer`, Adam for all but the last layer and SGD
with momentum for it, as fine-tuning uses it (issue 44).

On JAX, `--kernels` prints instead an exact proxy of the step's fixed cost:
the kernels (XLA fusions) of one compiled train step, the host callbacks in
it, and the bytes XLA's cost analysis counts, for the models above and for
a model of 10, 100 and 1,000 variables of the same total size (the fixed
cost must not grow with the number of tensors). On a CPU a small model's
step is mostly kernel launches.

Usage:
    KERAS_BACKEND=jax python benchmarks/bench_examples.py
    KERAS_BACKEND=tensorflow python benchmarks/bench_examples.py --busy 1
    KERAS_BACKEND=jax python benchmarks/bench_examples.py --kernels
    KERAS_BACKEND=jax python benchmarks/bench_examples.py --multi
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import keras
import numpy as np
from _stats import ratio_summary  # this folder is on sys.path
from keras import layers

import keras_nanguard as ng
from examples import convnet, gpt, lstm, transformer

ARMS = ("plain", "clipnorm", "terminate", "safe", "guard", "guard, no early warning")
# The figures: an arm's time over another's in the same round. Each arm over
# plain, then each over what it replaces.
FIGURES = [(arm, "plain") for arm in ARMS[1:]] + [
    ("safe", "clipnorm"),
    ("guard", "terminate"),
]
Data = tuple[keras.Model, np.ndarray, np.ndarray, int]


def _lstm() -> Data:
    x, y = lstm.data(2048, 0)
    return lstm.stacked_lstms(), x, y, 32


def _convnet() -> Data:
    x, y = convnet.data()
    return convnet.convnet(), x, y, 64


def _transformer() -> Data:
    x, y = transformer.data(1024, 0)
    inputs = layers.Input(shape=(transformer.LENGTH,))
    h = transformer.TokenAndPositionEmbedding(
        transformer.LENGTH, transformer.VOCAB, 16
    )(inputs)
    h = transformer.TransformerBlock(16, 2, 16)(h)
    h = layers.GlobalAveragePooling1D()(h)
    outputs = layers.Dense(2, activation="softmax")(h)
    return keras.Model(inputs, outputs), x, y, 32


def _gpt() -> Data:
    x, y, vocab = gpt.data(512)
    inputs = layers.Input(shape=(gpt.CONTEXT,), dtype="int32")
    h = gpt.TokenAndPositionEmbedding(gpt.CONTEXT, vocab, gpt.WIDTH)(inputs)
    h = gpt.TransformerBlock(gpt.WIDTH, gpt.HEADS, gpt.WIDTH)(h)
    outputs = layers.Dense(vocab)(h)
    return keras.Model(inputs, outputs), x, y, 32


class Many(layers.Layer):
    """A linear map 80 -> 100 whose weight is `parts` variables of the same
    total size (8,000 floats)."""

    def __init__(self, parts: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.parts = parts

    def build(self, input_shape) -> None:
        size = 80 * 100 // self.parts
        self.pieces = [
            self.add_weight(shape=(size,), initializer="glorot_uniform", name=f"w{i}")
            for i in range(self.parts)
        ]

    def call(self, x):
        return x @ keras.ops.reshape(keras.ops.concatenate(self.pieces), (80, 100))


def _many(parts: int):
    def make() -> Data:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(256, 80)).astype("float32")
        y = np.tanh(x @ rng.normal(size=(80, 100))).astype("float32")
        model = keras.Sequential([keras.Input((80,)), Many(parts)])
        return model, x, y, 32

    return make


MODELS = {
    "two LSTMs": _lstm,
    "convnet": _convnet,
    "transformer": _transformer,
    "GPT": _gpt,
}
SWEEP = {f"{n} variables": _many(n) for n in (10, 100, 1000)}
LOSSES = {
    "two LSTMs": "mse",
    "convnet": "categorical_crossentropy",
    "transformer": "sparse_categorical_crossentropy",
    "GPT": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
}


MULTI = False  # --multi: each arm's Adam is a MultiOptimizer (see `_adam`)


def _adam(model: keras.Model, **kwargs) -> keras.optimizers.Optimizer:
    """Adam at 1e-3; with `--multi`, Keras's per-layer optimizers as
    fine-tuning uses them: Adam for all but the last layer, which trains
    with SGD and momentum (each sub-optimizer gets `kwargs`)."""
    if not MULTI:
        return keras.optimizers.Adam(1e-3, **kwargs)
    chosen = keras.optimizers.OptimizerMap(keras.optimizers.Adam(1e-3, **kwargs))
    head = model.layers[-1].name
    chosen[f"{head}/.*"] = keras.optimizers.SGD(1e-2, momentum=0.9, **kwargs)
    return keras.optimizers.MultiOptimizer(chosen)


def _optimizer(arm: str, model: keras.Model) -> keras.optimizers.Optimizer:
    if arm == "clipnorm":  # of a MultiOptimizer: each sub-optimizer's own norm
        return _adam(model, global_clipnorm=1.0)
    opt = _adam(model)
    if arm in ("plain", "terminate"):
        return opt
    if arm == "safe, no recorder":
        return ng.SafeOptimizer(opt, flight_recorder=False)
    return ng.SafeOptimizer(opt)


def _arm(name: str, arm: str):
    keras.utils.set_random_seed(0)
    model, x, y, batch = MODELS[name]()
    model.compile(_optimizer(arm, model), LOSSES[name])
    callbacks: list[keras.callbacks.Callback] = []
    if arm == "terminate":
        callbacks = [keras.callbacks.TerminateOnNaN()]
    elif arm.startswith("guard"):
        callbacks = [ng.NaNGuard(verbose=0, early_warning=arm == "guard")]

    def fit(epochs: int) -> float:
        start = time.perf_counter()
        model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, callbacks=callbacks)
        return time.perf_counter() - start

    fit(1)  # compiles
    return fit, len(x) // batch


def compiled_step(model: keras.Model, x: np.ndarray, y: np.ndarray):
    """One compiled JAX train step of a compiled, built `model` on `(x, y)`."""
    import jax

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    return jax.jit(model.train_step).lower(state, (x, y)).compile()


def step_kernels(compiled) -> tuple[int, int, float]:
    """Fusions and host callbacks in the entry computation of a compiled
    step, and the bytes XLA's cost analysis counts."""
    import re

    text = compiled.as_text()
    entry = text[text.index("ENTRY") :]
    callbacks = len(re.findall(r"custom_call_target=\"xla_(?:ffi_)?python", text))
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    fusions = len(re.findall(r" fusion\(", entry))
    return fusions, callbacks, float(analysis["bytes accessed"])


def _kernels(make, loss, arm: str) -> tuple[int, int, float]:
    keras.utils.set_random_seed(0)
    model, x, y, batch = make()
    model.compile(_optimizer(arm, model), loss)
    model.fit(x[:batch], y[:batch], batch_size=batch, verbose=0)  # builds
    return step_kernels(compiled_step(model, x[:batch], y[:batch]))


@contextlib.contextmanager
def _busy(n: int) -> Iterator[None]:
    """`n` processes spinning on the CPU while the block runs."""
    spin = [sys.executable, "-c", "while True: pass"]
    procs = [subprocess.Popen(spin) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _kernel_table() -> None:
    arms = ("plain", "clipnorm", "safe, no recorder", "safe")
    print("\nfusions, host callbacks, MB accessed (XLA cost analysis):\n")
    print("| model | " + " | ".join(arms) + " | safe - clipnorm fusions |")
    print("|---|" + "---|" * (len(arms) + 1))
    models = {**{n: (m, LOSSES[n]) for n, m in MODELS.items()}}
    models.update({n: (m, "mse") for n, m in SWEEP.items()})
    for name, (make, loss) in models.items():
        found = [_kernels(make, loss, arm) for arm in arms]
        cells = [f"{k}, {c}, {b / 1e6:.2f}" for k, c, b in found]
        extra = found[3][0] - found[1][0]
        print(f"| {name} | " + " | ".join(cells) + f" | {extra} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--busy", type=int, default=0, help="spinning processes")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--kernels", action="store_true")
    parser.add_argument(
        "--multi", action="store_true", help="MultiOptimizer: Adam, SGD for the head"
    )
    args = parser.parse_args()
    global MULTI
    MULTI = args.multi
    print(f"keras {keras.__version__}, backend {keras.backend.backend()}")
    if args.kernels:
        _kernel_table()
        return
    names = args.models.split(",")
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"--models: each of {list(MODELS)}. Received: {unknown}")
    print(f"busy processes: {args.busy}; MultiOptimizer: {args.multi}")
    print("each cell: one arm's time / another's")
    print(
        "\n| model | steps timed | plain s/step | "
        + " | ".join(f"{a} / {b}" for a, b in FIGURES)
        + " |"
    )
    print("|---|---|---|" + "---|" * len(FIGURES))
    with _busy(args.busy):
        for name in names:
            fits = {}
            for arm in ARMS:
                fits[arm], steps = _arm(name, arm)
            for arm in ARMS:  # an untimed round: the first fit of each is slow
                fits[arm](1)
            times: dict[str, list[float]] = {arm: [] for arm in ARMS}
            for _ in range(args.rounds):
                for arm in ARMS:
                    times[arm].append(fits[arm](args.epochs))
            per_step = min(times["plain"]) / (steps * args.epochs)
            ratios = [ratio_summary(times[a], times[b]) for a, b in FIGURES]
            print(
                f"| {name} | {steps * args.epochs} | {per_step * 1e3:.2f} ms | "
                + " | ".join(ratios)
                + " |",
                flush=True,
            )


if __name__ == "__main__":
    main()
