"""NaNGuard's incidents (`IncidentLog`: the incidents, the open episode)
and how it tells a person about them: once each, with the action
(`Notifier`), the summary and the report.

An incident is told once its action is known (after the rollback, say, not
before it): as a Python warning if policy `"warn"` warned about it, not at
all if NaNGuard raised `NonFiniteError` for it (the error says it), else as
a log line (logger `"keras_nanguard"`, level WARNING) when `verbose`. An
incident told with no action that later becomes trouble (a streak of
rejected steps reaching `max_rejections`) is told again, with its action.

`fit(verbose=1)` draws its progress bar by rewriting one line (`\r`, no
newline): a message in the middle of an epoch would continue that line, so
the bar's line is ended first, as Keras's own callbacks do
(`"\nEpoch 3: early stopping"`).
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

import keras

from keras_nanguard.incidents import Incident, QuarantinedRow
from keras_nanguard.nan_guard.batch_watch import REJECTED, Event

LOG = logging.getLogger("keras_nanguard")
_OURS = ("keras", "keras_nanguard")  # frames a warning does not point at


class GuardRun(Protocol):
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
    policy: str, rollbacks: int, incidents: list[Incident], runs: Sequence[GuardRun]
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


def summary(incidents: list[Incident], rollbacks: int, runs: Sequence[GuardRun]) -> str:
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


class Notifier:
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


# NaNGuard's incidents: the record, the episode still open, and the count
# of rejected steps in an incident's words.
#
# Consecutive bad steps are one episode, so one incident: an event that
# `continues` the open incident's episode extends it instead of making a new
# one. Bookkeeping only: no model, no Keras (`Responses` makes the incidents).


class IncidentLog:
    """The incidents of a guard, in all its fits, and the open episode.

    A guard keeps one for its life; `begin_fit` closes the episode.
    """

    def __init__(self) -> None:
        self.incidents: list[Incident] = []
        # The incident whose episode a next bad event may continue: only one
        # of a batch, and closed by a healthy batch (`Event.continues`).
        self.open: Incident | None = None
        # The open incident's rejected steps, and the words that count them
        # in its detail: (incident, count, words).
        self._rejections: tuple[Incident | None, int, str] = (None, 0, "")
        # The epoch's quarantine incident and its count of rows (some may
        # not be named: the optimizer's log keeps the last 512).
        self._quarantine: tuple[Incident | None, int] = (None, 0)

    def begin_fit(self) -> None:
        self.open, self._rejections = None, (None, 0, "")
        self._quarantine = (None, 0)

    @property
    def quarantined(self) -> list[QuarantinedRow]:
        """Every row the quarantine left out, in all fits, in order."""
        return [
            row
            for inc in self.incidents
            if inc.kind == "quarantined_samples"
            for row in inc.rows
        ]

    def quarantine(
        self, ev: Event, fit: int, rows: list[QuarantinedRow], count: int
    ) -> Incident:
        """Adds `count` quarantined rows of the execution `ev`, `rows` of them
        named, to the epoch's quarantine incident (made by the first)."""
        inc, total = self._quarantine
        if inc is None or inc.epoch != ev.epoch:
            inc, total = (
                Incident(
                    fit=fit,
                    epoch=ev.epoch,
                    step=ev.step,
                    batch=ev.batch,
                    kind="quarantined_samples",
                    detail="",
                    action="left out of their steps",
                ),
                0,
            )
            self.incidents.append(inc)  # never an episode others continue
        inc.rows += rows
        inc.steps = ev.step + ev.steps - inc.step
        total += count
        self._quarantine = (inc, total)
        inc.detail = quarantine_words(inc.rows, total)
        return inc

    @property
    def last(self) -> Incident:
        """The newest incident (there is one: trouble follows its record)."""
        return self.incidents[-1]

    def add(self, inc: Incident, opens: bool) -> None:
        """Records `inc`; `opens`: a batch's incident, which later events may
        extend (not one found at an epoch's end or in a snapshot)."""
        self.incidents.append(inc)
        self.open = inc if opens else None

    def close(self) -> None:
        """The next event begins a new episode, whatever came before."""
        self.open = None

    def extend(self, ev: Event, kind: str | None = None) -> bool:
        """Adds `ev` to the open incident if it continues its episode (then
        of `kind`, if given); returns whether it did."""
        inc = self.open
        if not (ev.continues and inc is not None):
            return False
        inc.steps = ev.step + ev.steps - inc.step
        if kind is not None:
            inc.kind = kind
        return True

    def count_from(self, count: int, words: str) -> None:
        """The open incident began with `count` rejected steps, told in its
        detail by `words` (from `rejected_words`)."""
        self._rejections = (self.open, count, words)

    def count_rejections(self, more: int) -> None:
        """Counts `more` rejected steps in the open incident, in its detail
        too: the count there is the incident's, not its first event's."""
        inc, count, words = self._rejections
        if inc is None or inc is not self.open:  # it did not begin rejected
            return
        count += more
        new = rejected_words(count, inc.step, inc.steps)
        inc.detail = inc.detail.replace(words, new, 1)
        self._rejections = (inc, count, new)


def quarantine_words(rows: list[QuarantinedRow], count: int) -> str:
    """A quarantine incident's detail: `count` rows, `rows` of them named.

    Example:

    >>> row = QuarantinedRow(0, 0, 4, 4, 7, ("non-finite input",), 135)
    >>> quarantine_words([row], 1)
    'the quarantine left 1 row out of its step (1 non-finite input): batch 4 row 7 (position 135).'
    """
    reasons = Counter(words for row in rows for words in row.reasons)
    why = ", ".join(f"{n} {words}" for words, n in reasons.items())
    steps = len({(row.fit, row.step) for row in rows})
    where = "its step" if steps <= 1 else f"{steps} steps"
    text = f"the quarantine left {count} row{'s' if count != 1 else ''} out of {where}"
    text += f" ({why})" if why else ""
    shown = [
        f"batch {r.batch} row {r.row}"
        + ("" if r.position is None else f" (position {r.position})")
        for r in rows[:5]
    ]
    more = count - len(shown)
    text += ": " + ", ".join(shown) + (f" and {more} more" if more > 0 else "")
    return text + "."


def rejected_words(count: int, step: int, steps: int) -> str:
    """'SafeOptimizer rejected 2 steps in steps 3-4', of an incident's (or an
    event's) `steps` steps from `step`.

    Example:

    >>> rejected_words(2, 3, 2)
    'SafeOptimizer rejected 2 steps in steps 3-4'
    >>> rejected_words(1, 7, 1)
    'SafeOptimizer rejected 1 step'
    """
    last = step + steps - 1
    when = "" if step >= last else f" in steps {step}-{last}"
    return f"SafeOptimizer rejected {count} step{'s' if count > 1 else ''}{when}"
