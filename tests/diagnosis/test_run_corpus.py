"""`NaNGuard.explain()` and its early warning on the corpus of runs with known
fates (`notebooks/run_corpus.py`): each diverging run is explained by its
cause, each healthy run is `healthy`, and the warning comes before the first
bad step in at least 80% of the diverging runs and never in a healthy one.

Each run trains once per session (`_run`); the per-run tests and the
corpus-wide figures read the same runs.

The whole corpus trains on JAX; TensorFlow and torch train one run of each
cause and five healthy ones (`EVERY_BACKEND`), which read each signal the
causes are named from on their own steps: the rules are host code, the same
on every backend, and the whole corpus took ~50 s per backend (issue 53).
The other runs' tests are skipped there, with the same IDs."""

import pytest
import run_corpus as corpus  # notebooks/, on the path (tests/__init__.py)

from keras_nanguard.flight import RUN_CAUSES
from tests.helpers import BACKEND

EVERY_BACKEND = {
    "lr_warmup_mlp",
    "bad_data_nan_batches",
    "input_scale_mlp",
    "activation_growth_mlp",
    "policy_collapse_actor",
    "optimizer_state_rmsprop_mlp",
    "exploding_recurrence_warmup",
    "stalled_schedule_to_zero",
    "healthy_confident_classifier",
    "healthy_mlp",
    "healthy_actor",
    "healthy_loss_spike",
    "healthy_high_rate",
}
WHOLE_CORPUS_ON = "jax"
_ELSEWHERE = pytest.mark.skipif(
    BACKEND != WHOLE_CORPUS_ON,
    reason=f"the whole corpus trains on {WHOLE_CORPUS_ON}: here one run per cause",
)


def _here(names):
    """`names` as parameters, those not in `EVERY_BACKEND` skipped off
    `WHOLE_CORPUS_ON`."""
    return [
        pytest.param(n, marks=() if n in EVERY_BACKEND else _ELSEWHERE) for n in names
    ]


DIVERGING = [n for n, r in corpus.RUNS.items() if r.cause not in ("healthy", "stalled")]
STALLED = [n for n, r in corpus.RUNS.items() if r.cause == "stalled"]
HEALTHY = [n for n, r in corpus.RUNS.items() if r.cause == "healthy"]
_RUNS: dict = {}


def _run(name):
    """(the run's NaNGuard, its model, its diagnosis, the warning's diagnosis
    or None) of run `name`, trained and explained once per session."""
    if name not in _RUNS:
        models = []
        guard = corpus.run(name, model_out=models)
        warnings = [
            i
            for i in guard.incidents
            if i.kind in ("divergence_warning", "stall_warning")
        ]
        assert len(warnings) <= 1  # once per fit
        warned = warnings[0].diagnosis if warnings else None
        _RUNS[name] = (guard, models[0], guard.explain(), warned)
    return _RUNS[name]


def _result(name):
    """(diagnosis, the warning's diagnosis or None) of run `name`."""
    return _run(name)[2:]


def test_the_corpus_covers_every_cause():
    causes = {r.cause for r in corpus.RUNS.values()}
    assert causes == set(RUN_CAUSES) - {"unknown"}
    assert len(DIVERGING) >= 12 and len(HEALTHY) >= 6
    # each cause on every backend too
    assert {corpus.RUNS[n].cause for n in EVERY_BACKEND} == causes


@pytest.mark.parametrize("name", _here(DIVERGING))
def test_a_diverging_run_is_explained_by_its_cause(name):
    found, _ = _result(name)
    assert found.first_bad_step is not None, f"{name} did not diverge"
    assert found.cause == corpus.RUNS[name].cause, str(found)
    assert found.onset_step is not None and found.onset_step <= found.first_bad_step
    assert found.steps_from_onset == found.first_bad_step - found.onset_step
    assert found.evidence and found.hints


@pytest.mark.parametrize("name", _here(STALLED))
def test_a_stalled_run_is_said_stalled_and_warned_as_a_stall(name):
    found, warned = _result(name)
    assert (found.cause, found.first_bad_step) == ("stalled", None), str(found)
    assert found.evidence and found.hints
    assert warned is not None and warned.cause == "stalled"


def test_a_confident_classifier_trained_to_100_percent_is_healthy():
    from keras import ops

    guard, model, _, _ = _run("healthy_confident_classifier")  # the healthy runs' own
    x, y = corpus._digits()
    probs = ops.convert_to_numpy(model(x))
    assert (probs.argmax(axis=1) == y).mean() == 1.0
    assert probs.min() < 1e-14  # as confident as the report
    assert guard.explain().cause == "healthy"
    assert [i.kind for i in guard.incidents] == []


@pytest.mark.parametrize("name", _here(HEALTHY))
def test_a_healthy_run_is_healthy_and_never_warned(name):
    found, warned = _result(name)
    assert (found.cause, found.first_bad_step, warned) == ("healthy", None, None)


@_ELSEWHERE
def test_the_warning_comes_before_the_first_bad_step_in_80_percent():
    before = []
    for name in DIVERGING:
        found, warned = _result(name)
        if warned is not None and warned.at_step < found.first_bad_step:
            before.append(name)
            assert warned.cause == found.cause, name
    assert len(before) >= 0.8 * len(DIVERGING), sorted(set(DIVERGING) - set(before))
