"""NaNGuard's training-thread parts on a tiny built model, without `fit`:
`Snapshotter` (first snapshot, cadence, promotion), `Responses` (each
policy's action, exactly) and `Supervisor` (events into incidents, discarded
batches). The turns are driven by hand, as the hooks would."""

import math
import types

import keras
import numpy as np
import pytest

from keras_nanguard.errors import NonFiniteError
from keras_nanguard.nan_guard.batch_watch import Event
from keras_nanguard.nan_guard.callback import ARGUMENTS
from keras_nanguard.nan_guard.fit_state import start_fit
from keras_nanguard.nan_guard.reporting import IncidentLog
from keras_nanguard.nan_guard.snapshotting import SnapshotKeeper
from keras_nanguard.nan_guard.supervisor import Supervisor
from tests.helpers import assert_bit_identical, numpy

RESTORED = "restored the snapshot of epoch 0, step 0"


def _parts(**settings):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    settings.setdefault("snapshot_every", 1000)
    state = start_fit(0, model, ARGUMENTS.of(**settings))
    keeper, log, written = SnapshotKeeper(), IncidentLog(), []
    turns = Supervisor.for_fit(
        ARGUMENTS.of(**settings),
        state,
        log,
        keeper,
        report=lambda: {"incidents": len(log.incidents)},
        write_report=lambda: written.append(len(log.incidents)),
    )
    return types.SimpleNamespace(
        model=model,
        state=state,
        keeper=keeper,
        log=log,
        written=written,
        responses=turns.responses,
        turns=turns,
    )


def _spoil(model, value=5.0):
    kernel = model.layers[0].kernel
    kernel.assign(np.full(kernel.shape, value, "float32"))


def _trouble_at(p, step):
    """A non-finite loss recorded at `step`, then acted on."""
    p.state.now = step
    ev = Event("bad_figures", 0, step - 1, step - 1, 1, {"loss": math.nan}, ["loss"])
    p.responses.record(ev, "nonfinite_loss", "non-finite loss=nan.", [])
    p.responses.trouble()
    return p.log.last


def test_the_first_turn_takes_the_first_snapshot():
    p = _parts()
    weights = numpy(p.model.weights)
    p.turns.take(snapshot=True)
    assert p.state.started
    assert (p.keeper.point.step, p.keeper.kept, p.state.restored_at) == (0, 1, 0)
    assert p.keeper.pendings == []
    p.turns.snapshotter.restore()
    assert_bit_identical(weights, numpy(p.model.weights))


def test_a_first_snapshot_after_a_step_waits_for_a_healthy_batch():
    """A model `fit` built in its first step: the state after that step
    may be ruinous (finite), so it is no rollback point until proven."""
    p = _parts()
    p.state.now = p.state.seen = 1  # the first turn comes after step 0
    p.turns.take(snapshot=True)
    assert p.state.started and p.keeper.point is None
    assert [s.step for s in p.keeper.pendings] == [1]
    with pytest.raises(NonFiniteError, match="no healthy step has proven"):
        _trouble_at(p, 2)  # step 1 went bad: nothing proven to go back to


def test_a_healthy_batch_proves_the_first_snapshot_after_a_step():
    p = _parts()
    p.state.now = p.state.seen = 1
    p.turns.take(snapshot=True)
    weights = numpy(p.model.weights)
    with p.state.lock:
        p.state.watch.healthy_step = 1  # step 1 ended healthy
    p.state.now = 2
    p.turns.take(snapshot=True)
    assert (p.keeper.point.step, p.keeper.pendings) == (1, [])
    _spoil(p.model)
    assert _trouble_at(p, 3).action.startswith(
        "rolled back: restored the snapshot of epoch 0, step 1"
    )
    assert_bit_identical(weights, numpy(p.model.weights))


def test_a_model_non_finite_before_training_has_nothing_to_protect():
    p = _parts()
    _spoil(p.model, math.nan)
    with pytest.raises(NonFiniteError, match="already non-finite before training"):
        p.turns.take(snapshot=True)
    assert p.keeper.point is None


def test_a_due_snapshot_becomes_the_rollback_point_after_a_healthy_step():
    p = _parts(snapshot_every=2)
    p.turns.take(snapshot=True)  # step 0: the first snapshot
    for now in (1, 2):
        p.state.now = now
        p.turns.take(snapshot=True)
    assert [s.step for s in p.keeper.pendings] == [2]  # due at step 2
    assert p.keeper.point.step == 0
    with p.state.lock:
        p.state.watch.healthy_step = 2  # the batch of step 2 was healthy
    p.state.now = 3
    p.turns.take(snapshot=True)
    assert (p.keeper.point.step, p.keeper.kept, p.keeper.pendings) == (2, 2, [])


def test_rollback_restores_lowers_the_rate_and_counts():
    p = _parts(policy="rollback", lr_factor=0.5)
    p.turns.take(snapshot=True)
    weights = numpy(p.model.weights)
    _spoil(p.model)
    inc = _trouble_at(p, 4)
    assert inc.action == RESTORED.replace("restored", "rolled back: restored") + (
        ", learning rate 0.1 -> 0.05"
    )
    assert inc.learning_rate == pytest.approx((0.1, 0.05))
    assert_bit_identical(weights, numpy(p.model.weights))
    assert float(p.model.optimizer.learning_rate) == pytest.approx(0.05)
    assert (p.keeper.rollbacks, p.keeper.rollbacks_since) == (1, 1)
    assert (p.state.resumed_at, p.state.restored_at) == (4, 4)
    assert p.state.watch.leave_out_until == 4  # the undone batches
    assert (p.state.stopping, p.state.discard_until) == (False, None)
    assert p.written == [1]  # at the record; the action is told later


def test_past_patience_it_stops_with_the_rollback_point_restored():
    p = _parts(policy="rollback", patience=1)
    p.turns.take(snapshot=True)
    _trouble_at(p, 2)
    _spoil(p.model)
    inc = _trouble_at(p, 5)
    assert inc.action == RESTORED + (
        ", stopped training after 1 rollbacks without recovery"
    )
    assert p.model.stop_training and p.state.stopping
    assert p.state.watch.leave_out_until == math.inf
    assert p.keeper.rollbacks == 1


def test_stop_restores_and_stops():
    p = _parts(policy="stop")
    p.turns.take(snapshot=True)
    weights = numpy(p.model.weights)
    _spoil(p.model)
    assert _trouble_at(p, 3).action == RESTORED + ", stopped training"
    assert_bit_identical(weights, numpy(p.model.weights))
    assert (p.keeper.rollbacks, p.state.stopping) == (0, True)


def test_raise_restores_then_raises_with_the_report():
    p = _parts(policy="raise")
    p.turns.take(snapshot=True)
    weights = numpy(p.model.weights)
    _spoil(p.model)
    with pytest.raises(NonFiniteError, match=r"^NaNGuard: \[epoch 0, step 2\]") as err:
        _trouble_at(p, 3)
    assert err.value.report == {"incidents": 1}
    assert p.log.last.action == RESTORED + ", raised NonFiniteError"
    assert_bit_identical(weights, numpy(p.model.weights))
    assert p.written == [1, 1]  # at the record, and with the action


def test_with_no_rollback_point_trouble_raises():
    p = _parts(policy="rollback")
    with pytest.raises(NonFiniteError, match="no good state to go back to"):
        _trouble_at(p, 1)
    assert p.log.last.action == "raised NonFiniteError: no good state to restore"


def test_warn_only_marks_the_incident():
    p = _parts(policy="warn")
    p.turns.take(snapshot=True)
    _spoil(p.model)
    spoiled = numpy(p.model.weights)
    assert _trouble_at(p, 3).action == "warned"
    assert_bit_identical(spoiled, numpy(p.model.weights))
    assert (p.keeper.rollbacks, p.state.restored_at) == (0, 0)


def test_skip_batches_are_undone_once_they_have_run():
    p = _parts(policy="rollback", skip_batches=2, lr_factor=1.0)
    p.turns.take(snapshot=True)
    weights = numpy(p.model.weights)
    _spoil(p.model)
    inc = _trouble_at(p, 4)
    assert inc.action == "rolled back: " + RESTORED + ", discarding the next 2 batches"
    assert (p.state.discard_until, p.state.watch.leave_out_until) == (6, 6)
    _spoil(p.model, 7.0)  # the discarded batches train on
    p.state.now = 5
    p.turns.take(snapshot=True)
    assert p.state.discard_until == 6
    assert numpy([p.model.layers[0].kernel])[0][0, 0] == 7.0  # not undone yet
    p.state.now = 6
    p.turns.take(snapshot=True)
    assert (p.state.discard_until, p.state.restored_at) == (None, 6)
    assert_bit_identical(weights, numpy(p.model.weights))


def test_a_bad_loss_with_a_non_finite_state_is_trouble():
    p = _parts(policy="rollback", lr_factor=1.0)
    p.turns.take(snapshot=True)
    weights = numpy(p.model.weights)
    _spoil(p.model, math.inf)
    with p.state.lock:
        p.state.watch.events.append(
            Event("bad_figures", 0, 3, 3, 1, {"loss": math.nan}, ["loss"])
        )
    p.state.now = 4
    p.turns.take(snapshot=True)
    (inc,) = p.log.incidents
    assert (inc.kind, inc.step, inc.batch, inc.steps) == ("nonfinite_loss", 3, 3, 1)
    assert math.isnan(inc.loss)
    assert inc.detail == (
        "non-finite loss=nan in this batch. The update was applied: the state "
        "is non-finite."
    )
    assert inc.variables == [p.model.layers[0].kernel.path]
    assert inc.action == "rolled back: " + RESTORED
    assert_bit_identical(weights, numpy(p.model.weights))


def test_an_event_of_an_undone_state_is_no_incident():
    p = _parts()
    p.turns.take(snapshot=True)
    p.state.resumed_at = 5
    with p.state.lock:
        p.state.watch.events.append(
            Event("bad_figures", 0, 3, 3, 1, {"loss": math.nan}, ["loss"])
        )
    p.state.now = 6
    p.turns.take(snapshot=True)
    assert p.log.incidents == []
