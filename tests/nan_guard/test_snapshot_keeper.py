"""SnapshotKeeper, NaNGuard's bookkeeping of its rollback point: a pending
snapshot is promoted only by a healthy step after it, buffers are reused but
never the rollback point's, and `patience` counts rollbacks since the point
was kept. Host snapshots of NumPy arrays; no model, no training."""

import numpy as np
import pytest

from keras_nanguard.nan_guard.snapshotting import MAX_PENDING, SnapshotKeeper
from keras_nanguard.snapshots import Snapshot

pytestmark = pytest.mark.backend_free


def _snap(step: int) -> Snapshot:
    return Snapshot([np.full(2, float(step))], ["w"], epoch=0, step=step)


def test_a_healthy_step_promotes_the_newest_snapshot_taken_before_it():
    keeper = SnapshotKeeper()
    s10, s20, s30 = _snap(10), _snap(20), _snap(30)
    for snap in (s10, s20, s30):
        keeper.add(snap)
    # A healthy step before every pending snapshot proves none of them.
    assert keeper.proven(9) is None
    assert keeper.pendings == [s10, s20, s30]
    # Step 25 ran after 10 and 20: the newest, 20, is proven; 10 is let go;
    # 30 still waits.
    assert keeper.proven(25) is s20
    assert keeper.pendings == [s30]
    assert keeper.spare is None  # let go, but not a spare
    keeper.keep(s20)
    assert (keeper.point, keeper.kept, keeper.pendings) == (s20, 1, [s30])
    # A snapshot taken at the healthy step itself ran before it.
    assert keeper.proven(30) is s30
    assert keeper.pendings == []


def test_at_most_max_pending_snapshots_wait():
    keeper = SnapshotKeeper()
    assert MAX_PENDING == 3
    for step in range(MAX_PENDING):
        assert keeper.has_room()
        keeper.add(_snap(step))
    assert not keeper.has_room()
    keeper.proven(0)
    assert keeper.has_room()


def test_the_old_rollback_point_is_the_spare_and_lent_once():
    keeper = SnapshotKeeper()
    first, second = _snap(0), _snap(10)
    keeper.keep(first)
    assert keeper.reusable() is None  # the rollback point is never lent
    keeper.add(second)
    keeper.keep(second)
    assert keeper.point is second
    assert keeper.reusable() is first
    assert keeper.reusable() is None  # once
    # Keeping the rollback point again lends nothing.
    keeper.keep(second)
    assert (keeper.spare, keeper.kept) == (None, 3)


def test_trouble_drops_the_pending_snapshots_and_the_newest_is_spare():
    keeper = SnapshotKeeper()
    keeper.keep(_snap(0))
    older, newer = _snap(10), _snap(20)
    keeper.add(older)
    keeper.add(newer)
    keeper.drop_pending()
    assert keeper.pendings == []
    assert keeper.spare is newer
    assert keeper.point.step == 0


def test_a_snapshot_found_non_finite_only_lends_its_buffers():
    keeper = SnapshotKeeper()
    bad = _snap(10)
    keeper.add(bad)
    assert keeper.proven(11) is bad
    keeper.reject(bad)
    assert (keeper.point, keeper.spare, keeper.kept) == (None, bad, 0)


def test_patience_counts_rollbacks_since_the_point_was_kept():
    keeper = SnapshotKeeper()
    keeper.keep(_snap(0))
    assert keeper.may_roll_back(2)
    keeper.rolled_back()
    assert keeper.may_roll_back(2)
    keeper.rolled_back()
    assert not keeper.may_roll_back(2)  # the third would be past patience 2
    assert (keeper.rollbacks, keeper.rollbacks_since) == (2, 2)
    keeper.keep(_snap(5))  # a fresh good snapshot
    assert keeper.may_roll_back(2)
    assert (keeper.rollbacks, keeper.rollbacks_since) == (2, 0)
    assert not keeper.may_roll_back(0)  # patience 0: never


def test_a_new_fit_keeps_the_counts_and_lends_the_old_point():
    keeper = SnapshotKeeper()
    point = _snap(7)
    keeper.keep(point)
    keeper.rolled_back()
    keeper.add(_snap(8))
    keeper.begin_fit()
    assert (keeper.point, keeper.pendings, keeper.spare) == (None, [], point)
    assert (keeper.kept, keeper.rollbacks, keeper.rollbacks_since) == (1, 1, 0)
    # A fit that never kept a point leaves the spare it had.
    keeper.begin_fit()
    assert keeper.spare is point


def test_pending_at_is_the_newest_pending_one_of_that_step():
    keeper = SnapshotKeeper()
    keeper.add(_snap(4))
    last = _snap(8)
    keeper.add(last)
    assert keeper.pending_at(8) is last
    assert keeper.pending_at(4) is None  # not the newest
    keeper.release()
    assert (keeper.point, keeper.pendings, keeper.spare) == (None, [], None)
    assert keeper.pending_at(8) is None
