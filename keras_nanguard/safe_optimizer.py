"""SafeOptimizer: an optimizer wrapper under which a bad step is never applied."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import keras
import numpy as np
from keras import ops

from keras_nanguard import _model_state as model_state
from keras_nanguard import _spikes as spikes
from keras_nanguard import _step_ops as step_ops
from keras_nanguard import ops as ng_ops
from keras_nanguard._validation import check_in, check_int, check_positive
from keras_nanguard.errors import NonFiniteError

_REASONS = {0: "none", 1: "gradient", 2: "update", 3: "spike"}
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
    ("accepted_grad_norm", "float32", 0.0),
    ("spike_steps", "int32", 0),
)
# keras-nanguard 0.1 saved these counters, after two variables of the base
# class that are no longer state.
_COUNTERS_0_1 = 11
# Counters that are history (NaNGuard keeps them through a rollback); the
# others (consecutive_skips, lr_scale, consecutive_accepts) are control state.
_HISTORY = (
    "skipped_steps",
    "spike_steps",
    "nonfinite_gradient_steps",
    "nonfinite_update_steps",
    "clipped_steps",
    "last_grad_norm",
    "rejected_grad_norm",
    "last_rejection",
    "last_nonfinite_index",
)


def _forwarded(name: str) -> property:
    """An attribute of `keras.optimizers.Optimizer` that belongs to the inner
    optimizer: read and written through the wrapper."""

    def get(self: SafeOptimizer) -> Any:
        return getattr(self.inner_optimizer, name)

    def set_(self: SafeOptimizer, value: Any) -> None:
        # The base class's __init__ writes its own defaults before the inner
        # optimizer is known; those are not the user's and are dropped.
        if "inner_optimizer" in self.__dict__:
            setattr(self.inner_optimizer, name, value)

    return property(get, set_, doc=f"The inner optimizer's `{name}`.")


class _Plan(NamedTuple):
    """What one shape of call checks; Python-only work, made once per shape."""

    checked: list[int]  # positions of the gradients that are checked
    state: list[keras.Variable]  # weights, then every inner optimizer variable
    floats: list[int]  # positions in `state` of the float variables
    grad_index: Any  # int32 tensor: checked gradient -> reported index
    state_index: Any  # int32 tensor: checked float state -> reported index


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

    The forward pass writes state of its own before the optimizer runs
    (BatchNormalization statistics, other non-trainable variables,
    seed-generator state, torch buffers inside `TorchModuleWrapper`). Keras
    does not tell an optimizer which model it trains, so one call ties them:
    `opt.attach(model)` for `fit`/`train_on_batch` (`NaNGuard` makes it for
    you), `with opt.transaction(model):` around a custom TensorFlow or torch
    step, `opt.stateless_commit(...)` in a JAX stateless loop. A rejected
    step then leaves that state bit-identical too; seed-generator state
    included, so a rejected step does not advance dropout's random stream
    and training with bad batches equals training without them.

    The decision is taken on the device, inside the compiled step
    (`tf.function`, XLA, `jax.jit`). Costs are measured in BENCHMARKS.md.

    Counters (scalar optimizer variables, saved with the optimizer; read them
    with `int(...)`/`float(...)` or all at once with `counters()`):

    - `skipped_steps`: rejected steps in total.
    - `consecutive_skips`: rejected steps since the last accepted one (0
      exactly when the last step was accepted).
    - `nonfinite_gradient_steps`: rejected because a gradient was NaN/inf.
    - `nonfinite_update_steps`: rejected because the update would have made a
      weight or an optimizer variable NaN/inf.
    - `clipped_steps`: accepted steps whose gradients were clipped (with
      gradient accumulation, the inner optimizer clips the accumulated
      gradient and this counter stays 0).
    - `last_grad_norm`: global norm of the raw gradients of the last step
      (NaN or inf when they were not finite).
    - `rejected_grad_norm`: the same for the last rejected step.
    - `last_rejection`: why the last rejected step was rejected
      (0 never, 1 gradient, 2 update, 3 spike); `describe_last_rejection()` says it in
      words, naming the first variable involved (`last_nonfinite_index` is
      its position in the model's trainable variables followed by the inner
      optimizer's variables).
    - `lr_scale`: the current learning-rate back-off factor (1 without it).
    - `accepted_grad_norm`: global norm of the raw gradients of the last
      accepted step.
    - `spike_steps`: rejected as gradient spikes (with `spike_sigma`).

    Everything else of `keras.optimizers.Optimizer` is the inner optimizer's,
    read and set through the wrapper: `learning_rate` (and schedules),
    `iterations`, `weight_decay`, `exclude_from_weight_decay()`, EMA
    (`use_ema`, `finalize_variable_values()`), `gradient_accumulation_steps`
    (`clipnorm` then clips the accumulated gradient that is applied).
    `variables` are the counters followed by the inner optimizer's variables.

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
            trouble and follows its policy (its rollback resets the streak);
            without one, `fit` warns when it ends. Defaults to `None`.
        spike_sigma: float > 0 or `None`. If set, a step whose raw global
            gradient norm is more than `spike_sigma` standard deviations above
            the mean of the last `spike_window` accepted steps is rejected
            like a non-finite one (counted in `spike_steps`), as OLMo-core's
            `SkipStepOptimizer` does; inactive until the window has filled.
            Defaults to `None`.
        spike_window: int >= 2. Accepted steps in the spike statistics.
            Defaults to 128.
        name: the optimizer's name. Defaults to an automatic name.

    Example:

    >>> import numpy as np, keras
    >>> import keras_nanguard as ng
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-2), clipnorm=1.0)
    >>> model.compile(optimizer=opt, loss="mse")
    >>> opt.attach(model)                     # non-trainable state too
    >>> x = np.ones((8, 4), "float32"); y = np.ones((8, 1), "float32")
    >>> x[3, 0] = np.nan                      # one poisoned sample
    >>> _ = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    >>> int(opt.skipped_steps), int(opt.iterations)
    (1, 0)
    >>> bool(np.isfinite(model.layers[0].kernel.numpy()).all())
    True
    """

    weight_decay = _forwarded("weight_decay")
    global_clipnorm = _forwarded("global_clipnorm")
    clipvalue = _forwarded("clipvalue")
    use_ema = _forwarded("use_ema")
    ema_momentum = _forwarded("ema_momentum")
    ema_overwrite_frequency = _forwarded("ema_overwrite_frequency")
    loss_scale_factor = _forwarded("loss_scale_factor")
    gradient_accumulation_steps = _forwarded("gradient_accumulation_steps")

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer | str,
        *,
        clipnorm: float | None = None,
        lr_backoff: float | None = None,
        lr_recovery_steps: int = 100,
        min_lr_scale: float = 1e-3,
        max_consecutive_skips: int | None = None,
        spike_sigma: float | None = None,
        spike_window: int = 128,
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
        _check_clipping(inner, clipnorm)
        if lr_backoff is not None:
            lr_backoff = check_in("lr_backoff", lr_backoff, 0, 1, closed_high=False)
            if not isinstance(inner.learning_rate, keras.Variable):
                raise ValueError(
                    "`lr_backoff` needs the inner optimizer's learning rate to "
                    "be a float, not a schedule or a callable. Received: "
                    f"learning_rate={inner._learning_rate!r}"
                )
        lr_recovery_steps = check_int("lr_recovery_steps", lr_recovery_steps, 1)
        min_lr_scale = check_in("min_lr_scale", min_lr_scale, 0, 1, closed_high=True)
        max_consecutive_skips = check_int(
            "max_consecutive_skips", max_consecutive_skips, 1, allow_none=True
        )

        spike_sigma = check_positive("spike_sigma", spike_sigma, allow_none=True)
        spike_window = check_int("spike_window", spike_window, 2)

        super().__init__(learning_rate=0.0, name=name)
        # The base class made an `iteration` and a `learning_rate` variable;
        # the wrapper uses the inner optimizer's, so they are not state.
        self._variables.clear()
        self.inner_optimizer = inner
        self.clipnorm = clipnorm
        self.lr_backoff = lr_backoff
        self.lr_recovery_steps = lr_recovery_steps
        self.min_lr_scale = min_lr_scale
        self.max_consecutive_skips = max_consecutive_skips
        self.spike_sigma = spike_sigma
        self.spike_window = spike_window
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
        if spike_sigma is not None:
            self.spike_norms, self.spike_count = spikes.make_window(self, spike_window)

    # ----------------------------------------------------------------- state
    def build(self, var_list: Sequence[keras.Variable]) -> None:
        var_list = list(var_list)
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        # Not super().build(): it reads the forwarded `use_ema` and
        # `gradient_accumulation_steps` and would make a second set of
        # averages and accumulators. Set untracked, as the base class does:
        # the model's variables are not the optimizer's.
        object.__setattr__(self, "_trainable_variables", var_list)
        object.__setattr__(
            self,
            "_trainable_variables_indices",
            {id(v): i for i, v in enumerate(var_list)},
        )
        self.built = True

    @property
    def variables(self) -> list[keras.Variable]:
        return self._variables[:] + self.inner_optimizer.variables

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Sets `variables` (counters, then the inner optimizer's), or only
        the inner optimizer's when given as many values as it has."""
        if not self.built:
            raise ValueError(
                "Call `optimizer.build(trainable_variables)` before "
                "`set_weights()`: the optimizer has no variables yet."
            )
        weights = list(weights)
        targets = self.variables
        if len(weights) == len(self.inner_optimizer.variables):
            targets = self.inner_optimizer.variables
        elif len(weights) != len(targets):
            raise ValueError(
                "`weights` must hold one value per variable of the SafeOptimizer "
                f"({len(targets)}) or of its inner optimizer "
                f"({len(self.inner_optimizer.variables)}). "
                f"Received: {len(weights)} values"
            )
        for variable, weight in zip(targets, weights, strict=True):
            if tuple(variable.shape) != tuple(np.shape(weight)):
                raise ValueError(
                    f"Optimizer variable '{variable.path}' has shape "
                    f"{tuple(variable.shape)}, not that of the value given. "
                    f"Received: shape {tuple(np.shape(weight))}"
                )
        for variable, weight in zip(targets, weights, strict=True):
            variable.assign(weight)

    def load_own_variables(self, store: Any) -> None:
        n_inner = len(self.inner_optimizer.variables)
        if len(store.keys()) == 2 + _COUNTERS_0_1 + n_inner:
            # A file from keras-nanguard 0.1: two dead variables of the base
            # class, its counters, then the inner optimizer's; counters added
            # since keep their initial values.
            old = [store[str(i)] for i in range(2, len(store.keys()))]
            values = [v.numpy() for v in self._variables]
            values[:_COUNTERS_0_1] = old[:_COUNTERS_0_1]
            values += old[_COUNTERS_0_1:]
            store = {str(i): v for i, v in enumerate(values)}
        super().load_own_variables(store)

    def exclude_from_weight_decay(
        self,
        var_list: Sequence[keras.Variable] | None = None,
        var_names: Sequence[str] | None = None,
    ) -> None:
        """Excludes variables from the inner optimizer's weight decay; see
        `keras.optimizers.Optimizer.exclude_from_weight_decay`."""
        self.inner_optimizer.exclude_from_weight_decay(
            var_list=var_list, var_names=var_names
        )

    def scale_loss(self, loss: Any) -> Any:
        return self.inner_optimizer.scale_loss(loss)

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
        # The end of `fit` is a point on the host: a halt is said there.
        if self.max_consecutive_skips is not None and self._halted():
            warnings.warn(
                f"SafeOptimizer halted: {self._halt_message()} Every step "
                "after the halt was rejected.",
                stacklevel=2,
            )
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
        self._plans.steps += 1
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
                np.array([reported[i] for i in checked], "int32"),
                np.array([reported[j] for j in floats], "int32"),
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
        norm, grad_finite = ng_ops._norm_and_finite([grads[i] for i in plan.checked])
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

        new_finite = ng_ops._finite_flags([plan.state[j] for j in plan.floats])
        update_ok = ops.all(new_finite)
        ok = ops.logical_and(grads_ok, update_ok)
        spike = None
        if self.spike_sigma is not None:
            spike = spikes.is_spike(
                norm, self.spike_norms.value, self.spike_count.value, self.spike_sigma
            )
            ok = ops.logical_and(ok, ~spike)
        if self.max_consecutive_skips is not None:  # halted: reject everything
            ok = ops.logical_and(
                ok, self.consecutive_skips.value < self.max_consecutive_skips
            )
        step_ops.restore_unless(ok, plan.state, backup)
        bad_index = ops.where(
            grads_ok,
            ops.take(plan.state_index, step_ops.first_false(new_finite)),
            ops.take(plan.grad_index, step_ops.first_false(grad_finite)),
        )
        self._count(
            ok=ok,
            grads_ok=grads_ok,
            update_ok=update_ok,
            clipped=clipped,
            norm=norm,
            bad_index=bad_index,
            spike=spike,
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
        self, *, ok, grads_ok, update_ok, clipped, norm, bad_index, spike
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
            spikes.record(ok, norm, self.spike_norms, self.spike_count)
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

    # ------------------------------------------------- the model's own state
    def attach(self, model: keras.Model) -> None:
        """Ties this optimizer to `model`, so that in `model.fit`,
        `train_on_batch` and the like a rejected step also leaves the state
        the forward pass writes bit-identical: BatchNormalization statistics,
        every non-trainable variable, seed-generator state, and on torch the
        buffers of modules inside `keras.layers.TorchModuleWrapper`.

        Keras does not tell an optimizer which model it trains; this call
        does, by wrapping the model's `train_step` (its public override
        point) in a transaction. Call it once, before or after `compile`;
        `NaNGuard` calls it for you. The model must be compiled with this
        optimizer (or a `LossScaleOptimizer` around it) when it trains.

        Args:
            model: the `keras.Model` this optimizer trains.

        Example:

        >>> import numpy as np, keras, keras_nanguard as ng
        >>> model = keras.Sequential([keras.Input((2,)),
        ...     keras.layers.BatchNormalization(), keras.layers.Dense(1)])
        >>> opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1))
        >>> model.compile(optimizer=opt, loss="mse")
        >>> opt.attach(model)
        >>> x = np.array([[np.nan, 1.0]] * 4, "float32")
        >>> _ = model.fit(x, np.ones((4, 1)), verbose=0)
        >>> model.layers[0].moving_mean.numpy().tolist()   # untouched
        [0.0, 0.0]
        """
        if not isinstance(model, keras.Model):
            raise TypeError(
                "`model` must be a `keras.Model`. "
                f"Received: model={model!r} of type {type(model).__name__}"
            )
        self._check_is_optimizer_of(model)
        step = model.train_step
        if getattr(step, "_nanguard_optimizer", None) is self:
            return
        original = getattr(step, "_nanguard_original", step)

        if keras.backend.backend() == "jax":

            def train_step(state: Any, data: Any) -> Any:
                logs, new_state = original(state, data)
                trainable, non_trainable, optimizer_values, metrics = new_state
                self._check_is_optimizer_of(model)
                variables = model.optimizer.variables
                accepted = self._accepted(optimizer_values, variables)
                non_trainable = model_state.select(accepted, state[1], non_trainable)
                metrics = model_state.select(accepted, state[3], metrics)
                mapping = list(zip(model.metrics_variables, metrics, strict=True))
                mapping += list(zip(variables, optimizer_values, strict=True))
                with keras.StatelessScope(state_mapping=mapping):
                    logs = self._step_logs(model, logs)
                return logs, (trainable, non_trainable, optimizer_values, metrics)

        else:

            def train_step(data: Any) -> Any:
                model_state.build_for(model, data)
                state = model_state.forward_state(model) + model.metrics_variables
                with self._guard(model, state):
                    logs = original(data)
                return self._step_logs(model, logs)

        train_step._nanguard_optimizer = self  # type: ignore[attr-defined]
        train_step._nanguard_original = original  # type: ignore[attr-defined]
        model.train_step = train_step
        if getattr(model, "train_function", None) is not None:
            model.make_train_function(force=True)  # made before: remake it

    def transaction(self, model: keras.Model) -> contextlib.AbstractContextManager:
        """A custom training step as a whole-model transaction (TensorFlow,
        torch; eager or inside `tf.function`).

        Wrap the forward pass, the loss, the gradients and this optimizer's
        `apply`: if the step is rejected, the state the forward pass wrote
        (BatchNormalization statistics, non-trainable variables, seed state,
        torch buffers) is put back as it was. If the block raises, that state
        is put back too. In a JAX stateless loop use `stateless_commit`.

        Args:
            model: the built `keras.Model` being trained.

        Example:

        >>> import numpy as np, keras, keras_nanguard as ng
        >>> model = keras.Sequential([keras.Input((2,)),
        ...     keras.layers.BatchNormalization(), keras.layers.Dense(1)])
        >>> opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1))
        >>> opt.build(model.trainable_variables)
        >>> grads = [keras.ops.full(v.shape, np.nan) for v in model.trainable_variables]
        >>> with opt.transaction(model):
        ...     _ = model(np.ones((4, 2), "float32"), training=True)
        ...     opt.apply(grads, model.trainable_variables)
        >>> model.layers[0].moving_mean.numpy().tolist()
        [0.0, 0.0]
        """
        if not model.built:
            raise ValueError(
                "`transaction(model)` needs a built model (call it on a batch "
                f"first), to know its state. Received: model={model.name!r}, "
                "not built"
            )
        return self._guard(model, model_state.forward_state(model))

    @contextlib.contextmanager
    def _guard(self, model: keras.Model, state: list[Any]) -> Iterator[None]:
        self._check_is_optimizer_of(model)
        before = model_state.read(state)
        steps = self._plans.steps
        try:
            yield
        except BaseException:
            model_state.keep_unless(False, state, before)
            raise
        if self._plans.steps == steps:
            raise RuntimeError(
                "No step of this SafeOptimizer ran inside `transaction(model)`: "
                "call `apply`/`apply_gradients` inside the `with` block."
            )
        model_state.keep_unless(self.consecutive_skips.value == 0, state, before)

    def stateless_commit(
        self,
        optimizer_variables: Sequence[Any],
        before: Sequence[Any],
        after: Sequence[Any],
    ) -> list[Any]:
        """JAX stateless loops: the non-trainable values to carry on with.

        `after` (from `stateless_call`) if the step that returned
        `optimizer_variables` (from `stateless_apply`) was accepted, else
        `before`, tensor by tensor, on the device.

        Args:
            optimizer_variables: the values `stateless_apply` returned, in
                `optimizer.variables` order.
            before: the non-trainable values the step started from.
            after: the non-trainable values the forward pass returned.

        Returns:
            A list of tensors, like `after`.

        Example:

        >>> import keras, keras_nanguard as ng
        >>> from keras import ops
        >>> opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1))
        >>> opt.build([keras.Variable(1.0)])
        >>> kept = opt.stateless_commit([v.value for v in opt.variables],
        ...                              [ops.zeros(2)], [ops.ones(2)])
        >>> ops.convert_to_numpy(kept[0]).tolist()   # accepted: `after`
        [1.0, 1.0]
        """
        accepted = self._accepted(list(optimizer_variables), self.variables)
        return model_state.select(accepted, list(before), list(after))

    def _step_logs(self, model: keras.Model, logs: Any) -> Any:
        """A `fit` step's logs after the transaction: the metrics as they are
        (a rejected step left them out), and training health figures."""
        if not isinstance(logs, dict):
            return logs  # a custom train_step's own structure
        logs = dict(logs)
        fresh = model.get_metrics_result()
        logs.update({k: v for k, v in fresh.items() if k in logs})
        logs["nanguard_grad_norm"] = self.accepted_grad_norm.value
        logs["nanguard_rejected_steps"] = self.skipped_steps.value
        if self.lr_backoff is not None:
            logs["nanguard_lr_scale"] = self.lr_scale.value
        if self.spike_sigma is not None:
            logs["nanguard_spike_steps"] = self.spike_steps.value
        return logs

    def _accepted(self, values: list[Any], variables: list[keras.Variable]) -> Any:
        """Whether the step that produced `values` (of `variables`) was
        accepted: `consecutive_skips` is 0 exactly then."""
        if len(values) != len(variables):
            raise ValueError(
                "`optimizer_variables` must hold one value per variable of "
                f"`optimizer.variables` ({len(variables)}). "
                f"Received: {len(values)} values"
            )
        index = [id(v) for v in variables].index(id(self.consecutive_skips))
        return values[index] == 0

    def _check_is_optimizer_of(self, model: keras.Model) -> None:
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and find_safe_optimizer(optimizer) is not self:
            raise ValueError(
                "The model is compiled with another optimizer; compile it with "
                "this SafeOptimizer before tying them. "
                f"Received: model.optimizer={optimizer!r}"
            )

    # ------------------------------------------------------------ reporting
    def counters(
        self, optimizer_variables: Sequence[Any] | None = None
    ) -> dict[str, float | int]:
        """The counters as Python numbers (reads them from the device).

        Args:
            optimizer_variables: in a JAX stateless loop, the values
                `stateless_apply` returned (in `optimizer.variables` order);
                by default this optimizer's own variables.

        Example:

        >>> import keras, keras_nanguard as ng
        >>> ng.SafeOptimizer(keras.optimizers.SGD(0.1)).counters()["skipped_steps"]
        0
        """
        values = self._counter_values(optimizer_variables)
        out: dict[str, float | int] = {}
        for (counter, dtype, _), value in zip(_COUNTERS, values, strict=True):
            value = ops.convert_to_numpy(value)
            out[counter] = float(value) if dtype == "float32" else int(value)
        return out

    def _counter_values(self, optimizer_variables: Sequence[Any] | None) -> list:
        if optimizer_variables is None:
            return [getattr(self, counter) for counter, _, _ in _COUNTERS]
        values = list(optimizer_variables)
        if len(values) != len(self.variables):
            raise ValueError(
                "`optimizer_variables` must hold one value per variable of "
                f"`optimizer.variables` ({len(self.variables)}), as "
                f"`stateless_apply` returns them. Received: {len(values)} values"
            )
        return values[: len(_COUNTERS)]  # the counters come first

    def describe_last_rejection(
        self, optimizer_variables: Sequence[Any] | None = None
    ) -> str:
        """The last rejected step in words, or `""` if none was rejected.

        Args:
            optimizer_variables: as for `counters`.

        Example:

        >>> import keras, keras_nanguard as ng
        >>> ng.SafeOptimizer(keras.optimizers.SGD(0.1)).describe_last_rejection()
        ''
        """
        c = self.counters(optimizer_variables)
        reason = _REASONS.get(int(c["last_rejection"]), "none")
        if reason == "none":
            return ""
        names = [_path(v) for v in getattr(self, "_trainable_variables", [])]
        names += [_path(v, optimizer=True) for v in self.inner_optimizer.variables]
        index = int(c["last_nonfinite_index"])
        where = names[index] if 0 <= index < len(names) else f"variable #{index}"
        norm = c["rejected_grad_norm"]
        if reason == "spike":
            norms = self.spike_norms.value
            if optimizer_variables is not None:  # the window follows the counters
                norms = list(optimizer_variables)[len(_COUNTERS)]
            mean, std = (
                float(ops.convert_to_numpy(v)) for v in spikes.statistics(norms)
            )
            return (
                f"the global gradient norm {norm:.4g} was a spike, more than "
                f"{self.spike_sigma:g} standard deviations above the mean of the "
                f"last {self.spike_window} accepted steps ({mean:.4g} +- {std:.4g})"
            )
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

    def check_halted(self, optimizer_variables: Sequence[Any] | None = None) -> None:
        """Raises `NonFiniteError` if `max_consecutive_skips` was reached.

        Call it where your loop reads values back anyway (e.g. when logging).

        Args:
            optimizer_variables: as for `counters`.

        Example:

        >>> import keras, keras_nanguard as ng
        >>> opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1), max_consecutive_skips=3)
        >>> opt.check_halted()  # nothing rejected yet: returns quietly
        """
        if self.max_consecutive_skips is None:
            return
        if self._halted(optimizer_variables):
            raise NonFiniteError(
                f"SafeOptimizer {self._halt_message(optimizer_variables)} "
                "Training cannot make progress from this state: restore a good "
                "checkpoint, lower the learning rate or check the data.",
                report=self.counters(optimizer_variables),
            )

    def _halted(self, optimizer_variables: Sequence[Any] | None = None) -> bool:
        consecutive = self.counters(optimizer_variables)["consecutive_skips"]
        return consecutive >= self.max_consecutive_skips

    def _halt_message(self, optimizer_variables: Sequence[Any] | None = None) -> str:
        c = self.counters(optimizer_variables)
        return (
            f"rejected {c['consecutive_skips']} steps in a row "
            f"(max_consecutive_skips={self.max_consecutive_skips}) and halted; "
            f"last, {self.describe_last_rejection(optimizer_variables)}."
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
            "spike_sigma": self.spike_sigma,
            "spike_window": self.spike_window,
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
        self.cache: dict[tuple, _Plan] = {}
        self.buffers: dict[tuple, tuple[list, list]] = {}
        self.steps = 0  # calls of `apply`, so `transaction` can tell one ran

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


def find_safe_optimizer(optimizer: Any) -> SafeOptimizer | None:
    """The SafeOptimizer in a chain of wrappers (e.g. inside LossScaleOptimizer)."""
    seen = 0
    while optimizer is not None and seen < 8:
        if isinstance(optimizer, SafeOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
        seen += 1
    return None


def _check_clipping(inner: keras.optimizers.Optimizer, clipnorm: float | None) -> None:
    if clipnorm is None:
        return
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
            f"Received: clipnorm={clipnorm} and inner optimizer {inner_clip}"
        )


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
