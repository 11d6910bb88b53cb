"""The models more than one test file builds, built here once.

- The two models from the user's reports. They live in
  `notebooks/report_models.py`, with the notebooks whose story they are (and
  which `benchmarks/bench_diagnose.py` imports too); `tests/__init__.py` puts
  that folder on the path and this module re-exports them, so that every
  test, notebook and benchmark builds the very same models under one module
  name.
- The NaNGuard tests' net, `tiny_mlp` (6 features, Dense 8 ReLU, Dense 1),
  compiled as a binary classifier (`guard_model`) or a regressor
  (`mse_model`).
- `tanh_regressor` (8 features, two Dense 32 tanh, Dense 1) and
  `linear_stack` (3 features, Dense 4, Dense 2, no activation).

The digits MLP (64, Dense 64 ReLU twice, 10 logits) is the demo's:
`keras_nanguard.demo.mlp`, which the benchmarks and notebooks use too.
Builders that take no `seed` leave the weights to Keras's global seed: set
it first.
"""

from __future__ import annotations

import keras
from report_models import (  # noqa: F401  (re-exported; notebooks/, tests/__init__.py)
    WeightNormDense,
    actor,
    critic,
    gathered_log_prob_loss,
    policy_gradient_loss,
)

from tests.helpers import BINARY_LOSS


def tiny_layers(dropout: bool = False) -> list[keras.layers.Layer]:
    """`tiny_mlp`'s layers, new: Dense 8 ReLU (then Dropout 0.5, seeded, if
    `dropout`), Dense 1."""
    layers = [keras.layers.Dense(8, activation="relu")]
    if dropout:
        layers.append(keras.layers.Dropout(0.5, seed=1))
    return [*layers, keras.layers.Dense(1)]


class SubclassedNet(keras.Model):
    """`tiny_mlp` as a subclassed model, built by its first call."""

    def __init__(self):
        super().__init__()
        self.hidden, self.out = tiny_layers()

    def call(self, x):
        return self.out(self.hidden(x))


def tiny_mlp(kind: str = "input", dropout: bool = False) -> keras.Model:
    """The NaNGuard tests' net: 6 features, Dense 8 ReLU, Dense 1.

    `kind`: "input" (a Sequential with its `Input`, built at once),
    "sequential" (a Sequential without `Input`) or "subclassed"
    (`SubclassedNet`, without dropout); those two are built by `fit`.
    """
    if kind == "input":
        return keras.Sequential([keras.Input((6,)), *tiny_layers(dropout)])
    if kind == "sequential":
        return keras.Sequential(tiny_layers(dropout))
    if kind == "subclassed" and not dropout:
        return SubclassedNet()
    raise ValueError(f"No tiny_mlp of kind={kind!r}, dropout={dropout}.")


def guard_model(
    optimizer=None,
    kind: str = "input",
    seed: int = 1,
    compile: bool = True,
    dropout: bool = False,
    **compile_kwargs,
) -> keras.Model:
    """`tiny_mlp` from Keras's seed `seed`, compiled (unless not `compile`)
    as the binary classifier of `binary_data` (logits, `BINARY_LOSS`), with
    `optimizer` or else SGD(0.05)."""
    keras.utils.set_random_seed(seed)
    model = tiny_mlp(kind, dropout)
    if compile:
        model.compile(
            optimizer=optimizer or keras.optimizers.SGD(0.05),
            loss=BINARY_LOSS,
            **compile_kwargs,
        )
    return model


def mse_model(optimizer, seed: int | None = None) -> keras.Model:
    """`tiny_mlp` compiled as a regressor (MSE); `seed` sets Keras's seed first."""
    if seed is not None:
        keras.utils.set_random_seed(seed)
    model = tiny_mlp()
    model.compile(optimizer=optimizer, loss="mse")
    return model


def tanh_regressor() -> keras.Sequential:
    """8 features, two Dense 32 tanh, Dense 1: the regressor of the runs
    whose learning rate rises too far (a warm-up, a jump)."""
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(32, activation="tanh"),
            keras.layers.Dense(32, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )


def linear_stack() -> keras.Sequential:
    """3 features, Dense 4, Dense 2, no activation: two kernels and two
    biases, for tests of the optimizer's step itself."""
    return keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)]
    )
