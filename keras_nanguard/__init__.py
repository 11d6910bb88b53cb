"""keras-nanguard: keep Keras 3 training numerically healthy.

Public names (everything else is private):

- `SafeOptimizer`: wraps any optimizer; a step whose gradients, new weights or
  new optimizer state are not finite is rejected inside the compiled step.
- `NaNGuard`: a callback for `model.fit` that keeps a last-known-good state,
  rolls back / stops / raises by policy, and reports incidents in words.
- `diagnose(model, x, y)` -> `Diagnosis`: which layer went non-finite first,
  at which stage, and why (codes from `keras_nanguard.diagnosis.CAUSES`).
- `NonFiniteError`: raised when a policy says stop.
- `StableSoftmax`: a softmax layer that cannot produce NaN.
- `ops`: small numerics (`safe_log`, `safe_div`, `safe_sqrt`, `safe_norm`,
  `stable_log_softmax`, `policy_log_prob`, `global_norm`, `all_finite`).
- `faults`: fault injection for tests, notebooks and drills.
"""

from keras_nanguard import faults
from keras_nanguard import numerics as ops
from keras_nanguard.diagnosis import Diagnosis, diagnose
from keras_nanguard.errors import NonFiniteError
from keras_nanguard.nan_guard import NaNGuard
from keras_nanguard.safe_optimizer import SafeOptimizer
from keras_nanguard.stable_softmax import StableSoftmax

__version__ = "0.1.0"

__all__ = [
    "Diagnosis",
    "NaNGuard",
    "NonFiniteError",
    "SafeOptimizer",
    "StableSoftmax",
    "__version__",
    "diagnose",
    "faults",
    "ops",
]
