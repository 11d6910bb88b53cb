"""NaNGuard: its arguments, what it detects, its policies, snapshots and
rollbacks, the figures and messages of a guarded `fit`, its batch ends
(asynchronous on JAX and torch), its parts alone, and other callbacks and
tools beside it."""
