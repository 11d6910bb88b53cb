"""SafeOptimizer's flight recorder: health signals of every step, on the device.

Each step of the optimizer writes one row of float32 signals into a ring
buffer of the last `RING_STEPS` steps (`flight_ring`); every `probe_every`-th
step is a *probe* step, whose row also holds the signals that cost a pass
over the weights, the optimizer state or the batch, and which is kept in a
coarse history of the last `HISTORY_PROBES` probes (`flight_history`). No
step reads anything back to the host: the rows are read at epoch ends, at
incidents and on request (`FlightRecorder.read`).

Every step (nearly free: the gradient norms are the transaction's own sums
of squares): the step's number, `iterations`, accepted or not and why, the
global and per-layer gradient norms, the learning rate, and (written by the
attached `fit` step, or `SafeOptimizer.observe`) the batch's loss.
Probe steps: per-layer weight norms and update norms (the update-to-weight
ratio is their quotient), the smallest second-moment denominator of the
optimizer state (`sqrt(v) + epsilon`), and from the batch the largest input
magnitude, the largest output magnitude and, for probability outputs, their
mean entropy and smallest probability.

In compiled steps (TensorFlow, JAX) a probe is an `ops.cond` on the step
count; in eager steps (torch, `run_eagerly`) it is decided on the host by a
Python count of the calls, so no step reads a device value to decide it.
Under `torch.compile` (`jit_compile=True` on torch) every step is a probe (a
Python count would recompile the step) and the batch's figures are not
observed (the observing Python in the attached step made dynamo compile it
four more times).
Reductions are `ops.amax`/`ops.amin`: Keras's torch `max`/`min`
break a compiled graph.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_nanguard import _kernels as kernels
from keras_nanguard._backend import current as backend

RING_STEPS = 256
HISTORY_PROBES = 512
PROBE_EVERY = 16

# The columns of a row, in order; per-layer columns follow, one block of
# `len(layers)` each: GRAD, WEIGHT and UPDATE norms.
GLOBAL_COLUMNS = (
    "step",  # the optimizer's step count, 1 for its first (never rolled back)
    "iterations",  # the inner optimizer's `iterations` after the step
    "accepted",  # 1.0 if committed, 0.0 if rejected
    "reason",  # 0 accepted, 1 gradient, 2 update, 3 spike, 4 other (halt)
    "grad_norm",  # global norm of the raw gradients
    "learning_rate",  # the rate the step used
    "probe",  # 1.0 on probe rows
    "state_min",  # probe: smallest sqrt(second moment) + epsilon (else NaN)
    # Observed after the step (`observe`), one block:
    "loss",  # the batch's loss (NaN when no one observed it)
    "input_max",  # probe: largest |input| of the batch
    "output_max",  # probe: largest |output| of the model
    "entropy",  # probe: mean entropy of probability outputs (else NaN)
    "min_prob",  # probe: smallest probability output (else NaN)
)
COLUMN = {name: i for i, name in enumerate(GLOBAL_COLUMNS)}
LAYER_BLOCKS = ("grad_norm", "weight_norm", "update_norm")
# Optimizer variables holding a second moment, by the end of their name
# (Adam, AdamW, Nadam, RMSprop: velocity; Adagrad: accumulator).
SECOND_MOMENTS = ("velocity", "accumulator")
_OBSERVED = ("loss", "input_max", "output_max", "entropy", "min_prob")


def layer_of(variable: keras.Variable) -> str:
    """The name of the layer a variable belongs to (its path's parent)."""
    path = getattr(variable, "path", None) or variable.name
    parts = path.split("/")
    return parts[-2] if len(parts) > 1 else parts[0]


class FlightRecorder:
    """The device half of the flight recorder of one SafeOptimizer.

    Args:
        probe_every: one step in this many is a probe step (see the module).
    """

    def __init__(self, probe_every: int = PROBE_EVERY) -> None:
        self.probe_every = probe_every
        self.layers: list[str] = []
        self.recurrent: list[bool] = []  # per layer: holds a recurrent kernel
        self._layer_index: dict[int, int] = {}  # id(variable) -> layer
        # The variables (None until `build`); `Any`: read only once built.
        self.steps: Any = None
        self.probes: Any = None
        self.ring: Any = None
        self.history: Any = None
        self._calls = 0  # eager steps run: the host's probe cadence
        self._last_probe = False  # eager: whether the last step probed
        self._tables: dict = {}
        # Every step a probe (True) or none (False), for measuring what
        # each kind of step costs (benchmarks/bench_flight_recorder.py).
        self.force_probe: bool | None = None

    # ------------------------------------------------------------ creation
    @property
    def columns(self) -> list[str]:
        """The name of each column of a row (per-layer ones as
        `grad_norm/<layer>`)."""
        return list(GLOBAL_COLUMNS) + [
            f"{block}/{layer}" for block in LAYER_BLOCKS for layer in self.layers
        ]

    def build(
        self, optimizer: keras.optimizers.Optimizer, var_list: Sequence[keras.Variable]
    ) -> None:
        """Makes the recorder's variables (as `optimizer`'s), with one column
        block per layer of `var_list`."""
        layers: dict[str, int] = {}
        recurrent: dict[str, bool] = {}
        for v in var_list:
            name = layer_of(v)
            last = (getattr(v, "path", None) or v.name).split("/")[-1]
            if "recurrent" in last:  # a block of its own: growth through time
                name = f"{name}/{last}"
            index = layers.setdefault(name, len(layers))
            self._layer_index[id(v)] = index
            recurrent[name] = "recurrent" in last
        self.layers = list(layers)
        self.recurrent = [recurrent[n] for n in self.layers]
        width = len(self.columns)

        def make(name: str, shape: tuple, dtype: str, initial: float) -> Any:
            return optimizer.add_variable(
                shape=shape,
                dtype=dtype,
                initializer=keras.initializers.Constant(initial),
                aggregation="none",
                name=name,
            )

        self.steps = make("flight_steps", (), "int32", 0)
        self.probes = make("flight_probes", (), "int32", 0)
        # One scratch row each: writes that are not due go there. Rows past
        # the counts hold no step (`read` leaves them out); values are
        # written as `kernels.to_finite` codes, so every variable is finite.
        self.ring = make("flight_ring", (RING_STEPS + 1, width), "float32", 0.0)
        self.history = make(
            "flight_history", (HISTORY_PROBES + 1, width), "float32", 0.0
        )

    def variables(self) -> list[keras.Variable]:
        found = (self.steps, self.probes, self.ring, self.history)
        return [v for v in found if v is not None]

    # ------------------------------------------------------------ the step
    def record(
        self,
        *,
        inner: keras.optimizers.Optimizer,
        outcome: Any,
        grads_sq: Any,
        checked: Sequence[keras.Variable],
        variables: Sequence[keras.Variable],
        old: Sequence[Any],
        learning_rate: Any,
    ) -> None:
        """Writes the row of one step (device writes only), once it has
        committed or rolled back.

        `outcome` is the step's `StepOutcome`; `grads_sq` the sums of squares
        of the checked gradients (of `checked`, in order); `variables` the
        weights as committed, `old` their values before the step (a rejected
        step's update norm is 0: nothing was applied).
        """
        if self.ring is None:
            return  # not built (an optimizer never built with variables)
        n = len(self.layers)
        grad_norms = ops.sqrt(self._per_layer(grads_sq, checked, n))
        probe, extra = self._probe(inner, variables, old, n)
        step = self.steps.value + 1
        # 0 accepted, 1 gradient, 2 update, 3 spike, 4 other (a halt).
        other: Any = (
            4.0 if outcome.spike is None else ops.where(outcome.spike, 3.0, 4.0)
        )
        reason = ops.where(
            outcome.ok,
            0.0,
            ops.where(
                ~outcome.grads_ok, 1.0, ops.where(~outcome.update_ok, 2.0, other)
            ),
        )
        nan = ops.convert_to_tensor(math.nan, "float32")
        head = [
            ops.cast(step, "float32"),
            ops.cast(ops.convert_to_tensor(inner.iterations), "float32"),
            ops.cast(outcome.ok, "float32"),
            ops.cast(reason, "float32"),
            ops.cast(outcome.norm, "float32"),
            ops.cast(learning_rate, "float32"),
            ops.cast(probe, "float32"),
            extra[0],
            *[nan] * len(_OBSERVED),  # the batch's: observed after the step
        ]
        row = ops.concatenate(
            [ops.stack(head), ops.cast(grad_norms, "float32"), extra[1:]]
        )
        self._write(row, step, probe)

    def _write(self, row: Any, step: Any, probe: Any) -> None:
        row = kernels.to_finite(row)
        at = ops.mod(step - 1, RING_STEPS)
        backend.assign_block(self.ring, at, 0, row)
        probes = self.probes.value
        slot = ops.where(probe, ops.mod(probes, HISTORY_PROBES), HISTORY_PROBES)
        backend.assign_block(self.history, slot, 0, row)
        self.probes.assign(probes + ops.cast(probe, "int32"))
        self.steps.assign(step)

    def _per_layer(self, sq: Any, variables: Sequence[keras.Variable], n: int) -> Any:
        """Sums per layer of one value per variable (float32, length n)."""
        ids = tuple(self._layer_index.get(id(v), 0) for v in variables)
        if not ids:
            return ops.zeros((n,), "float32")
        table = backend.index_table(ids, self.steps, self._tables)
        # A one-hot matmul: no scatter (torch's reads its indices back).
        onehot = ops.cast(
            ops.expand_dims(table, 1) == ops.arange(n, dtype="int32")[None, :],
            "float32",
        )
        return ops.matmul(ops.cast(sq, "float32")[None, :], onehot)[0]

    def _probe(
        self,
        inner: keras.optimizers.Optimizer,
        variables: Sequence[keras.Variable],
        old: Sequence[Any],
        n: int,
    ) -> tuple[Any, Any]:
        """Whether this step probes, and the probe's values: the state's
        smallest denominator, then per layer the weight and update norms
        (NaN when it does not probe)."""
        floats = [
            (v, o)
            for v, o in zip(variables, old, strict=True)
            if keras.backend.is_float_dtype(v.dtype) and id(v) in self._layer_index
        ]
        moments = [
            w for w in inner.variables if w.path.split("/")[-1].endswith(SECOND_MOMENTS)
        ]
        epsilon = float(getattr(inner, "epsilon", 0.0) or 0.0)
        new_values = [v.value for v, _ in floats]
        old_values = [o for _, o in floats]
        moment_values = [w.value for w in moments]

        def measure() -> Any:
            if floats:
                w_sq, _ = backend.sums_of_squares(new_values)
                d_sq, _ = backend.sums_of_squares(
                    [a - b for a, b in zip(new_values, old_values, strict=True)]
                )
                held = [v for v, _ in floats]
                w = ops.sqrt(self._per_layer(w_sq, held, n))
                u = ops.sqrt(self._per_layer(d_sq, held, n))
            else:
                w = u = ops.zeros((n,), "float32")
            if moment_values:
                smallest = ops.amin(
                    ops.stack([ops.amin(ops.cast(m, "float32")) for m in moment_values])
                )
                state = ops.sqrt(ops.maximum(smallest, 0.0)) + epsilon
            else:
                state = ops.convert_to_tensor(math.nan, "float32")
            return ops.concatenate([ops.reshape(state, (1,)), w, u])

        def skip() -> Any:
            return ops.zeros((1 + 2 * n,), "float32") + math.nan

        if self.force_probe is not None:
            due = self.force_probe
            self._last_probe = due
            return ops.convert_to_tensor(due), measure() if due else skip()
        if backend.compiling():  # every step: a count would recompile
            return ops.convert_to_tensor(True), measure()
        if backend.executing_eagerly(self.steps):
            due = self._calls % self.probe_every == 0
            self._calls += 1
            self._last_probe = due
            return ops.convert_to_tensor(due), measure() if due else skip()
        due_now = ops.mod(self.steps.value, self.probe_every) == 0
        return due_now, ops.cond(due_now, measure, skip)

    # ----------------------------------------------------- after the step
    def observe(
        self, *, loss: Any = None, inputs: Any = None, outputs: Any = None
    ) -> None:
        """Writes the batch's figures into the row of the step just recorded:
        `loss` always, the input and output figures on probe rows only."""
        if self.ring is None or backend.compiling():
            return
        nan = ops.convert_to_tensor(math.nan, "float32")
        loss_value = nan if loss is None else ops.cast(ops.mean(loss), "float32")

        def batch_figures() -> Any:
            return ops.stack(
                [loss_value, *_input_max(inputs), *_output_figures(outputs)]
            )

        def loss_only() -> Any:
            return ops.stack([loss_value, nan, nan, nan, nan])

        at = ops.mod(self.steps.value - 1, RING_STEPS)
        if self.force_probe is not None:
            probe: Any = self.force_probe
            values = batch_figures() if probe else loss_only()
            probe = ops.convert_to_tensor(probe)
        elif backend.executing_eagerly(self.steps):
            probe = self._last_probe
            values = batch_figures() if probe else loss_only()
            probe = ops.convert_to_tensor(probe)
        else:
            probe = self.ring.value[at, COLUMN["probe"]] > 0
            values = ops.cond(probe, batch_figures, loss_only)
        first = COLUMN[_OBSERVED[0]]
        values = kernels.to_finite(values)
        backend.assign_block(self.ring, at, first, values)
        slot = ops.where(
            probe, ops.mod(self.probes.value - 1, HISTORY_PROBES), HISTORY_PROBES
        )
        backend.assign_block(self.history, slot, first, values)

    # ------------------------------------------------------------ host
    def start_read(self) -> list[Any]:
        """The variables' values copied on the device, their copy to the host
        started: a read that does not wait for the device (`read` them
        later)."""
        return backend.start_host_copies([v.value for v in self.variables()])

    def read(self, values: Sequence[Any] | None = None) -> dict[str, Any]:
        """The recorder's variables on the host (one read), or `values`, what
        `start_read` returned: `steps`, `probes`, and the `ring` and
        `history` rows in step order."""
        if values is None:
            values = [v.value for v in self.variables()]
        arrays = [np.asarray(ops.convert_to_numpy(v)) for v in values]
        steps, probes = int(arrays[0]), int(arrays[1])
        ring, history = arrays[2], arrays[3]
        first = max(0, steps - RING_STEPS)
        ring_rows = ring[np.arange(first, steps) % RING_STEPS]
        first = max(0, probes - HISTORY_PROBES)
        history_rows = history[np.arange(first, probes) % HISTORY_PROBES]
        return {
            "steps": steps,
            "probes": probes,
            "ring": kernels.from_finite(ring_rows.reshape(-1, ring.shape[1])),
            "history": kernels.from_finite(history_rows.reshape(-1, history.shape[1])),
        }


def _input_max(inputs: Any) -> list[Any]:
    floats = [
        t
        for t in keras.tree.flatten(inputs)
        if t is not None and kernels.is_float(ops.convert_to_tensor(t))
    ]
    if not floats:
        return [ops.convert_to_tensor(math.nan, "float32")]
    return [
        ops.amax(ops.stack([ops.amax(ops.abs(ops.cast(t, "float32"))) for t in floats]))
    ]


def _output_figures(outputs: Any) -> list[Any]:
    """The largest |output|, and for probability outputs (non-negative, rows
    summing to 1) their mean entropy and smallest probability (NaN if not)."""
    nan = ops.convert_to_tensor(math.nan, "float32")
    flat = [t for t in keras.tree.flatten(outputs) if t is not None]
    if not flat:
        return [nan, nan, nan]
    y = ops.cast(flat[-1], "float32")
    largest = ops.amax(
        ops.stack([ops.amax(ops.abs(ops.cast(t, "float32"))) for t in flat])
    )
    if len(y.shape) < 1 or y.shape[-1] in (None, 1):
        return [largest, nan, nan]
    smallest = ops.amin(y)
    sums = ops.sum(y, axis=-1)
    is_prob = ops.logical_and(smallest >= 0.0, ops.amax(ops.abs(sums - 1.0)) < 1e-3)
    plogp = ops.where(y > 0.0, y * ops.log(ops.where(y > 0.0, y, 1.0)), 0.0)
    entropy = -ops.mean(ops.sum(plogp, axis=-1))
    return [
        largest,
        ops.where(is_prob, entropy, nan),
        ops.where(is_prob, smallest, nan),
    ]
