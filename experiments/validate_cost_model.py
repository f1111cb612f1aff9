"""How good is the cost model? ``osdp validate`` over three GPT sizes on 2 CPU ranks.

For each model: every default plan (DDP, zero2, FSDP, checkpointing, split,
mixed) is trained for real on 2 local gloo ranks, interleaved in rounds with
the calibration jobs and the plain model's compute, and its measured median
step time and peak memory per rank are compared with the prediction.
Targets (docs/COST_MODEL.md): peak memory median error <= 5%, worst <= 10%;
step time median <= 10%, worst <= 20%; Kendall tau of the time ranking >= 0.8.

Writes experiments/results/validate_cost_model.json (every record) and
validate_cost_model.md (the tables). Run: python experiments/validate_cost_model.py
(about 15 minutes on a quiet 2-core machine; --models to choose).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from osdp.validate import format_report

RESULTS = Path(__file__).parent / "results"
# (model, micro-batch, sequence length, seconds of timed steps per plan)
MODELS = {
    "gpt2-tiny": (8, 64, 6.0),
    "gpt2-mini": (8, 128, 8.0),
    "gpt2-cpu-medium": (4, 128, 12.0),
}
TARGETS = {"peak_error_median": 0.05, "peak_error_worst": 0.10, "step_error_median": 0.10, "step_error_worst": 0.20}


def wait_for_quiet(max_load: float, timeout_s: float) -> float:
    """Wait (up to ``timeout_s``) until the 1-minute load average is below ``max_load``; return it.

    The machines are shared: other jobs' CPU use slows the measured plans, and
    gloo collectives far more than compute (both ranks must be running at once).
    """
    deadline = time.time() + timeout_s
    while os.getloadavg()[0] > max_load and time.time() < deadline:
        time.sleep(10)
    return os.getloadavg()[0]


def run(model: str, batch: int, seq: int, budget: float, nproc: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "osdp.validate", "--model", model, "--nproc", str(nproc),
               "--batch-size", str(batch), "--seq-len", str(seq), "--time-budget", str(budget),
               "--rounds", str(rounds), "--json", str(out)]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        return json.loads(out.read_text())


def verdict(summary: dict) -> str:
    missed = [f"{k} {summary[k]:.1%} > {v:.0%}" for k, v in TARGETS.items() if summary[k] > v]
    if summary["kendall_tau_step"] < 0.8:
        missed.append(f"Kendall tau {summary['kendall_tau_step']:.2f} < 0.8")
    return "all targets met" if not missed else "missed: " + "; ".join(missed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", type=Path, default=RESULTS / "validate_cost_model.json")
    p.add_argument("--quiet-load", type=float, default=2.5,
                   help="wait until the 1-minute load average is below this before each model (default 2.5)")
    p.add_argument("--quiet-timeout", type=float, default=900, help="seconds to wait for that at most")
    args = p.parse_args()
    start = time.time()
    results, loads = {}, {}
    for m in args.models:
        before = wait_for_quiet(args.quiet_load, args.quiet_timeout)
        results[m] = run(m, *MODELS[m], args.nproc, args.rounds)
        loads[m] = (before, os.getloadavg()[0])
    load = os.getloadavg()
    machine = {
        "platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "processor": next(iter(results.values()))["machine"]["processor"], "load_average_at_end": load,
    }
    lines = [
        "# Cost model vs measurement",
        "",
        f"`python experiments/validate_cost_model.py`, {args.nproc} gloo ranks, 1 thread each, "
        f"{machine['processor']}, {machine['platform']}, torch {machine['torch']}, "
        f"{time.strftime('%Y-%m-%d')}, {time.time() - start:.0f} s; load average at the end "
        f"{load[0]:.1f} on {machine['cpus']} cores (a shared machine).",
        "",
    ]
    for model, r in results.items():
        batch, seq, _ = MODELS[model]
        lines += [f"## {model} (micro-batch {batch}, sequence {seq}, {len(r['records'])} plans, "
                  f"load average {loads[model][0]:.1f} before, {loads[model][1]:.1f} after)", "", "```",
                  format_report(r["records"], r["summary"]), "```", "", verdict(r["summary"]), ""]
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(
        {"machine": machine, "targets": TARGETS, "load_average": loads, "results": results}, indent=1, default=str
    ))
    args.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
