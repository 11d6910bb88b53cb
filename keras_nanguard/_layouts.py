"""The layouts in which earlier versions saved SafeOptimizer's variables.

A `.keras` file holds an optimizer's variables as a numbered list. Counters
added since a version was released are appended to the counters, so a file
of that version has fewer; `upgrade` turns such a list into today's layout,
the new counters at their initial values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# keras-nanguard 0.1 saved 11 counters, after two variables of the base
# class that are no longer state; 0.2 saved 13, then the spike window if any.
COUNTERS_0_1 = 11
COUNTERS_0_2 = 13


def upgrade(
    store: Any, *, counters: int, window: int, inner: int, initial: list[Any]
) -> Any:
    """`store` in today's layout: `counters` counters, a spike window of
    `window` variables, `inner` variables of the inner optimizer; `initial`
    holds today's counter and window values, for what the file lacks."""
    keys = len(store.keys())
    if keys == 2 + COUNTERS_0_1 + inner and np.asarray(store["1"]).dtype.kind == "f":
        # 0.1: the second dead variable is a float learning rate, where
        # today's second entry is an int counter; no spike window then.
        first, saved, saved_window = 2, COUNTERS_0_1, 0
    elif keys == COUNTERS_0_2 + window + inner != counters + window + inner:
        first, saved, saved_window = 0, COUNTERS_0_2, window
    else:
        return store  # today's layout (or a mismatch Keras reports)
    old = [store[str(i)] for i in range(first, keys)]
    values = list(initial)
    values[:saved] = old[:saved]
    values[counters : counters + saved_window] = old[saved : saved + saved_window]
    values += old[saved + saved_window :]
    return {str(i): v for i, v in enumerate(values)}
