"""What NaNGuard uses of a SafeOptimizer, as a protocol: its public reports,
its halt limit and `attach`. NaNGuard's parts depend on this much only, and
a test can hand them a stand-in."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import keras

from keras_nanguard.flight.record import FlightRecord
from keras_nanguard.safe_optimizer import SafeOptimizer


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

    def _start_flight_read(self) -> Callable[[], FlightRecord]:
        """A read of the flight recorder that does not wait for the device:
        its copies are made and sent to the host now; the call returned
        makes the record of them."""
        ...

    def _newest_alarm(self, lag: int) -> int:
        """The step of the flight recorder's newest alarm the host knows
        without waiting for the device (0: none)."""
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


class SafeOptimizers:
    """Several SafeOptimizers of one model (a GAN's `d_optimizer` and
    `g_optimizer`) as one `SafeCounters`: their rejected steps summed, the
    reports of the one whose rejections are the latest streak (the
    *culprit*: most rejected steps in a row, then most in all). Only
    `model.optimizer` can be attached (see `attach`); the others are
    watched through their counters.

    Args:
        named: the SafeOptimizers by the attribute of the model holding
            them (`"optimizer"` for `model.optimizer`).
    """

    def __init__(self, named: Mapping[str, SafeOptimizer]) -> None:
        if len(named) < 2:
            raise ValueError(
                "`SafeOptimizers` holds two SafeOptimizers or more. "
                f"Received: {list(named)}"
            )
        self.named = dict(named)

    @property
    def max_consecutive_skips(self) -> int | None:
        limits = [o.max_consecutive_skips for o in self.named.values()]
        given = [limit for limit in limits if limit is not None]
        return min(given) if given else None

    def _read(self) -> dict[str, dict[str, float | int]]:
        return {name: opt.counters() for name, opt in self.named.items()}

    def _culprit(self, read: Mapping[str, Mapping[str, float | int]]) -> str:
        return max(
            read,
            key=lambda n: (read[n]["consecutive_skips"], read[n]["skipped_steps"]),
        )

    def counters(self) -> dict[str, float | int]:
        """Their counters summed (`consecutive_skips`: the longest streak);
        the figures of a step (norms, reasons) the culprit's."""
        read = self._read()
        out = dict(read[self._culprit(read)])
        for key, value in out.items():
            if isinstance(value, int) and key not in _PER_STEP:
                out[key] = sum(int(c[key]) for c in read.values())
        out["consecutive_skips"] = max(
            int(c["consecutive_skips"]) for c in read.values()
        )
        return out

    def describe_last_rejection(self) -> str:
        read = self._read()
        name = self._culprit(read)
        said = self.named[name].describe_last_rejection()
        return f"`{name}`: {said}" if said else ""

    def _recorded(self) -> SafeOptimizer:
        """Whose record is read: the culprit, the first optimizer while none
        rejected (a host read of the counters)."""
        read = self._read()
        if not any(c["skipped_steps"] for c in read.values()):
            return next(iter(self.named.values()))
        return self.named[self._culprit(read)]

    def flight_record(self) -> FlightRecord:
        """The culprit's record (the first optimizer's while none rejected)."""
        return self._recorded().flight_record()

    def _start_flight_read(self) -> Callable[[], FlightRecord]:
        return self._recorded()._start_flight_read()

    def _newest_alarm(self, lag: int) -> int:
        return self._recorded()._newest_alarm(lag)

    def attach(
        self,
        model: keras.Model,
        *,
        quarantine: bool | None = None,
        max_quarantine_fraction: float = 0.5,
    ) -> None:
        """Attaches `model.optimizer` if it is one of them. Per-sample
        quarantine, which reweighs the loss of one optimizer's step, is
        refused with several."""
        if quarantine:
            raise ValueError(
                "Per-sample quarantine works with one SafeOptimizer: it "
                "reweighs the loss of the model's `train_step`, which here "
                f"runs several ({', '.join(self.named)}). Received: "
                "quarantine=True"
            )
        own = self.named.get("optimizer")
        if own is not None:
            own.attach(model)

    def quarantined_rows(
        self, since: int = 0, until: int | None = None
    ) -> list[tuple[int, int, tuple[str, ...]]]:
        return []


# Counters that are the figures of one step or one setting, not totals.
_PER_STEP = frozenset(
    {
        "consecutive_skips",
        "consecutive_accepts",
        "last_rejection",
        "last_nonfinite_index",
        "recent_rejections",
    }
)
