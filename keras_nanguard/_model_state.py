"""The model's side of a whole-model transaction.

The forward pass of a training step writes state of its own before the
optimizer sees any gradient: BatchNormalization's moving statistics, any
layer's non-trainable variables, seed-generator state, and on torch the
buffers of modules inside `keras.layers.TorchModuleWrapper`. A rejected step
must leave that state as it was too. Here are the pieces SafeOptimizer's
`attach`, `transaction` and `stateless_commit` are made of: which state, and
a select that keeps the old values unless the step was accepted (one pass
over this state, which is small next to the weights; no branch, no host
read), and `ModelStateMixin`, the public calls themselves.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import keras
from keras import ops

from keras_nanguard import _step_ops as step_ops


def forward_state(model: keras.Model) -> list[Any]:
    """The state the forward pass may write: Keras's non-trainable variables
    (metrics excluded) and, on torch, module buffers Keras does not track."""
    state: list[Any] = list(model.non_trainable_variables)
    if keras.backend.backend() == "torch":
        state += _torch_buffers(model)
    return state


# model -> (what the walk below depends on, its result). The walk costs about
# 90 µs a step on a 3-layer model; what it finds changes only when a module
# or a buffer is registered somewhere (torch's global registration hooks
# count those; the model's rebuilt `Functional` after `Sequential.add` is
# one) or the model's weights change (it is built).
_BUFFERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_registrations = [0]


def _count_registration(*args: Any) -> None:
    _registrations[0] += 1


def _torch_buffers(model: keras.Model) -> list[Any]:
    if not _registrations[0]:  # the first call: from now on, count
        from torch.nn.modules import module

        module.register_module_module_registration_hook(_count_registration)
        module.register_module_buffer_registration_hook(_count_registration)
        _registrations[0] = 1
    key = (_registrations[0], tuple(map(id, model.weights)))
    cached = _BUFFERS.get(model)
    if cached is None or cached[0] != key:
        cached = _BUFFERS[model] = (key, _walk_buffers(model))
    return cached[1]


def _walk_buffers(model: keras.Model) -> list[Any]:
    # Every Keras layer is a torch module on this backend, but Sequential and
    # functional models keep their layers in plain lists that torch does not
    # see: walk both the Keras layers and the torch submodules, each module
    # once.
    found: dict[int, Any] = {}
    stack, seen = [model], set()
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for buffer in module.buffers(recurse=False):
            found.setdefault(id(buffer), buffer)
        stack.extend(module.children())
        stack.extend(getattr(module, "layers", None) or [])
    return list(found.values())


def read(state: list[Any]) -> list[Any]:
    """Values of `state` now, unaffected by the step's later writes."""
    backend = keras.backend.backend()
    values = [v.value if isinstance(v, keras.Variable) else v for v in state]
    if backend == "torch":
        return [t.detach().clone() for t in values]
    if backend == "tensorflow":
        import tensorflow as tf

        # Copy-on-write: the buffer is copied only if the step writes it.
        return [tf.identity(t) for t in values]
    return values


def select(accepted: Any, before: list[Any], after: list[Any]) -> list[Any]:
    """Stateless: `after` if `accepted`, else `before`, tensor by tensor."""
    if len(before) != len(after):
        raise ValueError(
            "`before` and `after` must hold the same non-trainable variables. "
            f"Received: len(before)={len(before)}, len(after)={len(after)}"
        )
    return [ops.where(accepted, a, b) for b, a in zip(before, after, strict=True)]


def build_for(model: keras.Model, data: Any) -> None:
    """Builds `model` from a batch's shapes if it is not built yet.

    On TensorFlow without a distribution strategy, Keras builds the model
    while it traces the first training step, after the state to keep must be
    known; building it symbolically first creates that state, with no
    computation in the step.
    """
    if model.built:
        return
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    spec = keras.tree.map_structure(
        lambda t: keras.KerasTensor(t.shape, keras.backend.standardize_dtype(t.dtype)),
        x,
    )
    model.compute_output_spec(spec)
    model.built = True


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
                non_trainable = select(accepted, state[1], non_trainable)
                metrics = select(accepted, state[3], metrics)
                mapping = list(zip(model.metrics_variables, metrics, strict=True))
                mapping += list(zip(variables, optimizer_values, strict=True))
                with keras.StatelessScope(state_mapping=mapping):
                    logs = self._step_logs(model, logs)
                return logs, (trainable, non_trainable, optimizer_values, metrics)

        else:

            def train_step(data: Any) -> Any:
                build_for(model, data)
                state = forward_state(model) + model.metrics_variables
                # In `fit` a halt is NaNGuard's to act on (or warned at the
                # end), as in compiled steps: not raised from `apply`.
                self._plans.in_fit = True
                try:
                    with self._guard(model, state):
                        logs = original(data)
                finally:
                    self._plans.in_fit = False
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
        return self._guard(model, forward_state(model))

    @contextlib.contextmanager
    def _guard(self, model: keras.Model, state: list[Any]) -> Iterator[None]:
        self._check_is_optimizer_of(model)
        before = read(state)
        # A flag set, not a count read: a compiled torch step would recompile
        # whenever a Python int it reads changes.
        self._plans.applied = False
        try:
            yield
        except BaseException:
            step_ops.restore_unless(False, state, before)
            raise
        if not self._plans.applied:
            raise RuntimeError(
                "No step of this SafeOptimizer ran inside `transaction(model)`: "
                "call `apply`/`apply_gradients` inside the `with` block."
            )
        step_ops.restore_unless(self.consecutive_skips.value == 0, state, before)

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
        logs["nanguard_grad_norm"] = self.accepted_grad_norm.value
        logs["nanguard_rejected_steps"] = self.skipped_steps.value
        logs["nanguard_recent_rejections"] = self.recent_rejections.value
        if self.lr_backoff is not None:
            logs["nanguard_lr_scale"] = self.lr_scale.value
        if self.spike_sigma is not None:
            logs["nanguard_spike_steps"] = self.spike_steps.value
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

    def _check_is_optimizer_of(self, model: keras.Model) -> None:
        optimizer = getattr(model, "optimizer", None)
        wrapper = optimizer  # self may sit inside a LossScaleOptimizer
        while wrapper is not None and wrapper is not self:
            wrapper = getattr(wrapper, "inner_optimizer", None)
        if optimizer is not None and wrapper is None:
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
