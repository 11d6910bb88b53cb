"""One process of the JAX job of test_processes: 2 processes x 2 CPU devices,
`keras.distribution` across processes as multi-host jobs run it.

Usage: python jax_processes.py INDEX COUNT OUT_DIR PORT (tests/launch.py).
Each process feeds its own half of every global batch of 16 rows (rank 1's
half holds the faults) and writes what it saw to OUT_DIR/jax{INDEX}.json and
its weights to OUT_DIR/jax{INDEX}.npz; the test compares the processes.
"""

import faulthandler
import json
import os
import signal
import sys
import time

faulthandler.register(signal.SIGTERM)  # a hung process says where it was

index, count, out_dir, port = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:5]
os.environ["KERAS_BACKEND"] = "jax"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import keras  # noqa: E402
import numpy as np  # noqa: E402

keras.distribution.initialize(f"127.0.0.1:{port}", count, index)

import keras_nanguard as ng  # noqa: E402
from tests.workers.jax_data import GLOBAL, QUARANTINED, STEPS, global_data  # noqa: E402

HALF = GLOBAL // count
own = os.path.join(out_dir, f"files{index}")  # this process's files
found: dict = {}
weights: dict = {}
ONLY = os.environ.get("NG_SCENARIOS")  # a comma-separated subset, to debug
_started = time.perf_counter()


def scenario(name):
    """Whether to run the scenario `name`; says so, with the time so far."""
    wanted = ONLY is None or name in ONLY.split(",")
    if wanted:
        print(f"scenario: {name} ({time.perf_counter() - _started:.0f} s)", flush=True)
    return wanted


def data_parallel():
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(
            devices=keras.distribution.list_devices(), auto_shard_dataset=False
        )
    )


def model_of(optimizer, norm=True):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            *([keras.layers.BatchNormalization()] if norm else []),
            keras.layers.Dense(1),
        ]
    )
    model.compile(
        optimizer=optimizer, loss=keras.losses.BinaryCrossentropy(from_logits=True)
    )
    return model


def mine(x, y, without=()):
    """This process's half of each global batch, but the batches `without`."""
    keep = [b for b in range(STEPS) if b not in without]
    rows = np.concatenate(
        [
            np.arange(b * GLOBAL + index * HALF, b * GLOBAL + (index + 1) * HALF)
            for b in keep
        ]
    )
    return x[rows], y[rows]


def rank1(batches):
    """A bad row in rank 1's half of each of `batches`."""
    return [(b, HALF + 3) for b in batches]


def local(variables):
    return np.concatenate(
        [np.asarray(v.value.addressable_shards[0].data).ravel() for v in variables]
    )


def fit(model, x, y, guard=None, epochs=1):
    cbs = [] if guard is None else [guard]
    return model.fit(
        x, y, batch_size=HALF, epochs=epochs, shuffle=False, verbose=0, callbacks=cbs
    )


def incidents(guard):
    return [[i.kind, i.step, i.action] for i in guard.incidents]


def s_transaction():
    """The whole-model transaction: SafeOptimizer as it comes, attached."""
    data_parallel()
    x, y = global_data(rank1([5]))
    model = model_of(ng.SafeOptimizer(keras.optimizers.Adam(1e-2)))  # defaults
    model.optimizer.attach(model)
    fit(model, *mine(x, y))
    # The same attached step without the bad batch. Plain Keras's step is
    # another XLA program, whose moving averages can differ in the last bit.
    clean = model_of(ng.SafeOptimizer(keras.optimizers.Adam(1e-2)))
    clean.optimizer.attach(clean)
    fit(clean, *mine(x, y, without=[5]))
    plain = model_of(keras.optimizers.Adam(1e-2))
    fit(plain, *mine(x, y, without=[5]))
    weights["transaction"] = local(model.weights)
    weights["transaction_clean"] = local(clean.weights)
    weights["transaction_trained"] = local(model.trainable_weights)
    weights["transaction_plain_trained"] = local(plain.trainable_weights)
    found["transaction_skipped"] = int(model.optimizer.counters()["skipped_steps"])


def s_graded_handling():
    """clip="adaptive", attached, a bad batch: the same thresholds and bounds
    on every process, and the job without the bad batch."""
    data_parallel()
    x, y = global_data(rank1([5]))

    def graded():
        model = model_of(ng.SafeOptimizer(keras.optimizers.Adam(0.3), clip="adaptive"))
        model.optimizer.attach(model)
        return model

    model = graded()
    fit(model, *mine(x, y), epochs=2)
    clean = graded()
    fit(clean, *mine(x, y, without=[5]), epochs=2)
    weights["graded"] = local(model.weights)
    weights["graded_clean"] = local(clean.weights)
    counters = model.optimizer.counters()
    for key in ("skipped_steps", "clipped_steps", "bounded_update_steps"):
        found[f"graded_{key}"] = int(counters[key])
    found["graded_thresholds"] = list(model.optimizer.clip_thresholds().values())


def s_nanguard_as_it_comes():
    """NaNGuard, as it comes."""
    x, y = global_data(rank1([5, 6, 7]))
    model = model_of(ng.SafeOptimizer(keras.optimizers.Adam(1e-2)))
    guard = ng.NaNGuard(
        verbose=0,
        directory=os.path.join(own, "snapshots"),
        report_path=os.path.join(own, "report.json"),
    )
    history = fit(model, *mine(x, y), guard=guard, epochs=2)
    found["guard_incidents"] = incidents(guard)
    found["guard_rollbacks"] = guard.rollbacks
    found["guard_loss"] = history.history["loss"]
    found["guard_cause"] = guard.explain().cause
    found["guard_lr"] = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
    weights["guard"] = local(model.weights)


def s_a_loss_spike_rolled_back():
    """A loss spike, rolled back."""
    x, y = global_data()
    y[12 * GLOBAL : 14 * GLOBAL] *= 1e4  # two global batches of huge targets
    model = model_of(ng.SafeOptimizer(keras.optimizers.SGD(1e-3)))
    guard = ng.NaNGuard(
        verbose=0, loss_spike_sigma=4.0, loss_spike_window=8, snapshot_every=2
    )
    fit(model, *mine(x, y), guard=guard)
    found["spike_incidents"] = incidents(guard)
    weights["spike"] = local(model.weights)


def s_raise_and_stop():
    """Raise and stop."""
    for policy in ("raise", "stop"):
        x, y = global_data(rank1([9, 10, 11]))
        model = model_of(ng.SafeOptimizer(keras.optimizers.Adam(1e-2)))
        guard = ng.NaNGuard(policy=policy, verbose=0, snapshot_every=4)
        try:
            fit(model, *mine(x, y), guard=guard)
            found[f"{policy}_raised"] = None
        except ng.NonFiniteError as e:
            found[f"{policy}_raised"] = type(e).__name__
        found[f"{policy}_incidents"] = incidents(guard)
        weights[policy] = local(model.weights)


def s_the_quarantine_global_rows():
    """The quarantine, global rows."""
    x, y = global_data(QUARANTINED)
    model = model_of(ng.SafeOptimizer(keras.optimizers.Adam(1e-2)), norm=False)
    guard = ng.NaNGuard(verbose=0, quarantine=True, snapshot_every=5)
    fit(model, *mine(x, y), guard=guard)
    found["quarantine_incidents"] = [i[0] for i in incidents(guard)]
    found["quarantined"] = [[r.step, r.row] for r in guard.quarantined]
    weights["quarantine"] = local(model.weights)


def s_the_jax_guide_s_stateless_loop_safeoptimizer():
    """The JAX guide's stateless loop, SafeOptimizer."""
    x, y = global_data(rank1([4]))

    def stateless_loop(optimizer, without=()):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(1),
            ]
        )
        loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
        optimizer.build(model.trainable_variables)

        def compute_loss(tv, ntv, xb, yb):
            y_pred, ntv = model.stateless_call(tv, ntv, xb, training=True)
            return loss_fn(yb, y_pred), ntv

        grad_fn = jax.value_and_grad(compute_loss, has_aux=True)

        @jax.jit
        def train_step(state, xb, yb):
            tv, ntv, ov = state
            (loss, ntv), grads = grad_fn(tv, ntv, xb, yb)
            tv, ov = optimizer.stateless_apply(ov, grads, tv)
            return loss, (tv, ntv, ov)

        dist = keras.distribution.distribution()
        x_layout = dist.get_data_layout((GLOBAL, 6)).backend_layout
        y_layout = dist.get_data_layout((GLOBAL, 1)).backend_layout
        state = (
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            [v.value for v in optimizer.variables],
        )
        xs, ys = mine(x, y, without)
        for i in range(len(xs) // HALF):
            part = slice(i * HALF, (i + 1) * HALF)
            xb = jax.make_array_from_process_local_data(x_layout, xs[part])
            yb = jax.make_array_from_process_local_data(y_layout, ys[part])
            _, state = train_step(state, xb, yb)
        for v, value in zip(optimizer.variables, state[2], strict=True):
            v.assign(value)
        return np.concatenate(
            [np.asarray(a.addressable_shards[0].data).ravel() for a in state[0]]
        )

    safe = ng.SafeOptimizer(keras.optimizers.Adam(1e-2))
    weights["loop"] = stateless_loop(safe)
    weights["loop_clean"] = stateless_loop(keras.optimizers.Adam(1e-2), without=[4])
    found["loop_skipped"] = int(safe.counters()["skipped_steps"])


def s_a_kernel_split_across_processes_modelparallel():
    """A kernel split across processes (ModelParallel)."""
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((count, 2), ["model", "batch"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*/wide/kernel"] = (None, "model")  # half the units each
    layout_map[".*/wide/bias"] = ("model",)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch", auto_shard_dataset=False
        )
    )
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu", name="wide"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=ng.SafeOptimizer(keras.optimizers.Adam(1e-3)), loss="mse")
    rng = np.random.default_rng(1)
    xm = rng.standard_normal((STEPS * GLOBAL, 64)).astype("float32")
    ym = xm[:, :1].copy()
    ym[10 * GLOBAL : 13 * GLOBAL] = np.nan  # three batches in a row: trouble
    guard = ng.NaNGuard(policy="stop", verbose=0, snapshot_every=5)
    found["split_refused"] = None
    try:  # the files: no process holds the whole state
        model.fit(
            xm,
            ym,
            batch_size=GLOBAL,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[ng.NaNGuard(directory=os.path.join(own, "split"))],
        )
    except ValueError as e:
        found["split_refused"] = str(e)
    model.fit(
        xm, ym, batch_size=GLOBAL, epochs=1, shuffle=False, verbose=0, callbacks=[guard]
    )
    snap = guard.snapshot

    def shards(array):
        return {
            s.device.id: np.asarray(s.data).tobytes() for s in array.addressable_shards
        }

    def own_bytes(values):
        return sum(s.data.nbytes for v in values for s in v.addressable_shards)

    from keras_nanguard import snapshots

    variables = snapshots.tracked(model)
    kernel = model.layers[0].kernel
    found["split_kernel_whole_here"] = bool(kernel.value.is_fully_addressable)
    found["split_kernel_spec"] = str(kernel.value.sharding.spec)
    found["split_snapshot_bytes"] = own_bytes(snap.values)
    found["split_own_bytes"] = own_bytes([v.value for v in variables])
    found["split_whole_bytes"] = sum(int(np.prod(v.shape)) * 4 for v in variables)
    found["split_incidents"] = incidents(guard)
    history = snapshots.unchecked(model)  # counters and rates: not restored
    found["split_restored"] = all(  # every shard back on its device
        shards(v.value) == shards(x)
        for v, x in zip(variables, snap.values, strict=True)
        if id(v) not in history
    )
    found["split_snapshot_step"] = snap.step


def s_settings_that_differ_refused():
    """Settings that differ: refused."""
    data_parallel()
    x, y = global_data()
    model = model_of(ng.SafeOptimizer(keras.optimizers.Adam(1e-2)))
    try:
        fit(model, *mine(x, y), guard=ng.NaNGuard(verbose=0, max_rejections=3 + index))
        found["different_settings"] = None
    except ValueError as e:
        found["different_settings"] = str(e)


if scenario("the whole-model transaction"):
    s_transaction()
if scenario("NaNGuard, as it comes"):
    s_nanguard_as_it_comes()
if scenario("the graded handling (clip='adaptive')"):
    s_graded_handling()
if scenario("a loss spike, rolled back"):
    s_a_loss_spike_rolled_back()
if scenario("raise and stop"):
    s_raise_and_stop()
if scenario("the quarantine, global rows"):
    s_the_quarantine_global_rows()
if scenario("the JAX guide's stateless loop, SafeOptimizer"):
    s_the_jax_guide_s_stateless_loop_safeoptimizer()
if scenario("a kernel split across processes (ModelParallel)"):
    s_a_kernel_split_across_processes_modelparallel()
if scenario("settings that differ: refused"):
    s_settings_that_differ_refused()

with open(os.path.join(out_dir, f"jax{index}.json"), "w") as f:
    json.dump(found, f)
np.savez(os.path.join(out_dir, f"jax{index}.npz"), **weights)
