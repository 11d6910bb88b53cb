"""Why did this run diverge: the run-level diagnosis and the early warning,
read from SafeOptimizer's flight recorder.

- `reading`: `explain(record)` -> `RunDiagnosis`, `warning(record)`, the
  vocabulary `RUN_CAUSES` and what to do about each (`HINTS`).
- `recorder`: the device half (`FlightRecorder`) and the rejection
  reasons (`Reason`); `record`: its rows on the host (`FlightRecord`).
"""

from keras_nanguard.flight.reading import (
    HINTS,
    RUN_CAUSES,
    RunDiagnosis,
    explain,
    warning,
)

__all__ = ["HINTS", "RUN_CAUSES", "RunDiagnosis", "explain", "warning"]
