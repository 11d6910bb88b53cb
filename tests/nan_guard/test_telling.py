"""How NaNGuard tells its incidents during `fit`: each once, on a line of its
own under the progress bar; with the "warn" policy one warning per incident,
pointing at the code that called `fit`; with "raise" in the error only; and
in the JSON report file."""

import contextlib
import io
import json
import logging
import warnings

import keras
import pytest

import keras_nanguard as ng
from tests.helpers import binary_data, fit_quietly
from tests.models import guard_model as _model


def _nan_target_run(guard, verbose, n=64):
    """A plain optimizer, a NaN target in batch 2 of n/16: the update is
    applied, so the state goes non-finite. Returns everything written to
    stdout, where the progress bar goes, with the warnings and the log lines
    of "keras_nanguard" interleaved in the order they were written."""
    x, y = binary_data(n)
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[2], target="y")
    model = _model(keras.optimizers.SGD(0.05))
    out, shown = io.StringIO(), []

    def show(message, category, filename, lineno, file=None, line=None):
        shown.append((category, str(message), filename))
        out.write(f"{message}\n")

    handler = logging.StreamHandler(out)
    logger = logging.getLogger("keras_nanguard")
    logger.addHandler(handler)
    try:
        with contextlib.redirect_stdout(out), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # others' deprecations
            warnings.filterwarnings("always", message="NaNGuard")
            warnings.showwarning = show
            model.fit(data, verbose=verbose, shuffle=False, callbacks=[guard])
    finally:
        logger.removeHandler(handler)
    return out.getvalue(), shown


@pytest.mark.parametrize("fit_verbose", [1, 0])
def test_incident_line_starts_a_line_of_its_own_under_the_progress_bar(
    fit_verbose,
):
    guard = ng.NaNGuard(verbose=1)
    text, shown = _nan_target_run(guard, fit_verbose)
    (inc,) = guard.incidents
    assert inc.action.startswith("rolled back: restored the snapshot")
    assert shown == []
    line = f"NaNGuard: {inc}\n"  # told once, with its action
    assert text.count("NaNGuard: ") == 1 and line in text
    at = text.index(line)
    if fit_verbose:
        # The bar had drawn its first line (no newline: Keras rewrites it
        # with `\r`); the incident begins a line of its own all the same.
        assert "1/4" in text[:at]
        assert text[at - 1] == "\n"
    else:  # no bar: nothing else written, no stray newline
        assert text == line


def test_warn_policy_warns_once_per_incident_at_the_fit_call(caplog):
    guard = ng.NaNGuard("warn", verbose=1)
    with caplog.at_level(logging.WARNING, logger="keras_nanguard"):
        text, shown = _nan_target_run(guard, verbose=1)
    # The NaN batch, then the NaN weights found at the end of the epoch.
    assert [i.kind for i in guard.incidents] == ["nonfinite_loss", "nonfinite_weights"]
    told = [f"NaNGuard: {i}" for i in guard.incidents]
    # Exactly one message per incident: its warning, and no log line besides.
    assert [message for _, message, _ in shown] == told
    assert [r for r in caplog.records if r.name == "keras_nanguard"] == []
    assert all(text.count(t) == 1 for t in told)
    # The warnings point at the code that called `fit` (this file), not
    # inside keras_nanguard or Keras.
    assert {(category, filename) for category, _, filename in shown} == {
        (UserWarning, __file__)
    }
    assert all(text[text.index(t) - 1] == "\n" for t in told)


def test_raise_policy_tells_the_incident_in_the_error_only(caplog):
    guard = ng.NaNGuard("raise", verbose=1)
    at_warning = caplog.at_level(logging.WARNING, logger="keras_nanguard")
    with at_warning, pytest.raises(ng.NonFiniteError) as err:
        _nan_target_run(guard, verbose=0)
    (inc,) = guard.incidents
    assert str(err.value) == f"NaNGuard: {inc}"
    assert inc.action.endswith(", raised NonFiniteError")
    assert [r for r in caplog.records if r.name == "keras_nanguard"] == []


def test_report_file_is_json(tmp_path):
    x, y = binary_data()
    path = tmp_path / "report.json"
    guard = ng.NaNGuard(verbose=0, report_path=path)
    data = ng.faults.PoisonedBatches(x, y, batch_size=16, bad_batches=[2], target="y")
    fit_quietly(_model(ng.SafeOptimizer(keras.optimizers.SGD(0.05))), data, [guard])
    report = json.loads(path.read_text())
    assert report["policy"] == "rollback"
    assert report["incidents"][0]["kind"] == "rejected_step"
    assert report["incidents"][0]["step"] == 2
    assert "nanguard: 1 incidents" in guard.summary().lower()
