"""The model's side of a whole-model transaction: `ModelStateMixin`, the
public calls of SafeOptimizer that tie it to the model it trains (`attach`,
`detach`, `transaction`, `stateless_commit`), made of the pieces in
`forward_state` and `loss_scaling`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import keras
from keras import ops

from keras_nanguard.safe_optimizer import loss_scaling, step_ops
from keras_nanguard.safe_optimizer.forward_state import (
    build_for,
    forward_state,
    read,
    select,
)


class ModelStateMixin:
    """`SafeOptimizer`'s whole-model transaction: the public calls that tie
    the optimizer to the model it trains."""

    def attach(self, model: keras.Model) -> None:
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
            train_step = self._stateless_train_step(model, original)
        else:
            train_step = self._train_step(model, original)
        train_step._nanguard_optimizer = self  # type: ignore[attr-defined]
        train_step._nanguard_original = original  # type: ignore[attr-defined]
        model.train_step = train_step
        self._plans.attached = True
        _remake_train_function(model)

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
        step = getattr(model, "train_step", None)
        if getattr(step, "_nanguard_optimizer", None) is not self:
            return
        original = step._nanguard_original
        if getattr(original, "__self__", None) is model and getattr(
            original, "__func__", None
        ) is getattr(type(model), "train_step", None):
            del model.train_step  # the class's own step again
        else:
            model.train_step = original  # a step the user had set
        self._plans.attached = False
        _remake_train_function(model)

    def _trains(self, model: keras.Model) -> bool:
        """Whether `model` is compiled with this optimizer (possibly inside
        loss scalers): the attached step is the plain one otherwise."""
        optimizer = getattr(model, "optimizer", None)
        while optimizer is not None and optimizer is not self:
            optimizer = getattr(optimizer, "inner_optimizer", None)
        return optimizer is self

    def _train_step(self, model: keras.Model, original: Any) -> Any:
        """The attached `train_step` of TensorFlow and torch."""

        def train_step(data: Any) -> Any:
            if not self._trains(model):  # compiled with another optimizer
                return original(data)
            build_for(model, data)
            state = forward_state(model) + model.metrics_variables
            # In `fit` a halt is NaNGuard's to act on (or warned at the
            # end), as in compiled steps: not raised from `apply`.
            self._plans.in_fit = True
            try:
                with self._guard(model, state) as step:
                    step.logs = original(data)
            finally:
                self._plans.in_fit = False
            return self._step_logs(model, step.logs)

        return train_step

    def _stateless_train_step(self, model: keras.Model, original: Any) -> Any:
        """The attached `train_step` of JAX: Keras's stateless step, then a
        select of the state it returns."""

        def train_step(state: Any, data: Any) -> Any:
            if not self._trains(model):  # compiled with another optimizer
                return original(state, data)
            self._plans.in_fit, self._plans.model = True, model
            try:
                logs, new_state = original(state, data)
            finally:
                self._plans.in_fit, self._plans.model = False, None
            trainable, non_trainable, optimizer_values, metrics = new_state
            variables = model.optimizer.variables
            accepted = self._accepted(optimizer_values, variables)
            found = loss_scaling.scalers(model.optimizer, self)
            if found:
                mapping = list(zip(variables, optimizer_values, strict=True))
                with keras.StatelessScope(state_mapping=mapping) as scope:
                    skipped = loss_scaling.settle(
                        self, found, _values_of(state[2], variables, found), logs
                    )
                optimizer_values = [scope.get_current_value(v) for v in variables]
                accepted = ops.logical_and(accepted, ops.logical_not(skipped))
            non_trainable = select(accepted, state[1], non_trainable)
            metrics = select(accepted, state[3], metrics)
            mapping = list(zip(model.metrics_variables, metrics, strict=True))
            mapping += list(zip(variables, optimizer_values, strict=True))
            with keras.StatelessScope(state_mapping=mapping):
                logs = self._step_logs(model, logs)
            return logs, (trainable, non_trainable, optimizer_values, metrics)

        return train_step

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
        return self._guard(model, forward_state(model))

    @contextlib.contextmanager
    def _guard(self, model: keras.Model, state: list[Any]) -> Iterator[_Step]:
        self._check_is_optimizer_of(model)
        found = loss_scaling.scalers(getattr(model, "optimizer", None), self)
        before = read(state)
        scalers_before = loss_scaling.read_state(found)
        # A flag set, not a count read: a compiled torch step would recompile
        # whenever a Python int it reads changes.
        self._plans.applied = False
        self._plans.model = model
        step = _Step()
        try:
            yield step
        except BaseException:
            step_ops.restore_unless(False, state, before)
            raise
        finally:
            self._plans.model = None
        if not self._plans.applied and not found:
            step_ops.restore_unless(False, state, before)
            raise RuntimeError(
                "No step of this SafeOptimizer ran inside `transaction(model)`: "
                "call `apply`/`apply_gradients` inside the `with` block."
            )
        accepted = self.consecutive_skips.value == 0
        if found:  # a loss scaler may have skipped the step without us
            skipped = loss_scaling.settle(self, found, scalers_before, step.logs)
            accepted = ops.logical_and(accepted, ops.logical_not(skipped))
        step_ops.restore_unless(accepted, state, before)

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
        return select(accepted, list(before), list(after))

    def _step_logs(self, model: keras.Model, logs: Any) -> Any:
        """A `fit` step's logs after the transaction: the metrics as they are
        (a rejected step left them out), and training health figures."""
        if not isinstance(logs, dict):
            return logs  # a custom train_step's own structure
        logs = dict(logs)
        fresh = model.get_metrics_result()
        logs.update({k: v for k, v in fresh.items() if k in logs})
        figures = {
            "nanguard_grad_norm": self.accepted_grad_norm,
            "nanguard_rejected_steps": self.skipped_steps,
        }
        if getattr(model, "steps_per_execution", 1) > 1:  # which steps, for NaNGuard
            figures["nanguard_recent_rejections"] = self.recent_rejections
        if self.lr_backoff is not None:
            figures["nanguard_lr_scale"] = self.lr_scale
        if self.spike_factor is not None:
            figures["nanguard_spike_steps"] = self.spike_steps
        if loss_scaling.scalers(getattr(model, "optimizer", None), self):
            figures["nanguard_loss_scale_steps"] = self.loss_scale_steps
        # Copies, not the variables: `run_eagerly` on TensorFlow hands the
        # logs on as they are, and torch's callbacks may read them in
        # Keras's worker threads after later steps updated the variables.
        logs.update({k: ops.copy(v.value) for k, v in figures.items()})
        if keras.backend.backend() == "torch":
            # A torch variable's value is the live tensor that later steps
            # update in place; callbacks run in Keras's worker threads may
            # read the logs a step or two later, so they get this step's.
            logs = {k: _frozen(v) for k, v in logs.items()}
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

    def _check_step_of(self, variables: list[keras.Variable]) -> None:
        """Refuses, before anything is written, a step inside a transaction
        that updates variables of another model than the transaction's; warns
        once about a step outside any transaction when this optimizer was
        saved attached (a model loaded from `.keras` is not attached)."""
        model = self._plans.model
        if model is None:
            if self._expects_attach and not self._plans.warned_unattached:
                self._plans.warned_unattached = True
                warnings.warn(
                    "This SafeOptimizer was saved attached to its model, but "
                    "it is not attached now (a model loaded from a `.keras` "
                    "file is not): a rejected step will still change "
                    "BatchNormalization statistics, seed state and metrics. "
                    "Call `optimizer.attach(model)` before `fit` (NaNGuard "
                    "does it for you), or wrap a custom step in "
                    "`optimizer.transaction(model)`.",
                    stacklevel=3,
                )
            return
        key = (id(model), tuple(map(id, variables)))
        # Not while torch compiles a step (`jit_compile=True`): a set it sees
        # change would recompile it; `fit`'s step trains the model's own.
        if key in self._plans.trained or step_ops.torch_compiling():
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
        self._plans.trained.add(key)

    def _check_is_optimizer_of(self, model: keras.Model) -> None:
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not self._trains(model):
            raise ValueError(
                "The model is compiled with another optimizer; compile it with "
                "this SafeOptimizer before tying them. "
                f"Received: model.optimizer={optimizer!r}"
            )


def _frozen(value: Any) -> Any:
    """A copy of a live torch variable (a Keras variable's value, which is
    also what a `Sum` metric's `result()` returns); anything else as is."""
    import torch

    live = isinstance(value, torch.nn.Parameter)
    return value.detach().clone() if live else value


class _Step:
    """What a guarded step hands back to its guard: its logs, where the loss
    tells bad data from an overflow of loss-scaled gradients."""

    logs: Any = None


def _values_of(values: list[Any], variables: list[Any], found: list[Any]) -> list:
    """The entries of `values` (in `variables` order) of the scalers' state."""
    index = {id(v): i for i, v in enumerate(variables)}
    return [values[index[id(v)]] for v in loss_scaling.state(found)]


def _remake_train_function(model: keras.Model) -> None:
    if getattr(model, "train_function", None) is not None:
        model.make_train_function(force=True)  # made before: remake it
