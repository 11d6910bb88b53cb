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
from typing import Any

import keras

from keras_nanguard.incidents import Incident, write_json
from keras_nanguard.nan_guard.batch_watch import REJECTED

LOG = logging.getLogger("keras_nanguard")
_OURS = ("keras", "keras_nanguard")  # frames a warning does not point at


class Telling:
    """The telling half of `NaNGuard` (a mixin: the state is the callback's):
    each incident once, the summary, the JSON report."""

    _told = 0  # incidents told, the last of them with the action `_told_as`
    _told_as: str | None = None

    def report(self) -> dict[str, Any]:
        """Everything NaNGuard saw, as a JSON-ready dict.

        Example:

        >>> import keras_nanguard as ng
        >>> ng.NaNGuard().report()["incidents"]
        []
        """
        out = {
            "policy": self.policy,
            "rollbacks": self.rollbacks,
            "incidents": [i.to_dict() for i in self.incidents],
        }
        if self.runs:  # its copies' (KerasTuner's trials), one per run
            out["runs"] = [
                {"run": r.run_index, "report_path": r.report_path, **r.report()}
                for r in self.runs
            ]
        return out

    def summary(self) -> str:
        """The incidents in words, one per line.

        Example:

        >>> import keras_nanguard as ng
        >>> ng.NaNGuard().summary()
        'NaNGuard: no incidents.'
        """
        lines = [f"NaNGuard: {_count(self.incidents, self.rollbacks)}."]
        if self.runs:  # its copies (KerasTuner makes one per trial)
            total = sum(len(r.incidents) for r in self.runs)
            lines[0] += f" Its {len(self.runs)} runs: {total} incidents in all."
        lines += [f"  {i}" for i in self.incidents]
        for run in self.runs:
            told = run.summary().splitlines()
            lines.append(f"  run {run.run_index}: {told[0].removeprefix('NaNGuard: ')}")
            lines += [f"  {line}" for line in told[1:]]
        return "\n".join(lines)

    def _write_report(self) -> None:
        if self.report_path is not None:
            write_json(self.report_path, self.report())
        if self.origin is not None:  # the runs together, in the origin's
            self.origin._write_report()

    def _publish(self, logs: dict) -> None:
        logs["nanguard_incidents"] = len(self.incidents)
        logs["nanguard_rollbacks"] = self.rollbacks
        if self._safe is not None:  # an attached step logs its own, exactly
            logs.setdefault(REJECTED, self._watch.rejected)

    def _tell(self) -> None:
        """Tells the incidents not told yet, and the last one told again if
        its action changed since. Training thread only."""
        incidents = self.incidents
        bar = self._in_epoch and self._watch.next_batch > 0
        bar = bar and _bar_in_place(self.params)
        start = self._told
        if start and incidents[start - 1].action != self._told_as:
            start -= 1
        for inc in incidents[start:]:
            bar = _say(inc, self.verbose, bar)
        if incidents:
            self._told, self._told_as = len(incidents), incidents[-1].action


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
