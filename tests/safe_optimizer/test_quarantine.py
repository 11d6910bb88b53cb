"""Per-sample quarantine (`attach(model, quarantine=True)`, `NaNGuard(
quarantine=True)`): a batch with bad rows trains as the same batch without
them, the rows are counted and named, and a clean batch is bit-identical to
training without quarantine.

The reference of each guarded run is plain Keras on a `PyDataset` that
yields the same batches with the bad rows removed (a batch over the limit
left out whole: the guarded step is rejected). The model mixes no samples
(Dense layers), so the two must agree to float32 rounding."""

import json

import keras
import numpy as np
import pytest
from keras import ops

import keras_nanguard as ng
from keras_nanguard.safe_optimizer import patches
from keras_nanguard.safe_optimizer.observer import StepObserver
from tests.helpers import BACKEND, assert_bit_identical, numpy

BATCH, ROWS, EPOCHS = 16, 64, 2
ONE, SEVERAL = [5], [3, 17, 18, 40]
OVER = [3, *range(16, 25)]  # 9 of batch 1's 16 rows: over the limit of 0.5
KINDS = ("nan_input", "inf_input", "nan_target", "nan_weight", "inf_loss")
REASON = {
    "nan_input": "non-finite input",
    "inf_input": "non-finite input",
    "nan_target": "non-finite target",
    "nan_weight": "non-finite sample weight",
    "inf_loss": "non-finite loss",
}
# The kind x rows matrices of `fit` and of the custom loop run whole on
# torch, whose eager steps of 8 batches cost the least (the whole file
# alone on a 2-core VM: torch 7 s, JAX 46 s, TensorFlow 103 s, each step
# traced or compiled there); TensorFlow and JAX run each kind
# once and each of ONE, SEVERAL and OVER at least once (what the backend's
# own code does: each kind's check, a rejected step), the other cases
# skipped there with the same IDs.
MATRIX_ON = "torch"
EVERY_BACKEND = {
    ("nan_input", "one"),
    ("inf_input", "over"),
    ("nan_target", "several"),
    ("nan_weight", "over"),
    ("inf_loss", "several"),
}
_ELSEWHERE = pytest.mark.skipif(
    BACKEND != MATRIX_ON,
    reason=f"the kind x rows matrix runs whole on {MATRIX_ON}: here each kind once",
)


def _matrix():
    """(kind, rows) of the matrix, as parameters with the IDs `kind-rows`."""
    rows = {"one": ONE, "several": SEVERAL, "over": OVER}
    return [
        pytest.param(
            kind,
            rows[name],
            id=f"{kind}-{name}",
            marks=() if (kind, name) in EVERY_BACKEND else _ELSEWHERE,
        )
        for name in rows
        for kind in KINDS
    ]


def relative_error(y_true, y_pred):
    """A per-sample loss that is inf for a finite target of 0 (`x / 0`)."""
    return ops.mean(ops.square((y_true - y_pred) / y_true), axis=-1)


def _data(kind=None, rows=()):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, 4)).astype("float32")
    y = rng.uniform(1.0, 2.0, (ROWS, 2)).astype("float32")
    w = np.ones(ROWS, "float32")
    rows = list(rows)
    if kind == "nan_input":
        x = ng.faults.poison(x, rows=rows)
    elif kind == "inf_input":
        x = ng.faults.poison(x, rows=rows, value="inf", columns=[2])
    elif kind == "nan_target":
        y = ng.faults.poison(y, rows=rows, columns=[1])
    elif kind == "nan_weight":
        w[rows] = np.nan
    elif kind == "inf_loss":
        y[rows, 0] = 0.0  # finite, but the row's loss is (y - p)^2 / 0
    return x, y, w


class RelativeError(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return relative_error(y_true, y_pred)


def _model(optimizer):
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(2),
        ]
    )
    model.compile(optimizer=optimizer, loss=relative_error, weighted_metrics=["mae"])
    return model


class WithoutRows(keras.utils.PyDataset):
    """The batches of `(x, y, w)` with the rows `bad` removed, and a batch
    with more than half of its rows bad left out whole."""

    def __init__(self, x, y, w, bad):
        super().__init__()
        self.batches = []
        for start in range(0, ROWS, BATCH):
            rows = [i for i in range(start, start + BATCH) if i not in bad]
            if len(rows) >= BATCH / 2:
                self.batches.append((x[rows], y[rows], w[rows]))

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        return self.batches[i]


def _guarded(**attach):
    opt = ng.SafeOptimizer(keras.optimizers.Adam(0.01))
    model = _model(opt)
    opt.attach(model, **attach)
    return model, opt


def _reference(x, y, w, bad):
    model = _model(keras.optimizers.Adam(0.01))
    model.history_ = model.fit(
        WithoutRows(x, y, w, bad), epochs=EPOCHS, verbose=0, shuffle=False
    )
    return model


def _assert_close_state(model, opt, ref):
    for a, b in zip(numpy(model.weights), numpy(ref.weights), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    inner = numpy(opt.inner_optimizer.variables)
    for a, b in zip(inner, numpy(ref.optimizer.variables), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _expected(rows):
    """Quarantined rows and rejected steps per epoch, for the bad `rows`."""
    over = [b for b in range(ROWS // BATCH) if sum(r // BATCH == b for r in rows) > 8]
    kept = [r for r in rows if r // BATCH not in over]
    return kept, len(over)


# ------------------------------------------------------------------ fit
@pytest.mark.parametrize(("kind", "rows"), _matrix())
def test_fit_trains_as_the_batches_without_the_bad_rows(kind, rows):
    x, y, w = _data(kind, rows)
    model, opt = _guarded(quarantine=True)
    history = model.fit(
        x,
        y,
        sample_weight=w,
        batch_size=BATCH,
        epochs=EPOCHS,
        verbose=0,
        shuffle=False,
    )
    ref = _reference(x, y, w, rows)
    _assert_close_state(model, opt, ref)
    # The epoch figures are those of the batches without the bad rows.
    for name in ("loss", "mae"):
        np.testing.assert_allclose(
            history.history[name], ref.history_.history[name], rtol=1e-5
        )
    kept, over = _expected(rows)
    c = opt.counters()
    assert c["quarantined_samples"] == EPOCHS * len(kept)
    assert c["quarantine_steps"] == EPOCHS * ROWS // BATCH
    assert c["quarantine_limit_steps"] == EPOCHS * over
    assert c["skipped_steps"] == EPOCHS * over
    assert history.history["nanguard_quarantined_samples"] == [
        float(len(kept) * (e + 1)) for e in range(EPOCHS)
    ]
    rows_named = opt.quarantined_rows()
    assert [(row, why) for _, row, why in rows_named] == [
        (r % BATCH, (REASON[kind],)) for r in kept
    ] * EPOCHS


@pytest.mark.parametrize("kind", KINDS)
def test_train_on_batch_trains_as_the_batch_without_the_bad_rows(kind):
    x, y, w = _data(kind, SEVERAL)
    model, opt = _guarded(quarantine=True)
    ref = _model(keras.optimizers.Adam(0.01))
    for start in range(0, ROWS, BATCH):
        s = slice(start, start + BATCH)
        logs = model.train_on_batch(x[s], y[s], sample_weight=w[s], return_dict=True)
        keep = [i for i in range(start, start + BATCH) if i not in SEVERAL]
        want = ref.train_on_batch(
            x[keep], y[keep], sample_weight=w[keep], return_dict=True
        )
        # The batch's loss and weighted metric are those of the healthy rows.
        np.testing.assert_allclose(logs["loss"], want["loss"], rtol=1e-5)
        np.testing.assert_allclose(logs["mae"], want["mae"], rtol=1e-5)
    _assert_close_state(model, opt, ref)
    assert opt.counters()["quarantined_samples"] == len(SEVERAL)


def test_a_clean_run_is_bit_identical_to_one_without_quarantine():
    x, y, _w = _data()
    runs = []
    for quarantine in (False, True):
        model, opt = _guarded(quarantine=quarantine)
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False)
        runs.append((numpy(model.weights), numpy(opt.inner_optimizer.variables)))
    assert_bit_identical(runs[0][0], runs[1][0], "weights")
    assert_bit_identical(runs[0][1], runs[1][1], "optimizer state")


def test_without_quarantine_a_bad_row_rejects_its_batch():
    x, y, _w = _data("nan_input", ONE)
    model, opt = _guarded()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    c = opt.counters()
    assert (c["skipped_steps"], c["quarantined_samples"], c["quarantine_steps"]) == (
        1,
        0,
        0,
    )


def test_detach_and_a_later_attach_turn_it_off():
    x, y, _ = _data("nan_input", ONE)
    model, opt = _guarded(quarantine=True)
    opt.attach(model)  # `None`: kept
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    assert opt.counters()["quarantined_samples"] == 1
    opt.attach(model, quarantine=False)
    assert "compute_loss" not in vars(model)
    # `compute_metrics` is the flight recorder's (it sees the outputs), over
    # the model's own: the quarantine's is gone.
    assert isinstance(patches.owner_of(model, "compute_metrics"), StepObserver)
    assert patches.original_of(model, "compute_metrics") == type(
        model
    ).compute_metrics.__get__(model)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    c = opt.counters()
    assert (c["quarantined_samples"], c["skipped_steps"]) == (1, 1)
    opt.attach(model, quarantine=True)
    opt.detach(model)
    assert "compute_loss" not in vars(model) and "train_step" not in vars(model)
    assert "compute_metrics" not in vars(model)


def test_evaluate_and_predict_are_untouched():
    x, y, _ = _data()
    model, _ = _guarded(quarantine=True)
    plain = _model(keras.optimizers.Adam(0.01))
    np.testing.assert_array_equal(
        model.predict(x, verbose=0), plain.predict(x, verbose=0)
    )
    assert model.evaluate(x, y, verbose=0) == plain.evaluate(x, y, verbose=0)


def test_batch_normalization_stays_finite_with_bad_rows():
    """BatchNormalization mixes the rows of a batch: each bad row is replaced
    by a copy of the batch's first healthy row (weight 0), so the batch
    statistics are those of the batch with that row repeated, finite."""
    x, y, _ = _data("nan_input", SEVERAL)
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.BatchNormalization(), keras.layers.Dense(2)]
    )
    opt = ng.SafeOptimizer(keras.optimizers.Adam(0.01))
    model.compile(optimizer=opt, loss="mse")
    opt.attach(model, quarantine=True)
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False)
    assert all(np.isfinite(v).all() for v in numpy(model.weights))
    c = opt.counters()
    assert (c["quarantined_samples"], c["skipped_steps"]) == (2 * len(SEVERAL), 0)
    # The first batch's statistics: rows 0..15 with row 3 replaced by row 0.
    rows = np.array(x[:BATCH])
    rows[3] = rows[0]
    check = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization()])
    check.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    check.train_on_batch(rows, rows)
    first = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization()])
    opt2 = ng.SafeOptimizer(keras.optimizers.SGD(0.0))
    first.compile(optimizer=opt2, loss="mse")
    opt2.attach(first, quarantine=True)
    first.train_on_batch(x[:BATCH], rows)
    np.testing.assert_allclose(
        numpy(first.layers[0].non_trainable_weights),
        numpy(check.layers[0].non_trainable_weights),
        rtol=1e-6,
    )


def test_bad_arguments_are_refused_naming_them():
    model, opt = _guarded()
    with pytest.raises(ValueError, match=r"max_quarantine_fraction.*Received: "):
        opt.attach(model, quarantine=True, max_quarantine_fraction=0.0)
    with pytest.raises(TypeError, match=r"`quarantine` must be True or False"):
        opt.attach(model, quarantine="yes")
    with pytest.raises(ValueError, match=r"max_quarantine_fraction"):
        ng.NaNGuard(quarantine=True, max_quarantine_fraction=1.5)
    plain = _model(keras.optimizers.Adam(0.01))
    x, y, _ = _data()
    with pytest.raises(ValueError, match=r"quarantine=True.*SafeOptimizer"):
        plain.fit(x, y, epochs=1, verbose=0, callbacks=[ng.NaNGuard(quarantine=True)])
    assert "compute_loss" not in vars(model)


# ------------------------------------------------------------------ NaNGuard
def test_nanguard_names_the_quarantined_rows_of_the_data(tmp_path):
    x, y, _w = _data("nan_input", SEVERAL)
    y = ng.faults.poison(y, rows=[50], columns=[0])
    model, _opt = _guarded()
    report = tmp_path / "report.json"
    guard = ng.NaNGuard(
        quarantine=True,
        replay=(x, y),
        batch_size=BATCH,
        report_path=report,
        verbose=0,
    )
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        verbose=0,
        shuffle=False,
        callbacks=[guard],
    )
    bad = sorted([*SEVERAL, 50])
    assert [r.position for r in guard.quarantined] == bad * EPOCHS
    assert [(r.epoch, r.batch, r.row) for r in guard.quarantined] == [
        (e, p // BATCH, p % BATCH) for e in range(EPOCHS) for p in bad
    ]
    assert [r.step for r in guard.quarantined] == [
        e * ROWS // BATCH + p // BATCH for e in range(EPOCHS) for p in bad
    ]
    assert [r.reasons for r in guard.quarantined[:5]] == [("non-finite input",)] * 4 + [
        ("non-finite target",)
    ]
    kinds = [i.kind for i in guard.incidents]
    assert kinds == ["quarantined_samples"] * EPOCHS  # one per epoch, no trouble
    assert guard.rollbacks == 0
    inc = guard.incidents[0]
    assert inc.detail == (
        "the quarantine left 5 rows out of 4 steps (4 non-finite input, "
        "1 non-finite target): batch 0 row 3 (position 3), batch 1 row 1 "
        "(position 17), batch 1 row 2 (position 18), batch 2 row 8 (position "
        "40), batch 3 row 2 (position 50)."
    )
    saved = json.loads(report.read_text())
    assert [r["position"] for r in saved["quarantined"]] == bad * EPOCHS
    assert saved["incidents"][1]["rows"][0]["reasons"] == ["non-finite input"]
    assert "quarantined_samples" in guard.summary()


def test_nanguard_without_replay_names_step_and_row():
    x, y, _ = _data("inf_loss", ONE)
    model, _ = _guarded()
    guard = ng.NaNGuard(quarantine=True, verbose=0)
    model.fit(
        x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[guard]
    )
    (row,) = guard.quarantined
    assert (row.step, row.batch, row.row, row.position, row.reasons) == (
        0,
        0,
        5,
        None,
        ("non-finite loss",),
    )


def test_nanguard_keeps_a_quarantine_attached_by_hand():
    x, y, _ = _data("nan_target", ONE)
    model, opt = _guarded(quarantine=True)
    guard = ng.NaNGuard(verbose=0)  # quarantine=False: the optimizer's kept
    model.fit(
        x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[guard]
    )
    assert [r.position for r in guard.quarantined] == [None]
    assert opt.counters()["quarantined_samples"] == 1


def test_nanguard_quarantine_round_trips_in_its_config():
    guard = ng.NaNGuard(quarantine=True, max_quarantine_fraction=0.25)
    again = ng.NaNGuard.from_config(guard.get_config())
    assert (again.quarantine, again.max_quarantine_fraction) == (True, 0.25)


# ------------------------------------------------------------ custom loops
def _loop_model():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(2),
        ]
    )
    return model


def _custom_loop(model, opt, batches, quarantine):
    """The Keras guides' custom loop of this backend, one step per batch;
    with `quarantine`, the batch goes through `opt.quarantine` first."""
    if BACKEND == "jax":
        return _jax_loop(model, opt, batches, quarantine)
    for xb, yb, wb in batches:
        xb, yb, wb = (ops.convert_to_tensor(a) for a in (xb, yb, wb))
        batch = opt.quarantine(xb, yb, wb) if quarantine else None
        if BACKEND == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                loss = _loop_loss(model, batch, xb, yb, wb)
            grads = tape.gradient(loss, model.trainable_weights)
        else:
            loss = _loop_loss(model, batch, xb, yb, wb)
            model.zero_grad()
            loss.backward()
            grads = [w.value.grad for w in model.trainable_weights]
        opt.apply(grads, model.trainable_weights)


def _loop_loss(model, batch, xb, yb, wb):
    loss_fn = RelativeError()
    if batch is None:
        return loss_fn(yb, model(xb, training=True), sample_weight=wb)
    return batch.loss(relative_error, model(batch.x, training=True))


def _jax_loop(model, opt, batches, quarantine):
    import jax

    loss_fn = RelativeError()

    def compute_loss(trainable, non_trainable, batch, xb, yb, wb):
        x_in = xb if batch is None else batch.x
        pred, non_trainable = model.stateless_call(
            trainable, non_trainable, x_in, training=True
        )
        if batch is None:
            return loss_fn(yb, pred, sample_weight=wb), (non_trainable, None)
        return batch.loss(relative_error, pred), (non_trainable, batch.codes)

    @jax.jit
    def train_step(state, xb, yb, wb):
        trainable, non_trainable, opt_vars = state
        # Inside the step, as the guide makes its batch.
        batch = opt.quarantine(xb, yb, wb) if quarantine else None
        grad_fn = jax.value_and_grad(compute_loss, has_aux=True)
        (_, (non_trainable, codes)), grads = grad_fn(
            trainable, non_trainable, batch, xb, yb, wb
        )
        if batch is not None:
            batch.codes = codes  # the rows as the loss saw them
        trainable, opt_vars = opt.stateless_apply(opt_vars, grads, trainable)
        return trainable, non_trainable, opt_vars

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in opt.variables],
    )
    for xb, yb, wb in batches:
        state = train_step(state, xb, yb, wb)
    for v, value in zip(model.trainable_variables, state[0], strict=True):
        v.assign(value)
    for v, value in zip(opt.variables, state[2], strict=True):
        v.assign(value)


def _batches_of(x, y, w):
    return [
        (x[i : i + BATCH], y[i : i + BATCH], w[i : i + BATCH])
        for e in range(EPOCHS)
        for i in range(0, ROWS, BATCH)
    ]


@pytest.mark.parametrize(("kind", "rows"), _matrix())
def test_custom_loop_trains_as_the_batches_without_the_bad_rows(kind, rows):
    x, y, w = _data(kind, rows)
    model, opt = _loop_model(), ng.SafeOptimizer(keras.optimizers.Adam(0.01))
    opt.build(model.trainable_variables)
    _custom_loop(model, opt, _batches_of(x, y, w), quarantine=True)
    ref, ref_opt = _loop_model(), ng.SafeOptimizer(keras.optimizers.Adam(0.01))
    ref_opt.build(ref.trainable_variables)
    healthy = WithoutRows(x, y, w, rows)
    _custom_loop(
        ref,
        ref_opt,
        [healthy[i] for i in range(len(healthy))] * EPOCHS,
        quarantine=False,
    )
    for a, b in zip(numpy(model.weights), numpy(ref.weights), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    inner, ref_inner = opt.inner_optimizer.variables, ref_opt.inner_optimizer.variables
    for a, b in zip(numpy(inner), numpy(ref_inner), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    kept, over = _expected(rows)
    c = opt.counters()
    assert (c["quarantined_samples"], c["quarantine_limit_steps"]) == (
        EPOCHS * len(kept),
        EPOCHS * over,
    )
    assert c["skipped_steps"] == EPOCHS * over
    assert [(row, why) for _, row, why in opt.quarantined_rows()] == [
        (r % BATCH, (REASON[kind],)) for r in kept
    ] * EPOCHS


def test_a_custom_loop_counts_only_the_batch_of_its_step():
    x, y, w = _data("nan_input", ONE)
    model, opt = _loop_model(), ng.SafeOptimizer(keras.optimizers.Adam(0.01))
    opt.build(model.trainable_variables)
    batches = _batches_of(x, y, w)[:2]
    _custom_loop(model, opt, batches, quarantine=True)
    _custom_loop(model, opt, batches, quarantine=False)  # plain steps after
    c = opt.counters()
    assert (c["quarantined_samples"], c["quarantine_steps"], c["skipped_steps"]) == (
        1,
        2,
        1,
    )
