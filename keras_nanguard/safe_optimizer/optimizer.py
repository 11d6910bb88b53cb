"""SafeOptimizer: an optimizer wrapper under which a bad step is never applied."""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import keras
import numpy as np

from keras_nanguard import _kernels as kernels
from keras_nanguard import _rates as rates
from keras_nanguard._arguments import Arguments, ArgumentSpec, Check
from keras_nanguard._backend import current as backend
from keras_nanguard._validation import (
    check_bool,
    check_choice,
    check_in,
    check_int,
    check_positive,
)
from keras_nanguard.flight.record import FlightRecord
from keras_nanguard.flight.recorder import PROBE_EVERY, FlightRecorder
from keras_nanguard.safe_optimizer import adaptive_clip, step_ops
from keras_nanguard.safe_optimizer import file_layouts as layouts
from keras_nanguard.safe_optimizer.adaptive_clip import MAX_UPDATE_RATIO, ClipState
from keras_nanguard.safe_optimizer.attributes import CounterAttribute, SettingAttribute
from keras_nanguard.safe_optimizer.counters import (
    COUNTER_NAMES,
    Counters,
    variable_names,
)
from keras_nanguard.safe_optimizer.inner import (
    check_multi,
    check_with_inner,
    forwarded,
    refuse_unknown,
    resolve_inner,
)
from keras_nanguard.safe_optimizer.model_transaction import ModelTransaction
from keras_nanguard.safe_optimizer.quarantine import (
    Quarantine,
    QuarantinedBatch,
    reasons,
)
from keras_nanguard.safe_optimizer.step import GuardedStep


@keras.saving.register_keras_serializable(package="keras_nanguard")
class SafeOptimizer(keras.optimizers.Optimizer):
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
    (`skipped_steps`, `spike_steps`, `last_grad_norm`, ...; the table is in
    docs/guide/bad_steps.md): read one with `int(opt.skipped_steps)`, all at
    once with `counters()`, the last rejection in words with
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
        clip: `"adaptive"` or `None`. `"adaptive"` grades each step instead
            of only accepting or rejecting it (`adaptive_clip` has the
            rules and where they come from): a moderate outlier of the
            global gradient norm is clipped to a threshold learnt from the
            run's own norms (ZClip: an EMA of the norm's mean and variance,
            z-score 2.5), each layer's gradient to 1.05 times an EMA of its
            own clipped norm (AdaGC), and each weight tensor's update is
            bounded to `max_update_ratio` times the tensor's RMS; non-finite
            steps, and spikes with `spike_factor`, are rejected as without
            it. With it a run trains at learning rates where plain clipping
            ends far from the best loss (BENCHMARKS.md, "Train at a higher
            learning rate"). `clipnorm` still caps the global threshold.
            Not with gradient accumulation. Defaults to `None`.
        max_update_ratio: float > 0 or `None`. With `clip="adaptive"`, the
            largest RMS of a weight tensor's update as a fraction of the
            tensor's RMS (at least 1e-3): a larger update is scaled down.
            `None`: no bound. Defaults to 0.01.
        reset_moments: int >= 1 or `None`. With `clip="adaptive"`, every
            this many rejected steps in a row the inner optimizer's moments
            (every variable of it but its step count and learning rate)
            go back to their initial values, as SPAM resets Adam's moments
            after a spike: moments filled by a run-away stretch stop
            steering the next steps. Not with `use_ema`. Defaults to `None`.
        probe_every: int >= 1. The flight recorder's cadence: one step in
            this many also records the weight and update norms per layer,
            the optimizer state's smallest denominator and the batch's input
            and output figures (the other steps record the loss and the
            gradient norms only). Read it with `flight_record()`; NaNGuard's
            `explain()` and early warning read it. Defaults to 16.
        flight_recorder: bool. `False` records nothing (no recorder
            variables, no work in the step; `flight_record()` is empty).
            Defaults to `True`.
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

    # The counters (docs/guide/bad_steps.md has the table), then the spike
    # window's variables (with `spike_factor`); see `Counters`.
    skipped_steps = CounterAttribute()
    consecutive_skips = CounterAttribute()
    nonfinite_gradient_steps = CounterAttribute()
    nonfinite_update_steps = CounterAttribute()
    clipped_steps = CounterAttribute()
    last_grad_norm = CounterAttribute(coded=True)
    rejected_grad_norm = CounterAttribute(coded=True)
    last_rejection = CounterAttribute()
    last_nonfinite_index = CounterAttribute()
    lr_scale = CounterAttribute()
    consecutive_accepts = CounterAttribute()
    accepted_grad_norm = CounterAttribute()
    spike_steps = CounterAttribute()
    loss_scale_steps = CounterAttribute()
    quarantine_steps = CounterAttribute()
    quarantined_samples = CounterAttribute()
    quarantine_limit_steps = CounterAttribute()
    quarantine_log = CounterAttribute()
    recent_rejections = CounterAttribute()
    spike_norms = CounterAttribute()
    spike_count = CounterAttribute()
    last_spike = CounterAttribute()

    @property
    def clip_threshold(self) -> Any:
        """With `clip="adaptive"`, the global gradient norm above which the
        next step is clipped (inf until 25 steps are in the statistics, or
        `clipnorm`), a value."""
        return kernels.decode_finite(self._clip_variable("clip_threshold").value)

    @property
    def bounded_update_steps(self) -> keras.Variable:
        """With `clip="adaptive"`, accepted steps whose update was bounded."""
        return self._clip_variable("bounded_update_steps")

    @property
    def moment_resets(self) -> keras.Variable:
        """With `clip="adaptive"`, resets of the inner optimizer's moments."""
        return self._clip_variable("moment_resets")

    def _clip_variable(self, name: str) -> keras.Variable:
        state = self._clip_state
        if state is None:
            raise AttributeError(
                f'SafeOptimizer has `{name}` only with `clip="adaptive"`, once '
                f"built. Received: clip={self.clip!r}, built={self.built}"
            )
        variable: keras.Variable = getattr(state, name)
        return variable

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer | str,
        *,
        # Each argument's one declaration: type, check, default; the
        # attributes of these names and `get_config` are made from them.
        clipnorm: Annotated[
            float | None, Check(check_positive, allow_none=True)
        ] = None,
        lr_backoff: Annotated[
            float | None, Check(check_in, 0, 1, closed_high=False, allow_none=True)
        ] = None,
        lr_recovery_steps: Annotated[int, Check(check_int, 1)] = 100,
        min_lr_scale: Annotated[float, Check(check_in, 0, 1, closed_high=True)] = 1e-3,
        max_consecutive_skips: Annotated[
            int | None, Check(check_int, 1, allow_none=True)
        ] = None,
        spike_factor: Annotated[
            float | None,
            Check(check_in, 1, math.inf, closed_high=False, allow_none=True),
        ] = None,
        spike_window: Annotated[int, Check(check_int, 2)] = 128,
        clip: Annotated[
            str | None, Check(check_choice, ("adaptive",), allow_none=True, fixed=True)
        ] = None,
        max_update_ratio: Annotated[
            float | None, Check(check_positive, allow_none=True)
        ] = MAX_UPDATE_RATIO,
        reset_moments: Annotated[
            int | None, Check(check_int, 1, allow_none=True, fixed=True)
        ] = None,
        probe_every: Annotated[int, Check(check_int, 1, fixed=True)] = PROBE_EVERY,
        flight_recorder: Annotated[bool, Check(check_bool, fixed=True)] = True,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        inner = resolve_inner(optimizer, SafeOptimizer)
        refuse_unknown(kwargs, inner)
        settings = ARGUMENTS.checked(locals(), inner)  # the names above
        super().__init__(learning_rate=0.0, name=name)
        # The base class made an `iteration` and a `learning_rate` variable;
        # the wrapper uses the inner optimizer's, so they are not state.
        self._variables.clear()
        self.inner_optimizer = inner
        # The parts (plain objects: Keras tracks no variable through them;
        # the counters' variables are tracked by `add_variable`).
        self._settings = settings
        self._counters = Counters.create(self, settings)
        self._recorder = FlightRecorder(settings.probe_every)
        self._recording = settings.flight_recorder
        recorder = self._recorder if self._recording else None
        self._step = GuardedStep(inner, self._counters, settings, recorder)
        self._model_transaction = ModelTransaction(
            self, self._counters, settings, recorder
        )
        # A custom loop's batch under quarantine, counted by the next `apply`.
        self._quarantined_batch: QuarantinedBatch | None = None

    def _configure(self, settings: Arguments) -> None:
        """Hands `settings` to the optimizer and its parts."""
        state = self._clip_state
        if state is not None and settings.max_update_ratio is not None:
            if self._settings.max_update_ratio is None:
                raise AttributeError(
                    "`max_update_ratio` was None when the SafeOptimizer was "
                    "built (no bound in its steps); make a new one to bound "
                    f"updates. Received: max_update_ratio={settings.max_update_ratio}"
                )
            # A variable: steps compiled already read the new value too.
            state.update_ratio.assign(settings.max_update_ratio)
        elif state is not None and self._settings.max_update_ratio is not None:
            raise AttributeError(
                "`max_update_ratio` cannot become None once the SafeOptimizer "
                "is built (its compiled steps bound updates): set a large value "
                "instead. Received: max_update_ratio=None"
            )
        self._settings = settings
        self._counters.settings = settings
        self._step.settings = settings
        self._model_transaction.settings = settings

    # ----------------------------------------------------------------- state
    def build(self, var_list: Sequence[keras.Variable]) -> None:
        var_list = list(var_list)
        self._step.build(var_list)  # the inner optimizer's build too
        if rates.is_multi(self.inner_optimizer):
            # A map given as a callable has its sub-optimizers only now.
            check_multi(self.inner_optimizer, SafeOptimizer)
            check_with_inner(self._settings, self.inner_optimizer)
        if self._recording and self._recorder.ring is None:  # after the window
            self._recorder.build(self, var_list)
        settings = self._settings
        if settings.clip == "adaptive" and self._step.clip_state is None:
            self._step.clip_state = ClipState.create(
                self, len(var_list), settings.clipnorm, settings.max_update_ratio
            )
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
        super().load_own_variables(
            layouts.upgrade(
                store,
                counters=len(COUNTER_NAMES),
                window=len(self._counters.variables()) - len(COUNTER_NAMES),
                recorder=len(self._recorder.variables()) + len(self._clip_variables()),
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
        # The end of `fit` is a point on the host: a halt, or a run frozen
        # by rejections, is said there (one read).
        if self.max_consecutive_skips is not None and self._counters.halted():
            warnings.warn(
                f"SafeOptimizer halted: {self._counters.halt_message(self._names())} "
                "Every step after the halt was rejected.",
                stacklevel=2,
            )
        elif self.built:
            frozen = self._counters.frozen_message(self._names())
            if frozen:
                warnings.warn(frozen, stacklevel=2)
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
        building = not self.built
        variables = self._variables_to_update(trainable_variables)
        if len(grads) != len(variables):
            raise ValueError(
                "`grads` and `trainable_variables` must have the same length. "
                f"Received: len(grads)={len(grads)}, "
                f"len(trainable_variables)={len(variables)}"
            )
        self._model_transaction.step_begins(variables)
        if building and backend.discarded_if_building():
            # TensorFlow traces a step that makes variables twice and runs
            # the second trace only: tracing the transaction in the first
            # too made a small model's first `fit` 1.5x as long
            # (benchmarks/bench_first_fit.py).
            self._quarantined_batch = None
            return
        self._step.apply(grads, variables)
        batch, self._quarantined_batch = self._quarantined_batch, None
        if batch is not None:
            self._count_quarantined(batch)
        if (
            self._settings.max_consecutive_skips is not None
            and not self._model_transaction.in_fit
            and step_ops.executing_eagerly(self._counters.consecutive_skips)
        ):
            self.check_halted()

    def _count_quarantined(self, batch: QuarantinedBatch) -> None:
        try:
            # Under torch.distributed, the rows of every process's batch.
            backend.record_rows(
                self._counters.record_quarantine, batch.codes, batch.over
            )
        except Exception as err:
            if type(err).__name__ != "UnexpectedTracerError":
                raise
            raise ValueError(
                "The quarantined batch's rows were last seen by `batch.loss` "
                "under `jax.grad`, whose values cannot leave it: return "
                "`batch.codes` from the loss function (as aux) and set "
                "`batch.codes = codes` before `stateless_apply` "
                "(docs/guide/quarantine.md, 'Custom loops')."
            ) from err

    def _variables_to_update(
        self, trainable_variables: Sequence[keras.Variable] | None
    ) -> list[keras.Variable]:
        """The variables `apply` updates; builds the optimizer first with
        them if it is not built."""
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing `grads` without `trainable_variables`, the "
                    "optimizer must already be built. Call "
                    "`optimizer.build(trainable_variables)` first."
                )
            return self._trainable_variables
        variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
        return variables

    # ------------------------------------------------------ the model's side
    def attach(
        self,
        model: keras.Model,
        *,
        quarantine: bool | None = None,
        max_quarantine_fraction: float = 0.5,
    ) -> None:
        """Ties this optimizer to `model`, so that in `model.fit`,
        `train_on_batch` and the like a rejected step also leaves the state
        the forward pass writes bit-identical: BatchNormalization statistics,
        every non-trainable variable, seed-generator state, and on torch the
        buffers of modules inside `keras.layers.TorchModuleWrapper` (not
        torch's global generator, which unseeded random layers draw from
        there: give them a `seed`).

        Keras does not tell an optimizer which model it trains; this call
        does, by wrapping the model's `train_step` (its public override
        point) in a transaction. Call it once, before or after `compile`;
        `NaNGuard` calls it for you. While the model is compiled with this
        optimizer (or a `LossScaleOptimizer` around it, as `compile` makes
        under `mixed_float16`) its steps are guarded; compiled with another,
        they are the plain ones; `detach` undoes it. A step the loss scaler
        skips is rejected too: a non-finite loss is a bad batch (counted as
        a non-finite gradient, the loss scale kept), a finite one an
        overflow (`loss_scale_steps`, the scale halved as usual).

        With `quarantine=True` a bad *row* costs that row, not the batch:
        the rows whose inputs, targets or sample weight hold a NaN or inf,
        and the rows whose own loss is not finite (`log(0)` for that
        sample), are left out of the step, on the device: the update is the
        one on the batch without them (the loss is the mean over the healthy
        rows), and the metrics leave them out too. `quarantined_samples`
        counts them and `quarantine_log` names the last ones (`NaNGuard`
        reports them). With more than `max_quarantine_fraction` of the batch
        bad the step is left whole and rejected as before (a broken
        pipeline, not bad rows). Layers that mix the rows of a batch
        (BatchNormalization's batch statistics) see each bad row replaced by
        a copy of a healthy one. What it covers: docs/guide/quarantine.md.

        Args:
            model: the `keras.Model` this optimizer trains.
            quarantine: bool, leave bad rows out of each step instead of
                rejecting the batch; `None` keeps what an earlier `attach`
                chose (off the first time). Defaults to `None`.
            max_quarantine_fraction: float in (0, 1]: a batch with more bad
                rows than this fraction is left whole. Defaults to 0.5.

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
        >>> opt.attach(model, quarantine=True)        # one bad row of 4
        >>> x[1:] = 1.0
        >>> _ = model.fit(x, np.ones((4, 1)), verbose=0)
        >>> int(opt.quarantined_samples), int(opt.skipped_steps)
        (1, 1)
        """
        fraction = check_in(
            "max_quarantine_fraction", max_quarantine_fraction, 0, 1, closed_high=True
        )
        current = self._model_transaction.quarantine
        if quarantine is None:
            chosen = current
        elif not check_bool("quarantine", quarantine):
            chosen = None
        elif current is not None and current.max_fraction == fraction:
            chosen = current
        else:
            chosen = Quarantine(fraction)
        self._model_transaction.attach(model, chosen)

    def detach(self, model: keras.Model) -> None:
        """Undoes `attach`: `model.train_step` is Keras's (or yours) again.

        Not needed to train the model with another optimizer: an attached
        step whose model is compiled with an optimizer other than this one
        (or a `LossScaleOptimizer` around it) is the plain step. Detaching a
        model this optimizer is not attached to does nothing.

        Args:
            model: the `keras.Model` given to `attach`.

        Example:

        >>> import keras, keras_nanguard as ng
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1))
        >>> model.compile(optimizer=opt, loss="mse")
        >>> opt.attach(model)
        >>> opt.detach(model)
        >>> "train_step" in vars(model)
        False
        """
        self._model_transaction.detach(model)

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
        return self._model_transaction.transaction(model)

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
        return self._model_transaction.stateless_commit(
            optimizer_variables, before, after
        )

    # ------------------------------------------------------------- reports
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
        found = self._counters.read(self._own_values(optimizer_variables))
        state = self._clip_state
        if state is not None:
            found.update(
                state.read(self._values_of(state.variables(), optimizer_variables))
            )
        return found

    def clip_thresholds(
        self, optimizer_variables: Sequence[Any] | None = None
    ) -> dict[str, float]:
        """With `clip="adaptive"`, the thresholds the next step is judged
        against (a host read): the global one (`"global"`: a norm above it is
        clipped; inf until 25 steps are in its statistics, `clipnorm` when
        lower) and each layer's, by variable path (1.05 times the EMA of its
        clipped norms; inf until then). Empty without `clip="adaptive"` or
        before `build`.

        Args:
            optimizer_variables: as for `counters`.

        Example:

        >>> import keras, keras_nanguard as ng
        >>> opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-3), clip="adaptive")
        >>> opt.build([keras.Variable([1.0, 2.0], name="w")])
        >>> for _ in range(30):
        ...     opt.apply([keras.ops.ones(2)])
        >>> {k: round(v, 3) for k, v in opt.clip_thresholds().items()}
        {'global': 1.414, 'w': 1.485}
        """
        state = self._clip_state
        if state is None:
            return {}
        values = self._values_of(state.variables(), optimizer_variables)
        stats, norms = (np.asarray(backend.host_view(v)) for v in values[:2])
        found = {"global": float(state.read(values)["clip_threshold"])}
        warm = stats[0] >= adaptive_clip.WARMUP_STEPS
        names = [
            getattr(v, "path", None) or v.name
            for v in getattr(self, "_trainable_variables", [])
        ]
        for name, ema in zip(names, norms[:-1], strict=False):
            found[name] = (
                float(adaptive_clip.LAYER_FACTOR * ema) if warm and ema > 0 else np.inf
            )
        return found

    @property
    def _clip_state(self) -> ClipState | None:
        """The graded handling's variables (`clip="adaptive"`, once built)."""
        return self._step.clip_state

    def _clip_variables(self) -> list[keras.Variable]:
        state = self._clip_state
        return [] if state is None else state.variables()

    def _values_of(
        self, variables: list[keras.Variable], optimizer_variables: Sequence[Any] | None
    ) -> list[Any]:
        """The values of some of this optimizer's `variables`: theirs, or
        their entries in `optimizer_variables` (a JAX stateless loop's)."""
        if optimizer_variables is None:
            return [v.value for v in variables]
        values = list(optimizer_variables)
        where = {id(v): i for i, v in enumerate(self.variables)}
        if len(values) != len(where):
            raise ValueError(
                "`optimizer_variables` must hold one value per variable of "
                f"`optimizer.variables` ({len(where)}), as `stateless_apply` "
                f"returns them. Received: {len(values)} values"
            )
        return [values[where[id(v)]] for v in variables]

    def quarantine(
        self,
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        *,
        max_quarantine_fraction: float = 0.5,
    ) -> QuarantinedBatch:
        """A custom loop's batch under per-sample quarantine (what
        `attach(model, quarantine=True)` does in `fit`).

        Its `x`, `y` and `sample_weight` have each row with a NaN or inf
        replaced by a healthy row's values; train the model on them, take
        the loss with `batch.loss(loss_fn, y_pred)`, which leaves those rows
        out and the rows whose own loss is not finite too (the mean is over
        the healthy rows), and this optimizer's next `apply` counts the rows
        (`quarantined_samples`, `quarantined_rows()`). With more than
        `max_quarantine_fraction` of the rows bad the batch is left whole
        and the step is rejected. In a JAX stateless loop, return
        `batch.codes` from under `jax.grad` and set it on the batch before
        `stateless_apply` (docs/guide/quarantine.md shows the three loops).

        Args:
            x: the batch's inputs (a tensor or a structure of tensors).
            y: its targets. Defaults to `None`.
            sample_weight: its sample weights. Defaults to `None`.
            max_quarantine_fraction: float in (0, 1]. Defaults to 0.5.

        Returns:
            A `QuarantinedBatch`.

        Example:

        >>> import numpy as np, keras, keras_nanguard as ng
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1))
        >>> x = ng.faults.poison(np.ones((4, 2), "float32"), rows=[1])
        >>> batch = opt.quarantine(x, np.ones((4, 1), "float32"))
        >>> loss = batch.loss("mse", model(batch.x))  # inside your tape
        >>> bool(np.isfinite(keras.ops.convert_to_numpy(loss)))
        True
        """
        fraction = check_in(
            "max_quarantine_fraction", max_quarantine_fraction, 0, 1, closed_high=True
        )
        batch = QuarantinedBatch(x, y, sample_weight, fraction)
        self._quarantined_batch = batch
        return batch

    def flight_record(self) -> FlightRecord:
        """The flight recorder's rows (reads them from the device): the last
        `RING_STEPS` steps, and the probe rows of the last `HISTORY_PROBES`
        probes (see `FlightRecord`). `ng.explain(record)` reads a diagnosis
        from it. In a JAX `fit`, read it after `fit` or through NaNGuard,
        which sees the values `fit` holds.

        Example:

        >>> import keras, keras_nanguard as ng
        >>> opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1))
        >>> opt.build([keras.Variable([1.0])])
        >>> opt.apply([keras.ops.ones(1)])
        >>> opt.flight_record().column("grad_norm").tolist()
        [1.0]
        """
        return FlightRecord.of(self._recorder)

    def _start_flight_read(self) -> Callable[[], FlightRecord]:
        """`flight_record` without waiting for the device (NaNGuard's reads
        during an epoch): the copies are started now, the call returned makes
        the record of them."""
        recorder = self._recorder
        values = recorder.start_read() if recorder.ring is not None else None
        return lambda: FlightRecord.of(recorder, values)

    def _newest_alarm(self, lag: int, model: Any = None) -> int:
        """The step of the flight recorder's newest alarm the host knows
        without waiting (NaNGuard reads the record when it rings), training
        `model`; see `FlightRecorder.newest_alarm`."""
        return self._recorder.newest_alarm(lag, model)

    def observe(
        self, *, loss: Any = None, inputs: Any = None, outputs: Any = None
    ) -> None:
        """Hands a custom loop's batch to the flight recorder, after `apply`:
        its `loss` on every step, its `inputs` and the model's `outputs` on
        probe steps (`probe_every`). A `fit` step of an attached model does
        this itself. TensorFlow and torch; in a JAX stateless loop the
        recorder records the optimizer's figures only.

        Example:

        >>> import keras, keras_nanguard as ng
        >>> opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1))
        >>> opt.build([keras.Variable([1.0])])
        >>> opt.apply([keras.ops.ones(1)])
        >>> opt.observe(loss=keras.ops.convert_to_tensor(0.5))
        >>> opt.flight_record().column("loss").tolist()
        [0.5]
        """
        if self._recording:
            self._recorder.observe(loss=loss, inputs=inputs, outputs=outputs)

    def quarantined_rows(
        self,
        since: int = 0,
        until: int | None = None,
        optimizer_variables: Sequence[Any] | None = None,
    ) -> list[tuple[int, int, tuple[str, ...]]]:
        """The rows the quarantine left out (`attach(model, quarantine=True)`),
        numbered `since` <= i < `until` in the order they were (`until`: by
        default `quarantined_samples`), as `(step, row, reasons)`: the step's
        number in `quarantine_steps` (1 for the first quarantined step), the
        row in its batch, and why. Only the last 512 are kept.

        Args:
            since: int >= 0, the first row wanted. Defaults to 0.
            until: the row after the last one wanted. Defaults to all.
            optimizer_variables: as for `counters`.

        Example:

        >>> import numpy as np, keras, keras_nanguard as ng
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1))
        >>> model.compile(optimizer=opt, loss="mse")
        >>> opt.attach(model, quarantine=True)
        >>> x = ng.faults.poison(np.ones((4, 2)), rows=[2])
        >>> _ = model.train_on_batch(x, np.ones((4, 1)))
        >>> opt.quarantined_rows()
        [(1, 2, ('non-finite input',))]
        """
        since = check_int("since", since, 0)
        values = self._own_values(optimizer_variables)
        total = int(self._counters.read(values)["quarantined_samples"])
        until = total if until is None else min(check_int("until", until, 0), total)
        return [
            (step, row, tuple(reasons(code)))
            for step, row, code in self._counters.quarantined_rows(since, until, values)
        ]

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
        return self._counters.describe_last_rejection(
            self._names(), self._own_values(optimizer_variables)
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
        self._counters.check_halted(
            self._names(), self._own_values(optimizer_variables)
        )

    def _own_values(self, optimizer_variables: Sequence[Any] | None) -> list | None:
        """The values of the counters and the spike window among values of
        `optimizer.variables` (they come first); `None` for none given."""
        if optimizer_variables is None:
            return None
        values = list(optimizer_variables)
        if len(values) != len(self.variables):
            raise ValueError(
                "`optimizer_variables` must hold one value per variable of "
                f"`optimizer.variables` ({len(self.variables)}), as "
                f"`stateless_apply` returns them. Received: {len(values)} values"
            )
        return values[: len(self._counters.variables())]

    def _names(self) -> list[str]:
        """What `last_nonfinite_index` counts, by name."""
        return variable_names(
            getattr(self, "_trainable_variables", []),
            self.inner_optimizer.variables,
        )

    # -------------------------------------------------------- serialization
    def get_config(self) -> dict[str, Any]:
        return {
            "attached": self._model_transaction.saved_as_attached(),
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            **self._settings,
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
        optimizer._model_transaction.expects_attach = bool(attached)
        return optimizer


ARGUMENTS = ArgumentSpec(SafeOptimizer.__init__, check_with_inner)
for _name in ARGUMENTS.names:  # read, and set where not fixed, on the optimizer
    setattr(
        SafeOptimizer, _name, SettingAttribute(_name, ARGUMENTS.checks[_name].fixed)
    )


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
