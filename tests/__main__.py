"""Run the whole check: ruff, then the test suite once per Keras backend.

Usage: `python -m tests [--backends tensorflow,jax,torch] [pytest args...]`.
Each backend runs in its own process (Keras picks its backend at import).
Any failure, and also pytest's exit code 5 ("no tests collected"), fails the
run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

BACKENDS = ("tensorflow", "jax", "torch")


def _run(cmd: list[str], env: dict[str, str] | None = None) -> int:
    print(f"\n$ {' '.join(cmd)}", flush=True)
    return subprocess.call(cmd, env=env)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--no-lint", action="store_true")
    args, pytest_args = parser.parse_known_args()
    backends = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        parser.error(f"--backends must be among {BACKENDS}. Received: {unknown}")

    failures = []
    if not args.no_lint:
        for cmd in (["ruff", "check", "."], ["ruff", "format", "--check", "."]):
            if _run([sys.executable, "-m", *cmd]) != 0:
                failures.append(" ".join(cmd))
    for backend in backends:
        env = dict(os.environ, KERAS_BACKEND=backend)
        start = time.perf_counter()
        code = _run([sys.executable, "-m", "pytest", *pytest_args], env=env)
        print(
            f"[{backend}] pytest exit code {code} in {time.perf_counter() - start:.0f} s"
        )
        if code != 0:  # 5 = no tests collected: a failure too
            failures.append(f"pytest under KERAS_BACKEND={backend} (exit code {code})")
    if failures:
        print("\nFAILED: " + "; ".join(failures))
        return 1
    print(f"\nAll checks passed on {', '.join(backends)}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
