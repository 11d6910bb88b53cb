"""SafeOptimizer's counters: named device variables, their updates, and the
reports made of them on the host.

`Counters` is a dataclass with one field per variable. Its fields are, in
order, the layout of the saved optimizer's variables (`.keras` files): new
counters go last, after `recent_rejections` (files of earlier versions have
fewer and still load: see `file_layouts`), and the spike window follows the
counters when there is one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import field
from typing import Any, NamedTuple

import keras
from keras import ops

from keras_nanguard import _kernels as kernels
from keras_nanguard._arguments import Arguments
from keras_nanguard._host_device import host_view
from keras_nanguard.errors import NonFiniteError
from keras_nanguard.flight.recorder import Reason
from keras_nanguard.safe_optimizer import spike_window as spikes
from keras_nanguard.safe_optimizer import step_ops

# `recent_rejections` holds the outcomes of the last `RECENT_STEPS` steps.
RECENT_STEPS = 30
# A run whose last `FROZEN_STEPS` steps were all rejected has stopped
# training while looking as if it ran: said at the end of `fit`.
FROZEN_STEPS = RECENT_STEPS
# `quarantine_log` names the last `QUARANTINE_LOG_ROWS` quarantined rows.
QUARANTINE_LOG_ROWS = 512


def _counter(
    dtype: str, initial: float, doc: str, *, history: bool, shape: tuple = ()
) -> dict:
    """A counter field's metadata: a scalar variable of `dtype` starting at
    `initial`, holding what `doc` says.
    A `history` counter is a report of what happened: NaNGuard's snapshots
    neither check it nor restore it; the others (control state the step reads, and
    `accepted_grad_norm`, always finite) are restored with the model."""
    return {
        "dtype": dtype,
        "initial": initial,
        "doc": doc,
        "history": history,
        "shape": shape,
    }


def _window(doc: str) -> dict:
    """A spike window field's metadata (the field is `None` without
    `spike_factor`)."""
    return {"doc": doc, "history": False}


class StepOutcome(NamedTuple):
    """What one step of the optimizer decided, as device tensors: what the
    counters record of it. A NamedTuple: torch compiles it without a break."""

    ok: Any  # the step is accepted (bool scalar)
    grads_ok: Any  # every checked gradient is finite
    update_ok: Any  # every new weight and optimizer variable is finite
    norm: Any  # the global norm of the raw gradients
    bad_index: Any  # the reported index of the first non-finite value
    clipped: Any = None  # the gradients were clipped; `None` without clipping
    spike: Any = None  # the norm is a spike; `None` without spike_factor
    spike_figures: Any = None  # the spike's threshold and percentile

    def reason(self) -> Any:
        """Why the step was rejected, a `Reason` code as an integer scalar
        (`NONE`: accepted; `HALTED`: refused for nothing else than the
        optimizer's halt). The one decision of it: the counters record it
        and so does the flight recorder."""
        other: Any = Reason.HALTED.value
        if self.spike is not None:
            other = ops.where(self.spike, Reason.SPIKE.value, other)
        return ops.where(
            self.ok,
            Reason.NONE.value,
            ops.where(
                ~self.grads_ok,
                Reason.GRADIENT.value,
                ops.where(~self.update_ok, Reason.UPDATE.value, other),
            ),
        )


@dataclasses.dataclass(eq=False)
class Counters:
    """SafeOptimizer's counters, and the spike window's variables: each a
    `keras.Variable` of the optimizer (`aggregation="none"`), on the device.

    Made by `create`, in the order of the fields; updated by the step
    (`record_step`) and by a loss scaler's skip (`record_scaler_skip`); read
    on the host, where a person looks (`read`, `describe_last_rejection`,
    `check_halted`).
    """

    skipped_steps: keras.Variable = field(
        metadata=_counter("int32", 0, "Rejected steps in total.", history=True)
    )
    consecutive_skips: keras.Variable = field(
        metadata=_counter(
            "int32", 0, "Rejected steps since the last accepted one.", history=False
        )
    )
    nonfinite_gradient_steps: keras.Variable = field(
        metadata=_counter(
            "int32", 0, "Steps rejected for a non-finite gradient.", history=True
        )
    )
    nonfinite_update_steps: keras.Variable = field(
        metadata=_counter(
            "int32",
            0,
            "Steps rejected because the update made a weight or optimizer "
            "variable non-finite (the gradients finite).",
            history=True,
        )
    )
    clipped_steps: keras.Variable = field(
        metadata=_counter(
            "int32",
            0,
            "Accepted steps whose gradients were clipped: to `clipnorm`, or "
            'with `clip="adaptive"` by its global or a layer\'s threshold '
            "(0 with gradient accumulation, where the inner optimizer clips).",
            history=True,
        )
    )
    last_grad_norm: keras.Variable = field(
        metadata=_counter(
            "float32",
            0.0,
            "Global norm of the last step's raw gradients (read it with "
            "`counters()` or as `opt.last_grad_norm`: the variable holds a "
            "non-finite norm as a finite code, `_kernels.to_finite`).",
            history=True,
        )
    )
    rejected_grad_norm: keras.Variable = field(
        metadata=_counter(
            "float32",
            0.0,
            "Global norm of the last rejected step's raw gradients (NaN after "
            "a loss scaler's skip; coded as `last_grad_norm`).",
            history=True,
        )
    )
    last_rejection: keras.Variable = field(
        metadata=_counter(
            "int32",
            Reason.NONE.value,
            "Why the last rejected step was rejected: a `Reason` code.",
            history=True,
        )
    )
    last_nonfinite_index: keras.Variable = field(
        metadata=_counter(
            "int32",
            -1,
            "Which variable the last rejection was about: an index into the "
            "model's trainable variables, then the inner optimizer's (-1: "
            "none).",
            history=True,
        )
    )
    lr_scale: keras.Variable = field(
        metadata=_counter(
            "float32",
            1.0,
            "The learning-rate back-off factor now (with `lr_backoff`).",
            history=False,
        )
    )
    consecutive_accepts: keras.Variable = field(
        metadata=_counter(
            "int32",
            0,
            "Accepted steps since the last rejected one, back to 0 when the "
            "learning rate recovers a factor (with `lr_backoff`).",
            history=False,
        )
    )
    accepted_grad_norm: keras.Variable = field(
        metadata=_counter(
            "float32",
            0.0,
            "Global norm of the last accepted step's raw gradients.",
            history=False,
        )
    )
    spike_steps: keras.Variable = field(
        metadata=_counter(
            "int32",
            0,
            "Steps rejected as gradient spikes (with `spike_factor`).",
            history=True,
        )
    )
    loss_scale_steps: keras.Variable = field(
        metadata=_counter(
            "int32",
            0,
            "Steps a `LossScaleOptimizer` around the optimizer skipped for an "
            "overflow of the scaled gradients (also in `skipped_steps`).",
            history=True,
        )
    )
    recent_rejections: keras.Variable = field(
        metadata=_counter(
            "int32",
            0,
            f"The last {RECENT_STEPS} steps as a bit mask, bit 0 the latest, 1 "
            "where rejected.",
            history=True,
        )
    )
    quarantine_steps: keras.Variable = field(
        metadata=_counter(
            "int32",
            0,
            "Steps run with per-sample quarantine (`attach(model, "
            "quarantine=True)`), a step's number in `quarantine_log`.",
            history=True,
        )
    )
    quarantined_samples: keras.Variable = field(
        metadata=_counter(
            "int32",
            0,
            "Rows left out of their step by the quarantine, in total.",
            history=True,
        )
    )
    quarantine_limit_steps: keras.Variable = field(
        metadata=_counter(
            "int32",
            0,
            "Quarantined steps with more than `max_quarantine_fraction` of "
            "the batch bad: left whole (and rejected as bad steps).",
            history=True,
        )
    )
    quarantine_log: keras.Variable = field(
        metadata=_counter(
            "int32",
            -1,
            f"The last {QUARANTINE_LOG_ROWS} quarantined rows, a ring buffer "
            "(row `i` of the total at `i % QUARANTINE_LOG_ROWS`): the step's "
            "number in `quarantine_steps`, and the row in the batch times 16 "
            "plus its code (`quarantine.INPUT | TARGET | WEIGHT | LOSS` "
            "bits); one more entry is scratch. Small: it is written at every "
            "quarantined step.",
            history=True,
            shape=(QUARANTINE_LOG_ROWS + 1, 2),
        )
    )
    spike_norms: keras.Variable | None = field(
        default=None,
        metadata=_window("The spike window's ring buffer of gradient norms."),
    )
    spike_count: keras.Variable | None = field(
        default=None, metadata=_window("Steps written into the spike window.")
    )
    last_spike: keras.Variable | None = field(
        default=None,
        metadata=_window("The last spike's threshold and 90th percentile."),
    )
    settings: Arguments = field(kw_only=True, metadata={"setting": True})
    """What the updates and reports need of the optimizer's arguments."""

    # --------------------------------------------------------------- creation
    @classmethod
    def create(
        cls, optimizer: keras.optimizers.Optimizer, settings: Arguments
    ) -> Counters:
        """The counters as new variables of `optimizer`, in field order, then
        the spike window when `settings` has a `spike_factor`."""
        made = {
            f.name: kernels.state_variable(
                optimizer,
                f.name,
                f.metadata["shape"],
                f.metadata["dtype"],
                f.metadata["initial"],
            )
            for f in COUNTER_FIELDS
        }
        if settings.spike_factor is not None:
            norms, count, last = spikes.make_window(optimizer, settings.spike_window)
            made.update(spike_norms=norms, spike_count=count, last_spike=last)
        return cls(**made, settings=settings)

    def variables(self) -> list[keras.Variable]:
        """The counters, then the spike window's variables if any: the first
        of `optimizer.variables`, in this order."""
        found = (getattr(self, f.name) for f in VARIABLE_FIELDS)
        return [v for v in found if v is not None]

    def history_variables(self) -> list[keras.Variable]:
        """The counters that record what happened (NaNGuard keeps them through
        a rollback; they are not state to check or restore)."""
        return [getattr(self, f.name) for f in COUNTER_FIELDS if f.metadata["history"]]

    # ---------------------------------------------------------------- updates
    def record_step(self, step: StepOutcome) -> None:
        """Counts a step of the optimizer (device writes only)."""
        ok, norm = step.ok, ops.cast(step.norm, "float32")
        # A halted step keeps the cause of the rejections that halted it.
        reason = step.reason()
        reason = ops.where(reason == Reason.HALTED.value, Reason.NONE.value, reason)
        self._count_outcome(ok, reason, step.clipped)
        self.last_grad_norm.assign(kernels.to_finite(norm))
        self.accepted_grad_norm.assign(
            ops.where(ok, norm, self.accepted_grad_norm.value)
        )
        self.rejected_grad_norm.assign(
            ops.where(ok, self.rejected_grad_norm.value, kernels.to_finite(norm))
        )
        if step.spike is not None:
            spike = reason == Reason.SPIKE.value
            self.spike_steps.assign(self.spike_steps.value + _i32(spike))
            norms, count, last = self.window()
            spikes.record(ok, spike, norm, step.spike_figures, norms, count, last)
        failed = reason > 0
        self.last_rejection.assign(ops.where(failed, reason, self.last_rejection.value))
        self.last_nonfinite_index.assign(
            ops.where(failed, step.bad_index, self.last_nonfinite_index.value)
        )
        if self.settings.lr_backoff is not None:
            self._back_off(ok, self.settings.lr_backoff)

    def _count_outcome(self, ok: Any, reason: Any, clipped: Any) -> None:
        self.skipped_steps.assign(self.skipped_steps.value + _i32(~ok))
        self.recent_rejections.assign(
            step_ops.shift_in(self.recent_rejections.value, _i32(~ok), RECENT_STEPS)
        )
        self.consecutive_skips.assign(
            ops.where(ok, 0, self.consecutive_skips.value + 1)
        )
        self.nonfinite_gradient_steps.assign(
            self.nonfinite_gradient_steps.value + _i32(reason == Reason.GRADIENT.value)
        )
        self.nonfinite_update_steps.assign(
            self.nonfinite_update_steps.value + _i32(reason == Reason.UPDATE.value)
        )
        if clipped is not None:
            self.clipped_steps.assign(
                self.clipped_steps.value + _i32(ops.logical_and(ok, clipped))
            )

    def _back_off(self, ok: Any, backoff: float) -> None:
        """The learning-rate scale after a step: lower after a rejection,
        back up a factor after `lr_recovery_steps` accepted ones in a row."""
        accepts = ops.where(ok, self.consecutive_accepts.value + 1, 0)
        recover = accepts >= self.settings.lr_recovery_steps
        lr_scale = self.lr_scale.value
        lr_scale = ops.where(
            ok,
            ops.where(recover, lr_scale / backoff, lr_scale),
            lr_scale * backoff,
        )
        self.lr_scale.assign(ops.clip(lr_scale, self.settings.min_lr_scale, 1.0))
        self.consecutive_accepts.assign(ops.where(recover, 0, accepts))

    def record_scaler_skip(self, skipped: Any, bad_data: Any) -> None:
        """Counts a step that a loss scaler around the optimizer skipped (the
        optimizer's step did not run): as a rejected step; as a non-finite
        gradient when the loss was not finite too (`bad_data`), else as an
        overflow of the loss-scaled gradients, which is the loss scaler's
        routine and neither a streak nor a reason to back off."""
        overflow = ops.logical_and(skipped, ops.logical_not(bad_data))
        self.skipped_steps.assign(self.skipped_steps.value + _i32(skipped))
        self.loss_scale_steps.assign(self.loss_scale_steps.value + _i32(overflow))
        self.nonfinite_gradient_steps.assign(
            self.nonfinite_gradient_steps.value + _i32(bad_data)
        )
        self.consecutive_skips.assign(self.consecutive_skips.value + _i32(bad_data))
        # The optimizer's own step did not run to shift its outcome in: a
        # bad batch is a rejected step there, an overflow is not.
        self.recent_rejections.assign(
            ops.where(
                skipped,
                step_ops.shift_in(
                    self.recent_rejections.value, _i32(bad_data), RECENT_STEPS
                ),
                self.recent_rejections.value,
            )
        )
        self._record_scaler_reason(skipped, bad_data, overflow)
        if self.settings.lr_backoff is not None:
            lr_scale = ops.where(
                bad_data,
                self.lr_scale.value * self.settings.lr_backoff,
                self.lr_scale.value,
            )
            self.lr_scale.assign(ops.clip(lr_scale, self.settings.min_lr_scale, 1.0))
            self.consecutive_accepts.assign(
                ops.where(bad_data, 0, self.consecutive_accepts.value)
            )

    def _record_scaler_reason(self, skipped: Any, bad_data: Any, overflow: Any) -> None:
        reason = ops.where(
            bad_data,
            Reason.LOSS.value,
            ops.where(overflow, Reason.LOSS_SCALE_OVERFLOW.value, Reason.NONE.value),
        )
        self.last_rejection.assign(
            ops.where(skipped, reason, self.last_rejection.value)
        )
        self.last_nonfinite_index.assign(
            ops.where(skipped, -1, self.last_nonfinite_index.value)
        )
        self.rejected_grad_norm.assign(  # the scaled gradients' norm: not finite
            ops.where(skipped, kernels.NAN_CODE, self.rejected_grad_norm.value)
        )

    def record_quarantine(self, codes: Any, over: Any) -> None:
        """Counts a step of the quarantine (device writes only): `codes`, an
        int32 code per row of the batch (0: healthy), `over` whether the bad
        rows were too many to quarantine (none was then): a bool, or one per
        row (the replicas of a `tf.distribute` step decide each on its own
        rows)."""
        step = self.quarantine_steps.value + 1
        self.quarantine_steps.assign(step)
        self.quarantine_limit_steps.assign(
            self.quarantine_limit_steps.value + _i32(ops.any(over))
        )
        flags = ops.logical_and(codes > 0, ops.logical_not(over))
        counts = ops.cumsum(_i32(flags))
        total = self.quarantined_samples.value
        size = QUARANTINE_LOG_ROWS
        # Each quarantined row at its place in the ring, the others into the
        # scratch row; steps of more than `size` bad rows keep some of them.
        at = ops.where(flags, ops.mod(total + counts - 1, size), size)
        rows = ops.arange(0, ops.shape(codes)[0], dtype="int32")
        entries = ops.stack([ops.ones_like(rows) * step, rows * 16 + codes], axis=1)
        self.quarantine_log.assign(
            ops.scatter_update(
                self.quarantine_log.value, ops.expand_dims(at, 1), entries
            )
        )
        self.quarantined_samples.assign(total + ops.sum(_i32(flags)))

    def quarantined_rows(
        self, since: int, until: int, values: Sequence[Any] | None = None
    ) -> list[tuple[int, int, int]]:
        """The quarantined rows `since` <= i < `until` of the total (a host
        read), as `(step, row, code)`: those still in the log."""
        log = ops.convert_to_numpy(self._named(values)["quarantine_log"])
        first = max(since, until - QUARANTINE_LOG_ROWS)
        out = []
        for i in range(first, until):
            step, packed = (int(v) for v in log[i % QUARANTINE_LOG_ROWS])
            out.append((step, packed // 16, packed % 16))
        return out

    def window(self) -> tuple[keras.Variable, keras.Variable, keras.Variable]:
        """The spike window: norms, count, last spike (with `spike_factor`)."""
        norms, count, last = self.spike_norms, self.spike_count, self.last_spike
        if norms is None or count is None or last is None:
            raise ValueError("The spike window exists only with `spike_factor`.")
        return norms, count, last

    # ------------------------------------------------------- reading (host)
    def read(self, values: Sequence[Any] | None = None) -> dict[str, float | int]:
        """The counters as Python numbers (a host read).

        Args:
            values: the values of `variables()`, in that order (a JAX
                stateless loop's); by default the variables themselves.
        """
        named = self._named(values)
        out: dict[str, float | int] = {}
        for f in SCALAR_FIELDS:
            # Not `convert_to_numpy`: NumPy warns reading a TensorFlow variable.
            value = host_view(named[f.name])
            out[f.name] = (
                float(kernels.from_finite(value))
                if f.metadata["dtype"] == "float32"
                else int(value)
            )
        return out

    def _named(self, values: Sequence[Any] | None) -> dict[str, Any]:
        """`values` (by default the variables) by field name."""
        names = [f.name for f in VARIABLE_FIELDS if getattr(self, f.name) is not None]
        if values is None:
            values = self.variables()
        return dict(zip(names, values, strict=True))

    def describe_last_rejection(
        self, names: Sequence[str], values: Sequence[Any] | None = None
    ) -> str:
        """The last rejected step in words, or `""` if none was rejected.

        Args:
            names: the names the reported indices count (`variable_names`).
            values: as for `read`.
        """
        c = self.read(values)
        reason = _reason(int(c["last_rejection"]))
        if reason is Reason.NONE:
            return ""
        if reason is Reason.SPIKE:
            return self._describe_spike(c, self._named(values)["last_spike"])
        if reason in _FIXED_WORDS:
            return _FIXED_WORDS[reason]
        index = int(c["last_nonfinite_index"])
        where = names[index] if 0 <= index < len(names) else f"variable #{index}"
        norm = c["rejected_grad_norm"]
        if reason is Reason.GRADIENT:
            return (
                f"the gradient of {where} was not finite "
                f"(global gradient norm {norm:.4g})"
            )
        return (
            f"the update would have made {where} non-finite although the "
            f"gradients were finite (global gradient norm {norm:.4g}); the "
            "learning rate is probably too high for these gradients"
        )

    def _describe_spike(self, c: dict[str, float | int], last: Any) -> str:
        threshold, reference = (float(v) for v in ops.convert_to_numpy(last))
        factor = self.settings.spike_factor
        return (
            f"the global gradient norm {c['rejected_grad_norm']:.4g} was a spike, "
            f"more than {factor:g} times the 90th percentile of the last "
            f"{self.settings.spike_window} steps' norms ({reference:.4g}): above "
            f"{threshold:.4g}"
        )

    def halted(self, values: Sequence[Any] | None = None) -> bool:
        """Whether `max_consecutive_skips` was reached (a host read); never
        without it."""
        limit = self.settings.max_consecutive_skips
        return limit is not None and self.read(values)["consecutive_skips"] >= limit

    def halt_message(
        self, names: Sequence[str], values: Sequence[Any] | None = None
    ) -> str:
        c = self.read(values)
        return (
            f"rejected {c['consecutive_skips']} steps in a row "
            f"(max_consecutive_skips={self.settings.max_consecutive_skips}) and "
            f"halted; last, {self.describe_last_rejection(names, values)}."
        )

    def frozen_message(
        self, names: Sequence[str], values: Sequence[Any] | None = None
    ) -> str:
        """What to say when the last `FROZEN_STEPS` steps or more were all
        rejected (a host read), else `""`."""
        c = self.read(values)
        run = int(c["consecutive_skips"])
        if run < FROZEN_STEPS:
            return ""
        return (
            f"SafeOptimizer rejected the last {run} steps in a row "
            f"({c['skipped_steps']} in all); last, "
            f"{self.describe_last_rejection(names, values)}. Nothing was "
            "applied in those steps: training is not making progress. Lower "
            "the learning rate, check the data, or let NaNGuard roll back "
            "(callbacks=[ng.NaNGuard()])."
        )

    def check_halted(
        self, names: Sequence[str], values: Sequence[Any] | None = None
    ) -> None:
        """Raises `NonFiniteError` if `max_consecutive_skips` was reached."""
        if self.halted(values):
            raise NonFiniteError(
                f"SafeOptimizer {self.halt_message(names, values)} "
                "Training cannot make progress from this state: restore a good "
                "checkpoint, lower the learning rate or check the data.",
                report=self.read(values),
            )


# The fields in the order of the variables: the counters, then the window.
VARIABLE_FIELDS = tuple(
    f for f in dataclasses.fields(Counters) if not f.metadata.get("setting")
)
COUNTER_FIELDS = tuple(f for f in VARIABLE_FIELDS if "dtype" in f.metadata)
COUNTER_NAMES = tuple(f.name for f in COUNTER_FIELDS)
SCALAR_FIELDS = tuple(f for f in COUNTER_FIELDS if not f.metadata["shape"])
WINDOW_NAMES = tuple(f.name for f in VARIABLE_FIELDS if "dtype" not in f.metadata)

_FIXED_WORDS = {
    Reason.LOSS_SCALE_OVERFLOW: (
        "the loss-scaled gradients overflowed (mixed precision): the "
        "LossScaleOptimizer skipped the step and halved its loss "
        "scale, its routine"
    ),
    Reason.LOSS: (
        "the loss was not finite (a bad batch: non-finite inputs, "
        "targets or loss terms), so the loss-scaled gradients were "
        "not either; the LossScaleOptimizer's scale was kept"
    ),
}


def _reason(code: int) -> Reason:
    """The reason of a code; an unknown one (not saved by this version) as
    `NONE`."""
    try:
        return Reason(code)
    except ValueError:
        return Reason.NONE


def _i32(flag: Any) -> Any:
    return ops.cast(flag, "int32")


def variable_names(
    trainable: Sequence[keras.Variable], inner: Sequence[keras.Variable]
) -> list[str]:
    """What `last_nonfinite_index` counts, by name: the trainable variables
    the optimizer was built with, then the inner optimizer's variables."""
    names = [_path(v) for v in trainable]
    return names + [_path(v, optimizer=True) for v in inner]


def _path(v: keras.Variable, optimizer: bool = False) -> str:
    name = f"'{getattr(v, 'path', None) or v.name}'"
    return f"optimizer variable {name}" if optimizer else name
