"""A snapshot and a model across files: `load_into` loads NaNGuard's
snapshot file into a model; `save_weights_file` writes a snapshot as a plain
Keras weights file (`model.load_weights` reads it), beside that file.

The weights file is written with the public `model.save_weights`: the
snapshot's values are put into the model's variables for the write, and the
values the model had are put back after it, also on error. It goes to a
temporary file in the same directory, then is renamed over the previous one.
"""

from __future__ import annotations

import os

import keras

from keras_nanguard._atomic import atomic_path
from keras_nanguard._host_device import held_value
from keras_nanguard.snapshots import (
    Snapshot,
    assign,
    learning_rate_variable,
    load,
    optimizer_variables,
    seed_states,
    tracked,
    unchecked,
)

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
    variables = tracked(model)
    if len(variables) != len(snapshot.values):
        raise ValueError(
            "The snapshot does not match the model: it has "
            f"{len(snapshot.values)} variables, the model and optimizer have "
            f"{len(variables)}."
        )
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
