"""NaNGuard's incidents: the record, the episode still open, and the count
of rejected steps in an incident's words.

Consecutive bad steps are one episode, so one incident: an event that
`continues` the open incident's episode extends it instead of making a new
one. Bookkeeping only: no model, no Keras (`Responses` makes the incidents).
"""

from __future__ import annotations

from collections import Counter

from keras_nanguard.incidents import Incident, QuarantinedRow
from keras_nanguard.nan_guard.batch_watch import Event


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
