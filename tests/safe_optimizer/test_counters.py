"""SafeOptimizer's `Counters` on their own: the variables they make (the saved
layout), what a step and a loss scaler's skip write, and the words of each
rejection reason."""

import math

import keras
import numpy as np
import pytest
from keras import ops

import keras_nanguard as ng
from keras_nanguard.safe_optimizer.counters import (
    COUNTER_NAMES,
    QUARANTINE_LOG_ROWS,
    Counters,
    Reason,
    StepOutcome,
    variable_names,
)
from keras_nanguard.safe_optimizer.optimizer import ARGUMENTS

# The saved `.keras` layout: (name, dtype, shape, initial value), in order.
LAYOUT = [
    ("skipped_steps", "int32", (), 0),
    ("consecutive_skips", "int32", (), 0),
    ("nonfinite_gradient_steps", "int32", (), 0),
    ("nonfinite_update_steps", "int32", (), 0),
    ("clipped_steps", "int32", (), 0),
    ("last_grad_norm", "float32", (), 0.0),
    ("rejected_grad_norm", "float32", (), 0.0),
    ("last_rejection", "int32", (), 0),
    ("last_nonfinite_index", "int32", (), -1),
    ("lr_scale", "float32", (), 1.0),
    ("consecutive_accepts", "int32", (), 0),
    ("accepted_grad_norm", "float32", (), 0.0),
    ("spike_steps", "int32", (), 0),
    ("loss_scale_steps", "int32", (), 0),
    ("recent_rejections", "int32", (), 0),
    ("quarantine_steps", "int32", (), 0),
    ("quarantined_samples", "int32", (), 0),
    ("quarantine_limit_steps", "int32", (), 0),
]
# The log of quarantined rows follows (not a number: `read` leaves it out).
LOG = ("quarantine_log", "int32", (QUARANTINE_LOG_ROWS + 1, 2))
WINDOW = [
    ("spike_norms", "float32", (4,)),
    ("spike_count", "int32", ()),
    ("last_spike", "float32", (2,)),
]


def _counters(**settings):
    holder = keras.optimizers.SGD(0.1)  # any optimizer can hold them
    return Counters.create(holder, ARGUMENTS.of(**settings)), holder


def _layout(variables):
    return [(v.name, str(v.dtype), tuple(v.shape)) for v in variables]


def _flags(ok, grads_ok=True, update_ok=True, norm=1.0, bad_index=0, **more):
    return StepOutcome(
        ok=ops.convert_to_tensor(ok),
        grads_ok=ops.convert_to_tensor(grads_ok),
        update_ok=ops.convert_to_tensor(update_ok),
        norm=ops.convert_to_tensor(norm, "float32"),
        bad_index=ops.convert_to_tensor(bad_index, "int32"),
        **{k: ops.convert_to_tensor(v) for k, v in more.items()},
    )


def _read(counters, *names):
    values = counters.read()
    return tuple(values[n] for n in names)


# ------------------------------------------------------------------ creation
def test_creation_makes_the_saved_layout_in_order():
    counters, holder = _counters()
    expected = [(n, d, s) for n, d, s, _ in LAYOUT] + [LOG]
    assert _layout(counters.variables()) == expected
    # They are the holder's own variables, after its two of the base class.
    assert _layout(holder.variables[2:]) == expected
    assert [v.aggregation for v in counters.variables()] == ["none"] * 19
    assert counters.read() == {n: initial for n, _, _, initial in LAYOUT}
    assert [type(v) for v in counters.read().values()] == [
        float if d == "float32" else int for _, d, _, _ in LAYOUT
    ]
    assert (*tuple(n for n, _, _, _ in LAYOUT), LOG[0]) == COUNTER_NAMES
    assert (ops.convert_to_numpy(counters.quarantine_log) == -1).all()
    assert counters.spike_norms is None and counters.last_spike is None


def test_the_spike_window_follows_the_counters():
    counters, _ = _counters(spike_factor=10.0, spike_window=4)
    expected = [(n, d, s) for n, d, s, _ in LAYOUT] + [LOG] + WINDOW
    assert _layout(counters.variables()) == expected
    assert counters.window() == (
        counters.spike_norms,
        counters.spike_count,
        counters.last_spike,
    )


def test_history_variables_are_the_reports_not_the_control_state():
    counters, _ = _counters()
    assert [v.name for v in counters.history_variables()] == [
        "skipped_steps",
        "nonfinite_gradient_steps",
        "nonfinite_update_steps",
        "clipped_steps",
        "last_grad_norm",
        "rejected_grad_norm",
        "last_rejection",
        "last_nonfinite_index",
        "spike_steps",
        "loss_scale_steps",
        "recent_rejections",
        "quarantine_steps",
        "quarantined_samples",
        "quarantine_limit_steps",
        "quarantine_log",
    ]


def test_reason_codes():
    assert [(r.name, r.value) for r in Reason] == [
        ("NONE", 0),
        ("GRADIENT", 1),
        ("UPDATE", 2),
        ("SPIKE", 3),
        ("LOSS_SCALE_OVERFLOW", 4),
        ("LOSS", 5),
        ("HALTED", 6),
    ]


# ------------------------------------------------------------------ updates
def test_a_bad_gradient_then_a_bad_update_then_a_clipped_good_step():
    counters, _ = _counters()
    names = (
        "skipped_steps",
        "consecutive_skips",
        "nonfinite_gradient_steps",
        "nonfinite_update_steps",
        "clipped_steps",
        "last_rejection",
        "last_nonfinite_index",
        "recent_rejections",
    )
    counters.record_step(
        _flags(False, grads_ok=False, norm=math.inf, bad_index=3, clipped=False)
    )
    assert _read(counters, *names) == (1, 1, 1, 0, 0, 1, 3, 0b1)
    assert _read(counters, "last_grad_norm", "rejected_grad_norm") == (
        math.inf,
        math.inf,
    )
    counters.record_step(_flags(False, update_ok=False, norm=2.0, bad_index=5))
    assert _read(counters, *names) == (2, 2, 1, 1, 0, 2, 5, 0b11)
    counters.record_step(_flags(True, norm=3.5, bad_index=0, clipped=True))
    assert _read(counters, *names) == (2, 0, 1, 1, 1, 2, 5, 0b110)
    assert _read(
        counters, "last_grad_norm", "accepted_grad_norm", "rejected_grad_norm"
    ) == (3.5, 3.5, 2.0)


def test_recent_rejections_keep_the_last_30_steps():
    counters, _ = _counters()
    for _ in range(31):
        counters.record_step(_flags(False, grads_ok=False))
    counters.record_step(_flags(True))
    assert _read(counters, "recent_rejections", "skipped_steps") == (2**30 - 2, 31)


def test_lr_backoff_lowers_to_its_floor_then_recovers():
    counters, _ = _counters(lr_backoff=0.5, lr_recovery_steps=2, min_lr_scale=0.25)
    scales = []
    for ok in (False, False, False, True, True, True):
        counters.record_step(_flags(ok, grads_ok=ok))
        scales.append(_read(counters, "lr_scale", "consecutive_accepts"))
    assert scales == [
        (0.5, 0),
        (0.25, 0),
        (0.25, 0),
        (0.25, 1),
        (0.5, 0),
        (0.5, 1),
    ]


def test_without_lr_backoff_the_scale_stays():
    counters, _ = _counters()
    counters.record_step(_flags(False, grads_ok=False))
    assert _read(counters, "lr_scale", "consecutive_accepts") == (1.0, 0)


def test_a_spike_is_counted_and_enters_the_window_as_its_threshold():
    counters, _ = _counters(spike_factor=10.0, spike_window=4)
    figures = np.array([30.0, 3.0], "float32")
    counters.record_step(
        _flags(False, norm=50.0, bad_index=0, spike=True, spike_figures=figures)
    )
    assert _read(
        counters, "spike_steps", "skipped_steps", "last_rejection", "rejected_grad_norm"
    ) == (1, 1, 3, 50.0)
    assert ops.convert_to_numpy(counters.spike_norms).tolist() == [30.0, 0, 0, 0]
    assert int(counters.spike_count) == 1
    assert ops.convert_to_numpy(counters.last_spike).tolist() == [30.0, 3.0]
    # A non-finite gradient is that, not a spike, and is not written.
    counters.record_step(
        _flags(False, grads_ok=False, norm=math.nan, spike=True, spike_figures=figures)
    )
    assert _read(counters, "spike_steps", "last_rejection") == (1, 1)
    assert int(counters.spike_count) == 1
    counters.record_step(_flags(True, norm=2.0, spike=False, spike_figures=figures))
    assert ops.convert_to_numpy(counters.spike_norms).tolist() == [30.0, 2.0, 0, 0]


def test_a_loss_scaler_overflow_then_a_bad_batch():
    counters, _ = _counters(lr_backoff=0.5)
    names = (
        "skipped_steps",
        "loss_scale_steps",
        "nonfinite_gradient_steps",
        "consecutive_skips",
        "recent_rejections",
        "last_rejection",
        "last_nonfinite_index",
        "lr_scale",
    )
    true, false = ops.convert_to_tensor(True), ops.convert_to_tensor(False)
    counters.record_scaler_skip(true, false)  # an overflow: routine
    assert _read(counters, *names) == (1, 1, 0, 0, 0b0, 4, -1, 1.0)
    assert math.isnan(counters.read()["rejected_grad_norm"])
    counters.record_scaler_skip(true, true)  # the loss was not finite
    assert _read(counters, *names) == (2, 1, 1, 1, 0b1, 5, -1, 0.5)
    counters.record_scaler_skip(false, false)  # no skip: nothing changes
    assert _read(counters, *names) == (2, 1, 1, 1, 0b1, 5, -1, 0.5)


# ------------------------------------------------------------ host reports
def _rejected(counters, reason, index=1, norm=7.25):
    counters.last_rejection.assign(reason.value)
    counters.last_nonfinite_index.assign(index)
    counters.rejected_grad_norm.assign(norm)


NAMES = ["'net/kernel'", "'net/bias'", "optimizer variable 'adam/m'"]


def test_no_rejection_has_no_words():
    counters, _ = _counters()
    assert counters.describe_last_rejection(NAMES) == ""


@pytest.mark.parametrize(
    ("reason", "index", "words"),
    [
        (
            Reason.GRADIENT,
            1,
            "the gradient of 'net/bias' was not finite (global gradient norm 7.25)",
        ),
        (
            Reason.GRADIENT,
            9,
            "the gradient of variable #9 was not finite (global gradient norm 7.25)",
        ),
        (
            Reason.UPDATE,
            2,
            "the update would have made optimizer variable 'adam/m' non-finite "
            "although the gradients were finite (global gradient norm 7.25); the "
            "learning rate is probably too high for these gradients",
        ),
        (
            Reason.LOSS_SCALE_OVERFLOW,
            -1,
            "the loss-scaled gradients overflowed (mixed precision): the "
            "LossScaleOptimizer skipped the step and halved its loss scale, its "
            "routine",
        ),
        (
            Reason.LOSS,
            -1,
            "the loss was not finite (a bad batch: non-finite inputs, targets or "
            "loss terms), so the loss-scaled gradients were not either; the "
            "LossScaleOptimizer's scale was kept",
        ),
    ],
)
def test_the_words_of_each_reason(reason, index, words):
    counters, _ = _counters()
    _rejected(counters, reason, index)
    assert counters.describe_last_rejection(NAMES) == words


def test_the_words_of_a_spike_give_its_figures():
    counters, _ = _counters(spike_factor=10.0, spike_window=4)
    _rejected(counters, Reason.SPIKE, 0, norm=123.0)
    counters.last_spike.assign(np.array([40.0, 4.0], "float32"))
    assert counters.describe_last_rejection(NAMES) == (
        "the global gradient norm 123 was a spike, more than 10 times the 90th "
        "percentile of the last 4 steps' norms (4): above 40"
    )


def test_an_unknown_code_has_no_words():
    counters, _ = _counters()
    counters.last_rejection.assign(17)
    assert counters.describe_last_rejection(NAMES) == ""


def test_values_of_a_stateless_loop_are_read_instead_of_the_variables():
    counters, _ = _counters()
    values = [v.value for v in counters.variables()]
    values[0] = ops.convert_to_tensor(4, "int32")  # skipped_steps
    values[7] = ops.convert_to_tensor(Reason.GRADIENT.value, "int32")
    values[8] = ops.convert_to_tensor(0, "int32")
    assert counters.read(values)["skipped_steps"] == 4
    assert counters.read()["skipped_steps"] == 0
    assert counters.describe_last_rejection(NAMES, values).startswith(
        "the gradient of 'net/kernel' was not finite"
    )


def test_halt_checks():
    counters, _ = _counters(max_consecutive_skips=2)
    counters.consecutive_skips.assign(1)
    assert counters.halted() is False
    counters.check_halted(NAMES)  # quietly
    counters.consecutive_skips.assign(2)
    _rejected(counters, Reason.GRADIENT, 0)
    assert counters.halted() is True
    with pytest.raises(ng.NonFiniteError) as raised:
        counters.check_halted(NAMES)
    assert str(raised.value).startswith(
        "SafeOptimizer rejected 2 steps in a row (max_consecutive_skips=2) and "
        "halted; last, the gradient of 'net/kernel' was not finite (global "
        "gradient norm 7.25). Training cannot make progress"
    )
    assert raised.value.report["consecutive_skips"] == 2


def test_no_limit_never_halts():
    counters, _ = _counters()
    counters.consecutive_skips.assign(1000)
    assert counters.halted() is False
    counters.check_halted(NAMES)


def test_variable_names_count_trainable_then_optimizer_variables():
    a, b = keras.Variable(1.0, name="a"), keras.Variable(2.0, name="b")
    assert variable_names([a], [b]) == ["'a'", "optimizer variable 'b'"]


# ------------------------------------------------------------------ quarantine
def _quarantine(counters, codes, over=False):
    counters.record_quarantine(
        ops.convert_to_tensor(np.array(codes, "int32")), ops.convert_to_tensor(over)
    )


def test_quarantined_rows_are_counted_and_logged_in_order():
    counters, _ = _counters()
    _quarantine(counters, [0, 1, 0, 8])  # step 1: rows 1 (input) and 3 (loss)
    _quarantine(counters, [0, 0, 0, 0])  # step 2: clean
    _quarantine(counters, [2, 1, 0, 0], over=True)  # step 3: over the limit
    _quarantine(counters, [4, 0, 0, 0])  # step 4: row 0 (weight)
    names = ("quarantine_steps", "quarantined_samples", "quarantine_limit_steps")
    assert _read(counters, *names) == (4, 3, 1)
    assert counters.quarantined_rows(0, 3) == [(1, 1, 1), (1, 3, 8), (4, 0, 4)]
    assert counters.quarantined_rows(2, 3) == [(4, 0, 4)]


def test_the_quarantine_log_keeps_the_latest_rows():
    counters, _ = _counters()
    size = QUARANTINE_LOG_ROWS
    _quarantine(counters, [1] * (size - 2))  # rows 0..size-3 of the total
    _quarantine(counters, [0, 2, 2, 2, 0])  # 3 more: the ring wraps once
    total = counters.read()["quarantined_samples"]
    assert total == size + 1
    rows = counters.quarantined_rows(0, total)
    assert len(rows) == size  # the oldest one was written over
    assert rows[0] == (1, 1, 1)
    assert rows[-3:] == [(2, 1, 2), (2, 2, 2), (2, 3, 2)]
