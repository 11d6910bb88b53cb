"""Training health in the logs: the gradient norm and SafeOptimizer's counters
reach the progress bar, History, CSVLogger and TensorBoard."""

import csv
import os

import keras
import numpy as np
import pytest

import keras_nanguard as ng


def _fit(tmp_path, callbacks, **opt_kwargs):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = ng.SafeOptimizer(keras.optimizers.SGD(1e-2), **opt_kwargs)
    model.compile(optimizer=opt, loss="mse")
    x = np.random.default_rng(0).standard_normal((64, 4)).astype("float32")
    y = x.sum(1, keepdims=True)
    guard = ng.NaNGuard(verbose=0)
    history = model.fit(
        ng.faults.poison(x, rows=[20]),  # batch 1 of 4 is rejected
        y,
        batch_size=16,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[guard, *callbacks],
    )
    return history, opt


def test_history_and_csv_logger_carry_the_health_figures(tmp_path):
    path = str(tmp_path / "log.csv")
    history, opt = _fit(tmp_path, [keras.callbacks.CSVLogger(path)], lr_backoff=0.5)
    h = history.history
    assert h["nanguard_rejected_steps"] == [1, 2]  # running totals
    assert h["nanguard_grad_norm"][-1] == pytest.approx(
        opt.counters()["accepted_grad_norm"], rel=1e-6
    )
    assert all(np.isfinite(h["nanguard_grad_norm"]))
    assert h["nanguard_lr_scale"] == [0.5, 0.25]  # backed off, not yet recovered
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [float(r["nanguard_rejected_steps"]) for r in rows] == [1.0, 2.0]
    assert float(rows[-1]["nanguard_grad_norm"]) == pytest.approx(
        h["nanguard_grad_norm"][-1], rel=1e-6
    )


def test_tensorboard_writes_the_health_figures(tmp_path):
    # Keras's TensorBoard callback writes with `tf.summary`, on any backend.
    pytest.importorskip("tensorflow", reason="Keras's TensorBoard needs TensorFlow")
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    logs = str(tmp_path / "tb")
    _fit(tmp_path, [keras.callbacks.TensorBoard(logs)], spike_factor=10.0)
    events = event_accumulator.EventAccumulator(os.path.join(logs, "train"))
    events.Reload()
    tags = set(events.Tags()["tensors"]) | set(events.Tags()["scalars"])
    assert {
        "epoch_nanguard_grad_norm",
        "epoch_nanguard_rejected_steps",
        "epoch_nanguard_spike_steps",
    } <= tags
