"""SafeOptimizer's flight recorder: what each step records, on the device, to
the float32 value NumPy computes from the same numbers; the probe cadence;
the ring and the history; saving; and NaNGuard's reading of it (`explain`,
`early_warning`, the report)."""

import json

import keras
import numpy as np
import pytest
from keras import ops

import keras_nanguard as ng
from keras_nanguard.flight.recorder import HISTORY_PROBES, RING_STEPS
from tests.helpers import BACKEND, numpy
from tests.models import tanh_regressor


def _dense(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, name="hidden"),
            keras.layers.Dense(2, name="out"),
        ]
    )


def _norm(arrays):
    if not isinstance(arrays, list):
        arrays = [arrays]
    return float(
        np.sqrt(sum(np.sum(np.square(np.asarray(a, "float64"))) for a in arrays))
    )


def test_a_step_records_its_norms_rate_and_outcome_exactly():
    model = _dense()
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1), probe_every=1)
    tv = model.trainable_variables
    opt.build(tv)
    before = numpy(tv)
    rng = np.random.default_rng(1)
    grads = [rng.normal(size=v.shape).astype("float32") for v in tv]
    opt.apply([ops.convert_to_tensor(g) for g in grads], tv)
    after = numpy(tv)
    bad = [g.copy() for g in grads]
    bad[2][0, 1] = np.nan
    opt.apply([ops.convert_to_tensor(g) for g in bad], tv)
    record = opt.flight_record()
    assert record.column("step").tolist() == [1.0, 2.0]
    assert record.column("iterations").tolist() == [1.0, 1.0]  # 2 rejected
    assert record.column("accepted").tolist() == [1.0, 0.0]
    assert record.column("reason").tolist() == [0.0, 1.0]  # 1: a gradient
    assert record.column("learning_rate").tolist() == [np.float32(0.1)] * 2
    assert record.column("probe").tolist() == [1.0, 1.0]
    np.testing.assert_allclose(record.column("grad_norm")[0], _norm(grads), 1e-6)
    assert record.blocks == ["hidden", "out"]
    g = record.block("grad_norm")[0]
    w = record.block("weight_norm")[0]
    u = record.block("update_norm")[0]
    np.testing.assert_allclose(g, [_norm(grads[:2]), _norm(grads[2:])], 1e-6)
    np.testing.assert_allclose(w, [_norm(after[:2]), _norm(after[2:])], 1e-6)
    updates = [a - b for a, b in zip(after, before, strict=True)]
    np.testing.assert_allclose(u, [_norm(updates[:2]), _norm(updates[2:])], 1e-5)
    # The rejected step's own row: its gradient norm is NaN, as it was.
    assert np.isnan(record.column("grad_norm")[1])
    assert np.isnan(record.block("grad_norm")[1, 1])
    # SGD has no second moment: no state figure.
    assert np.isnan(record.column("state_min")).all()


def test_adam_records_its_smallest_denominator():
    model = _dense()
    inner = keras.optimizers.Adam(0.01, epsilon=1e-6)
    opt = ng.SafeOptimizer(inner, probe_every=1)
    tv = model.trainable_variables
    opt.build(tv)
    grads = [np.full(v.shape, 0.5, "float32") for v in tv]
    grads[1][:] = 0.0  # the hidden bias: v stays 0
    opt.apply([ops.convert_to_tensor(g) for g in grads], tv)
    velocities = [
        ops.convert_to_numpy(v) for v in inner.variables if v.path.endswith("velocity")
    ]
    smallest = min(float(v.min()) for v in velocities)
    assert smallest == 0.0
    state = opt.flight_record().column("state_min")[0]
    assert state == np.float32(np.sqrt(smallest) + 1e-6)


def test_two_layers_sharing_an_inner_name_are_two_blocks():
    model = keras.Sequential(
        [
            keras.Input((5, 2)),
            keras.layers.LSTM(3, return_sequences=True),
            keras.layers.LSTM(3),
            keras.layers.Dense(1),
        ]
    )
    opt = ng.SafeOptimizer(keras.optimizers.SGD(1e-3))
    tv = model.trainable_variables
    opt.build(tv)
    opt.apply([ops.ones(v.shape) for v in tv], tv)
    first, second, dense = (layer.name for layer in model.layers)
    # The shortest end of each layer's path that no other layer shares.
    assert opt.flight_record().blocks == [
        f"{first}/lstm_cell",
        f"{first}/lstm_cell/recurrent_kernel",
        f"{second}/lstm_cell",
        f"{second}/lstm_cell/recurrent_kernel",
        dense,
    ]
    assert opt.flight_record().recurrent == [False, True, False, True, False]


def test_probe_cadence_ring_and_history():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt = ng.SafeOptimizer(keras.optimizers.SGD(1e-3), probe_every=16)
    tv = model.trainable_variables
    opt.build(tv)
    grads = [ops.ones(v.shape) for v in tv]
    steps = RING_STEPS + 44  # 300: the ring keeps the last 256
    for _ in range(steps):
        opt.apply(grads, tv)
    record = opt.flight_record()
    probes = [1 + 16 * k for k in range((steps - 1) // 16 + 1)]
    ring = list(range(steps - RING_STEPS + 1, steps + 1))
    assert record.column("step").astype(int).tolist() == sorted(set(probes) | set(ring))
    assert record.probes().column("step").astype(int).tolist() == probes
    ordinary = record.rows[record.column("probe") == 0]
    assert np.isnan(ordinary[:, record.columns.index("weight_norm/dense")]).all()
    assert np.isfinite(record.probes().block("weight_norm")).all()
    assert len(probes) <= HISTORY_PROBES


def test_fit_records_the_batch_loss_inputs_and_outputs():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, activation="softmax")]
    )
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.0), probe_every=1)
    model.compile(opt, "sparse_categorical_crossentropy")
    opt.attach(model)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype("float32") * 3
    y = rng.integers(0, 4, 16)
    probs = model.predict(x, verbose=0)
    expected_loss = model.evaluate(x, y, verbose=0)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)  # a rate of 0
    record = opt.flight_record()
    assert record.column("step").tolist() == [1.0, 2.0]
    np.testing.assert_allclose(record.column("loss"), [expected_loss] * 2, 1e-5)
    assert record.column("input_max").tolist() == [np.abs(x).max()] * 2
    np.testing.assert_allclose(record.column("output_max"), probs.max(), 1e-6)
    np.testing.assert_allclose(record.column("min_prob"), probs.min(), 1e-6)
    entropy = -np.mean(np.sum(probs * np.log(probs), axis=-1))
    np.testing.assert_allclose(record.column("entropy"), entropy, 1e-5)


def test_logits_have_no_entropy():
    model = _dense()
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.01), probe_every=1)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    opt.attach(model)
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    model.fit(x, np.zeros(8), batch_size=8, verbose=0)
    record = opt.flight_record()
    assert np.isnan(record.column("entropy")).all()
    assert np.isnan(record.column("min_prob")).all()
    assert np.isfinite(record.column("output_max")).all()


@pytest.mark.skipif(BACKEND == "jax", reason="JAX loops are stateless: no observe")
def test_a_custom_loop_observes_its_loss():
    model = _dense()
    opt = ng.SafeOptimizer(keras.optimizers.SGD(0.01), probe_every=2)
    tv = model.trainable_variables
    opt.build(tv)
    for loss in (0.5, 0.25, 0.125):
        opt.apply([ops.ones(v.shape) for v in tv], tv)
        x = ops.ones((2, 3)) * loss
        opt.observe(loss=ops.convert_to_tensor(loss), inputs=x, outputs=model(x))
    record = opt.flight_record()
    assert record.column("loss").tolist() == [0.5, 0.25, 0.125]
    # Input figures on the probe rows (steps 1 and 3) only.
    inputs = record.column("input_max")
    assert inputs[0] == 0.5 and np.isnan(inputs[1]) and inputs[2] == 0.125


def test_the_record_is_saved_and_loaded(tmp_path):
    model = _dense()
    opt = ng.SafeOptimizer(keras.optimizers.Adam(0.01))
    model.compile(opt, "mse")
    x = np.ones((32, 3), "float32")
    model.fit(x, np.ones((32, 2)), batch_size=8, epochs=2, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    a, b = opt.flight_record(), loaded.optimizer.flight_record()
    assert a.columns == b.columns and len(a) == 8
    np.testing.assert_array_equal(a.rows, b.rows)
    assert loaded.optimizer.get_config()["probe_every"] == 16


def test_probe_every_is_checked():
    with pytest.raises(ValueError, match="probe_every"):
        ng.SafeOptimizer(keras.optimizers.SGD(), probe_every=0)


def test_early_warning_is_checked():
    with pytest.raises(
        ValueError, match=r"early_warning.*Received: early_warning='yes'"
    ):
        ng.NaNGuard(early_warning="yes")
    with pytest.raises(TypeError, match="source"):
        ng.explain(42)


def _collapsing_actor():
    import run_corpus as corpus  # notebooks/, on the path (tests/__init__.py)

    spec = corpus.RUNS["policy_collapse_actor"]
    keras.utils.set_random_seed(1)
    model = spec.model()
    x, y = spec.data()
    model.compile(ng.SafeOptimizer(spec.optimizer()), loss=spec.loss)
    return model, x, y, spec


def test_early_warning_act_lowers_the_rate_before_the_collapse():
    model, x, y, _ = _collapsing_actor()
    guard = ng.NaNGuard(policy="rollback", early_warning="act", verbose=0)
    model.fit(x, y, batch_size=16, shuffle=False, callbacks=[guard], verbose=0)
    warnings = [i for i in guard.incidents if i.kind == "divergence_warning"]
    assert len(warnings) == 1
    warning = warnings[0]
    assert warning.diagnosis.cause == "policy_collapse"
    assert warning.action == "lowered the learning rate 0.01 -> 0.005"
    assert warning.learning_rate == (pytest.approx(0.01), pytest.approx(0.005))
    first_bad = guard.explain().first_bad_step
    assert first_bad is None or warning.diagnosis.at_step < first_bad
    assert "divergence_warning" in json.dumps(guard.report())


def test_explain_after_nonfinite_error_and_in_the_summary():
    model, x, y, _ = _collapsing_actor()
    guard = ng.NaNGuard(policy="raise", early_warning=False, verbose=0)
    with pytest.raises(ng.NonFiniteError):
        model.fit(x, y, batch_size=16, shuffle=False, callbacks=[guard], verbose=0)
    assert [i.kind for i in guard.incidents] == ["rejected_step"]
    found = guard.explain()
    assert found.cause == "policy_collapse"
    assert found.first_bad_step is not None
    assert found.onset_step < found.first_bad_step
    assert found.steps_from_onset == found.first_bad_step - found.onset_step
    # early_warning=False: no warning was given, so it had no lead.
    assert (found.warned_at_step, found.lead_steps) == (None, None)
    assert "No warning was given before the first bad step." in str(found)
    assert "Run diagnosis: policy_collapse" in guard.summary()
    assert str(found).startswith("Run diagnosis: policy_collapse")
    assert guard.report()["run_diagnosis"]["cause"] == "policy_collapse"
    assert ng.explain(guard).cause == "policy_collapse"
    assert ng.explain(guard.flight_record).cause == "policy_collapse"


def test_rollbacks_keep_the_record():
    model, x, y, _ = _collapsing_actor()
    guard = ng.NaNGuard(policy="rollback", early_warning=False, verbose=0)
    model.fit(
        x[:2048], y[:2048], batch_size=16, shuffle=False, callbacks=[guard], verbose=0
    )
    assert guard.rollbacks >= 1
    steps = guard.flight_record.column("step")
    # Every step is recorded once, rolled back or not, in order.
    assert np.all(np.diff(steps) > 0)
    assert int(steps[-1]) == 128


def _record(rows):
    """A record of one layer block 'x' from `rows`: dicts of column values
    (unnamed columns NaN), steps 1, 2, ...; every row a probe."""
    from keras_nanguard.flight.recorder import GLOBAL_COLUMNS

    columns = [*GLOBAL_COLUMNS, "grad_norm/x", "weight_norm/x", "update_norm/x"]
    record = ng.FlightRecord.empty(columns, ["x"], [False])
    data = np.full((len(rows), len(columns)), np.nan, "float32")
    for i, row in enumerate(rows):
        values = {"step": i + 1, "accepted": 1.0, "reason": 0.0, "probe": 1.0}
        values.update({"grad_norm": 1.0, "grad_norm/x": 1.0, "weight_norm/x": 1.0})
        values.update({"update_norm/x": 1e-3, "learning_rate": 1e-3, **row})
        for name, value in values.items():
            data[i, columns.index(name)] = value
    record.add(data)
    return record


def test_an_early_high_ratio_does_not_hide_bad_data():
    rows = [{"update_norm/x": 0.2}] + [{}] * 30  # Adam's first step, then calm
    rows.append({"accepted": 0.0, "reason": 1.0, "grad_norm": np.nan})
    found = ng.explain(_record(rows))
    assert (found.cause, found.first_bad_step, found.onset_step) == ("bad_data", 32, 32)


def test_a_tiny_denominator_is_the_cause_only_of_a_failed_update():
    tiny = {"state_min": 1e-11}
    failed = {"accepted": 0.0, "grad_norm": np.nan}
    gradient = ng.explain(_record([tiny] * 10 + [{**failed, "reason": 1.0}]))
    update = ng.explain(_record([tiny] * 10 + [{**failed, "reason": 2.0}]))
    assert (gradient.cause, update.cause) == ("bad_data", "optimizer_state")
    assert update.onset_step == 1 and update.steps_from_onset == 10
    assert update.lead_steps is None  # a record read on its own: no warning


def test_a_saturated_softmax_under_updates_too_large_is_their_consequence():
    # The update ratio climbs from step 5, the loss with it; the softmax
    # saturates from step 12: the rate is the cause, the saturation what
    # followed.
    rows = [{"loss": 1.0}] * 4
    rows += [{"update_norm/x": 0.2, "loss": 1.0 + 2 * i} for i in range(7)]
    rows += [{"update_norm/x": 0.3, "loss": 20.0, "min_prob": 1e-20}] * 8
    rows.append({"accepted": 0.0, "reason": 1.0, "grad_norm": np.nan})
    found = ng.explain(_record(rows))
    assert (found.cause, found.onset_step, found.first_bad_step) == (
        "learning_rate_too_high",
        5,
        20,
    )
    assert found.confidence == "high" and found.candidates == []
    assert len(found.consequences) == 1 and "softmax" in found.consequences[0]
    assert "What followed from it:" in str(found)


def test_two_causes_from_the_same_step_make_a_low_confidence_diagnosis():
    # Inputs of 100 (not normalised) and outputs 1000 times larger from the
    # first step: either could be the cause; neither is picked.
    rows = [{"input_max": 100.0, "output_max": 1e5}] * 6
    rows.append({"accepted": 0.0, "reason": 1.0, "grad_norm": np.nan})
    found = ng.explain(_record(rows))
    assert (found.cause, found.candidates, found.confidence) == (
        "input_scale",
        ["activation_growth"],
        "low",
    )
    assert found.onset_step == 1 and len(found.evidence) == 2
    assert str(found).startswith(
        "Run diagnosis (low confidence): input_scale or activation_growth;"
    )
    hints = ng.flight.RUN_HINTS
    assert found.hints == hints["input_scale"] + hints["activation_growth"]


def test_a_run_whose_weights_stop_moving_is_stalled_unless_it_learnt_first():
    moving = [{"loss": 2.0, "update_norm/x": 1e-3}] * 150
    frozen = [{"loss": 1.9, "update_norm/x": 1e-9}] * 150
    found = ng.explain(_record(moving + frozen))
    assert (found.cause, found.first_bad_step, found.onset_step) == (
        "stalled",
        None,
        151,
    )
    assert found.signal == "update_norm / weight_norm" and found.hints
    # The same freeze after the loss fell 20-fold: a task learnt.
    learnt = [{"loss": 0.1, "update_norm/x": 1e-9}] * 150
    assert ng.explain(_record(moving + learnt)).cause == "healthy"
    # Fewer than 200 steps: too short to call.
    assert ng.explain(_record(moving[:50] + frozen[:100])).cause == "healthy"


def _rate_jump_run(monkeypatch, alarms: bool):
    """A regressor trained at 0.01 whose rate jumps to 3 at step 51: it
    fails about 14 steps later, between two of the host's regular reads
    (steps 48 and 64)."""
    from keras_nanguard.flight.recorder import FlightRecorder

    if not alarms:
        monkeypatch.setattr(
            FlightRecorder, "newest_alarm", lambda self, lag, model=None: 0
        )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 8)).astype("float32")
    y = np.tanh(x @ rng.normal(size=(8, 1))).astype("float32")
    keras.utils.set_random_seed(1)
    model = tanh_regressor()
    rate = keras.optimizers.schedules.PiecewiseConstantDecay([50], [0.01, 3.0])
    model.compile(ng.SafeOptimizer(keras.optimizers.SGD(rate)), "mse")
    guard = ng.NaNGuard(policy="stop", verbose=0)
    model.fit(
        x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[guard]
    )
    return guard.explain()


def test_the_alarm_warns_a_run_that_fails_between_two_regular_reads(monkeypatch):
    # The device rings its alarm as the gradient norm jumps; the host reads
    # the record then, not at its next regular read.
    found = _rate_jump_run(monkeypatch, alarms=True)
    assert found.cause == "learning_rate_too_high"
    assert found.first_bad_step in range(60, 70), str(found)
    assert found.lead_steps is not None and found.lead_steps >= 5, str(found)


def test_without_the_alarm_the_same_run_is_warned_late_or_not(monkeypatch):
    found = _rate_jump_run(monkeypatch, alarms=False)
    assert found.first_bad_step in range(60, 70), str(found)
    assert found.lead_steps is None or found.lead_steps <= 1, str(found)
