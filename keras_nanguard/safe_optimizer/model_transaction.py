"""The model's side of a whole-model transaction: `ModelTransaction`, what
ties a SafeOptimizer to the model it trains (`attach`, `detach`,
`transaction`, `stateless_commit` of SafeOptimizer delegate to it), made of
the pieces in `forward_state` and `loss_scaling`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
from keras import ops

from keras_nanguard import _kernels as kernels
from keras_nanguard._arguments import Arguments
from keras_nanguard._backend import current as backend
from keras_nanguard.flight.recorder import FlightRecorder
from keras_nanguard.safe_optimizer import loss_scaling, on_batch, patches, step_ops
from keras_nanguard.safe_optimizer import observer as observing
from keras_nanguard.safe_optimizer.counters import Counters
from keras_nanguard.safe_optimizer.forward_state import (
    build_for,
    forward_state,
    is_built,
    read,
    select,
)
from keras_nanguard.safe_optimizer.quarantine import Quarantine

# Log figures held as finite codes (`_kernels.to_finite`), whose code for
# "none" (inf) is logged as 0: a log value must stay finite (NaNGuard takes a
# non-finite one for a broken metric).
_CODED = frozenset({"nanguard_clip_threshold"})


def _no_threshold_as_zero(value: Any) -> Any:
    return ops.where(value >= kernels.FLOAT32_MAX, 0.0, value)


class ModelTransaction:
    """What a SafeOptimizer knows of the model it trains, and the guard that
    makes a rejected step leave the model's forward-pass state as it was.

    Args:
        optimizer: the SafeOptimizer: which model it trains is told by its
            identity (`model.optimizer`, possibly inside loss scalers), and
            its `variables` are what `stateless_apply` returns values of.
        counters: its counters (whether a step was accepted, the figures
            of a `fit` step's logs, a loss scaler's skips).
        settings: its settings (which figures the logs carry).
    """

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer,
        counters: Counters,
        settings: Arguments,
        recorder: FlightRecorder | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.counters = counters
        self.settings = settings
        self.recorder = recorder
        self.observer = observing.StepObserver()
        self.applied = False  # set by `step_begins`, so a guard can tell one ran
        self.in_fit = False  # inside an attached `fit` step
        # Tracing or running `train_on_batch`'s step: its logs are the
        # step's own, as Keras returns them (see `on_batch`).
        self._raw_logs = False
        # The model of the transaction a step runs in (`None` outside one).
        self.model: keras.Model | None = None
        self.attached = False  # attached to a model at some point
        # Saved while attached to a model: a step warns once when it is not.
        self.expects_attach = False
        self._warned_unattached = False
        # The (model, variables) pairs found to belong together.
        self._trained: set[tuple] = set()
        # Per-sample quarantine of the attached model's steps, when asked for.
        self.quarantine: Quarantine | None = None

    def saved_as_attached(self) -> bool:
        """What a saved config says: attached to a model at some point (or
        loaded from a file that said so)."""
        return self.expects_attach or self.attached

    # -------------------------------------------------------------- attach
    def attach(self, model: keras.Model, quarantine: Quarantine | None = None) -> None:
        """Wraps `model.train_step` in a transaction (`SafeOptimizer.attach`),
        with per-sample `quarantine` if given (else none)."""
        if not isinstance(model, keras.Model):
            raise TypeError(
                "`model` must be a `keras.Model`. "
                f"Received: model={model!r} of type {type(model).__name__}"
            )
        self._check_is_optimizer_of(model)
        attached = patches.owner_of(model, "train_step") is self.optimizer
        if attached and quarantine is self.quarantine:
            return
        self.observer.unwrap(model)  # outermost: off before the quarantine's
        if self.quarantine is not None and self.quarantine is not quarantine:
            self.quarantine.unwrap(model)
        self.quarantine = quarantine
        if quarantine is not None:
            quarantine.wrap(model)
        self.observer.wrap(model)
        # A new step function, not the same one reading other settings: JAX
        # would reuse what it compiled for the old one.
        original = patches.original_of(model, "train_step")
        train_step = self._guarded_step(model, original)
        patches.patch(model, "train_step", train_step, self.optimizer, original)
        on_batch.wrap(model, self.raw_logs)
        self.attached = True
        _remake_train_function(model)

    def detach(self, model: keras.Model) -> None:
        """Undoes `attach` (`SafeOptimizer.detach`)."""
        if patches.owner_of(model, "train_step") is not self.optimizer:
            return
        self.observer.unwrap(model)
        if self.quarantine is not None:
            self.quarantine.unwrap(model)
            self.quarantine = None
        patches.unpatch(model, "train_step")  # the class's own or the user's
        on_batch.unwrap(model)
        self.attached = False
        _remake_train_function(model)

    def _guarded_step(self, model: keras.Model, original: Any) -> Callable[..., Any]:
        """The attached `train_step`: JAX's is stateless."""
        if backend.STATELESS_TRAIN_STEP:
            return self._stateless_train_step(model, original, self.quarantine)
        return self._train_step(model, original, self.quarantine)

    def _trains(self, model: keras.Model) -> bool:
        """Whether `model` is compiled with this optimizer (possibly inside
        loss scalers): the attached step is the plain one otherwise."""
        optimizer = getattr(model, "optimizer", None)
        while optimizer is not None and optimizer is not self.optimizer:
            optimizer = getattr(optimizer, "inner_optimizer", None)
        return optimizer is self.optimizer

    def _train_step(
        self, model: keras.Model, original: Any, quarantine: Quarantine | None
    ) -> Callable[[Any], Any]:
        """The attached `train_step` of TensorFlow and torch."""

        def train_step(data: Any) -> Any:
            if not self._trains(model):  # compiled with another optimizer
                return original(data)
            build_for(model, data)
            state = forward_state(model) + model.metrics_variables
            if quarantine is not None:
                data = quarantine.clean(data)
            # Not under torch.compile (see `flight_recorder`), nor in one
            # replica of a `tf.distribute` step.
            recording = (
                self.recorder is not None
                and not backend.compiling()
                and not backend.in_replica()
            )
            tracker: list[Any] = []
            tracked: list[Any] = []
            if quarantine is not None or recording:
                tracker = observing.loss_tracker(model)
                tracked = read(tracker)
            # In `fit` a halt is NaNGuard's to act on (or warned at the
            # end), as in compiled steps: not raised from `apply`.
            self.in_fit = True
            if recording:
                self.observer.begin()
            try:
                with self._guard(model, state) as step:
                    step.logs = original(data)
                    if recording:
                        self._observe(data, tracked, [v.value for v in tracker])
                    if quarantine is not None:
                        step.logs = self._end_quarantine(
                            quarantine, step.logs, tracker, tracked
                        )
            finally:
                self.in_fit = False
                if recording:
                    self.observer.end()
                if quarantine is not None:
                    quarantine.abandon()
            return self._step_logs(model, step.logs)

        return train_step

    def _stateless_train_step(
        self, model: keras.Model, original: Any, quarantine: Quarantine | None
    ) -> Callable[[Any, Any], Any]:
        """The attached `train_step` of JAX: Keras's stateless step, then a
        select of the state it returns."""

        def train_step(state: Any, data: Any) -> Any:
            if not self._trains(model):  # compiled with another optimizer
                return original(state, data)
            if quarantine is not None:
                data = quarantine.clean(data)
            self.in_fit, self.model = True, model
            self.observer.begin()
            try:
                logs, new_state = original(state, data)
                if quarantine is not None:
                    codes, over = quarantine.end()
            finally:
                self.in_fit, self.model = False, None
                outputs = self.observer.end()
                if quarantine is not None:
                    quarantine.abandon()
            trainable, non_trainable, optimizer_values, metrics = new_state
            optimizer_values = self._stateless_observe(
                model, optimizer_values, data, outputs, state[3], metrics
            )
            accepted, optimizer_values = self._stateless_verdict(
                model, state, optimizer_values, logs
            )
            if quarantine is not None:
                optimizer_values = self._stateless_quarantine(
                    model, optimizer_values, codes, over
                )
                metrics = _weigh_stateless_loss(
                    model, quarantine, state[3], metrics, codes, over
                )
            non_trainable = select(accepted, state[1], non_trainable)
            metrics = select(accepted, state[3], metrics)
            mapping = list(zip(model.metrics_variables, metrics, strict=True))
            mapping += list(
                zip(model.optimizer.variables, optimizer_values, strict=True)
            )
            with keras.StatelessScope(state_mapping=mapping):
                logs = self._step_logs(model, logs)
            return logs, (trainable, non_trainable, optimizer_values, metrics)

        return train_step

    def _stateless_verdict(
        self, model: keras.Model, state: Any, optimizer_values: list[Any], logs: Any
    ) -> tuple[Any, list[Any]]:
        """Whether a stateless step was accepted, and the optimizer values to
        go on with: a loss scaler around this optimizer may have skipped it
        (see `loss_scaling.settle`), which changes the counters."""
        variables = model.optimizer.variables
        accepted = self._accepted(optimizer_values, variables)
        found = loss_scaling.scalers(model.optimizer, self.optimizer)
        if not found:
            return accepted, optimizer_values
        mapping = list(zip(variables, optimizer_values, strict=True))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            skipped = loss_scaling.settle(
                self.counters, found, _values_of(state[2], variables, found), logs
            )
        optimizer_values = [scope.get_current_value(v) for v in variables]
        return ops.logical_and(accepted, ops.logical_not(skipped)), optimizer_values

    def _end_quarantine(
        self, quarantine: Quarantine, logs: Any, tracker: list, tracked: list
    ) -> Any:
        """Counts a quarantined step's rows and weighs its loss tracker by the
        healthy ones; its logs without the quarantine's entries."""
        codes, over = quarantine.end()
        backend.record_rows(self.counters.record_quarantine, codes, over)
        now = [v.value for v in tracker]
        weighed = quarantine.weigh_loss(tracked, now, codes, over)
        for v, value in zip(tracker, weighed, strict=True):
            v.assign(value)
        return logs

    def _observe(self, data: Any, before: list[Any], after: list[Any]) -> None:
        """Hands the step's loss, inputs and outputs to the flight recorder."""
        outputs = self.observer.outputs()
        if self.recorder is not None:
            self.recorder.observe(
                loss=observing.step_loss(before, after),
                inputs=observing.inputs_of(data),
                outputs=outputs,
            )

    def _stateless_observe(
        self,
        model: keras.Model,
        optimizer_values: list[Any],
        data: Any,
        outputs: Any,
        metrics_before: list[Any],
        metrics_after: list[Any],
    ) -> list[Any]:
        """The optimizer values with the batch's figures recorded."""
        if self.recorder is None:
            return optimizer_values
        where = observing.tracker_positions(model)
        loss = observing.step_loss(
            [metrics_before[i] for i in where], [metrics_after[i] for i in where]
        )
        variables = model.optimizer.variables
        mapping = list(zip(variables, optimizer_values, strict=True))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            self.recorder.observe(
                loss=loss, inputs=observing.inputs_of(data), outputs=outputs
            )
        return [scope.get_current_value(v) for v in variables]

    def _stateless_quarantine(
        self, model: keras.Model, optimizer_values: list[Any], codes: Any, over: Any
    ) -> list[Any]:
        """The optimizer values with the quarantine's counts of the step."""
        variables = model.optimizer.variables
        mapping = list(zip(variables, optimizer_values, strict=True))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            self.counters.record_quarantine(codes, over)
        return [scope.get_current_value(v) for v in variables]

    # --------------------------------------------------- custom training
    def transaction(self, model: keras.Model) -> contextlib.AbstractContextManager:
        """A custom step as a whole-model transaction
        (`SafeOptimizer.transaction`)."""
        if not is_built(model):
            raise ValueError(
                "`transaction(model)` needs a built model (call it on a batch "
                f"first), to know its state. Received: model={model.name!r}, "
                "not built"
            )
        return self._guard(model, forward_state(model))

    @contextlib.contextmanager
    def _guard(self, model: keras.Model, state: list[Any]) -> Iterator[_Step]:
        self._check_is_optimizer_of(model)
        found = loss_scaling.scalers(getattr(model, "optimizer", None), self.optimizer)
        before = read(state)
        scalers_before = loss_scaling.read_state(found)
        # A flag set, not a count read: a compiled torch step would recompile
        # whenever a Python int it reads changes.
        self.applied = False
        self.model = model
        step = _Step()
        try:
            yield step
        except BaseException:
            step_ops.restore_unless(False, state, before)
            raise
        finally:
            self.model = None
        if not self.applied and not found:
            step_ops.restore_unless(False, state, before)
            raise RuntimeError(
                "No step of this SafeOptimizer ran inside `transaction(model)`: "
                "call `apply`/`apply_gradients` inside the `with` block."
            )
        accepted = self.counters.consecutive_skips.value == 0
        if found:  # a loss scaler may have skipped the step without us
            skipped = loss_scaling.settle(
                self.counters, found, scalers_before, step.logs
            )
            accepted = ops.logical_and(accepted, ops.logical_not(skipped))
        step_ops.restore_unless(accepted, state, before)

    def stateless_commit(
        self,
        optimizer_variables: Sequence[Any],
        before: Sequence[Any],
        after: Sequence[Any],
    ) -> list[Any]:
        """`after` if the step was accepted, else `before`
        (`SafeOptimizer.stateless_commit`)."""
        accepted = self._accepted(list(optimizer_variables), self.optimizer.variables)
        return select(accepted, list(before), list(after))

    @contextlib.contextmanager
    def raw_logs(self) -> Iterator[None]:
        """Steps traced or run inside log what the step logged, not the
        metrics as the transaction left them (`train_on_batch`)."""
        self._raw_logs = True
        try:
            yield
        finally:
            self._raw_logs = False

    def _step_logs(self, model: keras.Model, logs: Any) -> Any:
        """A `fit` step's logs after the transaction: the metrics as they are
        (a rejected step left them out), and training health figures;
        `train_on_batch`'s keep the step's own figures."""
        if not isinstance(logs, dict):
            return logs  # a custom train_step's own structure
        logs = dict(logs)
        if not self._raw_logs:
            fresh = model.get_metrics_result()
            logs.update({k: v for k, v in fresh.items() if k in logs})
        figures = self._figures(model)
        # Copies, not the variables: `run_eagerly` on TensorFlow hands the
        # logs on as they are, and torch's callbacks may read them in
        # Keras's worker threads after later steps updated the variables.
        logs.update(
            {
                k: _no_threshold_as_zero(v.value) if k in _CODED else ops.copy(v.value)
                for k, v in figures.items()
            }
        )
        # torch: copies of live tensors (`backend.frozen`): a torch variable's
        # value is the tensor later steps update in place.
        return {k: backend.frozen(v) for k, v in logs.items()}

    def _figures(self, model: keras.Model) -> dict[str, keras.Variable]:
        """The counters a `fit` step's logs carry, by log name."""
        c = self.counters
        figures = {
            "nanguard_grad_norm": c.accepted_grad_norm,
            "nanguard_rejected_steps": c.skipped_steps,
        }
        if getattr(model, "steps_per_execution", 1) > 1:  # which steps, for NaNGuard
            figures["nanguard_recent_rejections"] = c.recent_rejections
        if self.settings.lr_backoff is not None:
            figures["nanguard_lr_scale"] = c.lr_scale
        if self.settings.spike_factor is not None:
            figures["nanguard_spike_steps"] = c.spike_steps
        if loss_scaling.scalers(getattr(model, "optimizer", None), self.optimizer):
            figures["nanguard_loss_scale_steps"] = c.loss_scale_steps
        if self.quarantine is not None:
            figures["nanguard_quarantined_samples"] = c.quarantined_samples
        state = self.optimizer._clip_state
        if state is not None:
            figures["nanguard_clip_threshold"] = state.clip_threshold
            figures["nanguard_clipped_steps"] = c.clipped_steps
            figures["nanguard_bounded_updates"] = state.bounded_update_steps
        return figures

    def _accepted(self, values: list[Any], variables: list[keras.Variable]) -> Any:
        """Whether the step that produced `values` (of `variables`) was
        accepted: `consecutive_skips` is 0 exactly then."""
        if len(values) != len(variables):
            raise ValueError(
                "`optimizer_variables` must hold one value per variable of "
                f"`optimizer.variables` ({len(variables)}). "
                f"Received: {len(values)} values"
            )
        consecutive = self.counters.consecutive_skips
        index = [id(v) for v in variables].index(id(consecutive))
        return values[index] == 0

    # ------------------------------------------------------ each step
    def step_begins(self, variables: list[keras.Variable]) -> None:
        """Called by the optimizer's `apply` before it writes anything: a
        step of another model than the transaction's is refused, and the
        guard is told that a step ran."""
        self._check_step_of(variables)
        self.applied = True

    def _check_step_of(self, variables: list[keras.Variable]) -> None:
        """Refuses, before anything is written, a step inside a transaction
        that updates variables of another model than the transaction's; warns
        once about a step outside any transaction when this optimizer was
        saved attached (a model loaded from `.keras` is not attached)."""
        model = self.model
        if model is None:
            self._warn_if_unattached()
            return
        key = (id(model), tuple(map(id, variables)))
        # Not while torch compiles a step (`jit_compile=True`): a set it sees
        # change would recompile it; `fit`'s step trains the model's own.
        if key in self._trained or step_ops.torch_compiling():
            return
        own = {id(v) for v in model.variables}
        foreign = [v for v in variables if id(v) not in own]
        if foreign:
            raise ValueError(
                "`transaction(model)` guards the state of `model`, but this "
                "step updates variables that are not `model`'s: a rejected "
                "step would leave the forward-pass state of the model they "
                "belong to (BatchNormalization statistics, ...) changed. Use "
                "`transaction()` with the model being trained. Received: "
                f"model={model.name!r}, variables such as "
                f"{foreign[0].path!r}"
            )
        self._trained.add(key)

    def _warn_if_unattached(self) -> None:
        if not self.expects_attach or self._warned_unattached:
            return
        self._warned_unattached = True
        # stacklevel 5: the caller of `SafeOptimizer.apply`, which called
        # `step_begins`, which called `_check_step_of`, which called this.
        warnings.warn(
            "This SafeOptimizer was saved attached to its model, but "
            "it is not attached now (a model loaded from a `.keras` "
            "file is not): a rejected step will still change "
            "BatchNormalization statistics, seed state and metrics. "
            "Call `optimizer.attach(model)` before `fit` (NaNGuard "
            "does it for you), or wrap a custom step in "
            "`optimizer.transaction(model)`.",
            stacklevel=5,
        )

    def _check_is_optimizer_of(self, model: keras.Model) -> None:
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not self._trains(model):
            raise ValueError(
                "The model is compiled with another optimizer; compile it with "
                "this SafeOptimizer before tying them. "
                f"Received: model.optimizer={optimizer!r}"
            )


class _Step:
    """What a guarded step hands back to its guard: its logs, where the loss
    tells bad data from an overflow of loss-scaled gradients."""

    logs: Any = None


def _weigh_stateless_loss(
    model: keras.Model,
    quarantine: Quarantine,
    before: list[Any],
    after: list[Any],
    codes: Any,
    over: Any,
) -> list[Any]:
    """A stateless step's metric values with the loss tracker counting the
    healthy rows (`Quarantine.weigh_loss`); the logs are made of them."""
    where = observing.tracker_positions(model)
    if not where:
        return after
    weighed = quarantine.weigh_loss(
        [before[i] for i in where], [after[i] for i in where], codes, over
    )
    after = list(after)
    for i, value in zip(where, weighed, strict=True):
        after[i] = value
    return after


def _values_of(values: list[Any], variables: list[Any], found: list[Any]) -> list:
    """The entries of `values` (in `variables` order) of the scalers' state."""
    index = {id(v): i for i, v in enumerate(variables)}
    return [values[index[id(v)]] for v in loss_scaling.state(found)]


def _remake_train_function(model: keras.Model) -> None:
    if getattr(model, "train_function", None) is not None:
        model.make_train_function(force=True)  # made before: remake it
