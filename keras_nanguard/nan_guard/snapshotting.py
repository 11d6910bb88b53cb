"""NaNGuard's snapshots: taking them, proving them, restoring the rollback
point and writing it to `directory` (`Snapshotter`), and which snapshot
is the rollback point (`SnapshotKeeper`).

The snapshotter reads and changes the model, so it runs on the training
thread only.
A non-finite state it finds is returned to the caller, which records the
incident and acts on the trouble (`Responses`).
"""

from __future__ import annotations

import tempfile
import time

from keras_nanguard import snapshots
from keras_nanguard.errors import NonFiniteError
from keras_nanguard.nan_guard.fit_state import FitState
from keras_nanguard.snapshots import Snapshot


class Snapshotter:
    """Snapshots of `state.model` into `keeper`, written to `directory` (if
    not `None`) whenever one becomes the rollback point."""

    def __init__(
        self, state: FitState, keeper: SnapshotKeeper, directory: str | None
    ) -> None:
        self.state, self.keeper, self.directory = state, keeper, directory

    def capture(self, verify: bool) -> tuple[snapshots.Snapshot | None, list[str]]:
        """A snapshot of the state now, or `None` and the non-finite names;
        with `verify`, its finiteness is read at once, else when it is
        promoted (`promote`)."""
        state = self.state
        snapshots.sync_from_device(state.model)
        snap, bad = snapshots.capture(
            state.model, epoch=state.epoch, step=state.now, into=self.keeper.reusable()
        )
        if snap is not None and verify:
            bad = snapshots.verify(snap)
            if bad:
                self.keeper.reject(snap)
                snap = None
        return snap, bad or []

    def take_if_due(self, steps: int, step_seconds: float | None) -> list[str]:
        """Takes a snapshot if one is due after `steps` more steps; returns
        the non-finite names if the state is found non-finite, else `[]`."""
        due = self.state.snapshot_cadence.due(step_seconds, steps)
        if not due or not self.keeper.has_room():
            return []
        return self._add(self.capture(verify=False))

    def take_at_epoch_end(self, epoch: int) -> list[str]:
        """The epoch's snapshot, read at once (one read per epoch): the
        non-finite names if the state is found non-finite, else `[]`."""
        snap, bad = self.capture(verify=True)
        if snap is not None:
            snap.epoch = epoch + 1
        return self._add((snap, bad))

    def _add(self, taken: tuple[snapshots.Snapshot | None, list[str]]) -> list[str]:
        snap, bad = taken
        if snap is None:
            return bad
        self.keeper.add(snap)
        self.state.snapshot_cadence.done(snap.seconds)  # counts from the copy
        return []

    def promote(self, healthy: int) -> tuple[int, list[str]] | None:
        """Makes the newest pending snapshot that a healthy batch (at step
        `healthy`) ran after the rollback point. Its finiteness flag is read
        here, steps after it was set. Returns its step and non-finite names
        if it proves non-finite, else `None`."""
        snap = self.keeper.proven(healthy)
        if snap is None:
            return None
        bad = snapshots.verify(snap)
        if not bad:
            self.keep(snap)
            return None
        self.keeper.reject(snap)
        return snap.step, bad

    def keep(self, snap: snapshots.Snapshot) -> None:
        """Makes `snap` the rollback point, and writes it to `directory`."""
        self.keeper.keep(snap)
        snap.seconds += self.save(snap)
        self.state.snapshot_cadence.cost = snap.seconds  # with read and write

    def save(self, snap: snapshots.Snapshot) -> float:
        """Writes `snap` to `directory` (NaNGuard's file and a Keras weights
        file), with the learning rate training goes on with; returns the
        seconds it took. In a job of many processes process 0 writes them;
        the others write the weights file into a scratch directory that is
        then deleted, since Keras's `save_weights` there places values with
        a collective that every process must join."""
        if self.directory is None:
            return 0.0
        start = time.perf_counter()
        model = self.state.model
        snapshots.sync_from_device(model)
        snap.learning_rate = snapshots.learning_rate(model)
        if self.state.process == 0:
            snapshots.save(snap, self.directory)
            snapshots.save_weights_file(model, snap, self.directory)
        else:
            with tempfile.TemporaryDirectory() as scratch:
                snapshots.save_weights_file(model, snap, scratch)
        return time.perf_counter() - start

    def restore(self) -> None:
        """Writes the rollback point back into the model (there is one)."""
        state, point = self.state, self.keeper.point
        if point is None:
            raise RuntimeError("NaNGuard: no rollback point to restore.")
        snapshots.sync_from_device(state.model)
        snapshots.restore(state.model, point)
        state.restored_at = state.now

    def start(self) -> None:
        """Takes the first snapshot, once the model has its variables."""
        state = self.state
        state.started = True
        optimizer = state.model.optimizer
        # As Keras builds it before a JAX or torch `fit`; not the one a
        # model with optimizers of its own (a GAN's) left unused.
        alone = len(snapshots.model_optimizers(state.model)) == 1
        if optimizer is not None and not optimizer.built and alone:
            optimizer.build(state.model.trainable_variables)
        snap, bad = self.capture(verify=True)
        if snap is not None and state.now == 0:  # the state training starts from
            self.keep(snap)
            state.restored_at = state.now  # the state is the rollback point's
        elif snap is not None:
            # A model `fit` built in its first step: the state after that
            # step is no rollback point until a healthy batch proves it.
            self.keeper.add(snap)
        elif state.now == 0:
            raise NonFiniteError(
                "NaNGuard: the model is already non-finite before training starts "
                f"({', '.join(bad[:5])}); there is no good state to protect. "
                "Re-initialise or load good weights first."
            )
        # else: the first step of a model built by `fit` went bad; its event
        # reports it and `Responses.trouble` finds no rollback point.

    def keep_final_state(self) -> None:
        """Makes the state `fit` returns the rollback point (and writes it to
        `directory`) if it is finite: nothing comes after it to prove it."""
        state = self.state
        last = self.keeper.pending_at(state.now)
        if last is not None:
            self.keep(last)  # taken (and read) at the epoch end
            return
        snap, _ = self.capture(verify=True)
        if snap is not None:
            snap.epoch = state.epoch + 1
            self.keep(snap)

    def finish(self) -> None:
        """At the end of training: undoes what ran after a stop; the state
        `fit` returns becomes the rollback point if it is finite, else the
        rollback point is written again, with the learning rate as it is."""
        state = self.state
        if state.stopping and state.restored_at != state.now:
            self.restore()
        if state.started and state.restored_at != state.now:
            self.keep_final_state()
        elif self.keeper.point is not None:  # the state is the point's
            self.save(self.keeper.point)


# The rollback point, and the snapshots waiting to become it.
#
# A new snapshot is *pending* until a batch that ran after it is healthy, so
# that a finite but ruinous update is not kept as "good" before its damage
# shows. Pending snapshots wait, oldest first, at most `MAX_PENDING` of them
# (the batch ends run behind). A healthy step proves every pending snapshot
# taken at or before it; the newest of them becomes the rollback point, the
# older ones are let go. A snapshot that is let go lends its buffers (the
# *spare*) to the next one taken, but the rollback point's are never
# overwritten.

# Snapshots waiting for a healthy batch (the batch ends run behind).
MAX_PENDING = 3


class SnapshotKeeper:
    """Which snapshot NaNGuard would roll back to, and how often it did.

    Bookkeeping only: it never reads the model (`Snapshotter` captures,
    verifies and writes the snapshots). A guard keeps one for its life:
    the rollback point, the spare buffers and the counts outlive a `fit`.
    """

    def __init__(self) -> None:
        self.point: Snapshot | None = None  # the rollback point
        self.pendings: list[Snapshot] = []  # oldest first
        self.spare: Snapshot | None = None  # buffers a new snapshot may reuse
        self.kept = 0  # snapshots made the rollback point, in all fits
        self.rollbacks = 0  # rollbacks, in all fits
        self.rollbacks_since = 0  # rollbacks since the rollback point was kept

    def begin_fit(self) -> None:
        """A new `fit`: the last one's rollback point only lends its buffers
        (the state may have changed since: it is no rollback point now)."""
        self.spare = self.point or self.spare
        self.point, self.pendings = None, []
        self.rollbacks_since = 0

    def reusable(self) -> Snapshot | None:
        """Hands out the spare buffers (never the rollback point's), once."""
        spare, self.spare = self.spare, None
        return spare

    def has_room(self) -> bool:
        """Whether another snapshot may wait to be proven."""
        return len(self.pendings) < MAX_PENDING

    def add(self, snap: Snapshot) -> None:
        """`snap` waits for a healthy batch after it."""
        self.pendings.append(snap)

    def pending_at(self, step: int) -> Snapshot | None:
        """The newest pending snapshot, if it was taken at `step`."""
        if self.pendings and self.pendings[-1].step == step:
            return self.pendings[-1]
        return None

    def drop_pending(self) -> None:
        """Trouble came before a healthy batch proved them: the pending
        snapshots are let go (the newest lends its buffers)."""
        if self.pendings:
            self.spare = self.pendings[-1]
        self.pendings = []

    def proven(self, healthy: int) -> Snapshot | None:
        """Takes out the pending snapshots that a healthy step at `healthy`
        ran after, and returns the newest of them (`None` if none), which
        the caller verifies and then `keep`s or `reject`s."""
        proven = [p for p in self.pendings if p.step <= healthy]
        if not proven:
            return None
        self.pendings = [p for p in self.pendings if p.step > healthy]
        return proven[-1]

    def reject(self, snap: Snapshot) -> None:
        """`snap` was found non-finite: only its buffers are of use."""
        self.spare = snap

    def keep(self, snap: Snapshot) -> None:
        """Makes `snap` the rollback point; the one before lends its buffers."""
        if self.point is not None and self.point is not snap:
            self.spare = self.point
        self.point = snap
        self.pendings = [p for p in self.pendings if p is not snap]
        self.kept += 1
        self.rollbacks_since = 0

    def may_roll_back(self, patience: int) -> bool:
        """Whether another rollback is allowed: fewer than `patience` since
        the rollback point was kept."""
        return self.rollbacks_since < patience

    def rolled_back(self) -> None:
        self.rollbacks += 1
        self.rollbacks_since += 1

    def release(self) -> None:
        """Lets every snapshot go (a finished copy's, see `runs`)."""
        self.point, self.pendings, self.spare = None, [], None
