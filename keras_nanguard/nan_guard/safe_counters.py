"""What NaNGuard uses of a SafeOptimizer, as a protocol: its public reports,
its halt limit and `attach`. NaNGuard's parts depend on this much only, and
a test can hand them a stand-in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import keras

from keras_nanguard.safe_optimizer.flight_record import FlightRecord


class SafeCounters(Protocol):
    @property
    def max_consecutive_skips(self) -> int | None: ...

    def counters(self) -> Mapping[str, float]:
        """The counters as Python numbers (a host read)."""
        ...

    def describe_last_rejection(self) -> str: ...

    def flight_record(self) -> FlightRecord:
        """The flight recorder's rows (a host read)."""
        ...

    def attach(
        self,
        model: keras.Model,
        *,
        quarantine: bool | None = None,
        max_quarantine_fraction: float = 0.5,
    ) -> None: ...

    def quarantined_rows(
        self, since: int = 0, until: int | None = None
    ) -> list[tuple[int, int, tuple[str, ...]]]: ...
