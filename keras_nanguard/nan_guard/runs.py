"""Copies of a NaNGuard, one per run: what KerasTuner makes of the one you pass.

KerasTuner deep-copies the callbacks for each trial (each execution of a
trial, each retry), so the guard a user passes never trains itself. A copy
(`copy.deepcopy(guard)`) is a fresh NaNGuard with the same configuration
that registers in `guard.runs`, in the order the copies were made, and
writes its files apart: run `i` writes `report_path` as `<stem>_run<i><ext>`
and its snapshot under `<directory>/run<i>`. The copy's `origin` is the
guard copied; copying a copy copies its origin. The `replay` data is shared,
not copied: it is data, as `fit`'s `x` is, and only read.

KerasTuner scores a trial by its best epoch (the objective's `nanmin` or
`nanmax` over the epochs) and, when the objective is NaN in every epoch,
marks the trial FAILED (`Oracle.end_trial`: a NaN score is INVALID, retried
`max_retries_per_trial` times, then FAILED). Without NaNGuard a diverging
trial's figures are NaN from the epoch it diverged in. A run NaNGuard
stops for trouble ends with its rollback point restored, so its last
epochs would report finite figures that mean nothing (the state before the
trouble, or a partial epoch), and the trial could win the search. So when
`keras_tuner` is imported, a copy that stops (`"stop"`, or `"rollback"`
after `patience` rollbacks) sets the figures of the epochs that ended after
its rollback point to NaN: the epoch it stopped in (in `logs`, before the
tuner's callbacks read them) and earlier ones (in the model's `History`,
which `fit` returns to the tuner). KerasTuner then scores the trial by the
epochs before the trouble, or marks it FAILED if there were none, as
without NaNGuard; the incident's action says so. With `"raise"` the
`NonFiniteError` reaches KerasTuner, which marks the trial FAILED in the
same way (INVALID, retried, FAILED), with the error as `trial.message`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Any

import keras

from keras_nanguard.incidents import Incident

# NaNGuard's own counters in the logs stay as they are (`is_metric`).
from keras_nanguard.nan_guard.batch_watch import is_metric
from keras_nanguard.nan_guard.fit_state import FitState
from keras_nanguard.snapshots import Snapshot


def run_report_path(path: str | None, index: int) -> str | None:
    """`report.json` -> `report_run3.json` for run 3."""
    if path is None:
        return None
    stem, ext = os.path.splitext(path)
    return f"{stem}_run{index}{ext}"


def run_directory(directory: str | None, index: int) -> str | None:
    """`ckpt` -> `ckpt/run3` for run 3."""
    return None if directory is None else os.path.join(directory, f"run{index}")


@dataclasses.dataclass
class Epochs:
    """A copy's epochs in its current fit: the step each ended at and the
    figures it logged (History keeps one list per figure, without gaps)."""

    fit: int = -1
    ends: list[tuple[int, list[str]]] = dataclasses.field(default_factory=list)


def epoch_end(
    epochs: Epochs,
    state: FitState,
    point: Snapshot | None,
    incidents: list[Incident],
    logs: dict[str, Any],
) -> None:
    """At each epoch's end of a copy (its `epochs`), under KerasTuner: once
    it stops for trouble, sets the figures of the epochs since its rollback
    `point` to NaN, this epoch's in `logs`, earlier ones in the model's
    `History` (see the module's docstring)."""
    if not _tuning():
        return
    if epochs.fit != state.fit:  # a new fit
        epochs.fit, epochs.ends = state.fit, []
    epochs.ends.append((state.now, [k for k, v in logs.items() if _figure(k, v)]))
    if not state.stopping or point is None:
        return
    history = getattr(state.model, "history", None)  # set by History each epoch
    figures = history.history if isinstance(history, keras.callbacks.History) else {}
    marked = _set_to_nan(epochs.ends, point.step, logs, figures)
    first = state.epoch - len(epochs.ends) + 1  # the epoch of `epochs.ends[0]`
    _tell_marked(incidents, [first + epoch for epoch in marked])


def _set_to_nan(
    ends: list[tuple[int, list[str]]],
    since: int,
    logs: dict[str, Any],
    figures: dict[str, list],
) -> list[int]:
    """Sets to NaN the figures of the epochs (`ends`: each one's last step
    and figure names) that ended after step `since` (no state after it
    proved good): the last epoch's in `logs`, earlier ones in the History's
    `figures`. Returns those epochs' positions in `ends`."""
    seen: dict[str, int] = {}
    marked = []
    for epoch, (end, keys) in enumerate(ends):
        last = epoch == len(ends) - 1
        for key in keys:
            index = seen[key] = seen.get(key, -1) + 1
            if end <= since:
                continue
            if last:
                logs[key] = math.nan
            elif index < len(figures.get(key, [])):
                figures[key][index] = math.nan
        if end > since:
            marked.append(epoch)
    return marked


def _tell_marked(incidents: list[Incident], marked: list[int]) -> None:
    inc = incidents[-1] if incidents else None
    if not marked or inc is None or "set to NaN" in inc.action:
        return
    which = ", ".join(map(str, marked))
    inc.action += (
        f"; the figures of epoch{'s' if len(marked) > 1 else ''} {which} set to "
        "NaN, so that KerasTuner scores the trial as it would without NaNGuard"
    )


def _tuning() -> bool:
    return "keras_tuner" in sys.modules


def _figure(key: str, value: Any) -> bool:
    # A figure the tuner scores: a metric, not a flag.
    return not isinstance(value, bool) and is_metric(key, value)
