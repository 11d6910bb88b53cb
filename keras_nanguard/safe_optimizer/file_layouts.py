"""The layouts in which earlier versions saved SafeOptimizer's variables.

A `.keras` file holds an optimizer's variables as a numbered list. Counters
added since a version was released are appended to the counters, so a file
of that version has fewer; `upgrade` turns such a list into today's layout,
the new counters at their initial values; `upgrade_config` does the same
for a saved config's arguments.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

# keras-nanguard 0.1 saved 11 counters, after two variables of the base
# class that are no longer state; 0.2 saved 13, then the spike window if any
# (its ring buffer and count; `last_spike` came later).
COUNTERS_0_1 = 11
COUNTERS_0_2 = 13
WINDOW_0_2 = 2  # spike_norms, spike_count


def upgrade(
    store: Any,
    *,
    counters: int,
    window: int,
    inner: int,
    initial: list[Any],
    recorder: int = 0,
) -> Any:
    """`store` in today's layout: `counters` counters, a spike window of
    `window` variables (0.2 saved the first `WINDOW_0_2` of them), the
    flight recorder's `recorder` variables (0.1 and 0.2 had none), `inner`
    variables of the inner optimizer; `initial` holds today's counter,
    window and recorder values, for what the file lacks."""
    keys = len(store.keys())
    window_0_2 = min(window, WINDOW_0_2)  # none without spike skipping
    if keys == 2 + COUNTERS_0_1 + inner and np.asarray(store["1"]).dtype.kind == "f":
        # 0.1: the second dead variable is a float learning rate, where
        # today's second entry is an int counter; no spike window then.
        first, saved, saved_window = 2, COUNTERS_0_1, 0
    elif (
        keys
        == COUNTERS_0_2 + window_0_2 + inner
        != (counters + window + recorder + inner)
    ):
        first, saved, saved_window = 0, COUNTERS_0_2, window_0_2
    else:
        return store  # today's layout (or a mismatch Keras reports)
    old = [store[str(i)] for i in range(first, keys)]
    values = list(initial)
    values[:saved] = old[:saved]
    values[counters : counters + saved_window] = old[saved : saved + saved_window]
    values += old[saved + saved_window :]
    return {str(i): v for i, v in enumerate(values)}


# 0.2's spike rule, mean + `spike_sigma` standard deviations of the window,
# rejected clean steps of noisy batches; today's is `spike_factor` times the
# window's 90th percentile, with 10 the documented value.
SPIKE_FACTOR_FOR_0_2 = 10.0


def upgrade_config(config: dict[str, Any]) -> None:
    """A SafeOptimizer config of 0.2 in today's arguments, in place: its
    `spike_sigma` becomes `spike_factor=10`, with a warning that says so."""
    if "spike_sigma" not in config:
        return
    sigma = config.pop("spike_sigma")
    if sigma is None:
        config.setdefault("spike_factor", None)
        return
    config["spike_factor"] = SPIKE_FACTOR_FOR_0_2
    warnings.warn(
        f"This SafeOptimizer was saved with spike_sigma={sigma!r} (keras-nanguard "
        "0.2: a step more than that many standard deviations above the mean "
        "of the window was a spike, which rejected clean steps of noisy "
        f"batches). It loads with spike_factor={SPIKE_FACTOR_FOR_0_2:g}: a step "
        f"more than {SPIKE_FACTOR_FOR_0_2:g} times the window's 90th percentile "
        "is a spike. The window's norms are kept.",
        stacklevel=3,
    )
