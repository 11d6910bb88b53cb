"""IncidentLog, NaNGuard's record: consecutive bad steps are one incident,
and the count of rejected steps in its detail is the incident's. Events and
incidents made by hand; no model, no training."""

import pytest

from keras_nanguard.incidents import Incident
from keras_nanguard.nan_guard.batch_watch import Event
from keras_nanguard.nan_guard.reporting import IncidentLog, rejected_words

pytestmark = pytest.mark.backend_free


def _event(step: int, steps: int = 1, continues: bool = False, **kw) -> Event:
    return Event("rejection", 0, step, step, steps, {}, [], continues=continues, **kw)


def _incident(step: int, detail: str = "", kind: str = "rejected_step") -> Incident:
    return Incident(fit=0, epoch=0, step=step, batch=step, kind=kind, detail=detail)


def test_an_event_that_continues_the_episode_extends_the_open_incident():
    log = IncidentLog()
    inc = _incident(4)
    log.add(inc, opens=True)
    assert log.open is inc and log.last is inc
    assert log.extend(_event(5, steps=2, continues=True))
    assert (inc.step, inc.steps, inc.kind) == (4, 3, "rejected_step")
    assert log.extend(_event(7, continues=True), kind="halted")
    assert (inc.steps, inc.kind) == (4, "halted")
    # A healthy batch in between: a new episode.
    assert not log.extend(_event(9))
    assert inc.steps == 4


def test_an_incident_found_outside_a_batch_closes_the_episode():
    log = IncidentLog()
    log.add(_incident(4), opens=True)
    found = _incident(6, kind="nonfinite_weights")
    log.add(found, opens=False)
    assert log.open is None and log.last is found
    assert not log.extend(_event(7, continues=True))
    log.add(_incident(8), opens=True)
    log.close()
    assert log.open is None
    assert [i.step for i in log.incidents] == [4, 6, 8]


def test_rejected_steps_are_counted_in_the_open_incidents_detail():
    log = IncidentLog()
    words = rejected_words(1, 4, 1)
    inc = _incident(4, detail=f"{words}: gradient norm inf; nothing was applied.")
    log.add(inc, opens=True)
    log.count_from(1, words)
    assert log.extend(_event(5, steps=2, continues=True))
    log.count_rejections(2)
    assert inc.detail == (
        "SafeOptimizer rejected 3 steps in steps 4-6: gradient norm inf; "
        "nothing was applied."
    )
    assert log.extend(_event(7, continues=True))
    log.count_rejections(1)
    assert inc.detail.startswith("SafeOptimizer rejected 4 steps in steps 4-7: ")


def test_only_an_incident_that_began_rejected_counts_rejections():
    log = IncidentLog()
    words = rejected_words(1, 2, 1)
    first = _incident(2, detail=words)
    log.add(first, opens=True)
    log.count_from(1, words)
    # A NaN loss opens a new incident: its detail has no count to keep.
    loss = _incident(3, detail="non-finite loss=nan in this batch.")
    log.add(loss, opens=True)
    log.count_rejections(1)
    assert (first.detail, loss.detail) == (words, "non-finite loss=nan in this batch.")
    # Nor after a new fit began.
    log.add(_incident(0, detail=words), opens=True)
    log.count_from(1, words)
    log.begin_fit()
    assert log.open is None
    log.count_rejections(5)
    assert log.last.detail == words


def test_rejected_words_name_the_steps_of_a_run():
    assert rejected_words(1, 0, 1) == "SafeOptimizer rejected 1 step"
    assert rejected_words(2, 3, 2) == "SafeOptimizer rejected 2 steps in steps 3-4"
    assert rejected_words(2, 3, 5) == "SafeOptimizer rejected 2 steps in steps 3-7"
