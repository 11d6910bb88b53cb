"""The data of the JAX job (tests/workers/jax_processes.py), which the test
also trains on alone, as one process, for its references."""

import numpy as np

GLOBAL, STEPS = 16, 20  # rows of a global batch, batches of an epoch


def global_data(bad_rows=()):
    """Global batches of 16 rows; `bad_rows`: (batch, row) given a NaN."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS * GLOBAL, 6)).astype("float32")
    y = (x[:, :1] > 0).astype("float32")
    for b, r in bad_rows:
        x[b * GLOBAL + r, 2] = np.nan
    return x, y


# Batch 3: two rows of rank 1's half (8..15); batch 8: one row of each half.
QUARANTINED = [(3, 9), (3, 13), (8, 2), (8, 10)]
