"""diagnose(): where a batch first goes non-finite, and why, in words.

The public names are `diagnose`, `Diagnosis`, `LayerStats`, `CAUSES` and
`STAGES` (and the `causes` module: `CAUSES` with `HINTS`); the other
modules of this folder are private:

- `batch`: `diagnose()` itself, and the state it leaves as it found it.
- `findings`: what it returns (`Diagnosis`, `LayerStats`, `STAGES`).
- `stages`: the checks, one per stage; `probes`: the eager probes.
- `causes`: the cause vocabulary and the hints for each cause.
"""

from keras_nanguard.diagnosis.batch import diagnose
from keras_nanguard.diagnosis.causes import CAUSES
from keras_nanguard.diagnosis.findings import STAGES, Diagnosis, LayerStats

__all__ = ["CAUSES", "STAGES", "Diagnosis", "LayerStats", "diagnose"]
