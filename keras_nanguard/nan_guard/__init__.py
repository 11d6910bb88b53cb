"""NaNGuard: watch `model.fit`, keep a good state, roll back or stop, say why.

The public names are `NaNGuard` and `POLICIES`; the modules of this folder
are private. NaNGuard is built from typed parts that it holds, not mixins:

- `callback`: the `keras.callbacks.Callback` users see: its hooks, which
  hand the work to the parts below.
- `fit_state`: what the parts share in one `fit`: the `FitState` (which
  thread touches which field); `safe_counters`: what they use of a
  SafeOptimizer.
- `batch_watch`: the batch-end side (it may run in Keras's worker threads):
  the logs read, the events queued; with `figures` (the epoch's figures
  without the bad batches) and `loss_spikes` (the loss-spike rule).
- The training-thread side: `turns` (each turn: events into incidents,
  counters, due snapshots), `responses` (record an incident, act on
  trouble by the policy), `snapshotting` (take, prove, restore and write
  snapshots), `snapshot_keeper` (which snapshot is the rollback point)
  and `incident_log` (the incidents and the open episode).
- `telling`: incidents in words, once each; the summary and the report.
- `cadence`: how often to snapshot; `learning_rate`: lowering it;
  `replay`: the batch of an incident; `runs`: copies made by KerasTuner;
  `snapshot_files`: snapshots on disk.

Threads, and what NaNGuard does when: docs/nan_guard.md.
"""

from keras_nanguard.nan_guard.callback import POLICIES, NaNGuard

__all__ = ["POLICIES", "NaNGuard"]
