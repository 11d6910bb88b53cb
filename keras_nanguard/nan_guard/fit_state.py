"""What NaNGuard's parts share during one `fit`: the state it keeps
(`FitState`), made afresh in `on_train_begin` with the guard's arguments as
they are then (its settings for the fit, an `Arguments`); its cadences
(`Cadence`); the agreement of the processes training together; and what it
uses of a SafeOptimizer (`SafeCounters`).

Threads: Keras may run `on_train_batch_end` in its worker threads (JAX,
PyTorch: NaNGuard is `async_safe` there); every other hook runs on the
thread that runs `fit`, the training thread. The two sides share only
`FitState.watch`, under `FitState.lock`; everything else in a `FitState` is
the training thread's, but for the fields set once in `on_train_begin`,
which both read. Only the training thread touches the model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import zlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import keras

from keras_nanguard import snapshots
from keras_nanguard._arguments import Arguments
from keras_nanguard._backend import current as backend
from keras_nanguard.flight.record import FlightRecord
from keras_nanguard.nan_guard import reporting
from keras_nanguard.nan_guard.batch_watch import BatchWatch, watch_for_fit
from keras_nanguard.safe_optimizer import SafeOptimizer


@dataclasses.dataclass
class FitState:
    """NaNGuard's state in one `fit`. Steps count from 0 at the fit's first
    batch, across epochs."""

    # Set once in `on_train_begin`; both threads read them.
    fit: int  # which of the guard's fits this is, from 0 (`Incident.fit`)
    thread: int  # the training thread's id
    k: int  # the model's `steps_per_execution`: batches per batch end
    # The model's SafeOptimizer, if it has one. The batch-end side only asks
    # whether there is one; its counters are read on the training thread.
    safe: SafeCounters | None
    # Both threads, only while holding `lock`; batch ends wait on it for
    # their turn, batch begins for the lag to shrink.
    lock: threading.Condition
    watch: BatchWatch  # the batch-end side's state; it queues `Event`s
    # Training thread only, from here on.
    # The model, read once: Keras's `Callback.model` syncs JAX state at each
    # access, so NaNGuard syncs only where it reads or changes the model.
    model: keras.Model
    snapshot_cadence: Cadence  # when the next snapshot is due
    check_cadence: Cadence  # when the next read of `safe`'s counters is due
    epoch: int = 0  # the epoch in progress
    # The step training is at: the steps run before the batch about to
    # begin, or all of them at an epoch's end.
    now: int = 0
    seen: int = 0  # `now` at the training thread's last turn
    checked_at: int = -1  # the last step the last read of the counters covers
    in_epoch: bool = False  # an epoch is under way (its progress bar may be)
    # The first snapshot was tried: at the first batch begin with the model
    # built (after every callback's `on_train_begin`, so after
    # `BackupAndRestore` loaded its backup).
    started: bool = False
    resumed_at: int = 0  # events of earlier steps ran on a state since undone
    restored_at: int = -1  # `now` when the rollback point was last restored
    discard_until: int | None = None  # `skip_batches`: restore again there
    stopping: bool = False  # trouble stopped training; undo what runs after
    # The SafeOptimizer's `quarantine_steps` before this fit's first step
    # (read at the first turn, after `BackupAndRestore` may have loaded it).
    quarantine_base: int = 0
    process: int = 0  # this process's index (process 0 writes the files)


def start_fit(
    fit: int,
    model: keras.Model,
    settings: Arguments,
    processes: tuple[int, int] = (0, 1),
) -> FitState:
    """The state of fit number `fit` of `model`, which begins now on this
    thread: its SafeOptimizers, if any (see `safe_optimizers_of`), the one
    compiled as `model.optimizer` attached (a rejected step then keeps
    BatchNormalization statistics too), and its batch-end side started from
    their totals (one read per fit). `processes`: this process's index and
    the number of processes training together (their "auto" cadences
    agree)."""
    named = safe_optimizers_of(model)
    safe: SafeCounters | None = None
    if len(named) == 1:
        safe = next(iter(named.values()))
    elif named:
        safe = SafeOptimizers(named)
    attachable = "optimizer" in named
    if settings.quarantine and not attachable:
        raise ValueError(
            "`NaNGuard(quarantine=True)` leaves bad rows out of the steps of a "
            "SafeOptimizer: compile the model with one, e.g. "
            "`optimizer=ng.SafeOptimizer(keras.optimizers.Adam())`. Received: "
            f"model.optimizer={model.optimizer!r}"
        )
    if safe is not None and attachable and settings.quarantine:
        safe.attach(
            model,
            quarantine=True,
            max_quarantine_fraction=settings.max_quarantine_fraction,
        )
    elif safe is not None and attachable:  # a quarantine the user attached is kept
        safe.attach(model)
    _warn_unattached(model, [name for name in named if name != "optimizer"])
    if safe is not None:
        snapshots.sync_from_device(model)
    if (
        processes[1] > 1
        and settings.directory
        and not backend.held_whole(snapshots.tracked(model))
    ):
        raise ValueError(
            "`directory`: process 0 writes the snapshot files, and a layout "
            "splits variables across processes here, so no process holds the "
            "whole state; leave `directory` out (each process keeps its own "
            "shards for rollbacks) and checkpoint with a sharded format. "
            f"Received: directory={settings.directory!r} on {processes[1]} "
            "processes"
        )
    agree = agree_max if processes[1] > 1 else None
    watch = watch_for_fit(
        safe,
        settings.loss_spike_sigma,
        settings.loss_spike_window,
        settings.loss_spike_patience,
    )
    return FitState(
        fit=fit,
        thread=threading.get_ident(),
        k=max(1, int(getattr(model, "steps_per_execution", 1) or 1)),
        safe=safe,
        lock=threading.Condition(),
        watch=watch,
        model=model,
        snapshot_cadence=Cadence(
            settings.snapshot_every, settings.snapshot_budget, 10, agree
        ),
        check_cadence=Cadence(settings.check_every, 0.01, 1, agree),
        process=processes[0],
    )


def safe_optimizers_of(model: keras.Model) -> dict[str, SafeOptimizer]:
    """The SafeOptimizers among the optimizers `model` trains with
    (`snapshots.model_optimizers`), each once, by the attribute holding it."""
    found: dict[str, SafeOptimizer] = {}
    for name, optimizer in snapshots.model_optimizers(model).items():
        safe = snapshots.find_safe_optimizer(optimizer)
        if safe is not None and all(safe is not s for s in found.values()):
            found[name] = safe
    return found


def _warn_unattached(model: keras.Model, names: list[str]) -> None:
    """Says what is not covered when SafeOptimizers the model holds besides
    `model.optimizer` train a model with forward-pass state."""
    if not names or not model.non_trainable_weights:  # BatchNormalization's, ...
        return
    held = ", ".join(f"`{n}`" for n in names)
    reporting.warn(
        f"NaNGuard: the model trains with SafeOptimizers it holds ({held}), "
        "besides `model.optimizer`: their rejected steps apply nothing to the "
        "weights or to their own state, and NaNGuard sees them (through their "
        "counters), but only `model.optimizer` can be attached to the model, "
        "so the forward-pass state such a step wrote (BatchNormalization "
        "statistics, ...) and its metrics are kept. Leave such layers out of "
        "the parts those optimizers train, or compile the model with its "
        "optimizer."
    )


# When a periodic host-side job of NaNGuard (a snapshot, a read of the
# optimizer's counters) is due.


class Cadence:
    """Every `every` steps, or, with "auto", as often as keeps the job's
    measured cost within `budget` of the measured step time, and at least
    `min_every` steps apart.

    With `agree` (a job of many processes), "auto"'s interval is set when
    the job is done, to `agree(this process's interval)`: the same on every
    process (the largest), so that each runs the job at the same steps.
    Alone, the interval follows the newest step time."""

    def __init__(
        self,
        every: int | str,
        budget: float,
        min_every: int,
        agree: Callable[[int], int] | None = None,
    ) -> None:
        self.every, self.budget, self.min_every = every, budget, min_every
        self.agree = agree
        self.cost: float | None = None
        self.since = 0
        self.interval = every if isinstance(every, int) else min_every
        self._step_seconds: float | None = None

    def due(self, step_seconds: float | None, steps: int = 1) -> bool:
        """Whether the job is due after `steps` more steps of `step_seconds`."""
        self.since += steps
        self._step_seconds = step_seconds or self._step_seconds
        if self.agree is None and self.every == "auto":
            self.interval = self._local_interval()
        return self.since >= self.interval

    def done(self, cost: float) -> None:
        self.cost, self.since = cost, 0
        if self.agree is not None and self.every == "auto":
            self.interval = max(self.min_every, self.agree(self._local_interval()))

    def _local_interval(self) -> int:
        if self.cost is None or not self._step_seconds:
            return self.min_every
        interval = math.ceil(self.cost / (self.budget * self._step_seconds))
        return max(self.min_every, interval)


# NaNGuard in a job of many processes (JAX's `keras.distribution` across
# processes): the same decision at the same step on every process.
#
# What makes it so: Keras runs the batch ends in line (NaNGuard is not
# `async_safe` there), so each process reads each batch's logs, which hold
# the global batch's figures, at the same point of its loop; the "auto"
# cadences take an interval agreed between the processes (`agree_max`) when
# their job is done; every other decision reads the replicated counters, the
# global logs or the flight record, which every process holds alike. The
# settings are compared at the start of `fit` (`check_same_settings`).
# Process 0 alone writes the report and the snapshot files.

# Settings a process may hold for itself: what it reads (its own replay
# data), where process 0 alone writes, what it prints.
_OWN = ("directory", "replay", "report_path", "verbose")


def processes() -> tuple[int, int]:
    """This process's index and the number of processes training together."""
    return backend.processes()


def agree_max(value: int) -> int:
    """The largest of every process's `value` (a collective)."""
    return max(v[0] for v in backend.gather_ints([int(value)]))


def check_engine(count: int) -> None:
    """NaNGuard runs inside `fit`: across processes only where `fit` does."""
    if count > 1 and backend.NAME != "jax":
        raise RuntimeError(
            "NaNGuard runs inside Keras's `fit`, which trains across processes "
            "only on JAX (keras.distribution). Under "
            + (
                "torch.distributed (DistributedDataParallel)"
                if backend.NAME == "torch"
                else "MultiWorkerMirroredStrategy"
            )
            + " train in your own loop with `ng.SafeOptimizer`, which takes the "
            "same decision on every process (docs/guide/distributed.md, "
            "'Many processes'). "
            f"Received: {count} processes on the {backend.NAME} backend"
        )


def check_same_settings(settings: Mapping[str, Any]) -> None:
    """Raises the same ValueError on every process if the processes' guards
    differ in a setting that decides (all but `_OWN`); a collective."""
    names = [n for n in settings if n not in _OWN]
    digests = [
        zlib.crc32(json.dumps(settings[n], default=repr).encode()) & 0x7FFFFFFF
        for n in names
    ]
    gathered = backend.gather_ints(digests)
    differ = [n for i, n in enumerate(names) if len({g[i] for g in gathered}) > 1]
    if differ:
        index, _ = processes()
        mine = ", ".join(f"{n}={settings[n]!r}" for n in differ)
        raise ValueError(
            "NaNGuard takes each decision on every process at the same step, "
            "so every process's guard needs the same settings; the processes' "
            f"guards differ in {', '.join(differ)}. Received on process "
            f"{index}: {mine}"
        )


# What NaNGuard uses of a SafeOptimizer, as a protocol: its public reports,
# its halt limit and `attach`. NaNGuard's parts depend on this much only, and
# a test can hand them a stand-in.


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

    def _newest_alarm(self, lag: int, model: Any = None) -> int:
        """The step of the flight recorder's newest alarm the host knows
        without waiting for the device (0: none), training `model`."""
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

    def _newest_alarm(self, lag: int, model: Any = None) -> int:
        return self._recorded()._newest_alarm(lag, model)

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
