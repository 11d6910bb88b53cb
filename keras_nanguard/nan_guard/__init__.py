"""NaNGuard: watch `model.fit`, keep a good state, roll back or stop, say why.

The public names are `NaNGuard` and `POLICIES`; the modules of this folder
are private:

- `callback`: the `keras.callbacks.Callback` users see, its hooks.
- `batch_watch`: the batch-end side (it may run in Keras's worker threads):
  the logs read, the events queued; with `figures` (the epoch's figures
  without the bad batches) and `loss_spikes` (the loss-spike rule).
- `responses`: the training-thread side: incidents, snapshots, rollback
  and stop; `telling`: incidents in words, the summary and the report.
- `cadence`: how often to snapshot; `learning_rate`: lowering it;
  `replay`: the batch of an incident; `runs`: copies made by KerasTuner;
  `snapshot_files`: snapshots on disk.
"""

from keras_nanguard.nan_guard.callback import POLICIES, NaNGuard

__all__ = ["POLICIES", "NaNGuard"]
