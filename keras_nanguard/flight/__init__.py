"""Why did this run diverge: the run-level diagnosis and the early warning,
read from SafeOptimizer's flight recorder.

- `reading`: `diagnose_run(record)` -> `RunDiagnosis`, `warning(record)`, the
  vocabulary `RUN_CAUSES` and what to do about each (`RUN_HINTS`).
- `recorder`: the device half (`FlightRecorder`) and the rejection
  reasons (`Reason`); `record`: its rows on the host (`FlightRecord`).
"""

from keras_nanguard.flight.reading import (
    RUN_CAUSES,
    RUN_HINTS,
    RunDiagnosis,
    diagnose_run,
    warning,
)

__all__ = ["RUN_CAUSES", "RUN_HINTS", "RunDiagnosis", "diagnose_run", "warning"]
