"""NaNGuard in a job of many processes (JAX's `keras.distribution` across
processes): the same decision at the same step on every process.

What makes it so: Keras runs the batch ends in line (NaNGuard is not
`async_safe` there), so each process reads each batch's logs, which hold
the global batch's figures, at the same point of its loop; the "auto"
cadences take an interval agreed between the processes (`agree_max`) when
their job is done; every other decision reads the replicated counters, the
global logs or the flight record, which every process holds alike. The
settings are compared at the start of `fit` (`check_same_settings`).
Process 0 alone writes the report and the snapshot files.
"""

from __future__ import annotations

import dataclasses
import json
import zlib

from keras_nanguard._backend import current as backend

# Settings a process may hold for itself: what it reads (its own replay
# data), where process 0 alone writes.
_OWN = ("directory", "replay")


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


def check_same_settings(settings: object) -> None:
    """Raises the same ValueError on every process if the processes' guards
    differ in a setting that decides (all but `_OWN`); a collective."""
    fields = [f.name for f in dataclasses.fields(settings)]  # type: ignore[arg-type]
    names = [n for n in fields if n not in _OWN]
    digests = [
        zlib.crc32(json.dumps(getattr(settings, n), default=repr).encode()) & 0x7FFFFFFF
        for n in names
    ]
    gathered = backend.gather_ints(digests)
    differ = [n for i, n in enumerate(names) if len({g[i] for g in gathered}) > 1]
    if differ:
        index, _ = processes()
        mine = ", ".join(f"{n}={getattr(settings, n)!r}" for n in differ)
        raise ValueError(
            "NaNGuard takes each decision on every process at the same step, "
            "so every process's guard needs the same settings; the processes' "
            f"guards differ in {', '.join(differ)}. Received on process "
            f"{index}: {mine}"
        )
