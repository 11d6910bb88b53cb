"""Last-known-good snapshots of a model and its optimizer, in memory or on disk.

A snapshot holds copies of every model weight (trainable and not), every
optimizer variable and the state of every `SeedGenerator` (dropout's random
stream, which `model.weights` leaves out and `model.variables` holds), kept
only when all of them are finite. `capture` copies
them on the device (JAX, torch, when the device has room: at memory speed,
without waiting for the steps in flight) and checks their finiteness there;
`verify` reads that one flag later. `take` copies them to the host and checks
them at once (TensorFlow, or no room on the device). Written to disk, it goes
to a temporary file in the same directory which is then renamed over the
previous one, so a crash mid-write leaves the previous snapshot loadable.
`load_into` loads a snapshot file into a model; `save_weights_file` writes a
snapshot as a plain Keras weights file (`model.load_weights` reads it),
beside that file. Where values live (host reads, device copies, device
room) is `_host_device.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import zipfile
from typing import Any

import keras
import numpy as np

from keras_nanguard import _rates as rates
from keras_nanguard._atomic import atomic_path
from keras_nanguard._backend import current as backend
from keras_nanguard._host_device import (
    device_copies,
    device_room,
    held_value,
    host_finite,
    host_view,
    to_host,
)
from keras_nanguard.ops import all_finite
from keras_nanguard.safe_optimizer import find_safe_optimizer

SNAPSHOT_FILE = "nanguard_snapshot.npz"


def sync_from_device(model: keras.Model) -> None:
    """Makes the model's variables current (JAX keeps them apart during fit)."""
    backend.sync_state(model)


def seed_states(model: keras.Model) -> list[keras.Variable]:
    """The model's `SeedGenerator` states: in `model.variables`, not in
    `model.weights` (nor in a `.weights.h5` file)."""
    weights = {id(v) for v in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def model_optimizers(model: keras.Model) -> dict[str, keras.optimizers.Optimizer]:
    """The optimizers `model` trains with, by the attribute that holds them:
    `model.optimizer`, then any the model holds itself (a GAN of Keras's
    examples compiles with `d_optimizer` and `g_optimizer` and calls
    `super().compile()` with none), each once."""
    found: dict[str, keras.optimizers.Optimizer] = {}
    seen: set[int] = set()
    held = [("optimizer", getattr(model, "optimizer", None))]
    held += [(k, v) for k, v in vars(model).items() if not k.startswith("_")]
    for name, value in held:
        if isinstance(value, keras.optimizers.Optimizer) and id(value) not in seen:
            found[name] = value
            seen.add(id(value))
    return found


def unbuilt_optimizers(model: keras.Model) -> list[str]:
    """The optimizers the model holds besides `model.optimizer` that are not
    built yet: they make their variables at their first step, so the state
    to snapshot is known only after it."""
    return [
        name
        for name, opt in model_optimizers(model).items()
        if name != "optimizer" and not opt.built
    ]


def optimizer_variables(model: keras.Model) -> list[keras.Variable]:
    """The variables of every optimizer the model holds (built), each once."""
    variables: list[keras.Variable] = []
    seen: set[int] = set()
    for optimizer in model_optimizers(model).values():
        if optimizer.built:
            new = [v for v in optimizer.variables if id(v) not in seen]
            seen.update(id(v) for v in new)
            variables += new
    return variables


def tracked(model: keras.Model) -> list[keras.Variable]:
    """What a snapshot copies, in the order of `Snapshot.values`: the
    weights, the optimizers' variables, the random streams."""
    return list(model.weights) + optimizer_variables(model) + seed_states(model)


def unchecked(model: keras.Model) -> set[int]:
    """The ids of the tracked variables that a restore leaves as they are."""
    # What a restore leaves as it is, a snapshot does not check: the report
    # values, and the learning rates (a setting callbacks change, e.g. a
    # `LearningRateSpike` to inf for one step, which SafeOptimizer rejects).
    skip: set[int] = set()
    for optimizer in model_optimizers(model).values():
        skip |= _reports(optimizer)
        skip |= {id(lr) for lr in rates.rate_variables(optimizer)}
    return skip


def _reports(optimizer: Any) -> set[int]:
    # SafeOptimizer's report values (the flight recorder, ...) are not state.
    safe = find_safe_optimizer(optimizer)
    if safe is None:
        return set()
    reports = safe._counters.history_variables() + safe._recorder.variables()
    if safe._clip_state is not None:
        reports += safe._clip_state.history_variables()
    return {id(v) for v in reports}


def optimizer_state(optimizer: keras.optimizers.Optimizer) -> list[keras.Variable]:
    """The optimizer's variables that are state, without SafeOptimizer's
    report values (its counters of what happened, its flight recorder)."""
    skip = _reports(optimizer)
    return [v for v in optimizer.variables if id(v) not in skip]


def variable_name(v: keras.Variable) -> str:
    return getattr(v, "path", None) or v.name


def learning_rate_variable(model: keras.Model) -> keras.Variable | None:
    """The optimizer's learning-rate variable; `None` for a schedule, and
    for a MultiOptimizer (its sub-optimizers' rates are among the
    optimizer's variables, which a restore leaves as they are)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or rates.is_multi(optimizer):
        return None
    lr = getattr(optimizer, "learning_rate", None)
    return lr if isinstance(lr, keras.Variable) else None  # not a schedule


def learning_rate(model: keras.Model) -> float | None:
    """The optimizer's learning rate (host read); `None` for a schedule."""
    lr = learning_rate_variable(model)
    return None if lr is None else float(host_view(lr))


@dataclasses.dataclass
class Snapshot:
    """Copies of a model's weights and optimizer variables.

    `values` are host arrays, or device arrays when `finite` is set: the
    device flag of their finiteness, not yet read (see `verify`). The first
    `n_weights` values are the model's weights (`model.weights`), the last
    `n_seeds` its `SeedGenerator` states (`seed_states`), those between its
    optimizer's variables. `learning_rate` is the optimizer's
    learning rate to go on with (`None` with a schedule): NaNGuard keeps it
    current when it lowers the rate, and `NaNGuard.restore` sets it.
    """

    values: list[np.ndarray]
    names: list[str]
    epoch: int
    step: int
    seconds: float = 0.0
    n_weights: int | None = None
    n_seeds: int = 0  # files of keras-nanguard <= 0.2 hold none
    learning_rate: float | None = None
    finite: Any = dataclasses.field(default=None, repr=False)
    on_device: bool = False
    lr_index: int | None = dataclasses.field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(int(v.nbytes) for v in self.values)


def nonfinite_variables(variables: list[keras.Variable]) -> list[str]:
    """Names of the `variables` holding NaN or inf (host read)."""
    return [variable_name(v) for v in variables if not host_finite(host_view(v))]


def nonfinite_names(model: keras.Model) -> list[str]:
    """Names of the model/optimizer variables holding NaN or inf (host read)."""
    skip = unchecked(model)
    return nonfinite_variables([v for v in tracked(model) if id(v) not in skip])


def take(
    model: keras.Model, epoch: int, step: int, into: Snapshot | None = None
) -> tuple[Snapshot | None, list[str]]:
    """A snapshot if every variable is finite, else `(None, bad_names)`.

    With `into` (a previous snapshot of the same model), its arrays are
    overwritten, once every variable has been verified finite: reusing the
    buffers avoids allocating (and page-faulting) the whole state again.
    """
    start = time.perf_counter()
    variables = tracked(model)
    skip = unchecked(model)
    views = [host_view(v) for v in variables]
    lr = learning_rate_variable(model)
    lr_value = next(
        (float(view) for v, view in zip(variables, views, strict=True) if v is lr), None
    )
    bad = [
        variable_name(v)
        for v, view in zip(variables, views, strict=True)
        if id(v) not in skip and not host_finite(view)
    ]
    if bad:
        return None, bad
    names = [variable_name(v) for v in variables]
    if (
        into is not None
        and into.names == names
        and all(
            a.shape == b.shape and a.dtype == b.dtype
            for a, b in zip(into.values, views, strict=True)
        )
    ):
        for buffer, view in zip(into.values, views, strict=True):
            np.copyto(buffer, view)
        snap = into
        snap.epoch, snap.step = epoch, step
    else:
        snap = Snapshot(
            [np.array(view, copy=True) for view in views], names, epoch, step
        )
    snap.n_weights, snap.learning_rate = len(model.weights), lr_value
    snap.n_seeds = len(seed_states(model))
    snap.seconds = time.perf_counter() - start
    return snap, []


def capture(
    model: keras.Model, epoch: int, step: int, into: Snapshot | None = None
) -> tuple[Snapshot | None, list[str] | None]:
    """A snapshot, copied on the device where it fits, else by `take`.

    Returns `take`'s answer for a host snapshot; for a device one
    `(snapshot, None)`: its finiteness is known only after `verify`. With
    `into` (torch) its device buffers are overwritten instead of allocated.
    The caller syncs JAX state first.
    """
    variables = tracked(model)
    # A value split across processes stays on the devices: each process
    # keeps its own shards.
    if not device_room(variables) and backend.held_whole(variables):
        host_into = into if into is not None and not into.on_device else None
        return take(model, epoch, step, into=host_into)
    start = time.perf_counter()
    names = [variable_name(v) for v in variables]
    reuse = (
        backend.REUSES_DEVICE_BUFFERS
        and into is not None
        and into.on_device
        and into.names == names
        and all(
            a.shape == v.value.shape and a.dtype == v.value.dtype
            for a, v in zip(into.values, variables, strict=True)
        )
    )
    if reuse and into is not None:
        backend.copy_into(into.values, [v.value for v in variables])
        values = into.values
    else:
        values = device_copies([v.value for v in variables])
    skip = unchecked(model)
    checked = [x for v, x in zip(variables, values, strict=True) if id(v) not in skip]
    snap = Snapshot(
        values,
        names,
        epoch,
        step,
        n_weights=len(model.weights),
        n_seeds=len(seed_states(model)),
    )
    snap.finite, snap.on_device = all_finite(checked), True
    lr = learning_rate_variable(model)
    snap.lr_index = next((i for i, v in enumerate(variables) if v is lr), None)
    snap.seconds = time.perf_counter() - start
    return snap, None


def verify(snap: Snapshot) -> list[str]:
    """Reads a device snapshot's finiteness flag (once); returns the names of
    its non-finite values (none for a host snapshot, checked when taken)."""
    if snap.finite is None:
        return []
    start = time.perf_counter()
    ok = bool(keras.ops.convert_to_numpy(snap.finite))
    snap.finite = None
    if snap.lr_index is not None:  # read with the flag
        snap.learning_rate = float(to_host(snap.values[snap.lr_index]))
    snap.seconds += time.perf_counter() - start
    if ok:
        return []
    return [
        n
        for n, x in zip(snap.names, snap.values, strict=True)
        if not host_finite(to_host(x))
    ]


def host_values(snap: Snapshot) -> list[np.ndarray]:
    """Copies of the snapshot's values on the host."""
    return [np.array(to_host(v), copy=True) for v in snap.values]


def _matching(model: keras.Model, snapshot: Snapshot) -> list[keras.Variable]:
    """The variables of `model` and its optimizers, which `snapshot` holds
    one value for each of."""
    variables = tracked(model)
    if len(variables) != len(snapshot.values):
        raise ValueError(
            "The snapshot does not match the model: it has "
            f"{len(snapshot.values)} variables, the model and optimizer have "
            f"{len(variables)}."
        )
    return variables


def restore(model: keras.Model, snapshot: Snapshot) -> None:
    """Writes `snapshot` back into the model and its optimizer.

    The learning rate is left as it is (a policy may have lowered it), and so
    are SafeOptimizer's cumulative counters, which are history, not state.
    """
    variables = _matching(model, snapshot)
    assign(model, variables, snapshot.values)


def assign(model: keras.Model, variables: list, values: list[np.ndarray]) -> None:
    """Writes `values` into `variables`, but for those `unchecked` leaves."""
    keep = unchecked(model)
    for v, value in zip(variables, values, strict=True):
        if id(v) not in keep:
            v.assign(backend.assignable(value, v))


def save(snapshot: Snapshot, directory: str | os.PathLike) -> str:
    """Writes `snapshot` atomically into `directory`; returns the file path."""
    directory = os.fspath(directory)
    path = os.path.join(directory, SNAPSHOT_FILE)
    meta = {
        "names": snapshot.names,
        "epoch": snapshot.epoch,
        "step": snapshot.step,
        "n_weights": snapshot.n_weights,
        "n_seeds": snapshot.n_seeds,
        "learning_rate": snapshot.learning_rate,
    }
    arrays: dict[str, Any] = {
        f"v{i}": to_host(v) for i, v in enumerate(snapshot.values)
    }
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    with atomic_path(path, ".tmp") as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)
    return path


def load(directory: str | os.PathLike) -> Snapshot:
    """Reads the snapshot that `save` wrote into `directory`.

    Example:

    >>> import tempfile, numpy as np
    >>> from keras_nanguard import snapshots
    >>> d = tempfile.mkdtemp()
    >>> _ = snapshots.save(snapshots.Snapshot([np.ones(2)], ["w"], 0, 5), d)
    >>> snapshots.load(d).step
    5
    """
    path = os.path.join(os.fspath(directory), SNAPSHOT_FILE)
    try:
        with np.load(path) as data:
            meta = json.loads(bytes(data["__meta__"]).decode())
            values = [data[f"v{i}"] for i in range(len(meta["names"]))]
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as err:
        raise ValueError(
            f"No readable keras-nanguard snapshot in {directory!s}. Received: "
            f"{path} ({err})"
        ) from err
    return Snapshot(
        values,
        meta["names"],
        meta["epoch"],
        meta["step"],
        n_weights=meta.get("n_weights"),
        n_seeds=meta.get("n_seeds", 0),
        learning_rate=meta.get("learning_rate"),
    )


# A snapshot and a model across files: `load_into` loads NaNGuard's
# snapshot file into a model; `save_weights_file` writes a snapshot as a plain
# Keras weights file (`model.load_weights` reads it), beside that file.
#
# The weights file is written with the public `model.save_weights`: the
# snapshot's values are put into the model's variables for the write, and the
# values the model had are put back after it, also on error. It goes to a
# temporary file in the same directory, then is renamed over the previous one.

WEIGHTS_FILE = "nanguard_snapshot.weights.h5"


def load_into(model: keras.Model, directory: str | os.PathLike) -> Snapshot:
    """Loads the snapshot in `directory` into `model` and returns it.

    The model's weights and random streams (`SeedGenerator` states; a file
    written before they were kept has none, and leaves them as they are)
    always; its optimizer's variables and learning rate when the model has
    an optimizer (it is built if needed). A model with no optimizer (not
    compiled, e.g. for inference) gets no optimizer state. Nothing is
    written unless every shape matches.
    """
    snap = load(directory)
    if not model.built:
        raise ValueError(
            "`model` is not built, so it has no weights to load the snapshot "
            "into. Call it on a batch or call `model.build(input_shape)` first. "
            f"Received: model={model.name!r} (built=False)"
        )
    weights = list(model.weights)
    # A file from before `n_weights` was stored: trust the shapes.
    n = len(weights) if snap.n_weights is None else snap.n_weights
    n_optimizer = len(snap.values) - n - snap.n_seeds
    variables, values = list(weights), list(snap.values[:n])
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and n_optimizer > 0:
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        variables += optimizer_variables(model)
        values += snap.values[n : n + n_optimizer]
    if snap.n_seeds:
        variables += seed_states(model)
        values += snap.values[n + n_optimizer :]
    shapes = [tuple(v.shape) for v in variables]
    if shapes != [tuple(a.shape) for a in values]:
        seeds = len(seed_states(model)) if snap.n_seeds else 0
        raise ValueError(
            "The snapshot in the directory was taken from a different model "
            f"or optimizer: {n} weights, {n_optimizer} optimizer variables and "
            f"{snap.n_seeds} random streams. Received: "
            f"directory={os.fspath(directory)!r}, model with {len(weights)} "
            f"weights, {len(variables) - len(weights) - seeds} optimizer "
            f"variables and {seeds} random streams (or different shapes)"
        )
    assign(model, variables, values)
    lr = learning_rate_variable(model)
    if lr is not None and snap.learning_rate is not None:
        lr.assign(snap.learning_rate)
    return snap


def save_weights_file(
    model: keras.Model, snapshot: Snapshot, directory: str | os.PathLike
) -> str:
    """Writes `snapshot` atomically into `directory` as a Keras weights file,
    `WEIGHTS_FILE`, that `model.load_weights` loads into a model of the same
    architecture (compiled with the same optimizer: its variables too, as
    `model.save_weights` writes them). The learning rate in it is the one
    training goes on with; random streams are not in it (Keras keeps no
    `SeedGenerator` state in weights files). Returns the file's path.

    The caller syncs JAX state first (`snapshots.sync_from_device`).
    """
    variables = _matching(model, snapshot)
    keep = unchecked(model) | {id(v) for v in seed_states(model)}
    swap = [
        (v, x)
        for v, x in zip(variables, snapshot.values, strict=True)
        if id(v) not in keep
    ]
    directory = os.fspath(directory)
    path = os.path.join(directory, WEIGHTS_FILE)
    with atomic_path(path, ".weights.h5") as tmp:
        current = [held_value(v) for v, _ in swap]
        try:
            assign(model, [v for v, _ in swap], [x for _, x in swap])
            model.save_weights(tmp, overwrite=True)
        finally:
            for (v, _), value in zip(swap, current, strict=True):
                v.assign(value)
    return path
