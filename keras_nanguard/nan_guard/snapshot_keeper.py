"""The rollback point, and the snapshots waiting to become it.

A new snapshot is *pending* until a batch that ran after it is healthy, so
that a finite but ruinous update is not kept as "good" before its damage
shows. Pending snapshots wait, oldest first, at most `MAX_PENDING` of them
(the batch ends run behind). A healthy step proves every pending snapshot
taken at or before it; the newest of them becomes the rollback point, the
older ones are let go. A snapshot that is let go lends its buffers (the
*spare*) to the next one taken, but the rollback point's are never
overwritten.
"""

from __future__ import annotations

from keras_nanguard.snapshots import Snapshot

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
