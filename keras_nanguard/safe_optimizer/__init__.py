"""SafeOptimizer: an optimizer wrapper under which a bad step is never applied.

The public names are `SafeOptimizer` and `find_safe_optimizer`; the modules
of this folder are private:

- `optimizer`: the `keras.optimizers.Optimizer` subclass users see, made of
  the typed parts below, which it holds and delegates to.
  Its arguments are declared once, in its signature (`_arguments`).
- `counters`: `Counters`, a dataclass of the counters (named device
  variables): their creation (the saved layout), updates and reports.
- `step`: `GuardedStep`, one step as a transaction (decide, update, check,
  commit or roll back); `tf.distribute` is `_backend/tensorflow.py`'s.
- `model_transaction`: `ModelTransaction`, the model's side (`attach`,
  `transaction`, `stateless_commit`), with `forward_state` (what the forward
  pass writes) and `loss_scaling` (a `LossScaleOptimizer` around the
  wrapper).
- `attributes`: the optimizer's attributes over its parts (arguments read
  and set, counters read).
- `spike_window`: the gradient-norm spike rule; `inner`: the wrapped optimizer
  and the arguments' checks against it; `file_layouts`: files of earlier versions;
  `step_ops`: small tensor operations of the step.
"""

from keras_nanguard.safe_optimizer.optimizer import SafeOptimizer, find_safe_optimizer

__all__ = ["SafeOptimizer", "find_safe_optimizer"]
