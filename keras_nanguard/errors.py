"""The exception keras-nanguard raises when a policy says stop."""

from __future__ import annotations


class NonFiniteError(RuntimeError):
    """Training met non-finite values and a keras-nanguard policy said stop.

    Raised by `SafeOptimizer` after `max_consecutive_skips` rejected steps, and
    by `NaNGuard(policy="raise")`. The message says what kept failing; where a
    report exists it is attached as `.report`.

    Example:

    >>> import keras_nanguard as ng
    >>> try:
    ...     raise ng.NonFiniteError("gradient of 'dense/kernel' is NaN")
    ... except ng.NonFiniteError as err:
    ...     print(err)
    gradient of 'dense/kernel' is NaN
    """

    def __init__(self, message: str, report: object | None = None) -> None:
        super().__init__(message)
        self.report = report
