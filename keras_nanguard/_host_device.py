"""Where a snapshot's values live: reads to the host, copies on the device,
and whether the device has room for them. Each backend's path is here."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np


def host_view(v: Any) -> np.ndarray:
    """The value of a variable or tensor on the host, sharing memory where the
    backend allows.

    Only for reading at once: on torch (CPU) it changes with `v`.
    """
    backend = keras.backend.backend()
    value = v.value if isinstance(v, keras.Variable) else v
    if backend == "tensorflow":
        if hasattr(value, "read_value"):
            value = value.read_value()  # a read is a copy-on-write view
        return np.asarray(value)
    if backend == "torch" and hasattr(value, "detach"):
        return value.detach().cpu().numpy()
    return np.asarray(value)


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
    if hasattr(value, "detach"):  # torch (on the CPU, shares memory)
        return value.detach().cpu().numpy()
    return np.asarray(value)


def device_copy(value: Any) -> Any:
    if keras.backend.backend() == "jax":
        import jax.numpy as jnp

        return jnp.array(value, copy=True)  # a new buffer: the step donates its own
    return value.detach().clone()


def device_room(variables: list[keras.Variable]) -> bool:
    """Whether the device can hold three more copies of the state (the
    rollback point, a new snapshot, a spare) with a quarter of it left free."""
    need = 3 * sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables
    )
    backend = keras.backend.backend()
    try:
        if backend == "torch":
            import torch

            value = variables[0].value if variables else None
            if value is None or value.device.type != "cuda":
                return True  # host memory: as for a host snapshot
            free, total = torch.cuda.mem_get_info(value.device)
            return need < free - total // 4
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            return True  # CPU
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return need < free - stats["bytes_limit"] // 4
    except Exception:  # no figures: the host is the safe place
        return False


def held_value(v: keras.Variable) -> Any:
    """The value of `v` now, on its device, that later assigns to `v` leave
    as it is (to put it back after them)."""
    backend = keras.backend.backend()
    if backend == "jax":
        return v.value  # immutable: an assign makes a new array
    if backend == "torch":
        return v.value.detach().clone()  # an assign copies in place
    return v.value.read_value()  # TensorFlow copies on write
