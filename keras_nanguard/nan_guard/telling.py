"""How NaNGuard tells a person about its incidents: once each, with the action.

An incident is told once its action is known (after the rollback, say, not
before it): as a Python warning if policy `"warn"` warned about it, not at
all if NaNGuard raised `NonFiniteError` for it (the error says it), else as
a log line (logger `"keras_nanguard"`, level WARNING) when `verbose`. An
incident told with no action that later becomes trouble (a streak of
rejected steps reaching `max_rejections`) is told again, with its action.

`fit(verbose=1)` draws its progress bar by rewriting one line (`\\r`, no
newline): a message in the middle of an epoch would continue that line, so
the bar's line is ended first, as Keras's own callbacks do
(`"\\nEpoch 3: early stopping"`).
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import keras

from keras_nanguard.incidents import Incident
from keras_nanguard.nan_guard.batch_watch import REJECTED

LOG = logging.getLogger("keras_nanguard")
_OURS = ("keras", "keras_nanguard")  # frames a warning does not point at


class Told(Protocol):
    """What `report` and `summary` read of a guard's runs (its copies)."""

    @property
    def run_index(self) -> int | None: ...

    @property
    def report_path(self) -> str | None: ...

    @property
    def incidents(self) -> list[Incident]: ...

    def report(self) -> dict[str, Any]: ...

    def summary(self) -> str: ...


def report(
    policy: str, rollbacks: int, incidents: list[Incident], runs: Sequence[Told]
) -> dict[str, Any]:
    """A guard's report (`NaNGuard.report`), with its runs' reports."""
    out: dict[str, Any] = {
        "policy": policy,
        "rollbacks": rollbacks,
        "incidents": [i.to_dict() for i in incidents],
    }
    if runs:  # its copies' (KerasTuner's trials), one per run
        out["runs"] = [
            {"run": r.run_index, "report_path": r.report_path, **r.report()}
            for r in runs
        ]
    return out


def summary(incidents: list[Incident], rollbacks: int, runs: Sequence[Told]) -> str:
    """A guard's summary (`NaNGuard.summary`), with its runs' summaries."""
    lines = [f"NaNGuard: {_count(incidents, rollbacks)}."]
    if runs:  # its copies (KerasTuner makes one per trial)
        total = sum(len(r.incidents) for r in runs)
        lines[0] += f" Its {len(runs)} runs: {total} incidents in all."
    lines += [f"  {i}" for i in incidents]
    for run in runs:
        told = run.summary().splitlines()
        lines.append(f"  run {run.run_index}: {told[0].removeprefix('NaNGuard: ')}")
        lines += [f"  {line}" for line in told[1:]]
    return "\n".join(lines)


def publish(
    logs: dict[str, Any], incidents: int, rollbacks: int, rejected: int | None
) -> None:
    """Adds NaNGuard's figures to `logs`; `rejected`: a SafeOptimizer's total
    of rejected steps, if there is one (an attached step logs its own)."""
    logs["nanguard_incidents"] = incidents
    logs["nanguard_rollbacks"] = rollbacks
    if rejected is not None:
        logs.setdefault(REJECTED, rejected)


class Teller:
    """Tells each incident once its action is known (see the module's
    docstring), and again if its action changed since. A guard keeps one
    for its life, as its incidents outlive a `fit`. Training thread only."""

    def __init__(self) -> None:
        self.told = 0  # incidents told
        self.told_as: str | None = None  # the action the last one was told with

    def tell(self, incidents: list[Incident], verbose: int, bar: bool) -> None:
        """Tells the incidents not told yet, and the last one told again if
        its action changed since; `bar`: `fit`'s progress bar has a line
        open (see `bar_open`)."""
        start = self.told
        if start and incidents[start - 1].action != self.told_as:
            start -= 1
        for inc in incidents[start:]:
            bar = _say(inc, verbose, bar)
        if incidents:
            self.told, self.told_as = len(incidents), incidents[-1].action


def bar_open(in_epoch: bool, next_batch: int, params: dict[str, Any] | None) -> bool:
    """Whether `fit`'s progress bar has a line open that a message would
    continue: in an epoch, after its first batch, with a bar that rewrites
    its line in place."""
    return in_epoch and next_batch > 0 and _bar_in_place(params)


def _count(incidents: list[Incident], rollbacks: int) -> str:
    if not incidents:
        return "no incidents"
    return f"{len(incidents)} incidents, {rollbacks} rollbacks"


def _bar_in_place(params: dict[str, Any] | None) -> bool:
    """Whether `fit`'s progress bar rewrites its line in place (verbose 1 or
    "auto", with Keras's interactive logging): a message written in the
    middle of an epoch would continue that line."""
    verbose = (params or {}).get("verbose")
    return verbose in (1, "auto") and keras.config.is_interactive_logging_enabled()


def _say(inc: Incident, verbose: int, bar: bool) -> bool:
    """Tells one incident; returns whether the bar's line is still open."""
    if "raised NonFiniteError" in inc.action:
        return bar
    warn = inc.action == "warned"
    if not (warn or (verbose and LOG.isEnabledFor(logging.WARNING))):
        return bar
    if bar:  # where Keras's Progbar writes (`io_utils.print_msg`)
        sys.stdout.write("\n")
        sys.stdout.flush()
    if warn:
        warnings.warn(f"NaNGuard: {inc}", stacklevel=_outside())
    else:
        LOG.warning("NaNGuard: %s", inc)
    return False


def warn(message: str) -> None:
    """A `UserWarning` that points at the code that called `fit`."""
    warnings.warn(message, stacklevel=_outside())


def _outside() -> int:
    """The `stacklevel` at which a `warnings.warn` called by its caller points
    at the first frame outside Keras and keras_nanguard: the code that called
    `fit`."""
    frame, level = sys._getframe(1), 1  # the caller's frame is level 1
    while frame.f_back is not None:
        if frame.f_globals.get("__name__", "").split(".")[0] not in _OURS:
            break
        frame, level = frame.f_back, level + 1
    return level
