"""The batches of an incident, read back from the data `fit` was given."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np


def check(name: str, data: Any) -> Any:
    """`data`, given as the argument `name`, if `batches` can read it: `None`,
    a `keras.utils.PyDataset`, `(x, y)` arrays of one length, or `x` alone
    (sliceable, with a length)."""
    if data is None or isinstance(data, keras.utils.PyDataset):
        return data
    pair = isinstance(data, tuple | list)
    message = (
        f"`{name}` must be `(x, y)` arrays, `x` alone, a keras.utils.PyDataset "
        f"or None. Received: {name}={data!r:.200}"
    )
    if pair and len(data) != 2:
        raise ValueError(message)
    if not all(map(_sliceable, data if pair else [data])):
        raise TypeError(message)
    if pair and len(data[0]) != len(data[1]):
        raise ValueError(
            f"`{name}` must be `(x, y)` arrays of the same length. Received: "
            f"len(x)={len(data[0])}, len(y)={len(data[1])}"
        )
    return data


def _sliceable(value: Any) -> bool:
    return (
        hasattr(value, "__len__")
        and hasattr(value, "__getitem__")
        and not isinstance(value, str | bytes | dict)
    )


def batches(
    data: Any, batch_size: int, first: int, last: int
) -> tuple[Any, int | None]:
    """The replay data of batches `first` to `last` of an epoch (one execution
    with `steps_per_execution > 1`), and the index of the bad one when it is
    knowable.

    When exactly one of the batches holds a NaN or inf, only that batch is
    returned, with its index; otherwise all of them, concatenated, and
    `None`. `(None, None)` when the data has no such batch.
    """
    items = []
    for i in range(first, last + 1):
        item = _batch(data, batch_size, i)
        if item is None:
            break
        items.append(item)
    if not items:
        return None, None
    bad = [i for i, item in enumerate(items) if not _finite(item)]
    if len(bad) == 1:
        return items[bad[0]], first + bad[0]
    if len(items) == 1:
        return items[0], None
    return keras.tree.map_structure(lambda *a: np.concatenate(a), *items), None


def _batch(data: Any, batch_size: int, index: int) -> Any:
    if isinstance(data, keras.utils.PyDataset):
        return data[index] if index < len(data) else None
    x, y = data if isinstance(data, tuple | list) else (data, None)
    lo = index * batch_size
    if lo >= len(x):
        return None
    sl = slice(lo, lo + batch_size)
    return (x[sl],) if y is None else (x[sl], y[sl])


def _finite(item: Any) -> bool:
    for value in keras.tree.flatten(item):
        array = np.asarray(value)
        if array.dtype.kind in "fc" and not np.isfinite(array).all():
            return False
    return True


def positions(
    data: Any, batch_size: int, rows: list[tuple[int, int]]
) -> list[int | None]:
    """The indices in `data` (read in order, as `batches` does) of the rows
    `(batch, row)`; `None` without data or past its end. A PyDataset's
    batches are taken to be as long as its first one, but for the last."""
    if data is None:
        return [None] * len(rows)
    if isinstance(data, keras.utils.PyDataset):
        count = len(data)
        size = _rows(data[0]) if count else 0
        last = _rows(data[count - 1]) if count else 0
        return [
            batch * size + row
            if batch < count and row < (last if batch == count - 1 else size)
            else None
            for batch, row in rows
        ]
    x = data[0] if isinstance(data, tuple | list) else data
    out: list[int | None] = []
    for batch, row in rows:
        index = batch * batch_size + row
        out.append(index if row < batch_size and index < len(x) else None)
    return out


def _rows(item: Any) -> int:
    """The rows of a batch: the length of its first array."""
    return len(keras.tree.flatten(item)[0])
