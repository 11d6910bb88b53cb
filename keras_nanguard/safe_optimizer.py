"""SafeOptimizer: an optimizer wrapper under which a bad step is never applied."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import keras
from keras import ops

from keras_nanguard import _step_ops as step_ops
from keras_nanguard import numerics
from keras_nanguard._validation import check_positive
from keras_nanguard.errors import NonFiniteError

_REASONS = {0: "none", 1: "gradient", 2: "update"}
_COUNTERS = (
    ("skipped_steps", "int32", 0),
    ("consecutive_skips", "int32", 0),
    ("nonfinite_gradient_steps", "int32", 0),
    ("nonfinite_update_steps", "int32", 0),
    ("clipped_steps", "int32", 0),
    ("last_grad_norm", "float32", 0.0),
    ("rejected_grad_norm", "float32", 0.0),
    ("last_rejection", "int32", 0),
    ("last_nonfinite_index", "int32", -1),
    ("lr_scale", "float32", 1.0),
    ("consecutive_accepts", "int32", 0),
)
# Counters that are history (NaNGuard keeps them through a rollback); the
# others (consecutive_skips, lr_scale, consecutive_accepts) are control state.
_HISTORY = (
    "skipped_steps",
    "nonfinite_gradient_steps",
    "nonfinite_update_steps",
    "clipped_steps",
    "last_grad_norm",
    "rejected_grad_norm",
    "last_rejection",
    "last_nonfinite_index",
)


@keras.saving.register_keras_serializable(package="keras_nanguard")
class SafeOptimizer(keras.optimizers.Optimizer):
    r"""Wraps any Keras optimizer so that a bad step is never applied.

    Every call to `apply` (and so every `model.fit` step) is a transaction:

    1. the global norm of the raw gradients is computed once, in float32,
       without overflow for large but finite gradients;
    2. if any gradient is NaN or inf, the step is rejected;
    3. otherwise the gradients are clipped to a global norm of `clipnorm`
       (when set): :math:`g \leftarrow g \cdot \min(1, c / \|g\|)`, and the
       inner optimizer computes its update;
    4. if any new weight or any new optimizer variable (moments, velocities,
       EMA, accumulators) is not finite, the step is rejected;
    5. a rejected step leaves the trainable weights, every optimizer variable
       and `iterations` (so also the learning-rate schedule position)
       bit-identical to what they were; only the counters below change.

    The decision is taken on the device, inside the compiled step
    (`tf.function`, XLA, `jax.jit`): there is no host synchronisation. On the
    PyTorch backend, where Keras runs steps eagerly, the two decisions are
    Python branches on a device scalar, as in Keras's `LossScaleOptimizer`.
    The cost: one fused pass over the gradients (their norm), one read pass
    over the new weights and optimizer state (their check), and memory for
    about one copy of weights and optimizer state, the rollback point. On
    TensorFlow and JAX the old values are kept while the update is computed
    out of place, so no copying work is done; on torch the state is copied
    once per step into buffers that are kept and reused. Measured in
    BENCHMARKS.md.


    Counters (scalar optimizer variables, saved with the optimizer; read them
    with `int(...)`/`float(...)` or all at once with `counters()`):

    - `skipped_steps`: rejected steps in total.
    - `consecutive_skips`: rejected steps since the last accepted one.
    - `nonfinite_gradient_steps`: rejected because a gradient was NaN/inf.
    - `nonfinite_update_steps`: rejected because the update would have made a
      weight or an optimizer variable NaN/inf.
    - `clipped_steps`: accepted steps whose gradients were clipped.
    - `last_grad_norm`: global norm of the raw gradients of the last step
      (NaN or inf when they were not finite).
    - `rejected_grad_norm`: the same for the last rejected step.
    - `last_rejection`: why the last rejected step was rejected
      (0 never, 1 gradient, 2 update); `describe_last_rejection()` says it in
      words, naming the first variable involved (`last_nonfinite_index` is
      its position among the gradients, or among the weights and optimizer
      variables, that were checked).
    - `lr_scale`: the current learning-rate back-off factor (1 without it).

    Args:
        optimizer: the `keras.optimizers.Optimizer` to wrap, or the name of a
            built-in one (`"adam"`). It must not clip gradients itself when
            `clipnorm` is set, and must not be a `LossScaleOptimizer` (under
            `mixed_float16`, `compile` wraps the SafeOptimizer in one).
        clipnorm: float or `None`. If set, gradients are clipped so that their
            *global* norm is at most `clipnorm` (after the finiteness check).
            Defaults to `None`.
        lr_backoff: float in (0, 1) or `None`. If set, every rejected step
            multiplies the learning rate by this factor (down to
            `min_lr_scale` times the original), and every `lr_recovery_steps`
            accepted steps in a row divide it back, up to the original. The
            inner optimizer needs a float learning rate (not a schedule) for
            this. Defaults to `None`.
        lr_recovery_steps: int >= 1. Accepted steps in a row before the
            learning rate recovers one back-off factor. Defaults to 100.
        min_lr_scale: float in (0, 1]. Lowest learning-rate scale the back-off
            reaches. Defaults to 1e-3.
        max_consecutive_skips: int >= 1 or `None`. After this many rejected
            steps in a row the optimizer halts: it rejects every further step
            (it never gives up and applies a bad update) and raises
            `keras_nanguard.NonFiniteError` at the next point where it runs
            on the host: at once in eager steps (custom loops, the torch
            backend, `run_eagerly=True`), or when you call `check_halted()`.
            In compiled `model.fit` steps, a `NaNGuard` treats the halt as
            trouble and follows its policy (its rollback resets the streak).
            Defaults to `None` (never halt).
        name: the optimizer's name. Defaults to an automatic name.

    Example:

    >>> import numpy as np, keras
    >>> import keras_nanguard as ng
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-2), clipnorm=1.0)
    >>> model.compile(optimizer=opt, loss="mse")
    >>> x = np.ones((8, 4), "float32"); y = np.ones((8, 1), "float32")
    >>> x[3, 0] = np.nan                      # one poisoned sample
    >>> _ = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    >>> int(opt.skipped_steps), int(opt.iterations)
    (1, 0)
    >>> bool(np.isfinite(model.layers[0].kernel.numpy()).all())
    True
    """

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer | str,
        *,
        clipnorm: float | None = None,
        lr_backoff: float | None = None,
        lr_recovery_steps: int = 100,
        min_lr_scale: float = 1e-3,
        max_consecutive_skips: int | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            hint = ""
            if {"global_clipnorm", "clipvalue"} & set(kwargs):
                hint = (
                    " SafeOptimizer clips by global norm with `clipnorm`; set "
                    "other clipping on the inner optimizer."
                )
            raise TypeError(
                f"SafeOptimizer got unknown keyword arguments {sorted(kwargs)}."
                f"{hint} Received: {kwargs}"
            )
        inner = _resolve_inner(optimizer)
        clipnorm = check_positive("clipnorm", clipnorm, allow_none=True)
        if clipnorm is not None:
            inner_clip = {
                k: getattr(inner, k)
                for k in ("clipnorm", "global_clipnorm", "clipvalue")
                if getattr(inner, k, None) is not None
            }
            if inner_clip:
                raise ValueError(
                    "Set gradient clipping on the SafeOptimizer or on the inner "
                    "optimizer, not both: clipping before the finiteness check "
                    "turns every gradient into NaN when the norm is not finite. "
                    f"Received: clipnorm={clipnorm} and inner optimizer "
                    f"{inner_clip}"
                )
        if lr_backoff is not None:
            lr_backoff = check_positive("lr_backoff", lr_backoff)
            if not lr_backoff < 1:
                raise ValueError(
                    f"`lr_backoff` must be in (0, 1). Received: lr_backoff={lr_backoff}"
                )
            if not isinstance(inner.learning_rate, keras.Variable):
                raise ValueError(
                    "`lr_backoff` needs the inner optimizer's learning rate to "
                    "be a float, not a schedule or a callable. Received: "
                    f"learning_rate={inner._learning_rate!r}"
                )
        if (
            isinstance(lr_recovery_steps, bool)
            or not isinstance(lr_recovery_steps, int)
            or lr_recovery_steps < 1
        ):
            raise ValueError(
                "`lr_recovery_steps` must be an integer >= 1. "
                f"Received: lr_recovery_steps={lr_recovery_steps!r}"
            )
        min_lr_scale = check_positive("min_lr_scale", min_lr_scale)
        if min_lr_scale > 1:
            raise ValueError(
                "`min_lr_scale` must be in (0, 1]. "
                f"Received: min_lr_scale={min_lr_scale}"
            )
        if max_consecutive_skips is not None and (
            isinstance(max_consecutive_skips, bool)
            or not isinstance(max_consecutive_skips, int)
            or max_consecutive_skips < 1
        ):
            raise ValueError(
                "`max_consecutive_skips` must be an integer >= 1 or None. "
                f"Received: max_consecutive_skips={max_consecutive_skips!r}"
            )

        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner
        self.clipnorm = clipnorm
        self.lr_backoff = lr_backoff
        self.lr_recovery_steps = lr_recovery_steps
        self.min_lr_scale = min_lr_scale
        self.max_consecutive_skips = max_consecutive_skips
        self._plans = _Plans()
        for counter, dtype, initial in _COUNTERS:
            var = self.add_variable(
                shape=(),
                dtype=dtype,
                initializer=keras.initializers.Constant(initial),
                aggregation="none",
                name=counter,
            )
            setattr(self, counter, var)

    # ----------------------------------------------------------------- state
    def build(self, var_list: Sequence[keras.Variable]) -> None:
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        if keras.backend.backend() == "tensorflow":
            step_ops.tf_update_out_of_place(self.inner_optimizer)
        super().build(var_list)

    @property
    def variables(self) -> list[keras.Variable]:
        return self._variables[:] + self.inner_optimizer.variables

    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self) -> Any:
        return self.inner_optimizer.iterations

    @iterations.setter
    def iterations(self, value: Any) -> None:
        self.inner_optimizer.iterations.assign(value)

    def finalize_variable_values(self, var_list: Sequence[keras.Variable]) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    # ------------------------------------------------------------ the step
    def apply_gradients(self, grads_and_vars: Any) -> Any:
        grads, trainable_variables = zip(*grads_and_vars, strict=True)
        self.apply(grads, trainable_variables)
        return self.iterations

    def apply(
        self,
        grads: Sequence[Any],
        trainable_variables: Sequence[keras.Variable] | None = None,
    ) -> None:
        grads = list(grads)
        if not grads:
            return
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing `grads` without `trainable_variables`, the "
                    "optimizer must already be built. Call "
                    "`optimizer.build(trainable_variables)` first."
                )
            trainable_variables = self._trainable_variables
        else:
            trainable_variables = list(trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise ValueError(
                "`grads` and `trainable_variables` must have the same length. "
                f"Received: len(grads)={len(grads)}, "
                f"len(trainable_variables)={len(trainable_variables)}"
            )
        if keras.backend.backend() == "tensorflow":
            self._tf_apply(grads, trainable_variables)
        else:
            # JAX: under a keras.distribution the step is one SPMD program whose
            # gradients are already global, so every device decides alike.
            self._transaction(grads, trainable_variables)
        if self.max_consecutive_skips is not None and step_ops.executing_eagerly(
            self.consecutive_skips
        ):
            self.check_halted()

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

    def _plan(self, grads: list[Any], variables: list[keras.Variable]) -> tuple:
        """Which gradients and which state variables a step checks, and their
        names; computed once per shape of call (it is Python-only work)."""
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
            names = (
                [_path(variables[i]) for i in checked],
                [_path(state[j], optimizer=j >= len(variables)) for j in floats],
            )
            plan = self._plans.cache[key] = (checked, state, floats, names)
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
        checked, state, floats, names = self._plan(grads, variables)
        # Names of what the counters' indices point at, for the reports.
        self._plans.names = names

        scale, rel, grad_finite = numerics.norm_parts([grads[i] for i in checked])
        grads_ok = ops.all(grad_finite)
        clipped, factor = None, None
        if self.clipnorm is not None:
            factor = ops.minimum(1.0, (self.clipnorm / scale) / rel)
            clipped = factor < 1.0

        to_clip = set(checked)

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
        backup = step_ops.snapshot(state, self._plans.rollback_buffers(state))

        if self.lr_backoff is None:
            update(clip)
        else:
            lr_var = inner.learning_rate
            (base_lr,) = step_ops.snapshot([lr_var])
            lr_var.assign(base_lr * ops.cast(self.lr_scale.value, lr_var.dtype))
            update(clip)
            lr_var.assign(base_lr)

        new_finite = numerics.finite_flags([state[j] for j in floats])
        update_ok = ops.all(new_finite)
        ok = ops.logical_and(grads_ok, update_ok)
        if self.max_consecutive_skips is not None:  # halted: reject everything
            ok = ops.logical_and(
                ok, self.consecutive_skips.value < self.max_consecutive_skips
            )
        step_ops.restore_unless(ok, state, backup)
        self._count(
            ok,
            grads_ok,
            update_ok,
            clipped,
            scale * rel,
            step_ops.first_false(grad_finite),
            step_ops.first_false(new_finite),
        )

    def _count(
        self, ok, grads_ok, update_ok, clipped, norm, first_bad_grad, first_bad_state
    ) -> None:
        i32 = lambda flag: ops.cast(flag, "int32")  # noqa: E731
        bad_grad = ~grads_ok
        bad_update = ops.logical_and(grads_ok, ~update_ok)
        norm = ops.cast(norm, "float32")
        self.skipped_steps.assign(self.skipped_steps.value + i32(~ok))
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
        self.rejected_grad_norm.assign(
            ops.where(ok, self.rejected_grad_norm.value, norm)
        )
        reason = ops.where(bad_grad, 1, ops.where(bad_update, 2, 0))
        failed = reason > 0
        self.last_rejection.assign(ops.where(failed, reason, self.last_rejection.value))
        self.last_nonfinite_index.assign(
            ops.where(
                failed,
                ops.where(bad_grad, first_bad_grad, first_bad_state),
                self.last_nonfinite_index.value,
            )
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

    # ------------------------------------------------------------ reporting
    def counters(self) -> dict[str, float | int]:
        """The counters as Python numbers (reads them from the device).

        Example:

        >>> import keras, keras_nanguard as ng
        >>> ng.SafeOptimizer(keras.optimizers.SGD(0.1)).counters()["skipped_steps"]
        0
        """
        out: dict[str, float | int] = {}
        for counter, dtype, _ in _COUNTERS:
            value = ops.convert_to_numpy(getattr(self, counter))
            out[counter] = float(value) if dtype == "float32" else int(value)
        return out

    def describe_last_rejection(self) -> str:
        """The last rejected step in words, or `""` if none was rejected.

        Example:

        >>> import keras, keras_nanguard as ng
        >>> ng.SafeOptimizer(keras.optimizers.SGD(0.1)).describe_last_rejection()
        ''
        """
        c = self.counters()
        reason = _REASONS.get(int(c["last_rejection"]), "none")
        if reason == "none":
            return ""
        names = self._plans.names[reason == "update"]
        index = int(c["last_nonfinite_index"])
        where = names[index] if 0 <= index < len(names) else f"variable #{index}"
        norm = c["rejected_grad_norm"]
        if reason == "gradient":
            return (
                f"the gradient of {where} was not finite "
                f"(global gradient norm {norm:.4g})"
            )
        return (
            f"the update would have made {where} non-finite although the "
            f"gradients were finite (global gradient norm {norm:.4g}); the "
            "learning rate is probably too high for these gradients"
        )

    def check_halted(self) -> None:
        """Raises `NonFiniteError` if `max_consecutive_skips` was reached.

        Call it where your loop reads values back anyway (e.g. when logging).

        Example:

        >>> import keras, keras_nanguard as ng
        >>> opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1), max_consecutive_skips=3)
        >>> opt.check_halted()  # nothing rejected yet: returns quietly
        """
        if self.max_consecutive_skips is None:
            return
        consecutive = int(ops.convert_to_numpy(self.consecutive_skips))
        if consecutive >= self.max_consecutive_skips:
            raise NonFiniteError(
                f"SafeOptimizer rejected {consecutive} steps in a row "
                f"(max_consecutive_skips={self.max_consecutive_skips}) and "
                f"halted; last, {self.describe_last_rejection()}. Training "
                "cannot make progress from this state: restore a good "
                "checkpoint, lower the learning rate or check the data.",
                report=self.counters(),
            )

    def _history_variables(self) -> list[keras.Variable]:
        return [getattr(self, name) for name in _HISTORY]

    # -------------------------------------------------------- serialization
    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "clipnorm": self.clipnorm,
            "lr_backoff": self.lr_backoff,
            "lr_recovery_steps": self.lr_recovery_steps,
            "min_lr_scale": self.min_lr_scale,
            "max_consecutive_skips": self.max_consecutive_skips,
        }

    @classmethod
    def from_config(
        cls, config: dict[str, Any], custom_objects: dict | None = None
    ) -> SafeOptimizer:
        config = copy.deepcopy(config)  # deserializing mutates nested dicts
        inner = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)


# ------------------------------------------------------------------ helpers
class _Plans:
    """Per-call-shape Python bookkeeping, kept out of Keras's variable tracking
    (a plain dict attribute would be tracked, and its variables with it)."""

    def __init__(self) -> None:
        self.cache: dict[tuple, tuple] = {}
        self.names: tuple[list[str], list[str]] = ([], [])
        self.buffers: dict[tuple, tuple[list, list]] = {}

    def rollback_buffers(self, state: list[keras.Variable]) -> list | None:
        """torch, eager: host-side buffers the rollback snapshot is copied
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


def _resolve_inner(optimizer: Any) -> keras.optimizers.Optimizer:
    if isinstance(optimizer, str):
        try:
            optimizer = keras.optimizers.get(optimizer)
        except ValueError as err:
            raise ValueError(
                "`optimizer` must be a Keras optimizer or the name of a built-in "
                f"one. Received: optimizer={optimizer!r}"
            ) from err
    if isinstance(optimizer, SafeOptimizer):
        raise ValueError(
            "`optimizer` is already a SafeOptimizer; wrapping it twice would "
            f"count and check every step twice. Received: optimizer={optimizer!r}"
        )
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "Wrap the other way round: LossScaleOptimizer(SafeOptimizer(...)). "
            "Under the `mixed_float16` policy, `model.compile` does this for "
            "you when given a SafeOptimizer; a SafeOptimizer inside a "
            "LossScaleOptimizer sees unscaled gradients. "
            f"Received: optimizer={optimizer!r}"
        )
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`optimizer` must be a `keras.optimizers.Optimizer` instance (Keras "
            f"3) or its name. Received: optimizer={optimizer!r} of type "
            f"{type(optimizer).__name__}"
        )
    if optimizer.loss_scale_factor is not None:
        raise ValueError(
            "The inner optimizer scales the loss (`loss_scale_factor`), so "
            "SafeOptimizer would see scaled gradients. Remove it; for mixed "
            "precision use LossScaleOptimizer(SafeOptimizer(...)). Received: "
            f"loss_scale_factor={optimizer.loss_scale_factor}"
        )
    return optimizer


def _path(v: keras.Variable, optimizer: bool = False) -> str:
    name = f"'{getattr(v, 'path', None) or v.name}'"
    return f"optimizer variable {name}" if optimizer else name
