"""How good is the planner users get? Out-of-sample validation over three GPT sizes on 2 CPU ranks.

One run, one command (about 15 minutes on a quiet 2-core machine):

    python experiments/validate_cost_model.py --out experiments/results/validate_cost_model-1.json

1. ``osdp calibrate --full --force`` in its own processes, into a cache of this run's own (``OSDP_CACHE_DIR``):
   the calibration ``osdp.wrap`` would measure on first use;
2. for each model, described as ``osdp.plan`` describes it (``osdp validate --describe-only``), into the same
   cache, in processes of their own, then ``osdp validate``: every default plan (DDP, ZeRO-2, FSDP,
   checkpointing, splits, mixed; twelve, selective checkpointing among them), two plans taking every other block apart
   (``osdp.cli.validate.per_block_plans``) and two gathering blocks two at a time (``grouped_plans``), predicted
   exactly as ``osdp.wrap`` predicts, from the cached calibration and descriptions (nothing measured in the
   validating run enters a prediction; the run checks that the descriptions came from the cache), then
   trained for real (gpt2-cpu-medium's one plan at a time, three passes: ``osdp validate --at-once 1
   --passes 3``);
3. the default ``osdp train`` run (gpt2-tiny, OSDP at its default budget): its plan's predicted step against
   its measured median.

Three runs give the spread; a target met in one run of three is not met:

    python experiments/validate_cost_model.py --spread experiments/results/validate_cost_model-{1,2,3}.json

Targets (docs/COST_MODEL.md): peak memory median error <= 5%, worst <= 10%, never more than 2% under the
measured peak; step time median <= 10%, worst <= 20%, Kendall tau of the time ranking >= 0.8; the default
``osdp train`` run's predicted step within 15% of its measured median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from osdp.cli.validate import format_drift, format_report, summarize
from osdp.machine.identity import machine_info

RESULTS = Path(__file__).parent / "results"
# (model, micro-batch, sequence length, seconds of timed steps per plan, plans alive at a time (0: all), passes)
MODELS = {
    "gpt2-tiny": (8, 64, 6.0, 0, 1),
    "gpt2-mini": (8, 128, 8.0, 0, 1),
    # each plan alone, as a user trains it: with all sixteen alive in one process the plan gathering blocks two
    # at a time paid page faults each step, a third longer than alone (osdp.runtime.jobs; runs 29-34's miss);
    # three passes, so that the machine's drift over the minutes it takes slows every plan alike (run 36)
    "gpt2-cpu-medium": (4, 128, 12.0, 1, 3),
}
TARGETS = {"peak_error_median": 0.05, "peak_error_worst": 0.10, "step_error_median": 0.10, "step_error_worst": 0.20}
UNDER_BY_AT_MOST = 0.02  # a plan's measured peak may exceed its prediction by this much, no more
KENDALL_TAU = 0.8
TRAIN_STEP_ERROR = 0.15


def wait_for_quiet(max_load: float, timeout_s: float) -> float:
    """Wait (up to ``timeout_s``) until the 1-minute load average is below ``max_load``; return it.

    The machines are shared: other jobs' CPU use slows the measured plans, and
    gloo collectives far more than compute (both ranks must be running at once).
    """
    deadline = time.time() + timeout_s
    while os.getloadavg()[0] > max_load and time.time() < deadline:
        time.sleep(10)
    return os.getloadavg()[0]


def _run(cmd: list[str], env: dict[str, str]) -> None:
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def calibrate(nproc: int, env: dict[str, str], out: Path) -> dict[str, Any]:
    _run([sys.executable, "-m", "osdp.cli", "calibrate", "--full", "--nproc", str(nproc), "--force", "--json", str(out)], env)
    return json.loads(out.read_text())


def describe(model: str, batch: int, seq: int, nproc: int, env: dict[str, str]) -> None:
    """The model described as osdp.plan describes it, into the run's cache, in processes of its own."""
    _run([sys.executable, "-m", "osdp.cli", "validate", "--model", model, "--nproc", str(nproc), "--batch-size",
          str(batch), "--seq-len", str(seq), "--describe-only"], env)


def validate(model: str, batch: int, seq: int, budget: float, at_once: int, passes: int, nproc: int,
             env: dict[str, str], out: Path) -> dict:
    _run([sys.executable, "-m", "osdp.cli", "validate", "--model", model, "--nproc", str(nproc), "--batch-size",
          str(batch), "--seq-len", str(seq), "--time-budget", str(budget), "--json", str(out)]
         + (["--at-once", str(at_once), "--passes", str(passes)] if at_once else []), env)
    result = json.loads(out.read_text())
    if not all(d["from_cache"] for d in result["description"].values()):
        raise RuntimeError(f"{model}: the validating run described the model itself; it must find the earlier "
                           "process's description in the cache")
    return result


def train(nproc: int, env: dict[str, str], out: Path) -> dict[str, Any]:
    """The default ``osdp train`` run, as a new user runs it."""
    _run([sys.executable, "-m", "osdp.cli", "train", "--nproc", str(nproc), "--json", str(out)], env)
    record = json.loads(out.read_text())
    predicted, measured = record["predicted_step_s"], record["measured_step_s"]
    return {"predicted_step_s": predicted, "measured_step_s": measured, "step_error": predicted / measured - 1,
            "plan": record["plan"], "steps": record["steps"]}


def verdicts(summary: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, bool]:
    out = {k: summary[k] <= v for k, v in TARGETS.items()}
    out["peak_never_under"] = all(r["measured_peak_bytes"] <= (1 + UNDER_BY_AT_MOST) * r["predicted_peak_bytes"]
                                  for r in records)
    out["kendall_tau_step"] = summary["kendall_tau_step"] >= KENDALL_TAU
    return out


def verdict_text(summary: dict[str, Any], records: list[dict[str, Any]]) -> str:
    v = verdicts(summary, records)
    missed = [f"{k} {summary[k]:.1%} > {TARGETS[k]:.0%}" for k in TARGETS if not v[k]]
    if not v["peak_never_under"]:
        worst = max(r["measured_peak_bytes"] / r["predicted_peak_bytes"] - 1 for r in records)
        missed.append(f"a measured peak {worst:.1%} over its prediction (> {UNDER_BY_AT_MOST:.0%})")
    if not v["kendall_tau_step"]:
        missed.append(f"Kendall tau {summary['kendall_tau_step']:.2f} < {KENDALL_TAU}")
    return "all targets met" if not missed else "missed: " + "; ".join(missed)


def run(args: argparse.Namespace) -> None:
    start = time.time()
    results, loads = {}, {}
    with tempfile.TemporaryDirectory(prefix="osdp-validate-") as tmp:
        # this run's own cache: its calibration and descriptions are measured by this run, not borrowed
        env = dict(os.environ, OMP_NUM_THREADS="1", OSDP_CACHE_DIR=str(Path(tmp) / "cache"))
        env.pop("OSDP_CALIBRATION_PROFILE", None)
        before = wait_for_quiet(args.quiet_load, args.quiet_timeout)
        calibration = calibrate(args.nproc, env, Path(tmp) / "calibration.json")
        loads["calibration"] = (before, os.getloadavg()[0])
        for m in args.models:
            before = wait_for_quiet(args.quiet_load, args.quiet_timeout)
            # just before its validation: a shared machine's speed drifts over minutes (runs 29-34: up to 14%,
            # every plan alike), and the describe's timings are what every prediction scales
            describe(m, *MODELS[m][:2], args.nproc, env)
            results[m] = validate(m, *MODELS[m], args.nproc, env, Path(tmp) / f"{m}.json")
            loads[m] = (before, os.getloadavg()[0])
        before = wait_for_quiet(args.quiet_load, args.quiet_timeout)
        default_train = train(args.nproc, env, Path(tmp) / "train.json") if not args.no_train else None
        loads["train"] = (before, os.getloadavg()[0])
    seconds = time.time() - start
    machine = {**machine_info(), "processor": next(iter(results.values()))["machine"]["processor"]}
    lines = [
        "# Cost model vs measurement, out of sample",
        "",
        f"`python experiments/validate_cost_model.py`, {args.nproc} gloo ranks, 1 thread each, "
        f"{machine['processor']}, {machine['platform']}, torch {machine['torch']}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}, {seconds:.0f} s; load average at the end "
        f"{machine['load_average'][0]:.1f} on {machine['cores']} cores.",
        "",
        f"Calibration (`osdp calibrate`, its own processes, {calibration['seconds']:.0f} s, load average "
        f"{loads['calibration'][0]:.1f} before): compute x{calibration['calibration']['compute_scale']:.2f}; "
        "per unit (ms) " + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in calibration["calibration"]["unit_overhead_s"].items())
        + f"; margin {calibration['calibration']['margin_bytes']} B.",
        "",
    ]
    for model, r in results.items():
        batch, seq = MODELS[model][:2]
        lines += [f"## {model} (micro-batch {batch}, sequence {seq}, {len(r['records'])} plans, "
                  f"load average {loads[model][0]:.1f} before, {loads[model][1]:.1f} after)", "", "```",
                  format_report(r["records"], r["summary"]), format_drift(r["drift"]), "```", "",
                  verdict_text(r["summary"], r["records"]), ""]
    if default_train:
        t = default_train
        lines += ["## The default `osdp train` run", "",
                  f"predicted step {1e3 * t['predicted_step_s']:.1f} ms, measured {1e3 * t['measured_step_s']:.1f} ms "
                  f"(median of the slowest rank): {t['step_error']:+.1%} "
                  f"({'within' if abs(t['step_error']) <= TRAIN_STEP_ERROR else 'NOT within'} "
                  f"{TRAIN_STEP_ERROR:.0%})", ""]
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(
        {"machine": machine, "targets": TARGETS, "load_average": loads, "seconds": seconds,
         "calibration": calibration, "results": results, "train": default_train}, indent=1, default=str
    ))
    args.out.with_suffix(".md").write_text(text)


def spread(paths: list[Path], without: tuple[str, ...] = ()) -> str:
    """Per model and target: the value in every run, and whether it was met in all of them (the summaries
    recomputed from the records, as this code summarizes); ``without``: leave out the plans whose names start so."""
    runs = [json.loads(p.read_text()) for p in paths]
    for res in (res for r in runs for res in r["results"].values()):
        res["records"] = [x for x in res["records"] if not (without and x["plan"].startswith(without))]
        res["summary"] = summarize(res["records"])
    title = f"# Spread over {len(runs)} validation runs" + (f", without the plans {', '.join(without)}*" if without else "")
    lines = [title, "",
             "Runs: " + "; ".join(f"{p.name} ({r['seconds']:.0f} s, calibration compute "
                                  f"x{r['calibration']['calibration']['compute_scale']:.2f})" for p, r in zip(paths, runs)),
             "", "| model | quantity | target | " + " | ".join(f"run {i + 1}" for i in range(len(runs)))
             + " | met in every run |", "|" + "---|" * (4 + len(runs))]
    quantities = [("step_error_median", "time err median", "<= 10%"), ("step_error_worst", "time err worst", "<= 20%"),
                  ("kendall_tau_step", "Kendall tau", ">= 0.8"), ("peak_error_median", "peak err median", "<= 5%"),
                  ("peak_error_worst", "peak err worst", "<= 10%"), ("peak_under", "peak under measured, worst", "<= 2%")]
    for model in runs[0]["results"]:
        for key, label, target in quantities:
            values, met = [], []
            for r in runs:
                res = r["results"][model]
                if key == "peak_under":
                    value = max(x["measured_peak_bytes"] / x["predicted_peak_bytes"] - 1 for x in res["records"])
                    ok = value <= UNDER_BY_AT_MOST
                else:
                    value = res["summary"][key]
                    ok = verdicts(res["summary"], res["records"])[key]
                values.append(f"{value:.2f}" if key == "kendall_tau_step" else f"{value:+.1%}" if key == "peak_under"
                              else f"{value:.1%}")
                met.append(ok)
            lines.append(f"| {model} | {label} | {target} | " + " | ".join(values) + f" | {'yes' if all(met) else 'NO'} |")
    trains = [r["train"] for r in runs if r.get("train")]
    if trains:
        errs = [t["step_error"] for t in trains]
        lines.append("| default `osdp train` | predicted vs measured step | within 15% | "
                     + " | ".join(f"{e:+.1%}" for e in errs)
                     + f" | {'yes' if all(abs(e) <= TRAIN_STEP_ERROR for e in errs) else 'NO'} |")
    worst_med = {m: statistics.median(r["results"][m]["summary"]["step_error_median"] for r in runs) for m in runs[0]["results"]}
    lines += ["", "Median over runs of the median time error: "
              + ", ".join(f"{m} {v:.1%}" for m, v in worst_med.items()), ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "validate_cost_model.json")
    p.add_argument("--no-train", action="store_true", help="leave out the default osdp train run")
    p.add_argument("--quiet-load", type=float, default=2.5,
                   help="wait until the 1-minute load average is below this before each part (default 2.5)")
    p.add_argument("--quiet-timeout", type=float, default=900, help="seconds to wait for that at most")
    p.add_argument("--spread", nargs="+", type=Path, metavar="RUN_JSON",
                   help="run nothing: the spread over these runs' JSON (written next to the first, as .spread.md)")
    p.add_argument("--without", nargs="+", default=[], metavar="PREFIX",
                   help="with --spread: leave out the plans whose names start so (e.g. per-block)")
    args = p.parse_args()
    if args.spread:
        text = spread(args.spread, tuple(args.without))
        print(text)
        suffix = ".spread.md" if not args.without else f".spread-without-{'-'.join(args.without)}.md"
        args.spread[0].with_suffix(suffix).write_text(text)
        return
    run(args)


if __name__ == "__main__":
    main()
