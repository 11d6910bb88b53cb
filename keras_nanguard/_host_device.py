"""Where a snapshot's values live: reads to the host, copies on the device,
and whether the device has room for them. Each backend's part is in `_backend`."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from keras_nanguard._backend import current as backend


def host_view(v: Any) -> np.ndarray:
    """The value of a variable or tensor on the host, sharing memory where the
    backend allows.

    Only for reading at once: on torch (CPU) it changes with `v`.
    """
    return backend.host_view(v.value if isinstance(v, keras.Variable) else v)


def host_finite(value: np.ndarray) -> bool:
    """Whether a host array holds no NaN or inf (non-float arrays always do)."""
    if value.dtype.kind != "f":
        return True
    # A sum reads once and allocates nothing; only a non-finite sum (a NaN or
    # inf, or an overflow of the sum itself) needs the exact check.
    with np.errstate(invalid="ignore", over="ignore"):  # inf + -inf, overflow
        total = value.sum()
    return bool(np.isfinite(total)) or bool(np.isfinite(value).all())


def to_host(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    return backend.host_view(value)


def device_copies(values: list[Any]) -> list[Any]:
    return backend.device_copies(values)


def device_room(variables: list[keras.Variable]) -> bool:
    """Whether the device can hold three more copies of the state (the
    rollback point, a new snapshot, a spare) with a quarter of it left free;
    across processes, whether every process's devices can (a collective)."""
    need = 3 * sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables
    )
    try:
        room = backend.device_room(variables, need)
    except Exception:  # no figures: the host is the safe place
        room = False
    if backend.processes()[1] > 1:  # every process keeps its copy alike
        room = all(r[0] for r in backend.gather_ints([int(room)]))
    return room


def held_value(v: keras.Variable) -> Any:
    """The value of `v` now, on its device, that later assigns to `v` leave
    as it is (to put it back after them)."""
    return backend.held_value(v)
