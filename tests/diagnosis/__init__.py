"""Diagnosis: `diagnose()` on a corpus of broken models, and
`NaNGuard.explain()` on a corpus of runs with known fates."""
