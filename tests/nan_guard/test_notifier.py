"""NaNGuard's telling side alone: each incident told once with its action
(again if the action changes), the progress bar's line ended first, and the
report and summary of a guard with runs. Incidents made by hand; no model."""

import dataclasses
import logging
import warnings

import keras
import pytest

from keras_nanguard.incidents import Incident
from keras_nanguard.nan_guard import reporting

pytestmark = pytest.mark.backend_free


def _incident(step: int, action: str = "none") -> Incident:
    return Incident(0, 0, step, step, "rejected_step", "nothing was applied.", action)


def _told(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "keras_nanguard"]


def test_each_incident_is_told_once(caplog):
    notifier = reporting.Notifier()
    incidents = [_incident(2), _incident(5)]
    with caplog.at_level(logging.WARNING, logger="keras_nanguard"):
        notifier.tell(incidents, verbose=1, bar=False)
        notifier.tell(incidents, verbose=1, bar=False)
        incidents.append(_incident(9))
        notifier.tell(incidents, verbose=1, bar=False)
    assert _told(caplog) == [
        "NaNGuard: [epoch 0, step 2] rejected_step: nothing was applied. Action: none.",
        "NaNGuard: [epoch 0, step 5] rejected_step: nothing was applied. Action: none.",
        "NaNGuard: [epoch 0, step 9] rejected_step: nothing was applied. Action: none.",
    ]
    assert (notifier.told, notifier.told_as) == (3, "none")


def test_an_incident_whose_action_changed_is_told_again(caplog):
    notifier = reporting.Notifier()
    inc = _incident(4)
    with caplog.at_level(logging.WARNING, logger="keras_nanguard"):
        notifier.tell([inc], verbose=1, bar=False)
        inc.action = "rolled back: restored the snapshot of epoch 0, step 0"
        notifier.tell([inc], verbose=1, bar=False)
        notifier.tell([inc], verbose=1, bar=False)
    told = _told(caplog)
    assert len(told) == 2
    assert told[1].endswith(
        "Action: rolled back: restored the snapshot of epoch 0, step 0."
    )


def test_verbose_0_tells_nothing_but_warned_incidents_warn(caplog):
    notifier = reporting.Notifier()
    quiet, warned = _incident(1), _incident(3, action="warned")
    with caplog.at_level(logging.WARNING, logger="keras_nanguard"):
        notifier.tell([quiet], verbose=0, bar=False)
        with pytest.warns(UserWarning, match=r"step 3\] rejected_step") as caught:
            notifier.tell([quiet, warned], verbose=0, bar=False)
    assert _told(caplog) == []
    assert len(caught) == 1
    assert notifier.told == 2


def test_an_incident_raised_for_is_never_told(capsys, caplog):
    notifier = reporting.Notifier()
    inc = _incident(6, action="restored the snapshot, raised NonFiniteError")
    at_warning = caplog.at_level(logging.WARNING, logger="keras_nanguard")
    with at_warning, warnings.catch_warnings():
        warnings.simplefilter("error")
        notifier.tell([inc], verbose=1, bar=True)
    assert _told(caplog) == []
    assert capsys.readouterr().out == ""  # the bar's line stays as it is
    assert notifier.told == 1


def test_the_progress_bars_line_is_ended_once_before_the_first_message(capsys, caplog):
    notifier = reporting.Notifier()
    with caplog.at_level(logging.WARNING, logger="keras_nanguard"):
        notifier.tell([_incident(1), _incident(2)], verbose=1, bar=True)
    assert capsys.readouterr().out == "\n"
    assert len(_told(caplog)) == 2


def test_bar_open_only_inside_an_epoch_after_a_batch_with_an_inplace_bar():
    assert not reporting.bar_open(False, 3, {"verbose": 1})
    assert not reporting.bar_open(True, 0, {"verbose": 1})
    assert not reporting.bar_open(True, 3, {"verbose": 2})
    assert not reporting.bar_open(True, 3, None)
    was = keras.config.is_interactive_logging_enabled()
    keras.config.enable_interactive_logging()
    try:
        assert reporting.bar_open(True, 3, {"verbose": 1})
        assert reporting.bar_open(True, 3, {"verbose": "auto"})
        keras.config.disable_interactive_logging()  # logs to absl: no bar
        assert not reporting.bar_open(True, 3, {"verbose": 1})
    finally:
        if was:
            keras.config.enable_interactive_logging()


@dataclasses.dataclass
class _Run:
    run_index: int
    report_path: str | None
    incidents: list[Incident]

    def report(self):
        return reporting.report("stop", 0, self.incidents, [])

    def summary(self):
        return reporting.summary(self.incidents, 0, [])


def test_report_and_summary_hold_the_runs():
    runs = [_Run(0, "r_run0.json", []), _Run(1, None, [_incident(7, "warned")])]
    report = reporting.report("rollback", 2, [_incident(1)], runs)
    assert report["policy"] == "rollback"
    assert report["rollbacks"] == 2
    assert [i["step"] for i in report["incidents"]] == [1]
    assert [
        (r["run"], r["report_path"], len(r["incidents"])) for r in report["runs"]
    ] == [
        (0, "r_run0.json", 0),
        (1, None, 1),
    ]
    assert "runs" not in reporting.report("rollback", 0, [], [])
    assert reporting.summary([], 0, runs).splitlines() == [
        "NaNGuard: no incidents. Its 2 runs: 1 incidents in all.",
        "  run 0: no incidents.",
        "  run 1: 1 incidents, 0 rollbacks.",
        "    [epoch 0, step 7] rejected_step: nothing was applied. Action: warned.",
    ]


def test_publish_adds_the_figures_and_keeps_a_logged_total():
    logs = {"loss": 0.5}
    reporting.publish(logs, incidents=2, rollbacks=1, rejected=None)
    assert logs == {"loss": 0.5, "nanguard_incidents": 2, "nanguard_rollbacks": 1}
    logs = {"nanguard_rejected_steps": 4}
    reporting.publish(logs, incidents=0, rollbacks=0, rejected=3)
    assert logs["nanguard_rejected_steps"] == 4  # the step's own, exact
    logs = {}
    reporting.publish(logs, incidents=0, rollbacks=0, rejected=3)
    assert logs["nanguard_rejected_steps"] == 3
