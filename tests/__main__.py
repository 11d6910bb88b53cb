"""Run the whole check: ruff, mypy and the docs build, then the test suite once
per Keras backend.

Usage: `python -m tests [--fast] [--backends tensorflow,jax,torch] [--jobs N]
[--no-lint] [pytest args...]`.
The lint phase (`--no-lint` skips it) runs `ruff check`, `ruff format
--check`, `mypy` and `mkdocs build --strict` (the documentation site of
`mkdocs.yml`, built into a temporary folder: a warning, such as a broken
link or a docstring griffe cannot parse, fails it; skipped on Python 3.10,
which the pinned docs tools do not support).
Each backend runs in its own process (Keras picks its backend at import),
`--jobs` of them at a time (default: one per CPU core, at most 3; on a
2-core VM the whole check took 1666 s, against 2602 s with `--jobs 1`;
each job's time today: `_jobs`).
With more than one at a time, each backend's output is printed whole when
it ends. Any failure, and also pytest's exit code 5 ("no tests collected"),
fails the run.

Tests marked `backend_free` (NumPy and pure-Python code, argument checks
that raise before any tensor exists) run under one backend only: JAX when it
is among `--backends` (TensorFlow's is the longest job),
else the first listed; the other backends skip them
(NANGUARD_SKIP_BACKEND_FREE=1, see tests/conftest.py).

The notebooks (`-m notebooks`, minutes of training in their own Jupyter
kernels) are a job of their own beside the backends when the whole suite
runs (TensorFlow among `--backends`, no `-m`, `-k` or paths among the pytest
args): TensorFlow's suite is the longest, and with them in it the other job
waited minutes for it. The jobs start longest first (`_jobs`).

`--fast`: a quick local run, not the whole check: pytest with
`-m "not slow and not notebooks"` (no long scenarios, no notebook
execution, no torch.compile), on one backend unless `--backends` is given:
torch where it is installed (its eager steps build nothing: the same tests
took ~10 minutes on TensorFlow, which traces each new step, on a 2-core
VM), else JAX, else TensorFlow; a `-m` among
the pytest args replaces that selection. CI (`.ci/run`) runs everything:
plain `python -m tests`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

BACKENDS = ("tensorflow", "jax", "torch")
BACKEND_FREE_ON = ("jax", "torch", "tensorflow")  # the first one present
FAST_MARKERS = "not slow and not notebooks"
FAST_BACKENDS = ("torch", "jax", "tensorflow")  # `--fast` takes the first installed


def _split_notebooks(backends: list[str], pytest_args: list[str]) -> bool:
    """Whether the notebooks run as a job of their own: the whole suite is
    asked for (only long options, no `-m`/`-k` selection, no paths), with
    TensorFlow (the kernels of notebooks 01-04 use it)."""
    whole = all(a.startswith("--") for a in pytest_args)
    return whole and "tensorflow" in backends


def _jobs(backends: list[str], pytest_args: list[str]) -> list[tuple[str, str, list]]:
    """(name, backend, pytest args) per pytest process, in the order they
    start: the longest first (`.ci/run` on a 2-core VM, 2026-12-07, b54f111:
    TensorFlow without the notebooks 797 s, JAX 709 s, the notebooks 331 s,
    torch 266 s)."""
    if not _split_notebooks(backends, pytest_args):
        return [(b, b, pytest_args) for b in backends]
    tensorflow = ("tensorflow", "tensorflow", ["-m", "not notebooks", *pytest_args])
    notebooks = ("notebooks", "tensorflow", ["-m", "notebooks", *pytest_args])
    jax = [("jax", "jax", pytest_args)] if "jax" in backends else []
    torch = [("torch", "torch", pytest_args)] if "torch" in backends else []
    return [tensorflow, *jax, notebooks, *torch]


def _fast_backend() -> str:
    """`--fast`'s backend: the first of FAST_BACKENDS installed (torch's
    eager steps cost the least to build)."""
    import importlib.util

    found = [b for b in FAST_BACKENDS if importlib.util.find_spec(b) is not None]
    return found[0] if found else FAST_BACKENDS[0]


def _run(cmd: list[str], env: dict[str, str] | None = None) -> int:
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    return subprocess.call(cmd, env=env)


def _lint() -> list[str]:
    """ruff, mypy and the docs build: the names of those that failed."""
    failures = []
    lint = (["ruff", "check", "."], ["ruff", "format", "--check", "."], ["mypy"])
    for cmd in lint:
        if _run([sys.executable, "-m", *cmd]) != 0:
            failures.append(" ".join(cmd))
    if sys.version_info < (3, 11):
        print("\nmkdocs build skipped: the pinned docs tools need Python 3.11")
        return failures
    # NO_MKDOCS_2_WARNING: Material's notice about MkDocs 2.0, not a warning
    # of this build.
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    with tempfile.TemporaryDirectory() as site:
        build = ["mkdocs", "build", "--strict", "--site-dir", site]
        if _run([sys.executable, "-m", *build], env) != 0:
            failures.append("mkdocs build --strict")
    return failures


def _pytest(
    backend: str, pytest_args: list[str], capture: bool, backend_free: bool
) -> tuple[int, str, float]:
    """The suite under `backend` (with its `backend_free` tests or not): exit
    code, output (streamed instead when not `capture`), seconds."""
    cmd = [sys.executable, "-m", "pytest", *pytest_args]
    skip = "" if backend_free else "NANGUARD_SKIP_BACKEND_FREE=1 "
    header = f"$ {skip}KERAS_BACKEND={backend} {shlex.join(cmd)}\n"
    if not capture:
        print(header, end="", flush=True)
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT} if capture else {}
    env = dict(os.environ, KERAS_BACKEND=backend)
    env.pop("NANGUARD_SKIP_BACKEND_FREE", None)
    if not backend_free:
        env["NANGUARD_SKIP_BACKEND_FREE"] = "1"
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, text=True, **pipes)
    output = header + done.stdout if capture else ""
    return done.returncode, output, time.perf_counter() - start


def _arguments() -> tuple[argparse.Namespace, list[str], list[str]]:
    """The options, the backends to run and the arguments for pytest."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default=None)
    parser.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 3))
    parser.add_argument("--no-lint", action="store_true")
    parser.add_argument(
        "--fast",
        action="store_true",
        help=f'-m "{FAST_MARKERS}", on torch (if installed) unless --backends',
    )
    args, pytest_args = parser.parse_known_args()
    if args.backends is None:
        args.backends = _fast_backend() if args.fast else ",".join(BACKENDS)
    if args.fast:  # a later -m of the user's wins
        pytest_args = ["-m", FAST_MARKERS, *pytest_args]
    backends = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown or not backends:
        parser.error(
            f"--backends must be among {BACKENDS}. Received: {unknown or args.backends!r}"
        )
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1. Received: {args.jobs}")
    return args, backends, pytest_args


def main() -> int:
    args, backends, pytest_args = _arguments()

    failures, start = [], time.perf_counter()
    phases: list[str] = []  # each phase's time, printed at the end
    if not args.no_lint:
        failures += _lint()
        phases.append(f"lint and docs {time.perf_counter() - start:.0f} s")
    jobs = _jobs(backends, pytest_args)
    slots = min(args.jobs, len(jobs))
    free_on = next(b for b in BACKEND_FREE_ON if b in backends)
    print(
        f"\npytest: {', '.join(name for name, _, _ in jobs)}, {slots} at a time; "
        f"backend_free tests on {free_on} only",
        flush=True,
    )
    with ThreadPoolExecutor(slots) as pool:
        capture = slots > 1  # one at a time: streamed
        runs = {
            pool.submit(_pytest, b, args_, capture, name == free_on): (name, b)
            for name, b, args_ in jobs
        }
        for run in as_completed(runs):
            (name, backend), (code, output, seconds) = runs[run], run.result()
            print(f"\n{output}[{name}] pytest exit code {code} in {seconds:.0f} s")
            phases.append(f"{name} {seconds:.0f} s")
            sys.stdout.flush()
            if code != 0:  # 5 = no tests collected: a failure too
                failures.append(
                    f"pytest {name} under KERAS_BACKEND={backend} (exit code {code})"
                )
    print(f"\nThe whole check took {time.perf_counter() - start:.0f} s.")
    print("Phases: " + "; ".join(phases) + f" ({slots} at a time).")
    if failures:
        print("\nFAILED: " + "; ".join(failures))
        return 1
    print(f"\nAll checks passed on {', '.join(backends)}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
