"""SafeOptimizer: its step and parts (the transaction, the counters, the
model's side), the graded handling, quarantine, and training with it in
`fit`, `train_on_batch` and custom loops; its saved files."""
