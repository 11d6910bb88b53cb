"""One process of the torch job of test_processes: 2 gloo processes, the
custom loop around `DistributedDataParallel` of Keras's guide to distributed
training with PyTorch, with `ng.SafeOptimizer` as its optimizer.

Usage: python torch_ddp.py INDEX COUNT OUT_DIR PORT (tests/launch.py).
Each process feeds its own half of every global batch of 16 rows (rank 1's
half holds the faults) and writes what it saw to OUT_DIR/torch{INDEX}.json
and its weights to OUT_DIR/torch{INDEX}.npz; the test compares the processes
and the runs without the faults, which each process trains alone.
"""

import faulthandler
import json
import os
import signal
import sys

faulthandler.register(signal.SIGTERM)  # a hung process says where it was

index, count, out_dir, port = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:5]
os.environ["KERAS_BACKEND"] = "torch"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=count
)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import keras_nanguard as ng  # noqa: E402

GLOBAL, STEPS = 16, 12
HALF = GLOBAL // count
found: dict = {}
weights: dict = {}


def model_of():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1),
        ]
    )


def global_data(bad_rows=(), huge=()):
    """Global batches of 16 rows; `bad_rows`: (batch, row) given a NaN;
    `huge`: (batch, row) whose target is 1e4 times too large."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS * GLOBAL, 6)).astype("float32")
    y = x[:, :1] * 2.0 - x[:, 1:2]
    for b, r in bad_rows:
        x[b * GLOBAL + r, 2] = np.nan
    for b, r in huge:
        y[b * GLOBAL + r] *= 1e4
    return x, y


def squared(y_true, y_pred):
    """The per-row loss."""
    return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


def ddp_loop(optimizer, x, y, quarantine=False, without=()):
    """The guide's loop: DDP around the model, this process's half of each
    global batch but the batches `without`, `loss.backward()`, the optimizer
    applies the gradients."""
    model = model_of()
    optimizer.build(model.trainable_variables)
    ddp = DistributedDataParallel(model)
    for b in range(STEPS):
        if b in without:
            continue
        rows = slice(b * GLOBAL + index * HALF, b * GLOBAL + (index + 1) * HALF)
        xb, yb = torch.from_numpy(x[rows]), torch.from_numpy(y[rows])
        if quarantine:
            batch = optimizer.quarantine(xb, yb)
            loss = batch.loss(squared, ddp(batch.x))
        else:
            loss = keras.ops.mean(squared(yb, ddp(xb)))
        model.zero_grad()
        loss.backward()
        optimizer.apply(
            [v.value.grad for v in model.trainable_variables],
            model.trainable_variables,
        )
    return model


def alone(optimizer, batches):
    """The same model trained by this process alone on whole `batches`."""
    model = model_of()
    optimizer.build(model.trainable_variables)
    for xb, yb in batches:
        loss = keras.ops.mean(
            squared(torch.from_numpy(yb), model(torch.from_numpy(xb)))
        )
        model.zero_grad()
        loss.backward()
        optimizer.apply(
            [v.value.grad for v in model.trainable_variables],
            model.trainable_variables,
        )
    return model


def flat(model):
    return np.concatenate(
        [keras.ops.convert_to_numpy(w).ravel() for w in model.weights]
    )


def whole_batches(x, y, without=(), rows_out=()):
    """The global batches, but the batches `without` and the rows `rows_out`."""
    out = []
    for b in range(STEPS):
        if b in without:
            continue
        keep = [r for r in range(GLOBAL) if (b, r) not in rows_out]
        out.append((x[b * GLOBAL + np.array(keep)], y[b * GLOBAL + np.array(keep)]))
    return out


# ------------------- a NaN row and a spike in rank 1's half, SafeOptimizer
print("scenario: a bad row and a spike, SafeOptimizer as it comes", flush=True)
x, y = global_data(bad_rows=[(4, HALF + 3)], huge=[(9, HALF + 1)])
safe = ng.SafeOptimizer(keras.optimizers.Adam(1e-2), spike_factor=10.0, spike_window=4)
model = ddp_loop(safe, x, y)
counters = safe.counters()
found["skipped_steps"] = int(counters["skipped_steps"])
found["spike_steps"] = int(counters["spike_steps"])
found["iterations"] = int(keras.ops.convert_to_numpy(safe.iterations))
weights["safe"] = flat(model)
clean = ng.SafeOptimizer(keras.optimizers.Adam(1e-2), spike_factor=10.0, spike_window=4)
weights["safe_clean"] = flat(ddp_loop(clean, x, y, without=[4, 9]))
alone_opt = ng.SafeOptimizer(
    keras.optimizers.Adam(1e-2), spike_factor=10.0, spike_window=4
)
weights["safe_alone"] = flat(alone(alone_opt, whole_batches(x, y, without=[4, 9])))

# ---------------------------- the graded handling (clip="adaptive") under DDP
print("scenario: clip='adaptive', a bad row", flush=True)
x, y = global_data(bad_rows=[(4, HALF + 3)])


def graded():
    return ng.SafeOptimizer(keras.optimizers.Adam(0.3), clip="adaptive")


safe = graded()
model = ddp_loop(safe, x, y)
counters = safe.counters()
for key in ("skipped_steps", "clipped_steps", "bounded_update_steps"):
    found[f"graded_{key}"] = int(counters[key])
found["graded_threshold"] = float(counters["clip_threshold"])
weights["graded"] = flat(model)
weights["graded_alone"] = flat(alone(graded(), whole_batches(x, y, without=[4])))

# ---------------------------------------- the quarantine, global rows
print("scenario: the quarantine, global rows", flush=True)
bad = [(3, HALF + 1), (3, HALF + 5), (8, 2), (8, HALF + 2)]
x, y = global_data(bad_rows=bad)
safe = ng.SafeOptimizer(keras.optimizers.Adam(1e-2))
model = ddp_loop(safe, x, y, quarantine=True)
found["quarantined_samples"] = int(safe.counters()["quarantined_samples"])
found["quarantined"] = [list(r) for r in safe.quarantined_rows()]
found["quarantine_skipped"] = int(safe.counters()["skipped_steps"])
weights["quarantine"] = flat(model)
plain = ng.SafeOptimizer(keras.optimizers.Adam(1e-2))
weights["quarantine_alone"] = flat(alone(plain, whole_batches(x, y, rows_out=bad)))

# ------------------------------------------------ NaNGuard: a clear error
print("scenario: NaNGuard under DDP: a clear error", flush=True)
model = model_of()
model.compile(optimizer=ng.SafeOptimizer(keras.optimizers.Adam(1e-2)), loss="mse")
try:
    model.fit(x[:GLOBAL], y[:GLOBAL], verbose=0, callbacks=[ng.NaNGuard(verbose=0)])
    found["nan_guard_error"] = None
except RuntimeError as e:
    found["nan_guard_error"] = str(e)

with open(os.path.join(out_dir, f"torch{index}.json"), "w") as f:
    json.dump(found, f)
np.savez(os.path.join(out_dir, f"torch{index}.npz"), **weights)
dist.destroy_process_group()
