"""Programs in the patterns of Keras's own examples, shrunk to run on a CPU in
seconds on data made in code (or scikit-learn's digits), each run plain and
under keras-nanguard as docs/guide/examples.md says.
`tests/end_to_end/test_examples.py` runs them.

Each module has `BACKENDS` (where its pattern runs), `FAULTS` (a variant
that really goes non-finite -> the run cause `explain()` should name) and
`train(mode, fault=None)`, `mode` one of `"plain"` (bare Keras), `"safe"`
(a `SafeOptimizer`) or `"guard"` (a `SafeOptimizer` and `NaNGuard`); it
returns a `Run`.
"""
