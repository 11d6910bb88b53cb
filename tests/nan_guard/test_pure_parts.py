"""NaNGuard's pure-Python parts, tested alone (no model, no backend tensor):
the epoch figures without left-out batches, the loss-spike window, the
cadence of periodic jobs, and the replay of an incident's batches."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keras_nanguard.nan_guard import batch_watch, fit_state, responses

pytestmark = pytest.mark.backend_free

losses = st.floats(0.0, 1e3, allow_nan=False, allow_infinity=False)


# ----------------------------------------------------------- EpochFigures
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(losses, st.booleans()), min_size=1, max_size=30))
def test_figures_are_the_mean_of_the_kept_batches(batches):
    """As in `fit` under NaNGuard: Keras's running mean includes every batch
    since its last reset; a bad batch is left out and the metrics are reset
    before the next one. What the logs then show is the mean of the kept
    batches, whatever the pattern."""
    fig = batch_watch.EpochFigures()
    since_reset: list[float] = []
    kept: list[float] = []
    for value, bad in batches:
        since_reset.append(value)
        logs = {"loss": sum(since_reset) / len(since_reset)}
        fig.add(logs, counted=1, leave_out=bad)
        if bad:
            fig.reset()
            since_reset = []
        else:
            kept.append(value)
        if kept:
            assert logs["loss"] == pytest.approx(sum(kept) / len(kept), rel=1e-9)
        else:
            assert "loss" not in logs  # nothing kept: no figure, not NaN


def test_figures_leave_a_batch_out_of_one_metric_only():
    fig = batch_watch.EpochFigures()
    fig.add({"loss": 1.0, "mae": 2.0}, counted=1)
    logs = {"loss": 2.0, "mae": float("nan")}  # running means of batches 0, 1
    fig.add(logs, counted=1, leave_out=["mae"])
    assert logs == {"loss": 2.0, "mae": 2.0}
    fig.reset()
    logs = {"loss": 4.0, "mae": 4.0, "nanguard_incidents": 1}
    fig.add(logs, counted=1)
    # loss: 2 batches of mean 2, then 4; mae: batch 0 (2), then 4.
    assert logs == {"loss": pytest.approx(8 / 3), "mae": 3.0, "nanguard_incidents": 1}


def test_epoch_end_logs_keep_validation_figures_as_keras_gives_them():
    fig = batch_watch.EpochFigures()
    fig.add({"loss": float("nan")}, counted=1, leave_out=True)
    logs = {"loss": float("nan"), "val_loss": 0.5}
    fig.finish(logs)
    assert logs == {"val_loss": 0.5}  # no kept training batch: no `loss`


def test_figure_helpers():
    assert batch_watch.is_loss("loss") and batch_watch.is_loss("policy_loss")
    assert not batch_watch.is_loss("val_accuracy_x")
    assert batch_watch.is_metric("accuracy", np.float32(0.5))
    assert not batch_watch.is_metric("nanguard_rejected_steps", 3)
    assert not batch_watch.is_metric("lr_schedule", "cosine")
    assert batch_watch.nonfinite(float("inf")) and not batch_watch.nonfinite(1.0)
    assert not batch_watch.nonfinite("text")
    assert batch_watch.nonfinite_validation({"val_loss": 1.0, "loss": math.nan}) is None
    assert batch_watch.nonfinite_validation({"val_loss": math.nan, "val_mae": 1.0}) == (
        "non-finite val_loss=nan at the end of the epoch. The weights are "
        "finite: the validation data or the model's outputs on it are not."
    )


# ------------------------------------------------------------- LossSpikes
@settings(max_examples=60, deadline=None)
@given(st.lists(losses, min_size=2, max_size=20), st.integers(1, 3))
def test_batch_losses_are_recovered_from_keras_running_means(values, k):
    """`n·m_n - (n-1)·m_{n-1}`: each execution of `k` batches is recovered
    (as their mean) from two consecutive running means."""
    spikes = batch_watch.BatchLosses()
    done = 0
    for start in range(0, len(values) - k + 1, k):
        chunk = values[start : start + k]
        running = sum(values[: start + k]) / (start + k)
        got = spikes.batch_loss(running, before=done, counted=k)
        assert got == pytest.approx(sum(chunk) / k, rel=1e-6, abs=1e-6)
        done += k


def test_batch_loss_is_unknown_after_a_reset_until_a_segment_starts():
    spikes = batch_watch.BatchLosses()
    assert spikes.batch_loss(2.0, before=0, counted=1) == 2.0
    spikes.segment_reset()
    assert spikes.batch_loss(3.0, before=5, counted=1) is None  # no previous mean
    assert spikes.batch_loss(float("nan"), before=6, counted=1) is None
    assert spikes.batch_loss("text", before=0, counted=1) is None


def test_a_spike_is_confirmed_after_patience_steps_with_its_figures():
    spikes = batch_watch.LossSpikes(sigma=2.0, window=4, patience=2)
    for step, loss in enumerate([1.0, 1.2, 0.8, 1.0]):  # fills the window
        assert spikes.see(loss, step, 1) is False
    assert spikes.see(1.1, 4, 1) is False  # healthy: enters the window
    assert spikes.see(10.0, 5, 1) is True  # high: a streak opens
    assert spikes.see(None, 6, 1) is True  # unknown loss: the streak stays
    spike = spikes.see(12.0, 7, 1)
    window = [1.2, 0.8, 1.0, 1.1]
    mean = sum(window) / 4
    std = math.sqrt(sum((v - mean) ** 2 for v in window) / 4)
    assert spike == batch_watch.Spike(5, 2, 12.0, mean, std, 4)
    assert spike.describe(2.0) == (
        "the batch loss stayed more than 2 standard deviations above its "
        f"rolling mean for 2 steps in a row (last loss 12, mean {mean:.4g}, "
        f"std {std:.3g}, over the last 4 healthy batches)."
    )
    # Confirmed: the statistics start afresh.
    assert (len(spikes.losses), spikes.streak_from, spikes.streak) == (0, None, 0)


def test_a_healthy_loss_ends_a_streak():
    spikes = batch_watch.LossSpikes(sigma=2.0, window=2, patience=3)
    spikes.see(1.0, 0, 1)
    spikes.see(1.0 + 1e-3, 1, 1)
    assert spikes.see(50.0, 2, 2) is True  # 2 steps of an execution
    assert spikes.see(1.0, 4, 1) is False
    assert (spikes.streak_from, spikes.streak) == (None, 0)


# ------------------------------------------------------------- LossBlowup
def test_a_ruinous_loss_proves_nothing_and_is_trouble_only_after_a_rollback():
    blowup = batch_watch.LossBlowup()
    for step, loss in enumerate([0.5, 0.4, 0.3, 0.2, 0.1]):
        assert blowup.see(loss, step, 1) is False
    assert blowup.level == 0.3  # the median of the early losses
    assert blowup.see(299.0, 5, 1) is False  # under 1000 times the level
    # Before any rollback a loss may grow as it likes (returns that grow):
    # not trouble, but no proof of a snapshot either.
    for step in range(6, 12):
        assert blowup.see(1e6, step, 1) is True
    assert (blowup.streak_from, blowup.streak) == (None, 0)
    assert blowup.level == 0.35  # of 0.1 ... 0.5 and 299: not of the 1e6s


def test_a_blowup_is_confirmed_after_three_steps_far_above_the_level():
    blowup = batch_watch.LossBlowup()
    for step, loss in enumerate([1.0, 2.0, 3.0]):
        blowup.see(loss, step, 1)
    blowup.arm()
    assert blowup.level == 2.0
    assert blowup.see(1999.0, 3, 1) is False  # under 1000 times the level
    assert blowup.level == 2.5  # the first 100 healthy losses make it
    assert blowup.see(2500.0, 4, 1) is True  # a streak opens
    assert blowup.see(None, 5, 1) is True  # an unknown loss keeps it
    assert blowup.see(10.0, 6, 1) is False  # a healthy loss ends it
    assert blowup.level == 3.0  # of 1, 2, 3, 1999 and 10
    assert blowup.see(5e3, 7, 2) is True  # an execution of 2 steps
    found = blowup.see(8e3, 9, 1)
    assert found == batch_watch.Blowup(7, 3, 8e3, 3.0)
    assert found.describe() == (
        "after a rollback the batch loss stayed above 1000 times the run's "
        "early level for 3 steps in a row (last loss 8000, level 3, the "
        "median of its first healthy batches): finite, but the run has blown "
        "up again."
    )
    assert (blowup.streak_from, blowup.streak) == (None, 0)


# ---------------------------------------------------------------- Cadence
def test_a_fixed_cadence_counts_steps():
    every = fit_state.Cadence(3, budget=0.01, min_every=1)
    assert [every.due(0.1) for _ in range(3)] == [False, False, True]
    every.done(cost=5.0)  # the cost does not matter with a fixed cadence
    assert every.due(0.1, steps=2) is False
    assert every.due(0.1) is True


def test_an_auto_cadence_keeps_the_cost_within_the_budget():
    auto = fit_state.Cadence("auto", budget=0.01, min_every=10)
    assert auto.due(None, steps=9) is False  # no cost known: every min_every
    assert auto.due(None) is True
    auto.done(cost=64.0)  # 64 s a job, 0.5 s a step: 1% is every 12800 steps
    assert auto.due(0.5, steps=12799) is False
    assert auto.due(0.5) is True
    auto.done(cost=1e-6)  # cheap: min_every still holds
    assert auto.due(0.5, steps=9) is False
    assert auto.due(0.5) is True


def test_an_auto_cadence_of_many_processes_takes_the_agreed_interval():
    asked = []

    def agree(interval):  # another process measured a slower job
        asked.append(interval)
        return max(interval, 300)

    auto = fit_state.Cadence("auto", budget=0.01, min_every=10, agree=agree)
    assert auto.due(None, steps=9) is False
    assert auto.due(0.5) is True  # the first: after min_every, as alone
    auto.done(cost=1.0)  # this process alone: every 200 steps
    assert asked == [200]
    assert auto.due(0.001, steps=299) is False  # a faster step changes nothing
    assert auto.due(0.001) is True  # until the next job is done
    assert asked == [200]


# ----------------------------------------------------------------- replay
def test_replay_data_is_checked():
    x, y = np.zeros((10, 2)), np.zeros((10,))
    assert responses.check_replay("replay", None) is None
    assert responses.check_replay("replay", (x, y)) == (x, y)
    with pytest.raises(ValueError, match=r"len\(x\)=10, len\(y\)=9"):
        responses.check_replay("replay", (x, y[:9]))
    with pytest.raises(ValueError, match="`replay` must be"):
        responses.check_replay("replay", (x, y, y))
    with pytest.raises(TypeError, match="`replay` must be"):
        responses.check_replay("replay", {"x": x})


def test_replay_finds_the_one_bad_batch_of_an_execution():
    x = np.arange(20, dtype="float32").reshape(10, 2)
    y = np.arange(10, dtype="float32")
    x[5, 1] = np.nan  # batch 2 of batch size 2
    data, bad = responses.replay_batches((x, y), batch_size=2, first=1, last=3)
    assert bad == 2
    np.testing.assert_array_equal(data[0], x[4:6])
    np.testing.assert_array_equal(data[1], y[4:6])
    # No bad batch among them: all, concatenated.
    data, bad = responses.replay_batches((x, y), batch_size=2, first=3, last=4)
    assert bad is None
    np.testing.assert_array_equal(data[0], x[6:10])
    # Past the end of the data.
    assert responses.replay_batches((x, y), batch_size=2, first=5, last=6) == (
        None,
        None,
    )
    # `x` alone, one batch: its index is known only if it is bad.
    data, bad = responses.replay_batches(x, batch_size=4, first=0, last=0)
    assert bad is None
    np.testing.assert_array_equal(data[0], x[:4])


def test_replay_reads_a_py_dataset():
    class Batches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__()

        def __len__(self):
            return 3

        def __getitem__(self, i):
            x = np.full((2, 1), float(i), "float32")
            if i == 1:
                x[0, 0] = np.inf
            return x, np.zeros((2,), "float32")

    data = Batches()
    assert responses.check_replay("replay", data) is data
    item, bad = responses.replay_batches(data, batch_size=99, first=0, last=2)
    assert bad == 1
    assert float(item[0][1, 0]) == 1.0
