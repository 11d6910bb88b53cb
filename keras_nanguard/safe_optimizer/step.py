"""SafeOptimizer's step: decide, update, check, commit or roll back.

`Transaction` is the machinery behind `SafeOptimizer.apply`, kept apart from
the public face: which variables a call shape checks (`plan`), the
transaction itself, and the inner optimizer's settings for the length of a
step (`tf.distribute` is `_backend/tensorflow.py`'s `run_step`). It writes
the inner optimizer's variables, the weights it is handed, and the
`Counters`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import keras
from keras import ops

from keras_nanguard import _kernels as kernels
from keras_nanguard._backend import current as backend
from keras_nanguard.flight.recorder import FlightRecorder
from keras_nanguard.safe_optimizer import spike_window as spikes
from keras_nanguard.safe_optimizer import step_ops
from keras_nanguard.safe_optimizer.counters import Counters, StepOutcome
from keras_nanguard.safe_optimizer.settings import Settings

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


class Transaction:
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
        settings: Settings,
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
        clip, clipped = self._clipping(norm, plan, accumulating)
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
        step_ops.restore_unless(ok, plan.state, backup)
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

    def _rate(self) -> Any:
        """The learning rate this step runs at (backed off by `lr_scale`)."""
        rate = ops.cast(self.inner.learning_rate, "float32")
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
                backend.index_table(plan.state_index, like, self._tables),
                step_ops.first_false(new_finite),
            ),
            ops.take(
                backend.index_table(plan.grad_index, like, self._tables),
                step_ops.first_false(grad_finite),
            ),
        )

    def _clipping(self, norm: Any, plan: Plan, accumulating: bool) -> tuple[Clip, Any]:
        """The gradients' clip to `clipnorm` (the identity without one), and
        whether it clips (`None` without one)."""
        clipnorm = self.settings.clipnorm
        if clipnorm is None or accumulating:
            return _unclipped, None
        factor = ops.minimum(1.0, clipnorm / norm)
        to_clip = set(plan.checked)

        def clip(gs: list[Any]) -> list[Any]:
            return [
                step_ops.scale(g, factor) if i in to_clip else g
                for i, g in enumerate(gs)
            ]

        return clip, factor < 1.0

    def _update(self, update: Update, clip: Clip) -> None:
        """The inner optimizer's update, at the backed-off learning rate when
        `lr_backoff` is set (the base rate put back after it)."""
        if self.settings.lr_backoff is None:
            update(clip)
            return
        lr_var = self.inner.learning_rate
        (base_lr,) = step_ops.snapshot([lr_var])
        lr_var.assign(base_lr * ops.cast(self.counters.lr_scale.value, lr_var.dtype))
        update(clip)
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
