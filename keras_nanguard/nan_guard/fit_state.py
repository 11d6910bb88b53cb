"""What NaNGuard's parts share during one `fit`: the state it keeps
(`FitState`), made afresh in `on_train_begin` with the guard's arguments as
they are then (its settings for the fit, an `Arguments`).

Threads: Keras may run `on_train_batch_end` in its worker threads (JAX,
PyTorch: NaNGuard is `async_safe` there); every other hook runs on the
thread that runs `fit`, the training thread. The two sides share only
`FitState.watch`, under `FitState.lock`; everything else in a `FitState` is
the training thread's, but for the fields set once in `on_train_begin`,
which both read. Only the training thread touches the model.
"""

from __future__ import annotations

import dataclasses
import threading

import keras

from keras_nanguard import snapshots
from keras_nanguard._arguments import Arguments
from keras_nanguard._backend import current as backend
from keras_nanguard.nan_guard import telling
from keras_nanguard.nan_guard.batch_watch import BatchWatch, watch_for_fit
from keras_nanguard.nan_guard.cadence import Cadence
from keras_nanguard.nan_guard.processes import agree_max
from keras_nanguard.nan_guard.safe_counters import SafeCounters, SafeOptimizers
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
    net: keras.Model
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
    net: keras.Model,
    settings: Arguments,
    processes: tuple[int, int] = (0, 1),
) -> FitState:
    """The state of fit number `fit` of `net`, which begins now on this
    thread: its SafeOptimizers, if any (see `safe_optimizers_of`), the one
    compiled as `model.optimizer` attached (a rejected step then keeps
    BatchNormalization statistics too), and its batch-end side started from
    their totals (one read per fit). `processes`: this process's index and
    the number of processes training together (their "auto" cadences
    agree)."""
    named = safe_optimizers_of(net)
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
            f"model.optimizer={net.optimizer!r}"
        )
    if safe is not None and attachable and settings.quarantine:
        safe.attach(
            net,
            quarantine=True,
            max_quarantine_fraction=settings.max_quarantine_fraction,
        )
    elif safe is not None and attachable:  # a quarantine the user attached is kept
        safe.attach(net)
    _warn_unattached(net, [name for name in named if name != "optimizer"])
    if safe is not None:
        snapshots.sync_from_device(net)
    if (
        processes[1] > 1
        and settings.directory
        and not backend.held_whole(snapshots.tracked(net))
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
        k=max(1, int(getattr(net, "steps_per_execution", 1) or 1)),
        safe=safe,
        lock=threading.Condition(),
        watch=watch,
        net=net,
        snapshot_cadence=Cadence(
            settings.snapshot_every, settings.snapshot_budget, 10, agree
        ),
        check_cadence=Cadence(settings.check_every, 0.01, 1, agree),
        process=processes[0],
    )


def safe_optimizers_of(net: keras.Model) -> dict[str, SafeOptimizer]:
    """The SafeOptimizers among the optimizers `net` trains with
    (`snapshots.model_optimizers`), each once, by the attribute holding it."""
    found: dict[str, SafeOptimizer] = {}
    for name, optimizer in snapshots.model_optimizers(net).items():
        safe = snapshots.find_safe_optimizer(optimizer)
        if safe is not None and all(safe is not s for s in found.values()):
            found[name] = safe
    return found


def _warn_unattached(net: keras.Model, names: list[str]) -> None:
    """Says what is not covered when SafeOptimizers the model holds besides
    `model.optimizer` train a model with forward-pass state."""
    if not names or not net.non_trainable_weights:  # BatchNormalization's, ...
        return
    held = ", ".join(f"`{n}`" for n in names)
    telling.warn(
        f"NaNGuard: the model trains with SafeOptimizers it holds ({held}), "
        "besides `model.optimizer`: their rejected steps apply nothing to the "
        "weights or to their own state, and NaNGuard sees them (through their "
        "counters), but only `model.optimizer` can be attached to the model, "
        "so the forward-pass state such a step wrote (BatchNormalization "
        "statistics, ...) and its metrics are kept. Leave such layers out of "
        "the parts those optimizers train, or compile the model with its "
        "optimizer."
    )
