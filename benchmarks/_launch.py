"""Runs a job of several processes on this machine: each process called as
`python SCRIPT INDEX COUNT OUT_DIR PORT...` (the loopback ports the job's
processes meet on), with a timeout so that a hang ends the job instead of
the run. The multi-process tests (`tests/launch.py`, for their workers) and
`bench_processes.py` run their jobs with it."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

# What a worker prints when its server cannot take its port.
_BIND_FAILED = re.compile(
    r"Address already in use|Could not start gRPC server|Failed to add port"
)


class JobFailed(RuntimeError):
    """A process of the job failed, or the job outlived its timeout: the
    message has each process's output."""


def run_job(
    script: Path,
    count: int,
    out_dir: Path,
    ports: int = 1,
    timeout: float = 240,
    attempts: int = 3,
) -> list[str]:
    """Runs `count` processes of `script` to the end and returns their
    output; raises `JobFailed`, with each one's output, if one failed or the
    job outlived `timeout` seconds. New ports if one could not be bound."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    for attempt in range(1, attempts + 1):
        chosen = [str(p) for p in _reserved_ports(ports)]
        logs = [
            out_dir / f"{script.name}.{i}.attempt{attempt}.log" for i in range(count)
        ]
        procs = []
        try:
            for i, log in enumerate(logs):
                with open(log, "wb") as out:  # a file: no pipe to fill up
                    procs.append(
                        subprocess.Popen(
                            [
                                sys.executable,
                                str(script),
                                str(i),
                                str(count),
                                str(out_dir),
                                *chosen,
                            ],
                            env=env,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                        )
                    )
            hung = not _wait(procs, timeout)
        finally:
            for p in procs:
                p.kill()
                p.wait()
        outputs = [log.read_text(errors="replace") for log in logs]
        failed = [o for p, o in zip(procs, outputs, strict=True) if p.returncode]
        rebind = failed and not hung and attempt < attempts
        if rebind and any(_BIND_FAILED.search(o) for o in failed):
            continue
        if hung or failed:
            said = "\n".join(
                f"--- process {i} (exit {p.returncode}):\n{out[-3000:]}"
                for i, (p, out) in enumerate(zip(procs, outputs, strict=True))
            )
            why = f"hung past {timeout} s" if hung else "a process failed"
            raise JobFailed(f"{script.name}: {why}\n{said}")
        return outputs
    raise AssertionError("unreachable")


def _wait(procs: list[subprocess.Popen], timeout: float) -> bool:
    """Waits for every process; once one fails, the others (waiting for
    their peer) are stopped instead of waiting out the timeout. Returns
    False if the timeout passed first."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if any(p.returncode for p in procs):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _reserved_ports(n: int) -> list[int]:
    """`n` distinct loopback ports kept from the OS's ephemeral allocator.

    TensorFlow's gRPC server binds the port named in TF_CONFIG itself, so no
    socket of ours can be handed over, and binding, releasing and rebinding
    leaves a window in which another process's `bind(0)` or `connect` may get
    the port. Each port here is bound (all `n` at once, so they differ),
    listened on, connected to and accepted, and the accepted side closed first:
    the port sits in TIME_WAIT (about 60 s), and Linux does not hand a port in
    TIME_WAIT to a plain `bind(0)`, while a server binding with SO_REUSEADDR
    can still take it. A process asking for that very port number can still
    win the race: the caller retries with new ports on a bind failure.
    """
    with contextlib.ExitStack() as stack:
        listeners = []
        for _ in range(n):
            s = stack.enter_context(socket.socket())
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("localhost", 0))
            s.listen(1)
            listeners.append(s)
        for s in listeners:
            client = stack.enter_context(socket.socket())
            client.connect(s.getsockname())
            accepted, _ = s.accept()
            accepted.close()  # this side closes first: TIME_WAIT on the port
        return [s.getsockname()[1] for s in listeners]
