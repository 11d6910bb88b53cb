"""NaNGuard: watch `model.fit`, keep a good state, roll back or stop, say why.

The public names are `NaNGuard` and `POLICIES`; the modules of this folder
are private. NaNGuard is built from typed parts that it holds, not mixins:

- `callback`: the `keras.callbacks.Callback` users see: its hooks, which
  hand the work to the parts below; `runs`: its copies (KerasTuner's).
- `fit_state`: what the parts share in one `fit`: the `FitState` (which
  thread touches which field), the cadences (when a snapshot or a read of
  the counters is due), the processes' agreement, and what the guard uses
  of a SafeOptimizer (`SafeCounters`).
- `batch_watch`: the batch-end side (it may run in Keras's worker threads):
  the logs read, the events queued, the epoch's figures without the bad
  batches, the loss-spike rule.
- `supervisor`: the training thread's side: at each turn it makes
  incidents of the events, reads the counters and the flight record, and
  takes due snapshots.
- `responses`: what trouble gets by the policy (record, roll back, stop,
  raise), the learning rate lowered, the incident's batch replayed.
- `snapshotting`: the guard's snapshots (taken, proven, restored, written;
  which is the rollback point). What a snapshot is, in memory and on disk,
  is `keras_nanguard.snapshots`.
- `reporting`: the incidents (the log, the open episode) and telling a
  person about them once each; the summary and the report.

Threads, and what NaNGuard does when: docs/nan_guard.md.
"""

from keras_nanguard.nan_guard.callback import POLICIES, NaNGuard

__all__ = ["POLICIES", "NaNGuard"]
