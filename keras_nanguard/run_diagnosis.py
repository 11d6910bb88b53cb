"""`explain`: the run diagnosis of a SafeOptimizer, a NaNGuard or a record."""

from __future__ import annotations

from keras_nanguard.flight import reading
from keras_nanguard.flight.reading import RunDiagnosis
from keras_nanguard.flight.record import FlightRecord
from keras_nanguard.nan_guard import NaNGuard
from keras_nanguard.safe_optimizer import SafeOptimizer


def explain(source: object) -> RunDiagnosis:
    """Why a run diverged, or is about to: a `RunDiagnosis` read from the
    flight recorder of a `SafeOptimizer`, a `NaNGuard` (all it gathered over
    its fits) or a `FlightRecord`. It reads the record only: it never
    changes the model or the optimizer.

    Example:

    >>> import numpy as np, keras, keras_nanguard as ng
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> opt = ng.SafeOptimizer(keras.optimizers.SGD(0.01))
    >>> model.compile(opt, "mse")
    >>> _ = model.fit(np.ones((64, 3)), np.ones((64, 1)), verbose=0)
    >>> print(ng.explain(opt))
    Run diagnosis: healthy (nothing is wrong).
    """
    if isinstance(source, FlightRecord):
        return reading.diagnose_run(source)
    if isinstance(source, NaNGuard):
        return source.explain()
    if isinstance(source, SafeOptimizer):
        return reading.diagnose_run(source.flight_record())
    raise TypeError(
        "`source` must be a SafeOptimizer, a NaNGuard or a FlightRecord. "
        f"Received: source={source!r} of type {type(source).__name__}"
    )
