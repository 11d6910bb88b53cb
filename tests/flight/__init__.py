"""The flight recorder: what SafeOptimizer records at each step, and
NaNGuard's early warning on healthy training."""
