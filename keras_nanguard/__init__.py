"""keras-nanguard: keep Keras 3 training numerically healthy.

Public names (everything else is private):

- `SafeOptimizer`: wraps any optimizer; a step whose gradients, new weights or
  new optimizer state are not finite (or, with `spike_factor`, whose gradient
  norm spikes) is rejected inside the compiled step; `attach(model)` makes
  the rejection cover the model's non-trainable state and metrics too.
- `NaNGuard`: a callback for `model.fit` that keeps a last-known-good state,
  rolls back / stops / raises by policy, and reports incidents in words
  (`Incident` records in `guard.incidents`).
- `diagnose(model, x, y)` -> `Diagnosis`: which layer went non-finite first,
  at which stage, and why (codes from `CAUSES`).
- `NonFiniteError`: raised when a policy says stop.
- `StableSoftmax`: a softmax layer that returns no NaN for finite or infinite
  logits (NaN logits propagate unless `nan_logits="mask"`).
- `ops`: small numerics (`safe_log`, `safe_div`, `safe_sqrt`, `safe_norm`,
  `stable_log_softmax`, `policy_log_prob`, `global_norm`, `all_finite`).
- `faults`: fault injection for tests, notebooks and drills.
- `explain(record_or_optimizer_or_guard)` -> `RunDiagnosis`: why a run
  diverged (or is about to), from SafeOptimizer's flight recorder (a cause
  from `RUN_CAUSES`, its onset, the evidence); `FlightRecord` is the record.
"""

from importlib.metadata import PackageNotFoundError, version

from keras_nanguard import faults, ops
from keras_nanguard.diagnosis import CAUSES, Diagnosis, diagnose
from keras_nanguard.errors import NonFiniteError
from keras_nanguard.flight import RUN_CAUSES, RunDiagnosis
from keras_nanguard.flight.record import FlightRecord
from keras_nanguard.incidents import Incident, QuarantinedRow
from keras_nanguard.nan_guard import NaNGuard
from keras_nanguard.run_diagnosis import explain
from keras_nanguard.safe_optimizer import SafeOptimizer
from keras_nanguard.stable_softmax import StableSoftmax

try:  # the one version source is pyproject.toml
    __version__ = version("keras-nanguard")
except PackageNotFoundError:  # imported from a source tree, not installed
    __version__ = "0+unknown"

__all__ = [
    "CAUSES",
    "RUN_CAUSES",
    "Diagnosis",
    "FlightRecord",
    "Incident",
    "NaNGuard",
    "NonFiniteError",
    "QuarantinedRow",
    "RunDiagnosis",
    "SafeOptimizer",
    "StableSoftmax",
    "__version__",
    "diagnose",
    "explain",
    "faults",
    "ops",
]
