"""NaNGuard under KerasTuner, which deep-copies the callbacks for each trial.

The search: a 4-1 linear regressor, SGD, a grid of two learning rates. At
0.01 it trains; at 1e12 the update overflows in the first batches (a loss of
inf, then NaN weights). Without NaNGuard that trial's `val_loss` is NaN in
every epoch and KerasTuner marks it FAILED (`Oracle.end_trial`: a NaN score
is INVALID, retried `max_retries_per_trial` = 0 times, then FAILED).
"""

from __future__ import annotations

import copy
import json
import math
import os

import keras
import numpy as np
import pytest

import keras_nanguard as ng

kt = pytest.importorskip("keras_tuner")

LEARNING_RATES = [0.01, 1e12]  # one trial trains, one diverges


def _data(n: int = 32) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(0).standard_normal((n, 4)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def _build(hp) -> keras.Model:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    lr = hp.Choice("lr", LEARNING_RATES)
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    return model


class _HyperModel(kt.HyperModel):
    """`_build`, or `build` if given, and keeps each fit's `History.history`."""

    def __init__(self, build=_build):
        super().__init__()
        self._build, self.histories = build, []

    def build(self, hp) -> keras.Model:
        return self._build(hp)

    def fit(self, hp, model, *args, **kwargs):
        history = model.fit(*args, **kwargs)
        self.histories.append(history.history)
        return history


def _search(
    directory, callbacks, hypermodel=None, max_trials: int = 2, epochs: int = 2
) -> list:
    """Runs a grid search; returns its trials in order."""
    keras.utils.set_random_seed(0)  # the same models with and without a guard
    x, y = _data()
    tuner = kt.GridSearch(
        hypermodel or _HyperModel(),
        objective="val_loss",
        max_trials=max_trials,
        directory=str(directory),
    )
    tuner.search(
        x,
        y,
        validation_data=(x, y),
        epochs=epochs,
        batch_size=8,
        verbose=0,
        callbacks=callbacks,
    )
    return [tuner.oracle.trials[i] for i in sorted(tuner.oracle.trials)]


def test_deepcopy_is_a_fresh_guard_with_the_same_config(tmp_path):
    x, y = _data()
    guard = ng.NaNGuard(
        "stop",
        patience=2,
        lr_factor=0.25,
        verbose=0,
        report_path=tmp_path / "report.json",
        directory=tmp_path / "ckpt",
        replay=(x, y),
    )
    # Trained once directly: it has an incident, a snapshot, a lock.
    model = _build(kt.HyperParameters())
    model.optimizer.learning_rate.assign(1e12)
    model.fit(x, y, batch_size=8, verbose=0, shuffle=False, callbacks=[guard])
    assert [i.kind for i in guard.incidents] == ["nonfinite_loss"]

    first = copy.deepcopy(guard)
    second = copy.deepcopy(first)  # a copy of a copy copies its origin

    assert first.get_config() == {
        **guard.get_config(),
        "report_path": str(tmp_path / "report_run0.json"),
        "directory": str(tmp_path / "ckpt" / "run0"),
    }
    assert second.get_config()["report_path"] == str(tmp_path / "report_run1.json")
    assert guard.runs == [first, second]
    assert (first.origin, first.run_index) == (guard, 0)
    assert (second.origin, second.run_index) == (guard, 1)
    assert first.incidents == [] and first.snapshot is None and first.runs == []
    assert first.rollbacks == 0 and first.snapshots_taken == 0
    # Nothing mutable is shared but the replay data, which is only read.
    assert first.replay is guard.replay
    mine = vars(guard)
    shared = [
        name
        for name, value in vars(first).items()
        if name not in ("replay", "origin")
        and not isinstance(value, str | int | float | bool | type(None))
        and value is mine.get(name)
    ]
    assert shared == []
    # The copy trains on its own: the original keeps its one incident.
    model = _build(kt.HyperParameters())
    model.optimizer.learning_rate.assign(1e12)
    model.fit(x, y, batch_size=8, verbose=0, shuffle=False, callbacks=[first])
    assert len(first.incidents) == 1 and len(guard.incidents) == 1
    assert os.path.exists(tmp_path / "report_run0.json")
    assert os.path.exists(tmp_path / "ckpt" / "run0" / "nanguard_snapshot.npz")


@pytest.mark.parametrize("policy", ["stop", "rollback", "raise"])
def test_each_trial_has_its_own_incidents_and_files(tmp_path, policy):
    guard = ng.NaNGuard(
        policy,
        patience=1,
        verbose=0,
        report_path=tmp_path / "nanguard.json",
        directory=tmp_path / "ckpt",
    )
    trials = _search(tmp_path / "search", [guard])

    assert [t.hyperparameters.get("lr") for t in trials] == LEARNING_RATES
    assert guard.incidents == []  # the guard passed never trains itself
    assert [r.run_index for r in guard.runs] == [0, 1]  # one copy per trial
    good, bad = guard.runs
    assert good.incidents == []
    assert {i.kind for i in bad.incidents} == {"nonfinite_loss"}
    assert len(bad.incidents) == (2 if policy == "rollback" else 1)
    ending = "raised NonFiniteError" if policy == "raise" else "stopped training"
    assert ending in bad.incidents[-1].action

    # Each run's report and snapshot apart; the passed guard's report has all.
    for run, incidents in ((0, good.incidents), (1, bad.incidents)):
        with open(tmp_path / f"nanguard_run{run}.json") as f:
            assert len(json.load(f)["incidents"]) == len(incidents)
        assert os.path.exists(tmp_path / "ckpt" / f"run{run}" / "nanguard_snapshot.npz")
    with open(tmp_path / "nanguard.json") as f:
        together = json.load(f)
    assert together["incidents"] == []
    assert [len(r["incidents"]) for r in together["runs"]] == [0, len(bad.incidents)]
    assert together["runs"][1]["report_path"] == str(tmp_path / "nanguard_run1.json")

    summary = guard.summary().splitlines()
    incidents = len(bad.incidents)
    assert summary[0] == (
        f"NaNGuard: no incidents. Its 2 runs: {incidents} incidents in all."
    )
    assert summary[1] == "  run 0: no incidents."
    assert summary[2].startswith(f"  run 1: {incidents} incidents")
    assert summary[-1] == f"    {bad.incidents[-1]}"
    # A finished run lets its model and snapshot go; its record stays.
    assert good.model is None and good.snapshot is None
    if policy == "raise":
        assert trials[1].status == "FAILED"
        assert "NonFiniteError" in trials[1].message


@pytest.mark.parametrize("policy", ["stop", "rollback"])
def test_a_stopped_trial_fails_as_without_nanguard(tmp_path, policy):
    without, under = _HyperModel(), _HyperModel()
    plain = _search(tmp_path / "plain", [], without)
    guard = ng.NaNGuard(policy, patience=1, verbose=0)
    guarded = _search(tmp_path / "guarded", [guard], under)

    assert [t.status for t in plain] == ["COMPLETED", "FAILED"]
    assert [t.status for t in guarded] == ["COMPLETED", "FAILED"]
    assert guarded[0].score == plain[0].score  # the healthy trial is untouched
    assert math.isnan(plain[1].score) and math.isnan(guarded[1].score)
    assert all(math.isnan(v) for v in without.histories[1]["val_loss"])
    assert under.histories[1]["val_loss"]  # NaNGuard stopped: all marked
    assert all(math.isnan(v) for v in under.histories[1]["val_loss"])
    assert "set to NaN, so that KerasTuner" in guard.runs[1].incidents[-1].action


def test_a_late_divergence_keeps_the_epochs_before_it(tmp_path):
    """The learning rate jumps to 1e12 after the first epoch: without NaNGuard
    the later epochs are NaN and the trial is scored by the first. NaNGuard
    rolls back to the first epoch's end in the second (its figures are
    those of that state), then stops in the third: both are set to NaN and
    the trial gets the same score."""

    def late(epoch: int, lr: float) -> float:
        return 0.01 if epoch == 0 else 1e12

    schedule = keras.callbacks.LearningRateScheduler(late)
    without, under = _HyperModel(), _HyperModel()
    plain = _search(tmp_path / "plain", [schedule], without, 1, epochs=3)[0]
    guard = ng.NaNGuard("rollback", patience=1, verbose=0)
    guarded = _search(tmp_path / "guarded", [guard, schedule], under, 1, epochs=3)
    guarded = guarded[0]

    assert plain.status == guarded.status == "COMPLETED"
    assert guarded.best_step == plain.best_step == 0
    first, *later = without.histories[0]["val_loss"]
    assert math.isfinite(first) and len(later) == 2
    assert all(math.isnan(v) for v in later)
    assert under.histories[0]["val_loss"][0] == first
    assert all(math.isnan(v) for v in under.histories[0]["val_loss"][1:])
    assert guarded.score == plain.score == first
    run = guard.runs[0]
    assert [i.action.split(":")[0] for i in run.incidents] == [
        "rolled back",
        "restored the snapshot of epoch 1, step 4, stopped training after 1 "
        "rollbacks without recovery; the figures of epochs 1, 2 set to NaN, so "
        "that KerasTuner scores the trial as it would without NaNGuard",
    ]
