"""Small test helpers: NumPy views of state, bit-identity, .keras round trips."""

from __future__ import annotations

import numpy as np
from keras import ops

from tests.conftest import BACKEND  # noqa: F401  (re-exported for tests)


def numpy(values) -> list[np.ndarray]:
    """Copies of a list of variables/tensors as NumPy arrays."""
    return [np.array(ops.convert_to_numpy(v), copy=True) for v in values]


def assert_bit_identical(before, after, what="state"):
    assert len(before) == len(after), f"{what}: {len(before)} vs {len(after)} arrays"
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}[{i}]"
        # Bitwise, so NaN payloads and -0.0 count too.
        assert a.tobytes() == b.tobytes(), f"{what}[{i}] changed"


def all_finite(values) -> bool:
    return all(np.isfinite(v).all() for v in numpy(values) if v.dtype.kind == "f")


def inner_state(opt):
    """The inner optimizer's variables (moments, iterations, ...) as NumPy."""
    return numpy(opt.inner_optimizer.variables)
