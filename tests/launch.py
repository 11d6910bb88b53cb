"""Runs a job of several processes on this machine: the workers in
`tests/workers/`, each called as `python WORKER INDEX COUNT OUT_DIR PORT...`
(the loopback ports the job's processes meet on), with a timeout so that a
hang fails the test instead of the run. The job runner is
`benchmarks/_launch.py`, which `bench_processes.py` uses too."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

_BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks")
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)

from _launch import JobFailed, run_job  # noqa: E402  (benchmarks/, put on the path)

WORKERS = Path(__file__).parent / "workers"


def launch(worker: str, count: int, out_dir: Path, **job: Any) -> list[str]:
    """Runs `count` processes of `worker` (a file of `tests/workers/`) to the
    end and returns their output (`job`: `run_job`'s `ports`, `timeout`,
    `attempts`); fails the test, with each one's output, if one failed or
    the job outlived its timeout."""
    try:
        return run_job(WORKERS / worker, count, out_dir, **job)
    except JobFailed as failed:
        pytest.fail(str(failed))
