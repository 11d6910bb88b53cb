"""Small test helpers: NumPy views of state, bit-identity, .keras round trips."""

from __future__ import annotations

import os

import keras
import numpy as np
from keras import ops

from tests.conftest import BACKEND  # noqa: F401  (re-exported for tests)

#: Files saved by earlier versions, which must keep loading (CONTRIBUTING.md).
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")

# The NaNGuard tests' task: two features decide a binary label.
BINARY_LOSS = keras.losses.BinaryCrossentropy(from_logits=True)


def binary_data(n: int = 128, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 6)).astype("float32")
    y = (x[:, :1] + x[:, 1:2] > 0).astype("float32")
    return x, y


def fit_quietly(model, data, callbacks, epochs=1, **kwargs):
    """`model.fit` on a dataset (a `PyDataset` or generator), unshuffled and
    silent."""
    return model.fit(
        data, epochs=epochs, verbose=0, shuffle=False, callbacks=callbacks, **kwargs
    )


def learning_rate(model) -> np.float32:
    """The model's optimizer's learning rate, read from the device."""
    return np.float32(ops.convert_to_numpy(model.optimizer.learning_rate))


def numpy(values) -> list[np.ndarray]:
    """Copies of a list of variables/tensors as NumPy arrays."""
    return [np.array(ops.convert_to_numpy(v), copy=True) for v in values]


def assert_bit_identical(before, after, what="state"):
    assert len(before) == len(after), f"{what}: {len(before)} vs {len(after)} arrays"
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}[{i}]"
        # Bitwise, so NaN payloads and -0.0 count too.
        assert a.tobytes() == b.tobytes(), f"{what}[{i}] changed"


def all_finite(values) -> bool:
    return all(np.isfinite(v).all() for v in numpy(values) if v.dtype.kind == "f")


def inner_state(opt):
    """The inner optimizer's variables (moments, iterations, ...) as NumPy."""
    return numpy(opt.inner_optimizer.variables)


def grad(fn, x, upstream=None):
    """d/dx of sum(fn(x) * upstream), as NumPy, on the current backend."""
    import keras
    from keras import ops

    x = np.asarray(x)
    backend = keras.backend.backend()

    def objective(t):
        out = fn(t)
        up = ops.ones_like(out) if upstream is None else ops.cast(upstream, out.dtype)
        return ops.sum(ops.cast(out * up, "float32"))

    if backend == "tensorflow":
        import tensorflow as tf

        t = tf.Variable(x)
        with tf.GradientTape() as tape:
            value = objective(t)
        return np.asarray(tape.gradient(value, t))
    if backend == "jax":
        import jax

        return np.asarray(jax.grad(objective)(ops.convert_to_tensor(x)))
    import torch

    t = torch.tensor(x, requires_grad=True)
    objective(t).backward()
    return t.grad.detach().numpy()


class WithoutBatches(keras.utils.PyDataset):
    """The batches of `(x, y)` that `PoisonedBatches(x, y, batch_size, ...)`
    gives, with the batches `drop` left out: the run a guarded run must equal."""

    def __init__(self, x, y, batch_size, drop):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size
        n = len(x) // batch_size
        self.keep = [i for i in range(n) if i not in drop]

    def __len__(self):
        return len(self.keep)

    def __getitem__(self, i):
        b = self.keep[i]
        s = slice(b * self.batch_size, (b + 1) * self.batch_size)
        return self.x[s], self.y[s]


#: The flight recorder's variables, in the order SafeOptimizer holds them.
FLIGHT_NAMES = [
    "flight_steps",
    "flight_probes",
    "flight_ring",
    "flight_history",
    "flight_alarm",
    "flight_level",
]
