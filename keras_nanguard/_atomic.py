"""Files written whole or not at all: what NaNGuard writes beside a run."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str) -> Iterator[str]:
    """A temporary file beside `path` for the block to write. When the block
    ends, the file is synced and renamed onto `path` (atomic on POSIX and
    Windows); if it raises, the file is removed and `path` is left as it
    was.

    Example:

    >>> import os, tempfile
    >>> from keras_nanguard._atomic import atomic_path
    >>> path = os.path.join(tempfile.mkdtemp(), "report.json")
    >>> with atomic_path(path, ".json") as tmp:
    ...     with open(tmp, "w") as f:
    ...         _ = f.write("{}")
    >>> open(path).read(), len(os.listdir(os.path.dirname(path)))
    ('{}', 1)
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".nanguard_", suffix=suffix, dir=directory)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
