"""SafeOptimizer's step: decide, update, check, commit or roll back.

`GuardedStep` is the machinery behind `SafeOptimizer.apply`, kept apart from
the public face: which variables a call shape checks (`plan`), the
transaction itself, and the inner optimizer's settings for the length of a
step (`tf.distribute` is `_backend/tensorflow.py`'s `run_step`). It writes
the inner optimizer's variables, the weights it is handed, and the
`Counters`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import keras
import numpy as np
from keras import ops

from keras_nanguard import _kernels as kernels
from keras_nanguard import _rates as rates
from keras_nanguard._arguments import Arguments
from keras_nanguard._backend import current as backend
from keras_nanguard.flight.recorder import FlightRecorder
from keras_nanguard.safe_optimizer import adaptive_clip, step_ops
from keras_nanguard.safe_optimizer import spike_window as spikes
from keras_nanguard.safe_optimizer.counters import Counters, StepOutcome

# Clips a gradient list: its clipped copy.
Clip = Callable[[list[Any]], list[Any]]
# Runs the inner optimizer's update on gradients clipped by `Clip`.
Update = Callable[[Clip], None]


class Plan(NamedTuple):
    """What one shape of call checks; Python-only work, made once per shape."""

    checked: list[int]  # positions of the gradients that are checked
    state: list[keras.Variable]  # weights, then every inner optimizer variable
    floats: list[int]  # positions in `state` of the float variables
    grad_index: tuple[int, ...]  # checked gradient -> reported index
    state_index: tuple[int, ...]  # checked float state -> reported index
    bounded: list[int]  # positions of the float weights whose update is bounded
    moments: list[int]  # positions in `state` of the inner optimizer's moments


class GuardedStep:
    """The step of `SafeOptimizer` (see there for what it guarantees).

    Args:
        inner: the wrapped optimizer, which makes the update.
        counters: the counters the step reads (the halt, the learning-rate
            scale, the spike window) and records its outcome in.
        settings: the optimizer's settings (`clipnorm`, `lr_backoff`,
            `spike_factor`, `max_consecutive_skips`).
    """

    def __init__(
        self,
        inner: keras.optimizers.Optimizer,
        counters: Counters,
        settings: Arguments,
        recorder: FlightRecorder | None = None,
    ) -> None:
        self.inner = inner
        self.counters = counters
        self.settings = settings
        self.recorder = recorder
        self._plans: dict[tuple, Plan] = {}
        # Tensors the step reuses, made once per call shape (torch: index
        # tables, rollback buffers; see `_backend`). Plain dicts here: as
        # attributes of the optimizer, Keras would track them.
        self._tables: dict = {}
        self._buffers: dict = {}
        # The variables the optimizer was built with, by id: their positions
        # are the reported indices (names can be found again after loading).
        self._built: dict[int, int] = {}
        self._n_built = 0
        # The graded handling's state (`clip="adaptive"`), made by the
        # optimizer's `build`; with `reset_moments`, the value each moment
        # of the inner optimizer starts from, by id.
        self.clip_state: adaptive_clip.ClipState | None = None
        self._initial: dict[int, float] = {}

    def build(self, var_list: Sequence[keras.Variable]) -> None:
        """Builds the inner optimizer with the variables the optimizer is
        built with (unless it is built), and makes the usual call's plan
        (every gradient present) here in eager code: a compiled torch step
        that made it would compile twice."""
        var_list = list(var_list)
        if not self.inner.built:
            self.inner.build(var_list)
        self._built = {id(v): i for i, v in enumerate(var_list)}
        self._n_built = len(var_list)
        if self.settings.reset_moments is not None:
            self._initial = step_ops.initial_moments(self.inner)
        self.plan(var_list, var_list)

    def apply(self, grads: list[Any], variables: list[keras.Variable]) -> None:
        """One step on `grads` for `variables`, as a transaction."""
        # Once per step; under `tf.distribute`, once in cross-replica context.
        backend.run_step(self._run, self.inner, grads, variables)

    def plan(self, grads: list[Any], variables: list[keras.Variable]) -> Plan:
        """What a call with these variables and these missing gradients
        checks (made once per call shape)."""
        key = (tuple(id(v) for v in variables), tuple(g is None for g in grads))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan(grads, variables)
        return plan

    def _make_plan(self, grads: list[Any], variables: list[keras.Variable]) -> Plan:
        checked = [
            i
            for i, (g, v) in enumerate(zip(grads, variables, strict=True))
            if g is not None and not getattr(v, "overwrite_with_gradient", False)
        ]
        state = list(variables) + list(self.inner.variables)
        floats = [j for j, v in enumerate(state) if step_ops.is_float_variable(v)]
        # Reported indices: into the built variables, then the inner
        # optimizer's, so that names can be found again after loading.
        n = self._n_built
        reported = [self._built.get(id(v), -1) for v in variables]
        reported += [n + k for k in range(len(state) - len(variables))]
        return Plan(
            checked,
            state,
            floats,
            tuple(reported[i] for i in checked),
            tuple(reported[j] for j in floats),
            [i for i in checked if step_ops.is_float_variable(variables[i])],
            [j for j in floats if id(state[j]) in self._initial],
        )

    def _run(
        self,
        grads: list[Any],
        variables: list[keras.Variable],
        update: Update | None = None,
    ) -> None:
        """One step: decide on `grads`, update, check, commit or roll back.

        `update(clip)` runs the inner optimizer, `clip` mapping a gradient
        list to its clipped copy; by default on `grads` themselves (under
        `tf.distribute`, `_backend.tensorflow.run_step` hands each replica its
        own).
        """
        plan = self.plan(grads, variables)
        norm, grad_finite, grad_sq = kernels.norms_and_finite(
            [grads[i] for i in plan.checked]
        )
        grads_ok = ops.all(grad_finite)
        # With gradient accumulation the applied gradient is the accumulated
        # one, which the inner optimizer clips itself (see `_inner_settings`).
        accumulating = bool(self.inner.gradient_accumulation_steps)
        clipping = self._adaptive(norm, grad_sq, plan, accumulating)
        clip, clipped = self._clipping(norm, plan, accumulating, clipping)
        if update is None:
            update = _update_of(self.inner, grads, variables)
        # The rollback point: weights and all inner optimizer variables, read
        # before the inner update writes to them.
        backup = step_ops.snapshot(
            plan.state, backend.rollback_buffers(plan.state, self._buffers)
        )
        learning_rate = self._rate()
        with self._inner_settings(accumulating):
            self._update(update, clip)
        new_finite = kernels.finite_flags([plan.state[j] for j in plan.floats])
        update_ok = ops.all(new_finite)
        ok, spike, spike_figures = self._verdict(norm, grads_ok, update_ok)
        bad_index = self._bad_index(plan, grads_ok, grad_finite, new_finite)
        outcome = StepOutcome(
            ok, grads_ok, update_ok, norm, bad_index, clipped, spike, spike_figures
        )
        scales, bounded = self._bounds(plan, backup, learning_rate)
        restored, reset = self._reset_moments(ok, plan, backup)
        step_ops.restore_unless(ok, plan.state, restored, scales)
        if clipping is not None:
            clipping.record(ok)
            clipping.state.count(ok, bounded, reset)
        if self.recorder is not None:  # the committed values: after the restore
            self.recorder.record(
                inner=self.inner,
                outcome=outcome,
                grads_sq=grad_sq,
                checked=[variables[i] for i in plan.checked],
                variables=variables,
                old=backup[: len(variables)],
                learning_rate=learning_rate,
            )
        self.counters.record_step(outcome)

    def _adaptive(
        self, norm: Any, grad_sq: Any, plan: Plan, accumulating: bool
    ) -> adaptive_clip.Clipping | None:
        """The step's graded clipping (`clip="adaptive"`), or `None`."""
        state = self.clip_state
        if state is None:
            return None
        if accumulating:
            raise ValueError(
                '`clip="adaptive"` decides on each batch\'s gradients, and with '
                "gradient accumulation the inner optimizer applies their sum "
                "every few batches. Use `clipnorm` with gradient accumulation. "
                "Received: gradient_accumulation_steps="
                f"{self.inner.gradient_accumulation_steps}"
            )
        return adaptive_clip.Clipping(
            state, norm, grad_sq, plan.grad_index, self.settings.clipnorm
        )

    def _bounds(
        self, plan: Plan, backup: list, learning_rate: Any
    ) -> tuple[list | None, Any]:
        """Per entry of `plan.state`, the factor its update is scaled by
        (`None`: as made), and whether any is below 1; `None`, `None`
        without the update bound. `learning_rate`: the step's."""
        state = self.clip_state
        if state is None or self.settings.max_update_ratio is None or not plan.bounded:
            return None, None
        found = adaptive_clip.update_scales(
            [backup[i] for i in plan.bounded],
            [plan.state[i].value for i in plan.bounded],
            adaptive_clip.step_ratio(state, learning_rate),
        )
        scales: list[Any] = [None] * len(plan.state)
        for k, i in enumerate(plan.bounded):
            scales[i] = found[k]
        return scales, ops.any(found < 1.0)

    def _reset_moments(self, ok: Any, plan: Plan, backup: list) -> tuple[list, Any]:
        """The values a rejected step restores: with `reset_moments`, the
        inner optimizer's moments at their initial values when this
        rejection makes a multiple of `reset_moments` in a row (and whether
        it does); else `backup` as it is (and `None`)."""
        every = self.settings.reset_moments
        if every is None or not plan.moments:
            return backup, None
        run = self.counters.consecutive_skips.value + 1
        reset = ops.logical_and(ops.logical_not(ok), ops.mod(run, every) == 0)
        restored = list(backup)
        for j in plan.moments:
            start = self._initial[id(plan.state[j])]
            # A scalar broadcast (`full_like` reads its fill value back on torch).
            restored[j] = ops.where(reset, start, backup[j])
        return restored, reset

    def _rate(self) -> Any:
        """The learning rate this step runs at (backed off by `lr_scale`);
        of a MultiOptimizer, the largest of its sub-optimizers' rates."""
        rate = functools.reduce(
            ops.maximum,
            [
                ops.cast(owner.learning_rate, "float32")
                for owner in rates.rate_owners(self.inner).values()
            ],
        )
        if self.settings.lr_backoff is None:
            return rate
        return rate * ops.cast(self.counters.lr_scale.value, "float32")

    def _bad_index(
        self, plan: Plan, grads_ok: Any, grad_finite: Any, new_finite: Any
    ) -> Any:
        """The reported index of the first non-finite gradient, or else of
        the first non-finite new state (0 when all are finite)."""
        like = plan.state[0]
        return ops.where(
            grads_ok,
            ops.take(
                backend.constant_table(
                    ("state_index", plan.state_index),
                    lambda: np.array(plan.state_index, "int32"),
                    like,
                    self._tables,
                ),
                step_ops.first_false(new_finite),
            ),
            ops.take(
                backend.constant_table(
                    ("grad_index", plan.grad_index),
                    lambda: np.array(plan.grad_index, "int32"),
                    like,
                    self._tables,
                ),
                step_ops.first_false(grad_finite),
            ),
        )

    def _clipping(
        self,
        norm: Any,
        plan: Plan,
        accumulating: bool,
        adaptive: adaptive_clip.Clipping | None,
    ) -> tuple[Clip, Any]:
        """The gradients' clip, to `clipnorm` or by the graded handling's
        factors (the identity with neither), and whether it clips (`None`
        with neither)."""
        clipnorm = self.settings.clipnorm
        if adaptive is None and (clipnorm is None or accumulating):
            return _unclipped, None
        if adaptive is None:
            factor = ops.minimum(1.0, clipnorm / norm)
            factors = [factor] * len(plan.checked)
            clipped = factor < 1.0
        else:
            factors = [adaptive.factors[k] for k in range(len(plan.checked))]
            clipped = adaptive.clipped
        of = dict(zip(plan.checked, factors, strict=True))

        def clip(gs: list[Any]) -> list[Any]:
            return [
                step_ops.scale(g, of[i]) if i in of else g for i, g in enumerate(gs)
            ]

        return clip, clipped

    def _update(self, update: Update, clip: Clip) -> None:
        """The inner optimizer's update, at the backed-off learning rates
        when `lr_backoff` is set (the base rates put back after it; each
        sub-optimizer's of a MultiOptimizer)."""
        if self.settings.lr_backoff is None:
            update(clip)
            return
        lr_vars = rates.rate_variables(self.inner)
        base = step_ops.snapshot(lr_vars)
        scale = self.counters.lr_scale.value
        for lr_var, base_lr in zip(lr_vars, base, strict=True):
            lr_var.assign(base_lr * ops.cast(scale, lr_var.dtype))
        update(clip)
        for lr_var, base_lr in zip(lr_vars, base, strict=True):
            lr_var.assign(base_lr)

    def _verdict(
        self, norm: Any, grads_ok: Any, update_ok: Any
    ) -> tuple[Any, Any, Any]:
        """Whether the step is accepted (bool scalar), whether it is a spike
        and the spike's figures (`None`, `None` without `spike_factor`)."""
        ok = ops.logical_and(grads_ok, update_ok)
        spike = spike_figures = None
        counters, settings = self.counters, self.settings
        if settings.spike_factor is not None:
            norms, count, _ = counters.window()
            spike, spike_figures = spikes.is_spike(
                norm, norms.value, count.value, settings.spike_factor
            )
            ok = ops.logical_and(ok, ~spike)
        if settings.max_consecutive_skips is not None:  # halted: reject everything
            ok = ops.logical_and(
                ok, counters.consecutive_skips.value < settings.max_consecutive_skips
            )
        return ok, spike, spike_figures

    @contextlib.contextmanager
    def _inner_settings(self, accumulating: bool) -> Iterator[None]:
        """Settings of the inner optimizer for the length of one step (a
        trace, in compiled steps); nothing about it is changed for good."""
        inner = self.inner
        saved = inner.global_clipnorm
        if accumulating and self.settings.clipnorm is not None:
            inner.global_clipnorm = self.settings.clipnorm
        try:
            with step_ops.out_of_place_updates(inner):
                yield
        finally:
            inner.global_clipnorm = saved


def _unclipped(gs: list[Any]) -> list[Any]:
    return gs


def _update_of(
    inner: keras.optimizers.Optimizer, grads: list[Any], variables: list[keras.Variable]
) -> Update:
    """The inner optimizer's update of `variables` with `grads`, clipped."""

    def update(clip: Clip) -> None:
        inner.apply(clip(list(grads)), variables)

    return update
