"""How far the machine's speed moves between a calibration and a validating run a minute later, and what that
does to the plans' step-time errors relative to each other: the validation test's pair
(tests/cli/test_validate.py), run after run.

    python experiments/validation_drift.py --runs 5 --out experiments/results/validation_drift.jsonl

Each run: a quick calibration (``osdp calibrate --force``'s, two ranks of their own), then ``osdp validate``
of gpt2-tiny at 8 x 64 over the test's plans (two more ranks), which trains four of the calibration's own jobs
beside the plans (``osdp.cli.validate.drift_jobs``). One JSON line per run: the jobs' times now over then and
their median (``drift``), each plan's predicted and measured step, its error and its error relative to the
run's median ratio (what the test judges), and the calibration's split terms. The table printed at the end
puts the drift beside the relative errors' median and worst.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from osdp.distributed.local_ranks import run_local_ranks
from osdp.report import format_table

PLANS = ["ddp", "fsdp", "fsdp-ckpt", "mixed-z2-ckpt", "fsdp-sac", "mixed-sac", "split2", "per-block-b"]
BATCH, SEQ, TIME_PER_PLAN_S = 8, 64, 1.5


def _calibrate(rank: int, world_size: int) -> dict:
    from osdp.calibration.measured import calibrate

    return calibrate(torch.device("cpu"), force=True, profile="quick", progress=False).to_dict()


def _validate(rank: int, world_size: int) -> dict:
    from osdp.cli.validate import validate

    return validate("gpt2-tiny", device=torch.device("cpu"), batch_size=BATCH, seq_len=SEQ, plan_names=PLANS,
                    time_budget_s=TIME_PER_PLAN_S)


def one_run(index: int) -> dict:
    start = time.perf_counter()
    calibration = run_local_ranks(_calibrate, 2, timeout_s=600, threads=1, pin=True)[0]
    calibrated_s = time.perf_counter() - start
    result = run_local_ranks(_validate, 2, timeout_s=600, threads=1, pin=True)[0]
    errors = {r["plan"]: r["step_error"] for r in result["records"]}
    median_ratio = statistics.median(1 + e for e in errors.values())
    relative = {name: (1 + e) / median_ratio - 1 for name, e in errors.items()}
    terms = calibration["calibration"]
    return {
        "run": index,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "calibration_s": round(calibrated_s, 1),
        "validation_s": round(time.perf_counter() - start - calibrated_s, 1),
        "drift": result["drift"],
        "median_ratio": median_ratio,
        "relative_error_median": statistics.median(map(abs, relative.values())),
        "relative_error_worst": max(map(abs, relative.values())),
        "relative_errors": relative,
        "step_errors": errors,
        "predicted_step_s": {r["plan"]: r["predicted_step_s"] for r in result["records"]},
        "measured_step_s": {r["plan"]: r["measured_step_s"] for r in result["records"]},
        "split_terms": {k: terms[k] for k in ("slice_overhead_s", "slice_s_per_byte", "slice_contention")},
        "load_average": os.getloadavg(),
    }


def table(rows: list[dict]) -> str:
    return format_table(
        [[str(r["run"]), f"x{r['drift']['ratio']:.2f}", "yes" if r["drift"]["changed"] else "no",
          f"{r['median_ratio']:.2f}", f"{r['relative_error_median']:.1%}", f"{r['relative_error_worst']:.1%}",
          max(r["relative_errors"], key=lambda n: abs(r["relative_errors"][n]))] for r in rows],
        ["run", "drift", "changed", "pred/meas", "rel. median", "rel. worst", "worst plan"], "rrrrrrl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True, help="JSON lines, one per run (appended)")
    args = ap.parse_args()
    os.environ["OSDP_CACHE_DIR"] = tempfile.mkdtemp(prefix="osdp-drift-")  # the describes, measured once
    os.environ["OSDP_CALIBRATION_PROFILE"] = "quick"  # the calibration a small model's first run measures
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(args.runs):
        rows.append(one_run(i))
        with args.out.open("a") as f:
            f.write(json.dumps(rows[-1]) + "\n")
        print(table(rows[-1:]), flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
