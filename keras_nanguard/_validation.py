"""Argument checks shared by the public classes: one rule everywhere.

A value of the wrong type raises `TypeError`, a value of the right type out
of range raises `ValueError`; both name the argument in backticks and end
with `Received: name=value`. NumPy scalars count as the numbers they hold.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any, TypeGuard, cast

import numpy as np


def is_int(value: Any, low: int | None = None) -> TypeGuard[int | np.integer]:
    """An integer (Python or NumPy, not bool), at least `low` when given."""
    return bool(
        isinstance(value, int | np.integer)
        and not isinstance(value, bool | np.bool_)
        and (low is None or value >= low)
    )


def is_number(value: Any) -> bool:
    """A finite real number (Python or NumPy, not bool)."""
    return _is_real(value) and math.isfinite(value)


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not (
        isinstance(value, bool | np.bool_)
    )


def check_positive(name: str, value: Any, allow_none: bool = False) -> Any:
    """`value` as a float, if it is a finite number > 0 (or None if allowed)."""
    if value is None and allow_none:
        return None
    if not _is_real(value):
        raise TypeError(
            f"`{name}` must be a positive number. Received: {name}={value!r}"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"`{name}` must be a finite number > 0. Received: {name}={value!r}"
        )
    return float(value)


def check_in(
    name: str,
    value: Any,
    low: float,
    high: float,
    *,
    closed_high: bool,
    allow_none: bool = False,
) -> Any:
    """`value` as a float, if it is a number in (low, high) or (low, high]
    (or None if allowed)."""
    if value is None and allow_none:
        return None
    bracket = "]" if closed_high else ")"
    what = f"in ({low:g}, {high:g}{bracket}"
    if not _is_real(value):
        raise TypeError(f"`{name}` must be a number {what}. Received: {name}={value!r}")
    inside = low < value < high or (closed_high and value == high)
    if not inside:  # NaN too
        raise ValueError(f"`{name}` must be {what}. Received: {name}={value!r}")
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    """`value` if it is a bool (NumPy's too)."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"`{name}` must be True or False. Received: {name}={value!r}")
    return bool(value)


def check_int(name: str, value: Any, low: int, allow_none: bool = False) -> Any:
    """`value` as an int, if it is an integer >= `low` (or None if allowed)."""
    if value is None and allow_none:
        return None
    if not is_int(value):
        what = f"an integer >= {low}" + (" or None" if allow_none else "")
        raise TypeError(f"`{name}` must be {what}. Received: {name}={value!r}")
    if value < low:
        raise ValueError(
            f"`{name}` must be an integer >= {low}. Received: {name}={value!r}"
        )
    return int(value)


def check_int_or_auto(name: str, value: Any, low: int) -> int | str:
    """`value` as an int if it is an integer >= `low`, or `"auto"`."""
    message = (
        f"`{name}` must be an integer >= {low} or 'auto'. Received: {name}={value!r}"
    )
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(message)
        return "auto"
    if not is_int(value):
        raise TypeError(message)
    if value < low:
        raise ValueError(message)
    return int(value)


def check_choice(
    name: str,
    value: Any,
    choices: tuple[str, ...] | tuple[int, ...],
    allow_none: bool = False,
) -> Any:
    """`value` if it is one of `choices`: all strings, or all integers (NumPy
    integers count, bools do not); or None if allowed."""
    if value is None and allow_none:
        return None
    text = isinstance(choices[0], str)
    message = f"`{name}` must be one of {choices}. Received: {name}={value!r}"
    if not (isinstance(value, str) if text else is_int(value)):
        raise TypeError(message)
    if value not in choices:
        raise ValueError(message)
    return str(value) if text else int(value)


def check_path(name: str, value: Any, allow_none: bool = False) -> str | None:
    """`value` as a `str` path, if it is a non-empty `str` or `os.PathLike`."""
    if value is None and allow_none:
        return None
    path = os.fspath(value) if isinstance(value, str | os.PathLike) else None
    if not isinstance(path, str):
        what = "a str or an os.PathLike" + (" or None" if allow_none else "")
        raise TypeError(f"`{name}` must be {what}. Received: {name}={value!r}")
    if not path:
        raise ValueError(f"`{name}` must not be empty. Received: {name}={value!r}")
    return path


def check_not_a_directory(name: str, path: str | None) -> str | None:
    """`path` (a file to write) if it is not an existing directory."""
    if path is not None and os.path.isdir(path):
        raise ValueError(
            f"`{name}` must be the path of a file, not of an existing directory: "
            f"give a file name in it, e.g. {os.path.join(path, 'nanguard.json')!r}. "
            f"Received: {name}={path!r}"
        )
    return path


def check_not_a_file(name: str, path: str | None) -> str | None:
    """`path` (a directory to write into) if it is not an existing file."""
    if path is not None and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(
            f"`{name}` must be a directory (it is created if needed), not an "
            f"existing file. Received: {name}={path!r}"
        )
    return path


def check_directory(name: str, value: Any, writable: bool = False) -> str | None:
    """`value` as a `str` path (or None) of a directory to write into: not an
    existing file; with `writable`, created and tried."""
    path = check_not_a_file(name, check_path(name, value, allow_none=True))
    if writable and path is not None:
        check_writable(path, name)
    return path


def check_file_path(name: str, value: Any, writable: bool = False) -> str | None:
    """`value` as a `str` path (or None) of a file to write: not an existing
    directory; with `writable`, its directory created and tried."""
    path = check_not_a_directory(name, check_path(name, value, allow_none=True))
    if writable and path is not None:
        check_writable(os.path.dirname(os.path.abspath(path)), name)
    return path


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


# The faults `faults` injects, by name.
_NAMED = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def fault_value(value: str | float, name: str = "value") -> float:
    """A fault to inject: `"nan"`, `"inf"`, `"-inf"` or a number, as a float."""
    if isinstance(value, str):
        if value.lower() not in _NAMED:
            raise ValueError(
                f"`{name}` must be 'nan', 'inf', '-inf' or a number. "
                f"Received: {name}={value!r}"
            )
        return _NAMED[value.lower()]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"`{name}` must be 'nan', 'inf', '-inf' or a number. "
            f"Received: {name}={value!r}"
        )
    return float(value)


def check_steps(
    at_steps: Iterable[int] | int, name: str = "at_steps", given: Any = None
) -> tuple[int, ...]:
    """Sorted distinct 0-based indices; errors show `given` (what the user
    passed) when the indices were taken out of it."""
    given = at_steps if given is None else given
    try:
        steps = (
            (int(at_steps),)
            if is_int(at_steps)
            else tuple(cast(Iterable[int], at_steps))
        )
    except TypeError as err:
        raise TypeError(
            f"`{name}` must be an int or a list of ints >= 0. "
            f"Received: {name}={given!r}"
        ) from err
    if not all(is_int(s, 0) for s in steps):
        raise ValueError(
            f"`{name}` must hold ints >= 0 (0-based indices). "
            f"Received: {name}={given!r}"
        )
    return tuple(sorted({int(s) for s in steps}))


def check_indices(name: str, value: Sequence[int] | int, size: int) -> list[int]:
    """`value` (an index or several) as ints, if each indexes `size` entries."""
    values = [value] if isinstance(value, int | np.integer) else list(value)
    bad = [v for v in values if not -size <= int(v) < size]
    if bad:
        raise ValueError(
            f"`{name}` must index the {size} entries there are (from {-size} to "
            f"{size - 1}). Received: {name}={value!r}"
        )
    return [int(v) for v in values]
