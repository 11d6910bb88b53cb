"""NaNGuard's reading of SafeOptimizer's flight recorder: the run's record,
gathered over its fits, and the early warning.

The record is read on the training thread at steps 1, 2, 4, 8, then every
`probe_every` steps of the recorder (one host read of its rows each time,
never per step), at epoch ends and when asked (`NaNGuard.explain`).
"""

from __future__ import annotations

from keras_nanguard import snapshots
from keras_nanguard.flight import reading as _explain
from keras_nanguard.flight.reading import RunDiagnosis
from keras_nanguard.nan_guard.fit_state import FitState
from keras_nanguard.safe_optimizer.flight_record import FlightRecord
from keras_nanguard.safe_optimizer.forward_state import is_built


class FlightWatch:
    """The record of the guard's runs and what it predicts."""

    def __init__(self) -> None:
        self.record: FlightRecord | None = None
        self.read_at = 0  # `state.now` at the last read in this fit
        self.warned = False  # this fit's warning was given
        # The step of the last warning given on this record (None: none).
        self.warned_at: int | None = None
        self._source: int | None = None  # id of the optimizer recorded

    def begin_fit(self, state: FitState) -> None:
        self.read_at, self.warned = 0, False
        if state.safe is not None and id(state.safe) != self._source:
            self.record, self._source = None, id(state.safe)
            self.warned_at = None

    def due(self, state: FitState) -> bool:
        if state.safe is None or state.now < 1:
            return False
        every = getattr(getattr(state.safe, "_recorder", None), "probe_every", 16)
        return state.now - self.read_at >= min(every, max(1, self.read_at))

    def read(self, state: FitState) -> None:
        """Adds the recorder's rows to the record (a host read)."""
        if state.safe is None or not is_built(state.net):
            return
        snapshots.sync_from_device(state.net)
        new = state.safe.flight_record()
        if self.record is None or self.record.columns != new.columns:
            self.record = new
        else:
            self.record.add(new.rows)
        self.read_at = state.now

    def warning(self) -> RunDiagnosis | None:
        """This fit's early warning, once: what the record predicts."""
        if self.warned or self.record is None:
            return None
        found = _explain.warning(self.record)
        self.warned = found is not None
        if found is not None:
            self.warned_at = found.at_step
        return found

    def explain(self) -> RunDiagnosis:
        if self.record is None:
            return _explain.RunDiagnosis(
                "unknown",
                evidence=[
                    "Nothing was recorded: no step of a SafeOptimizer ran "
                    "under this guard (its flight recorder is what explain "
                    "reads; compile with ng.SafeOptimizer(optimizer))."
                ],
                hints=list(_explain.HINTS["unknown"]),
            )
        return _explain.explain(self.record).warned(self.warned_at)
