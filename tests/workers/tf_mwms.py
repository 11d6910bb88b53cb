"""One worker of the MultiWorkerMirroredStrategy test (run by test_distributed).

Usage: python tf_mwms.py INDEX COUNT OUT_DIR PORT0 PORT1 (tests/launch.py).
Each worker trains on
its own batches; worker 1's second batch holds a NaN. Every worker writes
its weights and counters after each step to OUT_DIR/worker{INDEX}.npz.
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
                loss = (
                    loss_fn(y, model(x, training=True)) / strategy.num_replicas_in_sync
                )
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
    np.savez(os.path.join(out_dir, f"worker{index}.npz"), **record)


if __name__ == "__main__":
    main()
