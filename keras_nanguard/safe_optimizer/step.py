"""SafeOptimizer's step: decide, update, check, commit or roll back.

`Transaction` is the machinery behind `SafeOptimizer.apply`, kept apart from
the public face: which variables a call shape checks (`plan`), the
transaction itself, the inner optimizer's settings for the length of a step,
and the one place that knows `tf.distribute` (`_tf_apply`). It writes the
inner optimizer's variables, the weights it is handed, and the `Counters`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import keras
import numpy as np
from keras import ops

from keras_nanguard import _kernels as kernels
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
        self, inner: keras.optimizers.Optimizer, counters: Counters, settings: Settings
    ) -> None:
        self.inner = inner
        self.counters = counters
        self.settings = settings
        self._plans: dict[tuple, Plan] = {}
        self._tables = _TorchTables()
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
        if keras.backend.backend() == "tensorflow":
            _tf_apply(self._run, self.inner, grads, variables)
        else:
            # JAX: under a keras.distribution the step is one SPMD program whose
            # gradients are already global, so every device decides alike.
            self._run(grads, variables)

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
        `tf.distribute`, `_tf_apply` hands each replica its own).
        """
        plan = self.plan(grads, variables)
        norm, grad_finite = kernels.norm_and_finite([grads[i] for i in plan.checked])
        grads_ok = ops.all(grad_finite)
        # With gradient accumulation the applied gradient is the accumulated
        # one, which the inner optimizer clips itself (see `_inner_settings`).
        accumulating = bool(self.inner.gradient_accumulation_steps)
        clip, clipped = self._clipping(norm, plan, accumulating)
        if update is None:
            update = _update_of(self.inner, grads, variables)
        # The rollback point: weights and all inner optimizer variables, read
        # before the inner update writes to them.
        backup = step_ops.snapshot(plan.state, self._tables.buffers(plan.state))
        with self._inner_settings(accumulating):
            self._update(update, clip)
        new_finite = kernels.finite_flags([plan.state[j] for j in plan.floats])
        update_ok = ops.all(new_finite)
        ok, spike, spike_figures = self._verdict(norm, grads_ok, update_ok)
        step_ops.restore_unless(ok, plan.state, backup)
        bad_index = self._bad_index(plan, grads_ok, grad_finite, new_finite)
        self.counters.record_step(
            StepOutcome(
                ok, grads_ok, update_ok, norm, bad_index, clipped, spike, spike_figures
            )
        )

    def _bad_index(
        self, plan: Plan, grads_ok: Any, grad_finite: Any, new_finite: Any
    ) -> Any:
        """The reported index of the first non-finite gradient, or else of
        the first non-finite new state (0 when all are finite)."""
        like = plan.state[0]
        return ops.where(
            grads_ok,
            ops.take(
                self._tables.index(plan.state_index, like),
                step_ops.first_false(new_finite),
            ),
            ops.take(
                self._tables.index(plan.grad_index, like),
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


# A step on gradients to decide on: `Transaction._run`.
Run = Callable[[list[Any], list[keras.Variable], Update | None], None]


def _tf_apply(
    run: Run,
    inner: keras.optimizers.Optimizer,
    grads: list[Any],
    variables: list[keras.Variable],
) -> None:
    """The transaction `run` under `tf.distribute` (the one place that knows it).

    In a replica context of a real strategy each replica holds its own
    gradients. They are all-reduced first, and the whole transaction then
    runs once in cross-replica context (`merge_call`), as Keras's
    LossScaleOptimizer does: one decision, taken on the aggregated
    gradients and the resulting mirrored state, and so the same on every
    replica, with every write (update, rollback, counters) mirrored.
    """
    import tensorflow as tf

    ctx = tf.distribute.get_replica_context()
    if ctx is None or not tf.distribute.has_strategy():
        run(grads, variables, None)  # default strategy or cross-replica
        return
    summed = _all_reduced(ctx, grads)

    def cross_replica(
        distribution: Any, summed: Any, grads: Any, variables: Any
    ) -> None:
        variables = list(variables)
        # The decision: on the summed gradients (the same on every replica).
        decide_on = [
            None if g is None else distribution.experimental_local_results(g)[0]
            for g in summed
        ]

        def update(clip: Clip) -> None:
            # The update: each replica hands the inner optimizer its own
            # gradients, which it all-reduces itself, as it would unwrapped.
            def per_replica(grads: Any, variables: Any) -> None:
                inner.apply(clip(list(grads)), list(variables))

            distribution.extended.call_for_each_replica(
                per_replica, args=(grads, variables)
            )

        run(decide_on, variables, update)

    ctx.merge_call(cross_replica, args=(summed, grads, variables))


def _all_reduced(ctx: Any, grads: list[Any]) -> list[Any]:
    """tf.distribute: the sum over the replicas of each gradient present."""
    import tensorflow as tf

    present = [i for i, g in enumerate(grads) if g is not None]
    reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in present])
    summed: list[Any] = [None] * len(grads)
    for i, g in zip(present, reduced, strict=True):
        summed[i] = g
    return summed


class _TorchTables:
    """torch: tensors the step reuses, made once per call shape (index
    tables and rollback buffers); other backends keep none. Kept out of
    Keras's variable tracking (a plain dict attribute of the optimizer would
    be tracked, and its variables with it)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, tuple[list, list]] = {}
        self._indices: dict[tuple, Any] = {}

    def index(self, values: tuple[int, ...], like: keras.Variable) -> Any:
        """Reported indices as a table the step gathers from. On torch a
        tensor on `like`'s device, made once in eager steps (no host copy
        per step) and a constant of the graph in compiled ones (a NumPy
        array there would break the graph); elsewhere a NumPy constant."""
        if keras.backend.backend() != "torch":
            return np.array(values, "int32")
        return _torch_index(values, like, self._indices)

    def buffers(self, state: list[keras.Variable]) -> list | None:
        """torch, eager: buffers the rollback snapshot is copied
        into, made once and reused every step; otherwise `None`."""
        if keras.backend.backend() != "torch":
            return None
        return _torch_rollback_buffers(state, self._buffers)


def _torch_index(values: tuple[int, ...], like: keras.Variable, made: dict) -> Any:
    import torch

    def make() -> Any:
        return torch.tensor(values, dtype=torch.int32, device=like.value.device)

    if torch.compiler.is_compiling():
        return make()
    if values not in made:
        made[values] = make()
    return made[values]


def _torch_rollback_buffers(state: list[keras.Variable], made: dict) -> list | None:
    import torch

    if torch.compiler.is_compiling():
        return None  # no Python-held tensors inside a compiled graph
    key = tuple(id(v) for v in state)
    if key not in made:
        # The variables are kept with their buffers, so their ids cannot
        # be reused by other variables while the key lives.
        made[key] = (list(state), [torch.empty_like(v.value) for v in state])
    return made[key][1]
