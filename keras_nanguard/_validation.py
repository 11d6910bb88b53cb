"""Argument checks shared by the public classes; errors name the argument and
end with `Received: ...`."""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any

import numpy as np


def is_int(value: Any, low: int | None = None) -> bool:
    """An integer (Python or NumPy, not bool), at least `low` when given."""
    return (
        isinstance(value, int | np.integer)
        and not isinstance(value, bool)
        and (low is None or value >= low)
    )


def is_number(value: Any) -> bool:
    """A finite Python int or float (not bool)."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def check_positive(name: str, value: Any, allow_none: bool = False) -> Any:
    """`value` as a float, if it is a finite number > 0 (or None if allowed)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"`{name}` must be a positive number. Received: {name}={value!r}"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"`{name}` must be a finite number > 0. Received: {name}={value!r}"
        )
    return float(value)


def check_writable(directory: str, name: str) -> None:
    """Creates `directory` if needed and checks that a file can be made in it."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".nanguard_probe_", dir=directory)
        os.close(fd)
        os.remove(tmp)
    except OSError as err:
        raise ValueError(
            f"`{name}` must be a writable directory. Received: {name}={directory!r} ({err})"
        ) from err
