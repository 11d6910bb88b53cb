"""Run the whole check: ruff, then the test suite once per Keras backend.

Usage: `python -m tests [--backends tensorflow,jax,torch] [--jobs N] [pytest args...]`.
Each backend runs in its own process (Keras picks its backend at import),
`--jobs` of them at a time (default: one per CPU core, at most 3; on a
2-core VM the whole check took 1666 s, against 2602 s with `--jobs 1`).
With more than one at a time, each backend's output is printed whole when
it ends. Any failure, and also pytest's exit code 5 ("no tests collected"),
fails the run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

BACKENDS = ("tensorflow", "jax", "torch")


def _run(cmd: list[str]) -> int:
    print(f"\n$ {' '.join(cmd)}", flush=True)
    return subprocess.call(cmd)


def _pytest(
    backend: str, pytest_args: list[str], capture: bool
) -> tuple[int, str, float]:
    """The suite under `backend`: exit code, output (streamed instead when
    not `capture`), seconds."""
    cmd = [sys.executable, "-m", "pytest", *pytest_args]
    header = f"$ KERAS_BACKEND={backend} {' '.join(cmd)}\n"
    if not capture:
        print(header, end="", flush=True)
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT} if capture else {}
    env = dict(os.environ, KERAS_BACKEND=backend)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, text=True, **pipes)
    output = header + done.stdout if capture else ""
    return done.returncode, output, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 3))
    parser.add_argument("--no-lint", action="store_true")
    args, pytest_args = parser.parse_known_args()
    backends = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        parser.error(f"--backends must be among {BACKENDS}. Received: {unknown}")
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1. Received: {args.jobs}")

    failures, start = [], time.perf_counter()
    if not args.no_lint:
        for cmd in (["ruff", "check", "."], ["ruff", "format", "--check", "."]):
            if _run([sys.executable, "-m", *cmd]) != 0:
                failures.append(" ".join(cmd))
    jobs = min(args.jobs, len(backends))
    print(f"\npytest on {', '.join(backends)}, {jobs} at a time", flush=True)
    with ThreadPoolExecutor(jobs) as pool:
        capture = jobs > 1  # one at a time: streamed
        runs = {pool.submit(_pytest, b, pytest_args, capture): b for b in backends}
        for run in as_completed(runs):
            backend, (code, output, seconds) = runs[run], run.result()
            print(f"\n{output}[{backend}] pytest exit code {code} in {seconds:.0f} s")
            sys.stdout.flush()
            if code != 0:  # 5 = no tests collected: a failure too
                failures.append(
                    f"pytest under KERAS_BACKEND={backend} (exit code {code})"
                )
    print(f"\nThe whole check took {time.perf_counter() - start:.0f} s.")
    if failures:
        print("\nFAILED: " + "; ".join(failures))
        return 1
    print(f"\nAll checks passed on {', '.join(backends)}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
