"""One worker of the MultiWorkerMirroredStrategy job of test_processes: the
custom loop of `strategy.run` (Keras's own `fit` fails under this strategy).

Usage: python tf_mwms.py INDEX COUNT OUT_DIR PORT0 PORT1 (tests/launch.py).
Each worker trains on its own batches; worker 1's second batch holds a NaN.
Every worker writes its weights and counters after each step to
OUT_DIR/worker{INDEX}.npz. Then the quarantine: bad rows in both workers'
batches, and the same model trained by this worker alone on the global
batches without them (`quarantine_*` in the same file).
"""

import json
import os
import sys


def main() -> None:
    index, out_dir, port0, port1 = int(sys.argv[1]), sys.argv[3], *sys.argv[4:6]
    os.environ["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": [f"localhost:{port0}", f"localhost:{port1}"]},
            "task": {"type": "worker", "index": index},
        }
    )
    os.environ["KERAS_BACKEND"] = "tensorflow"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    import keras
    import numpy as np
    import tensorflow as tf

    import keras_nanguard as ng

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(1),
            ]
        )
        opt = ng.SafeOptimizer(keras.optimizers.Adam(1e-2), clipnorm=1.0)
        opt.build(model.trainable_variables)
    loss_fn = keras.losses.BinaryCrossentropy(
        from_logits=True, reduction="sum_over_batch_size"
    )

    rng = np.random.default_rng(index)
    batches = [rng.standard_normal((8, 6)).astype("float32") for _ in range(3)]
    if index == 1:
        batches[1][3, 2] = np.nan  # only this worker's shard of step 1

    @tf.function
    def step(x):
        def replica_step(x):
            y = tf.cast(x[:, :1] > 0, "float32")
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))  # divides by replicas
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

        strategy.run(replica_step, args=(x,))

    record = {}
    for i, x in enumerate(batches):
        step(tf.constant(x))
        c = opt.counters()
        record[f"step{i}_weights"] = np.concatenate(
            [w.ravel() for w in model.get_weights()]
        )
        record[f"step{i}_skipped"] = np.array(c["skipped_steps"])
        record[f"step{i}_iterations"] = np.array(
            int(keras.ops.convert_to_numpy(opt.iterations))
        )
    record.update(quarantine(strategy, index))
    np.savez(os.path.join(out_dir, f"worker{index}.npz"), **record)


def quarantine(strategy, index):
    """Rows of the global batch (worker 0's 8, then worker 1's) given a NaN:
    step 1, two of worker 1's; step 2, one of each."""
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_nanguard as ng

    bad = [(1, 9), (1, 13), (2, 2), (2, 10)]
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 16, 6)).astype("float32")
    for step, row in bad:
        x[step, row, 2] = np.nan
    y = (x[..., :1] > 0).astype("float32")

    def per_row(y_true, y_pred):
        return keras.losses.binary_crossentropy(y_true, y_pred, from_logits=True)

    def model_and_optimizer():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(1),
            ]
        )
        opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1))  # no Adam: exact
        opt.build(model.trainable_variables)
        return model, opt

    with strategy.scope():
        model, opt = model_and_optimizer()

    @tf.function
    def step(xb, yb):
        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                batch = opt.quarantine(xb, yb)
                # A Keras loss divides by the replicas itself, under a strategy.
                loss = batch.loss(per_row, model(batch.x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

        strategy.run(replica_step, args=(xb, yb))

    mine = slice(index * 8, (index + 1) * 8)
    for xb, yb in zip(x, y, strict=True):
        step(tf.constant(xb[mine]), tf.constant(yb[mine]))
    alone, alone_opt = model_and_optimizer()
    for s, (xb, yb) in enumerate(zip(x, y, strict=True)):
        keep = [r for r in range(16) if (s, r) not in bad]
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(per_row(yb[keep], alone(xb[keep], training=True)))
        grads = tape.gradient(loss, alone.trainable_variables)
        alone_opt.apply_gradients(zip(grads, alone.trainable_variables, strict=True))

    def flat(m):
        return np.concatenate([w.ravel() for w in m.get_weights()])

    counters = opt.counters()
    return {
        "quarantine_weights": flat(model),
        "quarantine_alone": flat(alone),
        "quarantine_samples": np.array(counters["quarantined_samples"]),
        "quarantine_skipped": np.array(counters["skipped_steps"]),
        "quarantine_rows": np.array([r[:2] for r in opt.quarantined_rows()]),
    }


if __name__ == "__main__":
    main()
