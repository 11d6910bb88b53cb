"""keras-nanguard: keep Keras 3 training numerically healthy.

Public names (everything else is private):

- `SafeOptimizer`: wraps any optimizer; a step whose gradients, new weights or
  new optimizer state are not finite is rejected inside the compiled step.
- `NaNGuard`: a callback for `model.fit` that keeps a last-known-good state,
  rolls back / stops / raises by policy, and reports incidents in words.
- `NonFiniteError`: raised when a policy says stop.
- `ops`: small numerics (`global_norm`, `all_finite`, ...).
- `faults`: fault injection for tests, notebooks and drills.
"""

from keras_nanguard import faults
from keras_nanguard import numerics as ops
from keras_nanguard.errors import NonFiniteError
from keras_nanguard.nan_guard import NaNGuard
from keras_nanguard.safe_optimizer import SafeOptimizer

__version__ = "0.1.0"

__all__ = [
    "NaNGuard",
    "NonFiniteError",
    "SafeOptimizer",
    "__version__",
    "faults",
    "ops",
]
