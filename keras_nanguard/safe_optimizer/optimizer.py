"""SafeOptimizer: an optimizer wrapper under which a bad step is never applied."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from keras_nanguard._validation import check_in, check_int, check_positive
from keras_nanguard.safe_optimizer import file_layouts as layouts
from keras_nanguard.safe_optimizer import spike_window as spikes
from keras_nanguard.safe_optimizer import step_ops
from keras_nanguard.safe_optimizer.counters import _COUNTERS, ReportsMixin
from keras_nanguard.safe_optimizer.inner import (
    check_clipping,
    forwarded,
    refuse_unknown,
    resolve_inner,
)
from keras_nanguard.safe_optimizer.model_transaction import ModelStateMixin
from keras_nanguard.safe_optimizer.step import TransactionMixin, _Plans


@keras.saving.register_keras_serializable(package="keras_nanguard")
class SafeOptimizer(
    ModelStateMixin, TransactionMixin, ReportsMixin, keras.optimizers.Optimizer
):
    r"""Wraps any Keras optimizer so that a bad step is never applied.

    Every call to `apply` (and so every `model.fit` step) is a transaction,
    decided on the device inside the compiled step: the global norm of the
    raw gradients is computed once (in float32, without overflow for large
    but finite gradients); a NaN or inf gradient rejects the step; otherwise
    the gradients are clipped to a global norm of `clipnorm` when set
    (:math:`g \leftarrow g \cdot \min(1, c / \|g\|)`) and the inner
    optimizer updates; a new weight or optimizer variable (moments, EMA,
    accumulators) that is not finite rejects the step. A rejected step leaves
    the trainable weights, every optimizer variable and `iterations` (so the
    learning-rate schedule position) bit-identical; only the counters change.

    What the forward pass writes (BatchNormalization statistics, seed
    generators, torch buffers) is covered too once the model is tied in:
    `opt.attach(model)` for `fit` (`NaNGuard` does it for you),
    `with opt.transaction(model):` around a custom TensorFlow or torch step,
    `opt.stateless_commit(...)` in a JAX stateless loop.

    Counters are scalar optimizer variables, saved with the optimizer
    (`skipped_steps`, `spike_steps`, `last_grad_norm`, ...; the README has
    the table): read one with `int(opt.skipped_steps)`, all at once with
    `counters()`, the last rejection in words with
    `describe_last_rejection()`.

    Everything else of `keras.optimizers.Optimizer` (`learning_rate` and
    schedules, `iterations`, weight decay, EMA, gradient accumulation) is the
    inner optimizer's, read and set through the wrapper. `variables` are the
    counters followed by the inner optimizer's variables.

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
            accepted steps in a row divide it back, up to the original. Needs
            a float inner learning rate, not a schedule. Defaults to `None`.
        lr_recovery_steps: int >= 1. Accepted steps in a row before the
            learning rate recovers one back-off factor. Defaults to 100.
        min_lr_scale: float in (0, 1]. Lowest learning-rate scale the back-off
            reaches. Defaults to 1e-3.
        max_consecutive_skips: int >= 1 or `None`. After this many rejected
            steps in a row the optimizer halts: it rejects every further step
            and raises `keras_nanguard.NonFiniteError` where it next runs on
            the host: at once in eager custom loops and in eager `fit` steps
            of an unattached optimizer (torch, `run_eagerly=True`), or at
            `check_halted()`. In other `fit` steps a `NaNGuard` treats the
            halt as trouble and follows its policy; without one, `fit` warns
            when it ends. Defaults to `None`.
        spike_factor: float > 1 or `None`. If set, a step whose raw global
            gradient norm is more than `spike_factor` times the 90th
            percentile of the last `spike_window` steps' norms is rejected
            like a non-finite one (counted in `spike_steps`), as OLMo-core's
            `SkipStepOptimizer` rejects a norm 6 standard deviations above
            the mean (which rejects clean steps of noisy batches: see
            BENCHMARKS.md); inactive until the window has filled. 10 is a
            good value. A rejected spike enters the window as the threshold
            it exceeded, so a lasting rise of the norm is taken in after a
            run of rejections instead of rejecting every later step.
            Defaults to `None`.
        spike_window: int >= 2. Steps in the spike statistics (accepted ones
            and spikes). Defaults to 128.
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

    weight_decay = forwarded("weight_decay")
    global_clipnorm = forwarded("global_clipnorm")
    clipvalue = forwarded("clipvalue")
    use_ema = forwarded("use_ema")
    ema_momentum = forwarded("ema_momentum")
    ema_overwrite_frequency = forwarded("ema_overwrite_frequency")
    loss_scale_factor = forwarded("loss_scale_factor")
    gradient_accumulation_steps = forwarded("gradient_accumulation_steps")

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer | str,
        *,
        clipnorm: float | None = None,
        lr_backoff: float | None = None,
        lr_recovery_steps: int = 100,
        min_lr_scale: float = 1e-3,
        max_consecutive_skips: int | None = None,
        spike_factor: float | None = None,
        spike_window: int = 128,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        inner = resolve_inner(optimizer, SafeOptimizer)
        refuse_unknown(kwargs, inner)
        clipnorm = check_positive("clipnorm", clipnorm, allow_none=True)
        check_clipping(inner, clipnorm)
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

        if spike_factor is not None:
            spike_factor = check_in(
                "spike_factor", spike_factor, 1, math.inf, closed_high=False
            )
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
        self.spike_factor = spike_factor
        self.spike_window = spike_window
        self._plans = _Plans()
        # Saved while attached to a model: `apply` warns once when it is not.
        self._expects_attach = False
        for counter, dtype, initial in _COUNTERS:
            var = self.add_variable(
                shape=(),
                dtype=dtype,
                initializer=keras.initializers.Constant(initial),
                aggregation="none",
                name=counter,
            )
            setattr(self, counter, var)
        if spike_factor is not None:
            self.spike_norms, self.spike_count, self.last_spike = spikes.make_window(
                self, spike_window
            )

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
        # The usual call's plan (every gradient present), made here in eager
        # code: a compiled torch step that made it would compile twice.
        self._plan(var_list, var_list)

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
        super().load_own_variables(
            layouts.upgrade(
                store,
                counters=len(_COUNTERS),
                window=len(self._variables) - len(_COUNTERS),
                inner=len(self.inner_optimizer.variables),
                initial=[v.numpy() for v in self._variables],
            )
        )

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
        self._check_step_of(trainable_variables)
        self._plans.applied = True
        if keras.backend.backend() == "tensorflow":
            self._tf_apply(grads, trainable_variables)
        else:
            # JAX: under a keras.distribution the step is one SPMD program whose
            # gradients are already global, so every device decides alike.
            self._transaction(grads, trainable_variables)
        if (
            self.max_consecutive_skips is not None
            and not self._plans.in_fit
            and step_ops.executing_eagerly(self.consecutive_skips)
        ):
            self.check_halted()

    # -------------------------------------------------------- serialization
    def get_config(self) -> dict[str, Any]:
        return {
            "attached": self._expects_attach or self._plans.attached,
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "clipnorm": self.clipnorm,
            "lr_backoff": self.lr_backoff,
            "lr_recovery_steps": self.lr_recovery_steps,
            "min_lr_scale": self.min_lr_scale,
            "max_consecutive_skips": self.max_consecutive_skips,
            "spike_factor": self.spike_factor,
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
        attached = config.pop("attached", False)  # not in files of 0.2
        layouts.upgrade_config(config)
        optimizer = cls(inner, **config)
        optimizer._expects_attach = bool(attached)
        return optimizer


# ------------------------------------------------------------------ helpers
def find_safe_optimizer(optimizer: Any) -> SafeOptimizer | None:
    """The SafeOptimizer in a chain of wrappers (e.g. inside LossScaleOptimizer)."""
    seen = 0
    while optimizer is not None and seen < 8:
        if isinstance(optimizer, SafeOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
        seen += 1
    return None
