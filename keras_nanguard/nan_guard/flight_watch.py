"""NaNGuard's reading of SafeOptimizer's flight recorder: the run's record,
gathered over its fits, and the early warning.

The record is read on the training thread at steps 1, 2, 4, 8, then every
`probe_every` steps of the recorder, whenever the recorder's alarm rings (the
device decides it every step; the host learns it without waiting, see
`FlightRecorder.newest_alarm`), at epoch ends and when asked
(`NaNGuard.explain`). A read due during an epoch does not wait for the
device: it copies the recorder's variables on the device and starts their
copy to the host, and the rows join the record two executions later (when
that step has surely run), at the same step on every process; a forced
read (epoch end, `explain`) reads at once.
"""

from __future__ import annotations

from collections.abc import Callable

from keras_nanguard import snapshots
from keras_nanguard.flight import reading as _explain
from keras_nanguard.flight.reading import RunDiagnosis
from keras_nanguard.flight.record import FlightRecord
from keras_nanguard.nan_guard.fit_state import FitState
from keras_nanguard.safe_optimizer.forward_state import is_built


class FlightWatch:
    """The record of the guard's runs and what it predicts."""

    def __init__(self) -> None:
        self.record: FlightRecord | None = None
        self.read_at = 0  # `state.now` at the last read in this fit
        self.warned = False  # this fit's warning was given
        # The last warning given on this record (None: none).
        self.given: RunDiagnosis | None = None
        self._source: int | None = None  # id of the optimizer recorded
        self.alarm_seen = 0  # the newest alarm step read for
        self._for_alarm = False  # the read now due is an alarm's
        self.alarm_reads = 0  # reads the alarm asked for, over the guard's fits
        # The reads under way: the step each was asked at, and its finish.
        self._pending: list[tuple[int, Callable[[], FlightRecord]]] = []

    def begin_fit(self, state: FitState) -> None:
        self.read_at, self.warned, self._pending = 0, False, []
        if state.safe is not None and id(state.safe) != self._source:
            self.record, self._source = None, id(state.safe)
            self.given = None

    def due(self, state: FitState) -> bool:
        """Whether a read is due: by the cadence, or an alarm the host has
        not read for yet (polled every turn)."""
        if state.safe is None or state.now < 1:
            return False
        alarm = state.safe._newest_alarm(2)  # polled every turn
        rang = alarm > self.alarm_seen
        self.alarm_seen = max(alarm, self.alarm_seen)
        every = getattr(getattr(state.safe, "_recorder", None), "probe_every", 16)
        if state.now - self.read_at >= min(every, max(1, self.read_at)):
            return True  # the cadence's read (it reads for the alarm too)
        self._for_alarm = rang  # a read besides the cadence, which stays
        return rang

    def read(self, state: FitState, wait: bool = True) -> bool:
        """Adds the recorder's rows to the record. With `wait`, a host read
        now (after the reads under way); without, the read is started and
        its rows are added by the first `collect` two executions later.
        Returns whether rows were added."""
        if state.safe is None or not is_built(state.net):
            return False
        snapshots.sync_from_device(state.net)
        self._pending.append((state.now, state.safe._start_flight_read()))
        if self._for_alarm:
            self.alarm_reads += 1
        else:
            self.read_at = state.now  # the cadence's last read
        self._for_alarm = False
        return self.collect(state, wait)

    def collect(self, state: FitState, wait: bool) -> bool:
        """Adds the rows of the reads under way that were asked two
        executions ago or more (all of them with `wait`). Returns whether
        rows were added."""
        lag = 2 * max(1, state.k)
        due = [p for p in self._pending if wait or state.now - p[0] >= lag]
        if not due:
            return False
        self._pending = self._pending[len(due) :]  # in the order asked
        for _, finish in due:
            new = finish()
            if self.record is None or self.record.columns != new.columns:
                self.record = new
            else:
                self.record.add(new.rows)
        return True

    def warning(self) -> RunDiagnosis | None:
        """This fit's early warning, once: what the record predicts."""
        if self.warned or self.record is None:
            return None
        found = _explain.warning(self.record)
        self.warned = found is not None
        if found is not None:
            self.given = found
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
        return _explain.explain_warned(self.record, self.given)
