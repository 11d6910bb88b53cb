"""Loss-spike rollback: a finite learning-rate spike (x100 for 3 steps) ruins
a plain run; NaNGuard sees the batch loss stay far above its rolling mean,
rolls back to the snapshot from before the spike, and training ends where
the clean run does."""

import json
import re

import keras
import numpy as np
import pytest
from sklearn.datasets import load_digits

import keras_nanguard as ng
from tests.helpers import numpy
from tests.models import tanh_regressor

SPIKE = 124  # epoch 2, batch 12 of 56: the spike's updates are steps 124-126
EPOCHS = 8  # 448 steps; SPIKE + 100 ends epoch 4
PER_EPOCH = 56


@pytest.fixture(scope="module")
def digits():
    d = load_digits()
    x = (d.data / 16.0).astype("float32")[: PER_EPOCH * 32]
    return x, d.target[: PER_EPOCH * 32].astype("int32")


class BatchLosses(keras.callbacks.Callback):
    """Each batch's own loss, from Keras's running means (logs only)."""

    def on_train_begin(self, logs=None):
        self.losses = []

    def on_epoch_begin(self, epoch, logs=None):
        self._last = 0.0

    def on_train_batch_end(self, batch, logs=None):
        mean = float(logs["loss"])
        self.losses.append((batch + 1) * mean - batch * self._last)
        self._last = mean


def _train(digits, spike, guard=None):
    x, y = digits
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=ng.SafeOptimizer(keras.optimizers.SGD(0.1)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    record = BatchLosses()
    callbacks = [guard] if guard is not None else []
    callbacks.append(record)
    if spike:
        steps = [SPIKE, SPIKE + 1, SPIKE + 2]
        callbacks.append(ng.faults.LearningRateSpike(at_steps=steps, factor=100))
    model.fit(
        x,
        y,
        batch_size=32,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    return float(model.evaluate(x, y, verbose=0)), record.losses


def _guard():
    return ng.NaNGuard(loss_spike_sigma=6, lr_factor=1.0, snapshot_every=10, verbose=0)


def test_loss_spike_rolls_back_to_before_the_spike(digits):
    clean, _ = _train(digits, spike=False)

    plain, losses = _train(digits, spike=True)
    before = np.mean(losses[SPIKE - 20 : SPIKE])
    assert np.isfinite(losses).all()  # finite: no NaN check would fire
    assert max(losses[SPIKE : SPIKE + 5]) > 10 * before  # the loss jumps
    # ... and has not recovered 100 steps later, nor at the end.
    assert np.mean(losses[SPIKE + 95 : SPIKE + 105]) > 1.5 * before
    assert plain > 1.5 * clean, (plain, clean)

    guard = _guard()
    final, _ = _train(digits, spike=True, guard=guard)
    assert len(guard.incidents) == 1 and guard.rollbacks == 1
    inc = guard.incidents[0]
    assert inc.kind == "loss_spike"
    # The first update at the spiked rate is step SPIKE; its loss shows at the
    # next batch, where the streak begins, and lasts `loss_spike_patience`.
    assert (inc.step, inc.steps) == (SPIKE + 1, 3)
    assert "3 steps in a row" in inc.detail and "mean" in inc.detail
    assert inc.loss > 10 * before
    # The rollback point is the last snapshot from before the spike began
    # (taken every 10 steps): none of the spiked updates is in it.
    assert inc.action.startswith("rolled back"), inc.action
    restored = int(re.search(r"step (\d+)", inc.action).group(1))
    assert SPIKE - 10 < restored <= SPIKE, inc.action
    assert abs(final - clean) <= 0.1 * clean, (final, clean)


def test_no_false_alarm_on_a_clean_run(digits):
    guard = _guard()
    _train(digits, spike=False, guard=guard)
    assert guard.incidents == [] and guard.rollbacks == 0


def test_off_by_default(digits):
    guard = ng.NaNGuard(verbose=0)
    assert guard.loss_spike_sigma is None
    _train(digits, spike=True, guard=guard)
    assert guard.incidents == []  # the spike is finite: nothing else sees it


@pytest.mark.backend_free
@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"loss_spike_sigma": "6"}, TypeError),
        ({"loss_spike_sigma": True}, TypeError),
        ({"loss_spike_sigma": 0}, ValueError),
        ({"loss_spike_sigma": float("nan")}, ValueError),
        ({"loss_spike_window": 10.0}, TypeError),
        ({"loss_spike_window": 1}, ValueError),
        ({"loss_spike_patience": None}, TypeError),
        ({"loss_spike_patience": 0}, ValueError),
    ],
)
def test_argument_errors(kwargs, error):
    ((name, value),) = kwargs.items()
    with pytest.raises(error, match=re.escape(f"Received: {name}={value!r}")):
        ng.NaNGuard(**kwargs)
    with pytest.raises(error, match=f"`{name}`"):
        ng.NaNGuard(**kwargs)


@pytest.mark.backend_free
def test_config_round_trip(tmp_path):
    guard = ng.NaNGuard(
        loss_spike_sigma=4.5, loss_spike_window=32, loss_spike_patience=2
    )
    config = guard.get_config()
    assert (
        config["loss_spike_sigma"],
        config["loss_spike_window"],
        config["loss_spike_patience"],
    ) == (4.5, 32, 2)
    path = tmp_path / "guard.json"  # through Keras's registry, as JSON
    path.write_text(json.dumps(keras.saving.serialize_keras_object(guard)))
    revived = keras.saving.deserialize_keras_object(json.loads(path.read_text()))
    assert isinstance(revived, ng.NaNGuard)
    assert revived.get_config() == config
    assert ng.NaNGuard().get_config()["loss_spike_sigma"] is None


def _warmup_run(callbacks):
    """The explain example of docs/guide/explain.md, with a rollback: a
    warm-up to 3.0 that a rollback cannot lower (a schedule); the loss blows
    up again, finite."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 8)).astype("float32")
    y = np.tanh(x @ rng.normal(size=(8, 1))).astype("float32")
    model = tanh_regressor()
    warmup = keras.optimizers.schedules.PolynomialDecay(0.01, 400, 3.0, power=1.0)
    model.compile(ng.SafeOptimizer(keras.optimizers.SGD(warmup)), "mse")
    model.fit(x, y, batch_size=16, epochs=3, callbacks=callbacks, verbose=0)
    return model, model.evaluate(x, y, verbose=0)


@pytest.mark.filterwarnings("ignore:NaNGuard. `lr_factor=0.5` cannot lower")
def test_a_finite_blowup_after_a_rollback_is_trouble():
    """Without `loss_spike_sigma`: a loss 1000x the run's early level proves
    no snapshot, and after the first rollback it is trouble, so `fit` ends
    with a model that is not blown up (without the rule: a loss of 2e14,
    and no incident after the first)."""
    # A fixed cadence: "auto" takes snapshots by the clock, so which states
    # are snapshots would vary from run to run.
    guard = ng.NaNGuard(early_warning=False, snapshot_every=10, verbose=0)
    # Batch ends in line: in Keras's worker threads (JAX, torch) the guard
    # acts a batch or two late by the clock, and under load a rollback came
    # late enough for the loss to end at 112.
    in_line = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: None)
    model, loss = _warmup_run([guard, in_line])
    kinds = [i.kind for i in guard.incidents]
    first = kinds.index("loss_blowup")
    # Non-finite trouble first (a rejected step, or an inf loss on the
    # backends whose MSE overflows first), rolled back; then blow-ups.
    assert first > 0 and "loss_blowup" not in kinds[:first]
    assert any("rolled back" in i.action for i in guard.incidents[:first])
    assert set(kinds[first:]) == {"loss_blowup"}, kinds
    for i in guard.incidents[first:]:
        assert "times the run's early level" in i.detail
    assert guard.incidents[-1].action.endswith(
        "stopped training after 3 rollbacks without recovery"
    )
    # Not blown up by the rule's own measure (the early level is 0.14-0.19
    # on the three backends): the rollback point is a snapshot proven before
    # the blow-up.
    assert loss < 100.0, loss
    assert all(np.isfinite(w).all() for w in numpy(model.weights))
