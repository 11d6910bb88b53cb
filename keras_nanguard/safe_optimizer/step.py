"""SafeOptimizer's step: decide, update, check, commit or roll back.

The machinery behind `SafeOptimizer.apply`, kept apart from the public face:
which variables a call shape checks (`_plan`), the transaction itself, the
inner optimizer's settings for the length of a step, the counters, and the
one place that knows `tf.distribute` (`_tf_apply`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import keras
import numpy as np
from keras import ops

from keras_nanguard import _kernels as kernels
from keras_nanguard.safe_optimizer import spike_window as spikes
from keras_nanguard.safe_optimizer import step_ops
from keras_nanguard.safe_optimizer.counters import RECENT_STEPS


class _Plan(NamedTuple):
    """What one shape of call checks; Python-only work, made once per shape."""

    checked: list[int]  # positions of the gradients that are checked
    state: list[keras.Variable]  # weights, then every inner optimizer variable
    floats: list[int]  # positions in `state` of the float variables
    grad_index: tuple[int, ...]  # checked gradient -> reported index
    state_index: tuple[int, ...]  # checked float state -> reported index


class TransactionMixin:
    """The step of `SafeOptimizer` (see there for what it guarantees)."""

    def _tf_apply(self, grads: list[Any], variables: list[keras.Variable]) -> None:
        """The transaction under `tf.distribute` (the one place that knows it).

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
            self._transaction(grads, variables)  # default strategy or cross-replica
            return
        present = [i for i, g in enumerate(grads) if g is not None]
        reduced = ctx.all_reduce(
            tf.distribute.ReduceOp.SUM, [grads[i] for i in present]
        )
        summed: list[Any] = [None] * len(grads)
        for i, g in zip(present, reduced, strict=True):
            summed[i] = g

        def cross_replica(distribution, summed, grads, variables):
            variables = list(variables)
            # The decision: on the summed gradients (the same on every replica).
            decide_on = [
                None if g is None else distribution.experimental_local_results(g)[0]
                for g in summed
            ]

            def update(clip):
                # The update: each replica hands the inner optimizer its own
                # gradients, which it all-reduces itself, as it would unwrapped.
                def per_replica(grads, variables):
                    self.inner_optimizer.apply(clip(list(grads)), list(variables))

                distribution.extended.call_for_each_replica(
                    per_replica, args=(grads, variables)
                )

            self._transaction(decide_on, variables, update=update)

        ctx.merge_call(cross_replica, args=(summed, grads, variables))

    def _plan(self, grads: list[Any], variables: list[keras.Variable]) -> _Plan:
        key = (tuple(id(v) for v in variables), tuple(g is None for g in grads))
        plan = self._plans.cache.get(key)
        if plan is None:
            checked = [
                i
                for i, (g, v) in enumerate(zip(grads, variables, strict=True))
                if g is not None and not getattr(v, "overwrite_with_gradient", False)
            ]
            state = list(variables) + list(self.inner_optimizer.variables)
            floats = [j for j, v in enumerate(state) if step_ops.is_float_variable(v)]
            # Reported indices: into the built variables, then the inner
            # optimizer's, so that names can be found again after loading.
            built = self._trainable_variables_indices
            n = len(self._trainable_variables)
            reported = [built.get(id(v), -1) for v in variables]
            reported += [n + k for k in range(len(state) - len(variables))]
            plan = self._plans.cache[key] = _Plan(
                checked,
                state,
                floats,
                tuple(reported[i] for i in checked),
                tuple(reported[j] for j in floats),
            )
        return plan

    def _transaction(
        self,
        grads: list[Any],
        variables: list[keras.Variable],
        update: Callable[[Callable[[list], list]], None] | None = None,
    ) -> None:
        """One step: decide on `grads`, update, check, commit or roll back.

        `update(clip)` runs the inner optimizer, `clip` mapping a gradient
        list to its clipped copy; by default on `grads` themselves (under
        `tf.distribute`, `_tf_apply` hands each replica its own).
        """
        inner = self.inner_optimizer
        plan = self._plan(grads, variables)
        norm, grad_finite = kernels.norm_and_finite([grads[i] for i in plan.checked])
        grads_ok = ops.all(grad_finite)
        # With gradient accumulation the applied gradient is the accumulated
        # one, which the inner optimizer clips itself (see `_inner_settings`).
        accumulating = bool(inner.gradient_accumulation_steps)
        clipped, factor = None, None
        if self.clipnorm is not None and not accumulating:
            factor = ops.minimum(1.0, self.clipnorm / norm)
            clipped = factor < 1.0
        to_clip = set(plan.checked)

        def clip(gs: list) -> list:
            if factor is None:
                return gs
            return [
                step_ops.scale(g, factor) if i in to_clip else g
                for i, g in enumerate(gs)
            ]

        if update is None:
            update = lambda clip: inner.apply(clip(list(grads)), variables)  # noqa: E731

        # The rollback point: weights and all inner optimizer variables, read
        # before the inner update writes to them.
        backup = step_ops.snapshot(plan.state, self._plans.rollback_buffers(plan.state))
        with self._inner_settings(accumulating):
            if self.lr_backoff is None:
                update(clip)
            else:
                lr_var = inner.learning_rate
                (base_lr,) = step_ops.snapshot([lr_var])
                lr_var.assign(base_lr * ops.cast(self.lr_scale.value, lr_var.dtype))
                update(clip)
                lr_var.assign(base_lr)

        new_finite = kernels.finite_flags([plan.state[j] for j in plan.floats])
        update_ok = ops.all(new_finite)
        ok = ops.logical_and(grads_ok, update_ok)
        spike = spike_figures = None
        if self.spike_factor is not None:
            spike, spike_figures = spikes.is_spike(
                norm, self.spike_norms.value, self.spike_count.value, self.spike_factor
            )
            ok = ops.logical_and(ok, ~spike)
        if self.max_consecutive_skips is not None:  # halted: reject everything
            ok = ops.logical_and(
                ok, self.consecutive_skips.value < self.max_consecutive_skips
            )
        step_ops.restore_unless(ok, plan.state, backup)
        bad_index = ops.where(
            grads_ok,
            ops.take(
                self._plans.index(plan.state_index, plan.state[0]),
                step_ops.first_false(new_finite),
            ),
            ops.take(
                self._plans.index(plan.grad_index, plan.state[0]),
                step_ops.first_false(grad_finite),
            ),
        )
        self._count(
            ok=ok,
            grads_ok=grads_ok,
            update_ok=update_ok,
            clipped=clipped,
            norm=norm,
            bad_index=bad_index,
            spike=spike,
            spike_figures=spike_figures,
        )

    @contextlib.contextmanager
    def _inner_settings(self, accumulating: bool) -> Iterator[None]:
        """Settings of the inner optimizer for the length of one step (a
        trace, in compiled steps); nothing about it is changed for good."""
        inner = self.inner_optimizer
        saved = inner.global_clipnorm
        if accumulating and self.clipnorm is not None:
            inner.global_clipnorm = self.clipnorm
        try:
            with step_ops.out_of_place_updates(inner):
                yield
        finally:
            inner.global_clipnorm = saved

    def _count(
        self, *, ok, grads_ok, update_ok, clipped, norm, bad_index, spike, spike_figures
    ) -> None:
        i32 = lambda flag: ops.cast(flag, "int32")  # noqa: E731
        bad_grad = ~grads_ok
        bad_update = ops.logical_and(grads_ok, ~update_ok)
        norm = ops.cast(norm, "float32")
        self.skipped_steps.assign(self.skipped_steps.value + i32(~ok))
        self.recent_rejections.assign(
            step_ops.shift_in(self.recent_rejections.value, i32(~ok), RECENT_STEPS)
        )
        self.consecutive_skips.assign(
            ops.where(ok, 0, self.consecutive_skips.value + 1)
        )
        self.nonfinite_gradient_steps.assign(
            self.nonfinite_gradient_steps.value + i32(bad_grad)
        )
        self.nonfinite_update_steps.assign(
            self.nonfinite_update_steps.value + i32(bad_update)
        )
        if clipped is not None:
            self.clipped_steps.assign(
                self.clipped_steps.value + i32(ops.logical_and(ok, clipped))
            )
        self.last_grad_norm.assign(norm)
        self.accepted_grad_norm.assign(
            ops.where(ok, norm, self.accepted_grad_norm.value)
        )
        self.rejected_grad_norm.assign(
            ops.where(ok, self.rejected_grad_norm.value, norm)
        )
        reason = ops.where(bad_grad, 1, ops.where(bad_update, 2, 0))
        if spike is not None:
            spike = ops.logical_and(spike, reason == 0)
            reason = ops.where(spike, 3, reason)
            self.spike_steps.assign(self.spike_steps.value + i32(spike))
            spikes.record(
                ok,
                spike,
                norm,
                spike_figures,
                self.spike_norms,
                self.spike_count,
                self.last_spike,
            )
        failed = reason > 0
        self.last_rejection.assign(ops.where(failed, reason, self.last_rejection.value))
        self.last_nonfinite_index.assign(
            ops.where(failed, bad_index, self.last_nonfinite_index.value)
        )
        if self.lr_backoff is None:
            return
        accepts = ops.where(ok, self.consecutive_accepts.value + 1, 0)
        recover = accepts >= self.lr_recovery_steps
        lr_scale = self.lr_scale.value
        lr_scale = ops.where(
            ok,
            ops.where(recover, lr_scale / self.lr_backoff, lr_scale),
            lr_scale * self.lr_backoff,
        )
        self.lr_scale.assign(ops.clip(lr_scale, self.min_lr_scale, 1.0))
        self.consecutive_accepts.assign(ops.where(recover, 0, accepts))

    def _count_scaler_skip(self, skipped: Any, bad_data: Any) -> None:
        """Counts a step that a loss scaler around this optimizer skipped
        (this optimizer's step did not run): as a rejected step; as a
        non-finite gradient when the loss was not finite too (`bad_data`),
        else as an overflow of the loss-scaled gradients, which is the loss
        scaler's routine and neither a streak nor a reason to back off."""
        i32 = lambda flag: ops.cast(flag, "int32")  # noqa: E731
        overflow = ops.logical_and(skipped, ops.logical_not(bad_data))
        self.skipped_steps.assign(self.skipped_steps.value + i32(skipped))
        self.loss_scale_steps.assign(self.loss_scale_steps.value + i32(overflow))
        self.nonfinite_gradient_steps.assign(
            self.nonfinite_gradient_steps.value + i32(bad_data)
        )
        self.consecutive_skips.assign(self.consecutive_skips.value + i32(bad_data))
        # This optimizer's own step did not run to shift its outcome in: a
        # bad batch is a rejected step there, an overflow is not.
        self.recent_rejections.assign(
            ops.where(
                skipped,
                step_ops.shift_in(
                    self.recent_rejections.value, i32(bad_data), RECENT_STEPS
                ),
                self.recent_rejections.value,
            )
        )
        reason = ops.where(bad_data, 5, ops.where(overflow, 4, 0))
        self.last_rejection.assign(
            ops.where(skipped, reason, self.last_rejection.value)
        )
        self.last_nonfinite_index.assign(
            ops.where(skipped, -1, self.last_nonfinite_index.value)
        )
        self.rejected_grad_norm.assign(  # the scaled gradients' norm: not finite
            ops.where(skipped, float("nan"), self.rejected_grad_norm.value)
        )
        if self.lr_backoff is not None:
            lr_scale = ops.where(
                bad_data, self.lr_scale.value * self.lr_backoff, self.lr_scale.value
            )
            self.lr_scale.assign(ops.clip(lr_scale, self.min_lr_scale, 1.0))
            self.consecutive_accepts.assign(
                ops.where(bad_data, 0, self.consecutive_accepts.value)
            )


class _Plans:
    """Per-call-shape Python bookkeeping, kept out of Keras's variable tracking
    (a plain dict attribute would be tracked, and its variables with it)."""

    def __init__(self) -> None:
        self.cache: dict[tuple, _Plan] = {}
        self.buffers: dict[tuple, tuple[list, list]] = {}
        self.indices: dict[tuple, Any] = {}
        self.applied = False  # set by `apply`, so `transaction` can tell one ran
        self.in_fit = False  # inside an attached `fit` step
        # The model of the transaction `apply` runs in (`None` outside one),
        # and the (model, variables) pairs found to belong together.
        self.model: keras.Model | None = None
        self.trained: set[tuple] = set()
        self.warned_unattached = False
        self.attached = False  # attached to a model at some point

    def index(self, values: tuple[int, ...], like: keras.Variable) -> Any:
        """Reported indices as a table the step gathers from. On torch a
        tensor on `like`'s device, made once in eager steps (no host copy
        per step) and a constant of the graph in compiled ones (a NumPy
        array there would break the graph); elsewhere a NumPy constant."""
        if keras.backend.backend() != "torch":
            return np.array(values, "int32")
        import torch

        def make() -> Any:
            return torch.tensor(values, dtype=torch.int32, device=like.value.device)

        if torch.compiler.is_compiling():
            return make()
        if values not in self.indices:
            self.indices[values] = make()
        return self.indices[values]

    def rollback_buffers(self, state: list[keras.Variable]) -> list | None:
        """torch, eager: buffers the rollback snapshot is copied
        into, made once and reused every step; otherwise `None`."""
        if keras.backend.backend() != "torch":
            return None
        import torch

        if torch.compiler.is_compiling():
            return None  # no Python-held tensors inside a compiled graph
        key = tuple(id(v) for v in state)
        if key not in self.buffers:
            # The variables are kept with their buffers, so their ids cannot
            # be reused by other variables while the key lives.
            self.buffers[key] = (
                list(state),
                [torch.empty_like(v.value) for v in state],
            )
        return self.buffers[key][1]
