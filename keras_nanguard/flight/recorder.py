"""SafeOptimizer's flight recorder: health signals of every step, on the device.

Each step of the optimizer writes one row of float32 signals into a ring
buffer of the last `RING_STEPS` steps (`flight_ring`); every `probe_every`-th
step is a *probe* step, whose row also holds the signals that cost a pass
over the weights, the optimizer state or the batch, and which is kept in a
coarse history of the last `HISTORY_PROBES` probes (`flight_history`). No
step reads anything back to the host: the rows are read at epoch ends, at
incidents, on request (`FlightRecorder.read`) and when the recorder's alarm
rings (decided on the device every step, see `ALARM_GROWTH`; the host polls
a copy of it two calls later, `FlightRecorder.newest_alarm`, with no host
call inside the step).

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

import enum
import math
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_nanguard import _kernels as kernels
from keras_nanguard import _rates as rates
from keras_nanguard._backend import current as backend


class Reason(enum.IntEnum):
    """Why a step was rejected: the one vocabulary of the counters
    (`last_rejection`), the flight recorder's `reason` column and the run
    diagnosis (docs/guide/bad_steps.md lists them)."""

    NONE = 0  # accepted (the counters: no step rejected yet)
    GRADIENT = 1  # a gradient was not finite
    UPDATE = 2  # the update made a weight or optimizer variable non-finite
    SPIKE = 3  # the gradient norm was a spike (`spike_factor`)
    LOSS_SCALE_OVERFLOW = 4  # a loss scaler skipped it, the loss finite
    LOSS = 5  # a loss scaler skipped it, the loss not finite
    HALTED = 6  # refused: the optimizer halted (`max_consecutive_skips`)

    @property
    def words(self) -> str:
        """The reason in a few words, as the run diagnosis says it."""
        return _REASON_WORDS[self]


_REASON_WORDS = {
    Reason.NONE: "no rejection",
    Reason.GRADIENT: "a non-finite gradient",
    Reason.UPDATE: "a non-finite update",
    Reason.SPIKE: "a gradient-norm spike",
    Reason.LOSS_SCALE_OVERFLOW: "a loss-scale overflow",
    Reason.LOSS: "a non-finite loss",
    Reason.HALTED: "a halt",
}

RING_STEPS = 256
HISTORY_PROBES = 512
PROBE_EVERY = 16

# The device's alarm, decided every step: the host reads the record when it
# rings (`FlightRecorder.newest_alarm`), and the run diagnosis decides. It
# rings on a gradient norm ALARM_GROWTH times its running level (an average
# of its logarithm over the accepted steps, ALARM_AVERAGING per step, after
# ALARM_FROM steps), and on probes whose figures cross the diagnosis's
# thresholds: an update-to-weight ratio above RATIO_ONSET, a second-moment
# denominator below STATE_WARN, a probability below PROB_WARN. In compiled
# steps, the step after a jump is a probe; in eager ones, the step after the
# host hears of an alarm.
ALARM_GROWTH = 10.0
ALARM_AVERAGING = 0.1
ALARM_FROM = 8
RATIO_ONSET = 0.05
STATE_WARN = 1e-12
PROB_WARN = 1e-14

# The columns of a row, in order; per-layer columns follow, one block of
# `len(layers)` each: GRAD, WEIGHT and UPDATE norms.
GLOBAL_COLUMNS = (
    "step",  # the optimizer's step count, 1 for its first (never rolled back)
    "iterations",  # the inner optimizer's `iterations` after the step
    "accepted",  # 1.0 if committed, 0.0 if rejected
    "reason",  # a `Reason` (NONE: accepted)
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
    """The layer a variable belongs to, by its full path (the variable's
    path less its own name)."""
    path = getattr(variable, "path", None) or variable.name
    parts = path.split("/")
    return "/".join(parts[:-1]) if len(parts) > 1 else parts[0]


def block_names(paths: Sequence[str]) -> dict[str, str]:
    """Each layer path's block name: the shortest end of it that no other
    layer's path shares (`lstm/lstm_cell` and `lstm_1/lstm_cell`, never two
    `lstm_cell`; `dense` alone when unique). Stable when a model is saved
    and loaded, whose variables' paths then lack the model's name."""
    distinct = list(dict.fromkeys(paths))
    names = {}
    for path in distinct:
        parts = path.split("/")
        for k in range(1, len(parts) + 1):
            end = "/".join(parts[-k:])
            if sum(q == end or q.endswith("/" + end) for q in distinct) == 1:
                names[path] = end
                break
        else:
            names[path] = path
    return names


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
        self.alarm: Any = None  # the step of the newest alarm (0: none)
        self.level: Any = None  # the gradient norm's running log-level
        self._calls = 0  # eager steps run: the host's probe cadence
        # The host's side of the alarm: the newest alarm step read from
        # copies of `alarm`, each read `lag` calls after it was started.
        self.heard = 0
        self._alarm_copies: list[Any] = []
        self._probed = 0  # eager: the newest alarm a probe followed
        self._eager_probes: list[int] = []  # eager: the last probes' steps
        self._last_probe = False  # eager: whether the last step probed
        self._tables: dict = {}

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
        short = block_names([layer_of(v) for v in var_list])
        for v in var_list:
            name = short[layer_of(v)]
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
            return kernels.state_variable(optimizer, name, shape, dtype, initial)

        self.steps = make("flight_steps", (), "int32", 0)
        self.probes = make("flight_probes", (), "int32", 0)
        # One scratch row each: writes that are not due go there. Rows past
        # the counts hold no step (`read` leaves them out); values are
        # written as `kernels.to_finite` codes, so every variable is finite.
        self.ring = make("flight_ring", (RING_STEPS + 1, width), "float32", 0.0)
        self.history = make(
            "flight_history", (HISTORY_PROBES + 1, width), "float32", 0.0
        )
        self.alarm = make("flight_alarm", (), "int32", 0)
        self.level = make("flight_level", (), "float32", 0.0)

    def variables(self) -> list[keras.Variable]:
        found = (
            self.steps,
            self.probes,
            self.ring,
            self.history,
            self.alarm,
            self.level,
        )
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
        reason = outcome.reason()
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
        self._ring_alarm(step, outcome, probe, extra, n)

    def _ring_alarm(
        self, step: Any, outcome: Any, probe: Any, extra: Any, n: int
    ) -> None:
        """Decides this step's alarm on the device (see `ALARM_GROWTH`) and
        moves the gradient norm's running level."""
        g = ops.cast(outcome.norm, "float32")
        log_g = ops.log(ops.maximum(kernels.to_finite(g), 1e-30))
        level = self.level.value
        jump = ops.logical_and(
            ops.logical_and(outcome.ok, step > ALARM_FROM),
            log_g > level + math.log(ALARM_GROWTH),
        )
        first = step == 1
        moved = level + ALARM_AVERAGING * (log_g - level)
        self.level.assign(
            ops.where(
                first,
                ops.where(outcome.ok, log_g, 0.0),
                ops.where(outcome.ok, moved, level),
            )
        )
        weights, updates = extra[1 : 1 + n], extra[1 + n :]
        ratio = (
            ops.amax(
                ops.where(
                    weights > 0, updates / ops.where(weights > 0, weights, 1.0), 0.0
                )
            )
            if n
            else ops.convert_to_tensor(0.0)
        )
        drift = ops.logical_or(ratio > RATIO_ONSET, extra[0] < STATE_WARN)
        self._raise(ops.logical_or(jump, ops.logical_and(probe, drift)), step)

    def _raise(self, ringing: Any, step: Any) -> None:
        """Sets the alarm to `step` where `ringing`. The host is not called
        from the step (a host callback under a `cond` made a compiled JAX
        step of a small model 3x slower even when it did not fire): it polls
        (`newest_alarm`)."""
        self.alarm.assign(ops.where(ringing, ops.cast(step, "int32"), self.alarm.value))

    def newest_alarm(self, lag: int, model: Any = None) -> int:
        """The step of the newest alarm the host knows without waiting for
        the device (0: none): read from a copy of the alarm started `lag`
        calls before (each call starts one). In JAX's `fit` the value is
        the one the trainer holds for `model` between two steps
        (`backend.live_value`)."""
        if self.alarm is None:
            return self.heard
        value = backend.live_value(self.alarm, model)
        if value is None:
            return self.heard
        self._alarm_copies.append(backend.start_host_copies([value])[0])
        if len(self._alarm_copies) > lag:
            copy = self._alarm_copies.pop(0)
            self.heard = max(self.heard, int(np.asarray(ops.convert_to_numpy(copy))))
        return self.heard

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
        if not ids or not n:
            return ops.zeros((n,), "float32")
        # A matmul with a one-hot constant (variables x layers): no scatter
        # (torch's reads its indices back), and one op where steps are
        # traced, not twenty.
        table = backend.constant_table(
            ("one_hot", ids, n),
            lambda: np.eye(n, dtype="float32")[list(ids)],
            self.steps,
            self._tables,
        )
        return ops.matmul(ops.cast(sq, "float32")[None, :], table)[0]

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
        # Each optimizer's second moments with its own epsilon (a
        # MultiOptimizer's sub-optimizers each have theirs).
        groups = []
        for owner in rates.rate_owners(inner).values():
            values = [
                w.value
                for w in owner.variables
                if w.path.split("/")[-1].endswith(SECOND_MOMENTS)
            ]
            if values:
                groups.append((values, float(getattr(owner, "epsilon", 0.0) or 0.0)))
        new_values = [v.value for v, _ in floats]
        old_values = [o for _, o in floats]

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
            state = ops.convert_to_tensor(math.nan, "float32")
            for k, (values, epsilon) in enumerate(groups):
                smallest = ops.amin(
                    ops.stack([ops.amin(ops.cast(m, "float32")) for m in values])
                )
                found = ops.sqrt(ops.maximum(smallest, 0.0)) + epsilon
                state = found if k == 0 else ops.minimum(state, found)
            return ops.concatenate([ops.reshape(state, (1,)), w, u])

        def skip() -> Any:
            return ops.zeros((1 + 2 * n,), "float32") + math.nan

        due = self._probe_due()
        if isinstance(due, bool):  # known on the host: one branch traced
            return ops.convert_to_tensor(due), measure() if due else skip()
        return due, ops.cond(due, measure, skip)

    def _probe_due(self) -> Any:
        """Whether this step probes: a bool where the host knows (while
        compiling, and in eager steps), else a tensor decided on the device."""
        if backend.compiling():  # every step: a count would recompile
            return True
        if backend.executing_eagerly(self.steps):
            # By the cadence, or once after an alarm the host heard of that
            # a step without a probe raised (a jump), as compiled steps do.
            jump = self.heard > self._probed and self.heard not in self._eager_probes
            due = self._calls % self.probe_every == 0 or jump
            self._probed = max(self._probed, self.heard)
            self._calls += 1
            if due:  # the step numbers of the last probes (steps count from 1)
                self._eager_probes = [*self._eager_probes, self._calls][-8:]
            self._last_probe = bool(due)
            return self._last_probe
        # Due by the cadence, or right after an alarm the last step raised
        # without probing (a jump of its gradient norm).
        steps = self.steps.value
        last = ops.mod(steps - 1 + RING_STEPS, RING_STEPS)
        probed = _probe_cell(self.ring, last) > 0
        return ops.logical_or(
            ops.mod(steps, self.probe_every) == 0,
            ops.logical_and(
                ops.logical_and(steps > 0, self.alarm.value == steps),
                ops.logical_not(probed),
            ),
        )

    def _row_probed(self, at: Any) -> Any:
        """Whether the step recorded in row `at` probed: a bool in eager
        steps (the last `_probe_due`), else read from the row."""
        if backend.executing_eagerly(self.steps):
            return self._last_probe
        return _probe_cell(self.ring, at) > 0

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
        probe = self._row_probed(at)
        if isinstance(probe, bool):  # known on the host: one branch traced
            values = batch_figures() if probe else loss_only()
            probe = ops.convert_to_tensor(probe)
        else:
            values = ops.cond(probe, batch_figures, loss_only)
        low = values[_OBSERVED.index("min_prob")] < PROB_WARN
        self._raise(ops.logical_and(probe, low), self.steps.value)
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


def _probe_cell(ring: keras.Variable, row: Any) -> Any:
    """The probe column of `ring` at a row known on the device only: a
    gather, not `ring[row, col]` (on TensorFlow a strided slice, whose begin
    XLA needs as a constant: it made the step counter a compile-time
    constant, and a `jit_compile=True` step recompiled at every call)."""
    return ops.take(ring.value[:, COLUMN["probe"]], row)


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
    summing to 1) their mean entropy and smallest probability (NaN if none
    is): over every output of a model with several (an actor-critic's
    policy and value), the first probability output's entropy."""
    nan = ops.convert_to_tensor(math.nan, "float32")
    flat = [t for t in keras.tree.flatten(outputs) if t is not None]
    if not flat:
        return [nan, nan, nan]
    largest = ops.amax(
        ops.stack([ops.amax(ops.abs(ops.cast(t, "float32"))) for t in flat])
    )
    entropy, smallest = nan, nan
    for t in reversed(flat):  # the first output's figures are chosen last
        y = ops.cast(t, "float32")
        if len(y.shape) < 1 or y.shape[-1] in (None, 1):
            continue
        low = ops.amin(y)
        sums = ops.sum(y, axis=-1)
        is_prob = ops.logical_and(low >= 0.0, ops.amax(ops.abs(sums - 1.0)) < 1e-3)
        plogp = ops.where(y > 0.0, y * ops.log(ops.where(y > 0.0, y, 1.0)), 0.0)
        h = -ops.mean(ops.sum(plogp, axis=-1))
        entropy = ops.where(is_prob, h, entropy)
        # The smallest over every probability output.
        smallest = ops.where(
            is_prob,
            ops.where(ops.isnan(smallest), low, ops.minimum(low, smallest)),
            smallest,
        )
    return [largest, entropy, smallest]
