"""Fault injection: put NaN/inf where training breaks, on purpose.

For tests, notebooks and your own drills ("does my setup survive a NaN
batch?"). Every helper works in `model.fit` and in custom loops, on all three
backends:

- `poison(x, ...)`: a copy of an array with NaN/inf written into some samples.
- `PoisonedBatches(x, y, ...)`: a `keras.utils.PyDataset` in which chosen
  batches are poisoned, in every epoch (a dataset with corrupted records).
- `GradientFault(at_steps=...)`: an identity layer whose *backward* pass turns
  the gradients of everything before it into NaN/inf at chosen steps, while
  the forward pass (and so the loss) stays exactly as it was.
- `corrupt_gradients(grads, ...)`: the same for a custom loop's gradient list.
- `LearningRateSpike(at_steps=..., factor=...)`: a callback that multiplies
  the learning rate for chosen steps (an overflowing update);
  `learning_rate_spike(optimizer, factor)` is the context-manager form for
  custom loops.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_nanguard import _rates as rates
from keras_nanguard._validation import check_indices, check_steps, fault_value, is_int


def poison(
    x: Any,
    rows: Sequence[int] | int = 0,
    value: str | float = "nan",
    columns: Sequence[int] | int | None = 0,
) -> np.ndarray:
    """A copy of `x` with `value` written into some samples.

    Args:
        x: array-like, samples along the first axis.
        rows: which samples to poison. Defaults to the first.
        value: `"nan"`, `"inf"`, `"-inf"` or a number. Defaults to `"nan"`.
        columns: which entries of each poisoned sample (indices into the
            flattened sample); `None` poisons the whole sample. Defaults to
            the first entry only.

    Returns:
        A float NumPy array; `x` is not modified.

    Example:

    >>> import numpy as np, keras_nanguard as ng
    >>> ng.faults.poison(np.ones((3, 2)), rows=[1])
    array([[ 1.,  1.],
           [nan,  1.],
           [ 1.,  1.]])
    """
    out = np.array(x, dtype=np.result_type(np.asarray(x).dtype, np.float32))
    if out.ndim == 0:
        raise ValueError(f"`x` must have a sample axis. Received: x.shape={out.shape}")
    flat = out.reshape(out.shape[0], -1)
    rows_ = check_indices("rows", rows, flat.shape[0])
    bad = fault_value(value)
    if columns is None:
        flat[rows_] = bad
    else:
        cols = check_indices("columns", columns, flat.shape[1])
        flat[np.ix_(rows_, cols)] = bad
    return flat.reshape(out.shape)


class PoisonedBatches(keras.utils.PyDataset):
    """Batches of `(x, y)` in which chosen batches are bad, in every epoch.

    Like a dataset with a few corrupted records: batch `i` (0-based, within an
    epoch) is poisoned each time it is served. A poisoned batch has `value` in
    the first entry of its first `rows` samples, in `x`, `y` or both. (Keras
    itself reads a batch or two ahead of an epoch to learn shapes, so a
    dataset cannot count global steps reliably; for a one-off fault at a
    given step use `GradientFault` or `LearningRateSpike`.) `fit` serves a
    `PyDataset`'s batches in shuffled order unless given `shuffle=False`,
    and with `workers` not always in index order (Keras 3.15 served 1, ...,
    9, 0 with `workers=2`): pass `shuffle=False`, without workers, to know at
    which step a poisoned batch lands.

    Args:
        x: inputs, a NumPy array.
        y: targets, a NumPy array, or `None`.
        batch_size: samples per batch. Defaults to 32.
        bad_batches: 0-based batch indices to poison, or a mapping
            `{batch: value}` for a different value per batch.
        value: `"nan"`, `"inf"`, `"-inf"` or a number. Defaults to `"nan"`.
        target: `"x"`, `"y"` or `"both"`. Defaults to `"x"`.
        rows: how many samples of a poisoned batch are poisoned. Defaults to 1.
        shuffle: shuffle the samples at the end of every epoch (with `seed`).
            Defaults to `False`.
        seed: seed for the shuffling. Defaults to 0.
        **kwargs: passed to `keras.utils.PyDataset` (`workers`, ...).

    Example:

    >>> import numpy as np, keras_nanguard as ng
    >>> ds = ng.faults.PoisonedBatches(np.ones((8, 2)), np.ones((8, 1)),
    ...                                batch_size=4, bad_batches=[1])
    >>> bool(np.isnan(ds[0][0]).any()), bool(np.isnan(ds[1][0]).any())
    (False, True)
    """

    def __init__(
        self,
        x: Any,
        y: Any = None,
        *,
        batch_size: int = 32,
        bad_batches: Iterable[int] | Mapping[int, str | float] = (),
        value: str | float = "nan",
        target: str = "x",
        rows: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if target not in ("x", "y", "both"):
            raise ValueError(
                f"`target` must be 'x', 'y' or 'both'. Received: target={target!r}"
            )
        if target != "x" and y is None:
            raise ValueError(f"`target={target!r}` needs targets `y`. Received: y=None")
        if not is_int(batch_size, 1):
            raise ValueError(
                f"`batch_size` must be an int >= 1. Received: batch_size={batch_size!r}"
            )
        if not (is_int(rows, 1) and rows <= batch_size):
            raise ValueError(
                f"`rows` must be an int in [1, batch_size]. Received: rows={rows!r}"
            )
        self.x = np.asarray(x)
        self.y = None if y is None else np.asarray(y)
        if self.y is not None and len(self.y) != len(self.x):
            raise ValueError(
                "`x` and `y` must have the same number of samples. Received: "
                f"len(x)={len(self.x)}, len(y)={len(self.y)}"
            )
        self.batch_size = batch_size
        if isinstance(bad_batches, Mapping):
            indices = check_steps(list(bad_batches), "bad_batches", given=bad_batches)
            values = {int(b): fault_value(v) for b, v in bad_batches.items()}
        else:
            indices = check_steps(bad_batches, "bad_batches")
            values = dict.fromkeys(indices, fault_value(value))
        self.bad_batches = {b: values[b] for b in indices}
        if any(b >= len(self) for b in self.bad_batches):
            raise ValueError(
                f"`bad_batches` must be < the number of batches ({len(self)}). "
                f"Received: bad_batches={sorted(self.bad_batches)}"
            )
        self.target = target
        self.rows = rows
        self.shuffle = shuffle
        self._rng = np.random.default_rng(seed)
        self._order = np.arange(len(self.x))
        self._poisoned: set[int] = set()

    def __len__(self) -> int:
        return math.ceil(len(self.x) / self.batch_size)

    def __getitem__(self, index: int) -> tuple:
        sel = self._order[index * self.batch_size : (index + 1) * self.batch_size]
        x = self.x[sel]
        y = None if self.y is None else self.y[sel]
        if index in self.bad_batches:
            rows = list(range(min(self.rows, len(sel))))
            value = self.bad_batches[index]
            if self.target in ("x", "both"):
                x = poison(x, rows, value)
            if self.target in ("y", "both"):
                y = poison(y, rows, value)
            self._poisoned.add(index)
        return (x,) if y is None else (x, y)

    @property
    def poisoned(self) -> list[int]:
        """The batch indices that have been served poisoned so far."""
        return sorted(self._poisoned)

    def on_epoch_end(self) -> None:
        if self.shuffle:
            self._rng.shuffle(self._order)


@keras.saving.register_keras_serializable(package="keras_nanguard")
class GradientFault(keras.layers.Layer):
    r"""Identity layer whose backward pass yields NaN/inf at chosen steps.

    The forward pass returns its input bit for bit, so the loss is unchanged;
    at the chosen training calls the gradient flowing back through the layer
    (and so the gradients of every weight before it) becomes NaN (`"nan"`) or
    infinite (`"inf"`). It is the classic `sqrt(0)` fault: the layer adds
    :math:`\sqrt{u} - \mathrm{stop\_gradient}(\sqrt{u})` with `u = 0` at a
    faulty step. Steps are counted per training call of this layer (0-based);
    calls with `training=False` are not counted and never faulty.

    Args:
        at_steps: int or list of ints, the faulty training steps.
        value: `"nan"` or `"inf"`. Defaults to `"nan"`.

    Example:

    >>> import keras, keras_nanguard as ng
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
    ...                           ng.faults.GradientFault(at_steps=[2]),
    ...                           keras.layers.Dense(1)])
    """

    def __init__(
        self, at_steps: Iterable[int] | int, value: str = "nan", **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        if value not in ("nan", "inf"):
            raise ValueError(
                f"`value` must be 'nan' or 'inf'. Received: value={value!r}"
            )
        self.at_steps = check_steps(at_steps)
        self.value = value
        self.calls = self.add_weight(
            shape=(), dtype="int32", initializer="zeros", trainable=False, name="calls"
        )

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        if not training or not self.at_steps:
            return inputs
        # Decide before counting: on TensorFlow and torch `.value` is the
        # variable itself, which the assign below would move on.
        step = self.calls.value
        faulty = ops.any(ops.equal(step, ops.convert_to_tensor(self.at_steps, "int32")))
        self.calls.assign(step + 1)
        if self.value == "nan":
            probe = inputs * 0  # gradient 0 times an infinite sqrt' = NaN
        else:
            probe = inputs - ops.stop_gradient(inputs)  # gradient 1: inf
        u = ops.where(faulty, probe, ops.ones_like(inputs))
        root = ops.sqrt(u)
        return inputs + (root - ops.stop_gradient(root))

    def compute_output_shape(self, input_shape: Any) -> Any:
        return input_shape

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update({"at_steps": list(self.at_steps), "value": self.value})
        return config


def corrupt_gradients(
    grads: Sequence[Any], value: str | float = "nan", index: int = 0
) -> list[Any]:
    """A copy of a gradient list where `grads[index]` is filled with `value`.

    For custom loops: `opt.apply(ng.faults.corrupt_gradients(grads), vars)`.

    Example:

    >>> from keras import ops
    >>> import keras_nanguard as ng
    >>> g = ng.faults.corrupt_gradients([ops.ones((2,)), ops.ones((1,))], "inf", 1)
    >>> ops.convert_to_numpy(g[1]).tolist()
    [inf]
    """
    bad = fault_value(value)
    grads = list(grads)
    if not -len(grads) <= index < len(grads):
        raise ValueError(
            f"`index` must point into the {len(grads)} gradients. Received: index={index}"
        )
    g = grads[index]
    grads[index] = ops.full(ops.shape(g), bad, dtype=g.dtype)
    return grads


def _settable_lr(optimizer: Any) -> Any:
    if rates.is_multi(optimizer):
        subs = list(rates.rate_owners(optimizer))
        raise ValueError(
            "A learning-rate spike changes one learning rate, and a "
            f"MultiOptimizer has one per sub-optimizer ({', '.join(subs)}). "
            "Spike a sub-optimizer's: `learning_rate_spike(sub, factor)` with "
            "`sub` one of `MultiOptimizer.optimizers`. Received: "
            f"optimizer={optimizer!r}"
        )
    lr = optimizer.learning_rate
    if not isinstance(lr, keras.Variable):
        raise ValueError(
            "A learning-rate spike needs an optimizer with a float learning rate, "
            f"not a schedule or a callable. Received: learning_rate={lr!r}"
        )
    return lr


@contextlib.contextmanager
def learning_rate_spike(optimizer: Any, factor: float) -> Iterator[None]:
    """Multiply `optimizer`'s learning rate by `factor` inside the block.

    The original value is restored exactly on exit, also on error.

    Example:

    >>> import keras, keras_nanguard as ng
    >>> opt = keras.optimizers.SGD(0.01)
    >>> with ng.faults.learning_rate_spike(opt, 1e6):
    ...     print(round(float(opt.learning_rate)))
    10000
    >>> round(float(opt.learning_rate), 6)
    0.01
    """
    lr = _settable_lr(optimizer)
    original = ops.convert_to_numpy(lr).copy()
    lr.assign(original * factor)
    try:
        yield
    finally:
        lr.assign(original)


class LearningRateSpike(keras.callbacks.Callback):
    """Multiplies the learning rate by `factor` for chosen training steps.

    Steps are global 0-based batch indices across epochs of one `fit`. With
    `steps_per_execution > 1` the callback sees one batch per execution, so
    the spike covers a whole execution.

    Another callback may change the rate during a spike (NaNGuard's
    rollback multiplies it by its `lr_factor`): the callback then carries the
    relative change over to the rate it puts back, `old * current / spiked`,
    so a cut made during the spike is kept. With an infinite `factor` the
    change cannot be measured (`inf * 0.5` is `inf`): the rate goes back to
    `old`.

    Args:
        at_steps: int or list of ints.
        factor: the multiplier, e.g. `1e6`.

    Example:

    >>> import keras_nanguard as ng
    >>> spike = ng.faults.LearningRateSpike(at_steps=[10, 11], factor=1e6)
    """

    def __init__(self, at_steps: Iterable[int] | int, factor: float) -> None:
        super().__init__()
        self.at_steps = check_steps(at_steps)
        # inf is allowed: a spike to an infinite learning rate is a fault too.
        if isinstance(factor, bool) or not (
            isinstance(factor, int | float) and factor > 0
        ):
            raise ValueError(
                f"`factor` must be a number > 0. Received: factor={factor!r}"
            )
        self.factor = float(factor)
        self._step = 0
        self._original: np.ndarray | None = None
        self._spiked: np.ndarray | None = None  # the rate this callback set

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._step = 0
        self._original = self._spiked = None
        _settable_lr(self.model.optimizer)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        lr = self.model.optimizer.learning_rate
        if self._step in self.at_steps:
            if self._original is None:
                self._original = ops.convert_to_numpy(lr).copy()
            else:
                self._carry_over(lr)
            dtype = self._original.dtype
            self._spiked = np.asarray(self._original * self.factor, dtype=dtype)
            lr.assign(self._spiked)
        elif self._original is not None:
            self._end(lr)
        self._step += 1

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._original is not None:
            self._end(self.model.optimizer.learning_rate)

    def _carry_over(self, lr: Any) -> None:
        """Applies a change another callback made to the spiked rate, in
        proportion, to the rate to put back."""
        current = ops.convert_to_numpy(lr)
        if self._spiked is None or self._original is None:
            return  # no spike is on
        if current.tobytes() == self._spiked.tobytes():
            return  # unchanged: the rate goes back exactly
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            carried = self._original * (current / self._spiked)
        if np.isfinite(carried):  # not with an infinite spike
            self._original = np.asarray(carried, dtype=self._original.dtype)

    def _end(self, lr: Any) -> None:
        self._carry_over(lr)
        lr.assign(self._original)
        self._original = self._spiked = None
