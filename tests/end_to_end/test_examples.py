"""The programs users copy from Keras's examples (`examples/`), run plain and
under keras-nanguard as docs/guide/examples.md says, on the backends each
pattern runs on: guarded equals plain bit for bit when nothing is rejected,
with no incident, no warning and a healthy `explain()`; a variant that
really goes non-finite has every bad step rejected, leaves a model that
works (finite loss on clean batches) and is explained by its cause."""

from __future__ import annotations

import importlib

import keras
import numpy as np
import pytest

import keras_nanguard as ng
from tests.helpers import BACKEND, all_finite, assert_bit_identical, numpy

EXAMPLES = [
    "convnet",
    "lstm",
    "transformer",
    "gpt",
    "vae",
    "gan",
    "wgan_gp",
    "actor_critic",
    "fine_tuning",
]
FAULTS = [
    (name, fault)
    for name in EXAMPLES
    for fault in importlib.import_module(f"examples.{name}").FAULTS
]


def _example(name):
    example = importlib.import_module(f"examples.{name}")
    if BACKEND not in example.BACKENDS:
        pytest.skip(f"{name} runs on {', '.join(example.BACKENDS)}")
    return example


def _explain(run):
    if run.guard is not None:
        return run.guard.explain()
    (opt,) = run.optimizers  # a custom loop's SafeOptimizer
    return ng.explain(opt)


def _rejected(run):
    return sum(
        o.counters()["skipped_steps"] for o in run.optimizers if hasattr(o, "counters")
    )


@pytest.mark.parametrize("name", EXAMPLES)
def test_guarded_runs_as_plain_and_is_healthy(name):
    example = _example(name)
    plain = example.train("plain")
    guarded = example.train("guard")
    assert_bit_identical(numpy(plain.model.weights), numpy(guarded.model.weights))
    # The losses as logged: TensorFlow's own runs of the VAE differ in the
    # 7th digit of a logged loss under load (a multi-threaded reduction),
    # with bit-identical weights.
    np.testing.assert_allclose(guarded.losses, plain.losses, rtol=1e-6)
    assert _rejected(guarded) == 0
    if guarded.guard is not None:
        assert guarded.guard.incidents == []  # no divergence_warning either
    found = _explain(guarded)
    assert (found.cause, found.first_bad_step) == ("healthy", None), str(found)


@pytest.mark.parametrize(("name", "fault"), FAULTS)
def test_a_run_that_goes_non_finite_is_kept_and_explained(name, fault):
    example = _example(name)
    run = example.train("guard", fault=fault)
    assert _rejected(run) >= 1
    assert all_finite(run.model.weights)
    for opt in run.optimizers:
        assert all_finite(opt.variables)
    assert np.isfinite(run.check())  # the model still works on clean data
    found = _explain(run)
    assert found.cause == example.FAULTS[fault], str(found)
    assert found.first_bad_step is not None


def test_the_vae_with_no_call_is_rolled_back_to_the_state_before_its_first_step():
    """Adam at 3.0: the first step is finite but ruinous; the rollback point is
    the state before it (the model has no `call()`, its sub-models are built),
    not the state after it."""
    example = _example("vae")
    run = example.train("guard", fault="rate")
    rollbacks = [i for i in run.guard.incidents if "rolled back" in i.action]
    assert rollbacks
    assert all(
        "restored the snapshot of epoch 0, step 0" in i.action for i in rollbacks
    )
    assert keras.ops.convert_to_numpy(run.optimizers[0].learning_rate) < 3.0


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the GAN example's backend")
def test_a_gan_rollback_restores_both_optimizers_and_lowers_both_rates():
    """NaNGuard finds the SafeOptimizers the GAN holds: the snapshot holds
    both optimizers' variables, and three of the discriminator's steps
    rejected in a row roll both back, with both rates halved."""
    from keras_nanguard import snapshots

    gan_example = _example("gan")
    images = (gan_example.load_digits().data[:256] / 16.0).reshape(-1, 8, 8, 1)
    images = images.astype("float32")
    images[96:192, 0, 0, 0] = np.nan  # batches 3-5: the critic's steps go NaN
    keras.utils.set_random_seed(0)
    gan = gan_example.GAN(*gan_example.networks(), latent_dim=gan_example.LATENT)
    d_opt = ng.SafeOptimizer(keras.optimizers.Adam(3e-4))
    g_opt = ng.SafeOptimizer(keras.optimizers.Adam(3e-4))
    gan.compile(d_opt, g_opt, keras.losses.BinaryCrossentropy(from_logits=True))
    assert list(snapshots.model_optimizers(gan)) == [
        "optimizer",
        "d_optimizer",
        "g_optimizer",
    ]

    def optimizer_state():  # what a restore writes: not the learning rates
        keep = snapshots.unchecked(gan)
        state = snapshots.optimizer_state(d_opt) + snapshots.optimizer_state(g_opt)
        return numpy([v for v in state if id(v) not in keep])

    class Record(keras.callbacks.Callback):
        """After NaNGuard: both optimizers' state at each batch begin."""

        def on_train_begin(self, logs=None):
            self.begins = []

        def on_train_batch_begin(self, batch, logs=None):
            self.begins.append(optimizer_state())

    guard, record = ng.NaNGuard(check_every=1, verbose=0), Record()
    gan.fit(
        images,
        epochs=1,
        batch_size=32,
        verbose=0,
        shuffle=False,
        callbacks=[guard, record],
    )
    (rollback,) = [i for i in guard.incidents if "rolled back" in i.action]
    assert rollback.action == (
        "rolled back: restored the snapshot of epoch 0, step 1, learning rates "
        "d_optimizer 0.0003 -> 0.00015, g_optimizer 0.0003 -> 0.00015"
    )
    # The first snapshot was taken at batch 1's begin (both optimizers made
    # their variables in step 0); the batch after the rollback began from it.
    after = rollback.step + rollback.steps
    snapshot = record.begins[1]
    assert_bit_identical(snapshot, record.begins[after], "both optimizers' state")
    ids = {id(v) for v in snapshots.tracked(gan)}
    assert all(id(v) in ids for v in d_opt.variables + g_opt.variables)
    assert np.float32(d_opt.learning_rate) == np.float32(g_opt.learning_rate)
    assert np.float32(d_opt.learning_rate) == np.float32(0.00015)
    assert (
        d_opt.counters()["skipped_steps"] == 3
        and g_opt.counters()["skipped_steps"] == 0
    )
