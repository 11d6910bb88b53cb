"""Many devices: every replica takes the same decision (tf.distribute's
MirroredStrategy on 2 logical CPUs; JAX's keras.distribution.DataParallel on
2 host devices). A fault on one replica's shard only must be rejected by all."""

import keras
import numpy as np
import pytest

import keras_nanguard as ng
from tests.helpers import BACKEND, all_finite, assert_bit_identical
from tests.models import tiny_mlp

LOSS = keras.losses.BinaryCrossentropy(from_logits=True)


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, 6)).astype("float32")
    y = (x[:, :1] > 0).astype("float32")
    return x, y


def _model(optimizer):
    keras.utils.set_random_seed(0)
    model = tiny_mlp()
    model.compile(optimizer=optimizer, loss=LOSS)
    return model


def _replicas(v):
    """Each replica's (device's) copy of a variable, as NumPy."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return (
            [
                np.array(t)
                for t in tf.distribute.get_strategy().experimental_local_results(
                    v.value
                )
            ]
            if tf.distribute.has_strategy()
            else [np.array(v.value)]
        )
    return [np.asarray(shard.data) for shard in v.value.addressable_shards]


def _int(v):
    # int(variable) fails for a tf.distribute MirroredVariable; this does not.
    return int(keras.ops.convert_to_numpy(v))


def _state(model):
    """Weights and the (inner) optimizer's state, per replica; SafeOptimizer's
    own counters are left out: they are meant to change on a rejection."""
    opt = model.optimizer
    variables = list(model.weights) + list(
        getattr(opt, "inner_optimizer", opt).variables
    )
    return [_replicas(v) for v in variables]


def _assert_replicas_agree(state):
    for copies in state:
        assert len(copies) == 2, "expected a copy on each of the two devices"

        for other in copies[1:]:
            assert copies[0].tobytes() == other.tobytes(), "replicas disagree"


@pytest.fixture
def strategy():
    if BACKEND == "tensorflow":
        import tensorflow as tf

        cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
        assert len(cpus) >= 2
        strategy = tf.distribute.MirroredStrategy(cpus[:2])
        with strategy.scope():
            yield strategy
    elif BACKEND == "jax":
        import jax

        assert len(jax.devices()) >= 2
        devices = keras.distribution.list_devices()[:2]
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=devices)
        )

        try:
            yield "data_parallel"
        finally:
            keras.distribution.set_distribution(None)
    else:
        pytest.skip(
            "Keras offers no multi-device data parallelism on the torch backend"
        )


@pytest.mark.parametrize("clip", [None, "adaptive"])
def test_a_fault_on_one_replica_is_rejected_by_every_replica(strategy, clip):
    x, y = _data()
    opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-2), clipnorm=1.0, clip=clip)
    model = _model(opt)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 48, 16)]
    model.train_on_batch(*batches[0])
    before = _state(model)
    _assert_replicas_agree(before)
    # One NaN in the second half of the batch: the second replica's shard only.
    bad_x = ng.faults.poison(batches[1][0], rows=[12])
    model.train_on_batch(bad_x, batches[1][1])
    after = _state(model)
    _assert_replicas_agree(after)
    for b, a in zip(before, after, strict=True):
        assert_bit_identical([b[0]], [a[0]], "state after the rejected step")
    c = opt.counters()
    assert (c["skipped_steps"], c["consecutive_skips"], _int(opt.iterations)) == (
        1,
        1,
        1,
    )
    model.train_on_batch(*batches[2])  # good steps go on
    _assert_replicas_agree(_state(model))
    assert _int(opt.iterations) == 2 and opt.counters()["consecutive_skips"] == 0
    assert all_finite(model.weights)


def test_quarantine_counts_and_names_the_rows_of_every_replica(strategy):
    """Bad rows on both replicas' shards: every replica leaves them out and
    agrees; each row is counted once, by its place in the global batch."""
    x, y = _data()
    opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-2))
    model = _model(opt)
    opt.attach(model, quarantine=True)
    bad = [2, 12, 37]  # replica 0 of batch 0, replica 1 of batches 0 and 2
    model.fit(ng.faults.poison(x, rows=bad), y, batch_size=16, shuffle=False, verbose=0)
    _assert_replicas_agree(_state(model))
    assert all_finite(model.weights)
    c = opt.counters()
    assert (c["quarantined_samples"], c["skipped_steps"], c["quarantine_steps"]) == (
        3,
        0,
        3,
    )
    assert [(step, row) for step, row, _ in opt.quarantined_rows()] == [
        (1, 2),
        (1, 12),
        (3, 5),
    ]


def test_fit_with_a_poisoned_shard_and_nan_guard_rollback(strategy):
    x, y = _data()
    y_bad = ng.faults.poison(y, rows=[28])  # batch 1, second replica's half
    model = _model(keras.optimizers.SGD(0.05))  # plain: only NaNGuard protects
    guard = ng.NaNGuard(verbose=0, check_every=1)
    model.fit(
        x, y_bad, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[guard]
    )
    assert [i.kind for i in guard.incidents] == ["nonfinite_loss"]
    assert guard.incidents[0].action.startswith("rolled back")
    assert all_finite(model.weights)
    _assert_replicas_agree(_state(model))
