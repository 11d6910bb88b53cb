"""The run diagnosis on runs it was not tuned on: `explain()` and the early
warning over the runs of `diagnosis_runs.py`, split by family.

    KERAS_BACKEND=jax python benchmarks/bench_run_diagnosis.py train
    KERAS_BACKEND=jax python benchmarks/bench_run_diagnosis.py report

`train` trains every run of the backend, once per seed (`--seeds`, default
1,2: the model's initialisation and its random ops; a healthy run once, with
the first), `--half held_out` only the held-out families, under
`NaNGuard(policy="stop", early_warning=True)` (the defaults otherwise) and
writes, per run, what the guard said (its explanation, its warnings) and its
flight record to `benchmarks/results/diagnosis/<backend>/` (`--only REGEX`:
some runs; `--jobs`: none, one process, the machine has 2 cores).
`report` reads them back and prints, per half (`tuning`, `held_out`):

- cause right: diverging runs (a rejected step; for `stalled`, none, by
  construction) whose `explain()` names the cause they were built with;
- warned ahead: of the warnable runs (diverging, not `bad_data`: a bad batch
  has no drift to see; first bad step at step 4 or later), those warned
  before their first bad step, with the warned cause right;
- the median lead in steps, and as a share of the steps to the first bad step;
- false warnings per 10,000 healthy steps, and healthy runs not `healthy`;
- stalled runs said `stalled`.

`report --replay` re-reads each stored record with the rules as they are now
(`explain` only: the warnings are the live ones, as NaNGuard's `explain()`
reads them), for changing rules against the tuning half without training
again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import diagnosis_runs as runs

BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")
OUT = Path(__file__).resolve().parent / "results" / "diagnosis"
WARNABLE_FROM = 4  # the first bad step: a read two executions after step 1


def train(
    only: str | None, seeds: list[int], half: str | None, skip_done: bool
) -> None:
    import keras

    import keras_nanguard as ng

    out = OUT / BACKEND
    out.mkdir(parents=True, exist_ok=True)
    todo = [
        (name, spec, seed)
        for name, spec in runs.SPECS.items()
        for seed in (seeds if spec.cause != "healthy" else seeds[:1])
        if BACKEND in spec.backends
        and (half is None or spec.half == half)
        and (only is None or re.search(only, name))
    ]
    for spec_name, spec, seed in todo:
        name = f"{spec_name}#{seed}"
        path = out / f"{name.replace('/', '__').replace('#', '.')}.json"
        if skip_done and path.exists():
            continue
        keras.backend.clear_session()
        guard = ng.NaNGuard(policy="stop", early_warning=True, verbose=0)
        start = time.perf_counter()
        result: dict = {"name": name, "family": spec.family, "cause": spec.cause}
        try:
            spec.train(guard, seed)
        except Exception as e:  # a run that cannot train is reported, not hidden
            result["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        result["seconds"] = time.perf_counter() - start
        found = guard.explain()
        warnings = [
            i
            for i in guard.incidents
            if i.kind in ("divergence_warning", "stall_warning")
        ]
        result["explained"] = found.to_dict()
        result["warnings"] = [w.diagnosis.to_dict() for w in warnings]
        record = guard.flight_record
        if record is not None:
            np.savez_compressed(
                out / f"{name.replace('/', '__').replace('#', '.')}.npz",
                rows=record.rows,
                columns=np.array(record.columns),
                blocks=np.array(record.blocks),
                recurrent=np.array(record.recurrent),
            )
            loss = record.column("loss")
            result["steps"] = int(record.column("step").max()) if len(record) else 0
            finite = loss[np.isfinite(loss)]
            if len(finite) >= 8:
                result["loss_first"] = float(np.median(finite[:4]))
                result["loss_last"] = float(np.median(finite[-4:]))
        path.write_text(json.dumps(result, indent=1))
        w = result["warnings"][0] if result["warnings"] else None
        print(
            f"{name:55s} {spec.cause:24s} -> {found.cause:24s} bad={found.first_bad_step} "
            f"warn={None if w is None else (w['at_step'], w['cause'])} "
            f"steps={result.get('steps')} {result['seconds']:.1f}s",
            flush=True,
        )


def _load(replay: bool) -> list[dict]:
    from keras_nanguard.flight.reading import RunDiagnosis, diagnose_warned_run
    from keras_nanguard.flight.record import FlightRecord

    results = []
    for path in sorted((OUT / BACKEND).glob("*.json")):
        r = json.loads(path.read_text())
        if replay and path.with_suffix(".npz").exists():
            z = np.load(path.with_suffix(".npz"))
            record = FlightRecord(
                list(z["columns"]), list(z["blocks"]), list(z["recurrent"]), z["rows"]
            )
            given = RunDiagnosis(**r["warnings"][0]) if r["warnings"] else None
            r["explained"] = diagnose_warned_run(record, given).to_dict()
        results.append(r)
    return results


def figures(results: list[dict]) -> dict:
    """The figures of one half (see the module)."""
    diverging = [
        r
        for r in results
        if r["cause"] not in ("healthy", "stalled")
        and r["explained"]["first_bad_step"] is not None
    ]
    not_diverged = [
        f"{r['name']}: explained {r['explained']['cause']}"
        + (f", warned {r['warnings'][0]['cause']}" if r["warnings"] else "")
        for r in results
        if r["cause"] not in ("healthy", "stalled")
        and r["explained"]["first_bad_step"] is None
    ]
    right = [r for r in diverging if r["explained"]["cause"] == r["cause"]]
    warnable = [
        r
        for r in diverging
        if r["cause"] != "bad_data"
        and r["explained"]["first_bad_step"] >= WARNABLE_FROM
    ]
    ahead, leads, shares = [], [], []
    for r in warnable:
        w = r["warnings"][0] if r["warnings"] else None
        bad = r["explained"]["first_bad_step"]
        if w is not None and w["at_step"] < bad and w["cause"] == r["cause"]:
            ahead.append(r)
            leads.append(bad - w["at_step"])
            shares.append((bad - w["at_step"]) / bad)
    warned = [r for r in results if r["warnings"] and r["cause"] != "healthy"]
    agree = [r for r in warned if r["warnings"][0]["cause"] == r["explained"]["cause"]]
    low = [r for r in diverging if r["explained"].get("confidence") == "low"]
    healthy = [r for r in results if r["cause"] == "healthy"]
    healthy_steps = sum(r.get("steps", 0) for r in healthy)
    false = [r for r in healthy if r["warnings"]]
    sick = [r for r in healthy if r["explained"]["cause"] != "healthy"]
    stalled = [r for r in results if r["cause"] == "stalled"]
    stalled_named = [r for r in stalled if r["explained"]["cause"] == "stalled"]
    return {
        "runs": len(results),
        "diverging": len(diverging),
        "not_diverged": not_diverged,
        "cause_right": len(right),
        "misnamed": sorted(
            f"{r['name']}: {r['explained']['cause']}"
            for r in diverging
            if r not in right
        ),
        "warnable": len(warnable),
        "warned_ahead": len(ahead),
        "unwarned": sorted(
            f"{r['name']}: {(r['warnings'][0]['at_step'], r['warnings'][0]['cause']) if r['warnings'] else None}"
            f" bad={r['explained']['first_bad_step']}"
            for r in warnable
            if r not in ahead
        ),
        "median_lead": float(np.median(leads)) if leads else None,
        "median_lead_share": float(np.median(shares)) if shares else None,
        "warned": len(warned),
        "agree": len(agree),
        "disagree": sorted(
            f"{r['name']}: warned {r['warnings'][0]['cause']}, explained "
            f"{r['explained']['cause']}"
            for r in warned
            if r not in agree
        ),
        "low_confidence": len(low),
        "healthy": len(healthy),
        "healthy_steps": healthy_steps,
        "false_warnings": len(false),
        "false_per_10k": 1e4 * len(false) / max(healthy_steps, 1),
        "healthy_not_healthy": sorted(
            f"{r['name']}: {r['explained']['cause']}"
            + (f" (warned {r['warnings'][0]['cause']})" if r["warnings"] else "")
            for r in healthy
            if r in sick or r in false
        ),
        "stalled": len(stalled),
        "stalled_named": len(stalled_named),
        "stalled_missed": sorted(
            f"{r['name']}: {r['explained']['cause']}"
            for r in stalled
            if r not in stalled_named
        ),
        "errors": sorted(f"{r['name']}: {r['error']}" for r in results if "error" in r),
    }


def report(replay: bool) -> None:
    results = _load(replay)
    halves = {
        "tuning": [r for r in results if r["family"] in runs.TUNING],
        "held_out": [r for r in results if r["family"] in runs.HELD_OUT],
    }
    print(f"\n### Run diagnosis, {BACKEND}: {len(results)} runs\n")
    print("| | tuning | held out |")
    print("|---|---|---|")
    f = {h: figures(rs) for h, rs in halves.items()}

    def pct(a: int, b: int) -> str:
        return f"{a}/{b} ({100 * a / b:.0f}%)" if b else "-"

    rows = [
        (
            "cause right (diverging runs)",
            lambda x: pct(x["cause_right"], x["diverging"]),
        ),
        (
            "warned ahead (warnable runs)",
            lambda x: pct(x["warned_ahead"], x["warnable"]),
        ),
        ("median lead, steps", lambda x: x["median_lead"]),
        (
            "median lead, share of the steps to failure",
            lambda x: (
                None
                if x["median_lead_share"] is None
                else f"{x['median_lead_share']:.2f}"
            ),
        ),
        (
            "built to diverge, stayed finite (left out above)",
            lambda x: len(x["not_diverged"]),
        ),
        (
            "warned runs: the warning and explain() name the same cause",
            lambda x: pct(x["agree"], x["warned"]),
        ),
        ("diverging runs said with low confidence", lambda x: x["low_confidence"]),
        (
            "healthy runs said healthy, no warning",
            lambda x: pct(x["healthy"] - len(x["healthy_not_healthy"]), x["healthy"]),
        ),
        (
            "false warnings per 10,000 healthy steps",
            lambda x: (
                f"{x['false_per_10k']:.2f} ({x['false_warnings']} in {x['healthy_steps']} steps)"
            ),
        ),
        ("stalled runs said stalled", lambda x: pct(x["stalled_named"], x["stalled"])),
    ]
    for label, get in rows:
        print(f"| {label} | {get(f['tuning'])} | {get(f['held_out'])} |")
    for half, x in f.items():
        print(f"\n{half}:")
        for key in (
            "misnamed",
            "unwarned",
            "disagree",
            "healthy_not_healthy",
            "stalled_missed",
            "not_diverged",
            "errors",
        ):
            if x[key]:
                print(f"  {key}:")
                for line in x[key]:
                    print(f"    - {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("train", "report"))
    parser.add_argument("--only", default=None)
    parser.add_argument("--replay", action="store_true")
    parser.add_argument(
        "--seeds", default="1,2", help="each run once per seed (healthy: the first)"
    )
    parser.add_argument("--half", choices=("tuning", "held_out"), default=None)
    parser.add_argument("--skip-done", action="store_true", help="keep runs written")
    args = parser.parse_args()
    if args.what == "train":
        seeds = [int(n) for n in args.seeds.split(",")]
        train(args.only, seeds, args.half, args.skip_done)
    else:
        report(args.replay)


if __name__ == "__main__":
    main()
