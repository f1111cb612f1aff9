"""Throughput-vs-memory curves of OSDP against the baselines users run, from one command.

    python experiments/sweep.py --quick    # gpt2-mini, both links, 2 CPU ranks
    python experiments/sweep.py --full     # gpt2-mini and gpt2-cpu-medium, more budgets and repeats

For each reference model and each link (``loopback``: gloo over 127.0.0.1;
``gpu-ratio``: the two ranks in their own network namespaces joined by a veth
pair shaped with tc tbf, its rate calibrated until this core's FLOP/s over
the link's measured all-gather bytes/s is an 8x H100 NVLink node's ratio
within 10%, see ``netns.py``), one process group (``run.py``) measures the
link, describes the model, measures torch-ddp's peak, plans OSDP at budgets
from the least any plan needs (predicted) up to torch-ddp's measured peak,
and trains every run in interleaved repeats: the six baselines of
``baselines.py``, OSDP at every budget (each budget its own run), OSDP's own
uniform plans (an ablation, ``--no-ablation`` leaves them out) and the
compute-only reference. Every reduction uses ``osdp.distributed.collectives``'s reduce-scatter
(``--reduce-scatter``, default ``pairwise``: NCCL's traffic on gloo), for
every strategy alike. A baseline's throughput does not depend on the budget:
it is placed at every budget, as fitting where its measured peak is within
the budget and as "does not fit (needs X)" elsewhere.

One part at a time (``--full --models gpt2-cpu-medium --links gpu-ratio --out DIR``, each part as the whole
profile runs it), then one report: ``--merge DIR1 DIR2 ... --out DIR``.

Writes to ``--out`` (default experiments/results/sweep-quick or sweep-full):
``runs.json`` (every record), ``sweep.csv``, ``summary.md`` (the tables, OSDP /
best fitting baseline, the targets) and the PNG figures of ``plots.py``.

``sweep.csv``: one row per model, link, strategy and budget.

| column | meaning |
|---|---|
| model, world_size, link | the part |
| strategy | ``osdp``; a baseline: ``torch-ddp``, ``fsdp2``, ``fsdp2-zero2``, each also ``+ac``; the ablation ``osdp-uniform-ddp``, ``-zero2``, ``-fsdp``; ``fairscale`` (CUDA) |
| budget_bytes | the per-rank memory budget of the row |
| fits | measured peak <= budget (for OSDP also: a plan was found) |
| tokens_per_s | tokens per second per rank, median over repeats |
| peak_bytes | measured peak per rank, largest over ranks and repeats |
| predicted_tokens_per_s, predicted_peak_bytes, predicted_step_s | the cost model's (OSDP and the ablation; empty for baselines, which are no plans) |
| needs_bytes | what it needs: the measured peak, or the search's minimum where OSDP has no plan |
| status | ``fits``, ``does not fit (needs X)`` and why, or ``skipped: ...`` |
| efficiency | compute-only step / this step (the plain model, one rank, the same micro-batch, no communication), median over repeats of the paired ratio; 1.0 is the physical limit |
| tokens_per_s_min, tokens_per_s_max | the slowest and the fastest repeat |
| step_s_median, compute_step_s | this run's and the compute-only run's step time (s), medians over repeats |
| replicated_fraction, plan_hash, plan_summary | the plan (OSDP and the ablation) |
| timed_steps | timed steps per repeat (``;``-separated) |
| batch_size, seq_len | the micro-batch per rank |
| tokens_per_s_rounds | tokens/s of each repeat, in run order (``;``-separated) |
| reduce_scatter, all_gather | osdp.distributed.collectives's implementations every strategy used (``pairwise`` or ``native``) |
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as run_mod  # noqa: E402
from baselines import BASELINES  # noqa: E402

from osdp.machine.identity import machine_info, source_commit

RESULTS = HERE / "results"
# model -> (micro-batch per rank, sequence length)
PROFILES = {
    "quick": {"models": {"gpt2-mini": (8, 128)}, "budgets": 6, "rounds": 5, "time_per_run_s": 1.5},
    "full": {"models": {"gpt2-mini": (8, 128), "gpt2-cpu-medium": (4, 128)}, "budgets": 8, "rounds": 5,
             "time_per_run_s": 3.0},
}
LINKS = ("loopback", "gpu-ratio")
ABLATIONS = tuple(run_mod.ABLATIONS)
CSV_COLUMNS = [
    "model", "world_size", "link", "strategy", "budget_bytes", "fits", "tokens_per_s", "peak_bytes",
    "predicted_tokens_per_s", "predicted_peak_bytes", "needs_bytes", "status", "efficiency", "tokens_per_s_min",
    "tokens_per_s_max", "step_s_median", "compute_step_s", "predicted_step_s", "replicated_fraction", "plan_hash",
    "plan_summary", "timed_steps", "batch_size", "seq_len", "tokens_per_s_rounds", "reduce_scatter",
    "all_gather",
]
QUIET_LOAD = 2.5
# the targets: OSDP / best fitting baseline at every budget, at some budget
TARGET_EVERY, TARGET_SOME = 0.98, 1.10


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def does_not_fit(needs: int | None) -> str:
    return f"does not fit (needs {mib(needs)})"


# --------------------------------------------------------------------------- rows


def rows_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One CSV row per strategy and budget: baselines and the ablation placed at every OSDP budget."""
    records = result["records"]
    budgets = sorted({r["budget_bytes"] for r in records if r["strategy"] == "osdp"})
    compute = (result.get("compute_only") or {}).get("step_s_median")
    rows = []
    for rec in records:
        m = rec.get("measured") or {}
        base = {
            "model": rec["model"], "world_size": rec["world_size"], "link": rec["link"], "strategy": rec["strategy"],
            "tokens_per_s": m.get("tokens_per_s"), "peak_bytes": m.get("peak_bytes"),
            "predicted_tokens_per_s": rec.get("predicted_tokens_per_s"),
            "predicted_peak_bytes": rec.get("predicted_peak_bytes"), "efficiency": m.get("efficiency"),
            "tokens_per_s_min": min(m["tokens_per_s_rounds"]) if m else None,
            "tokens_per_s_max": max(m["tokens_per_s_rounds"]) if m else None,
            "tokens_per_s_rounds": ";".join(f"{x:.1f}" for x in m["tokens_per_s_rounds"]) if m else None,
            "step_s_median": m.get("step_s_median"), "compute_step_s": compute,
            "predicted_step_s": rec.get("predicted_step_s"),
            "replicated_fraction": rec.get("replicated_fraction"), "plan_hash": rec.get("plan_hash"),
            "plan_summary": rec.get("plan_summary"),
            "timed_steps": ";".join(str(x) for x in m["timed_steps"]) if m.get("timed_steps") else None,
            "batch_size": rec["batch_size"], "seq_len": rec["seq_len"], **run_mod.recorded_collectives(rec),
        }
        if rec["strategy"] == "osdp":
            budget = rec["budget_bytes"]
            if rec["status"] == "budget too small":
                needs = rec.get("needs_bytes")
                rows.append({**base, "budget_bytes": budget, "fits": False, "needs_bytes": needs,
                             "status": does_not_fit(needs) + ": no plan under the cost model"})
                continue
            needs = m.get("peak_bytes")
            fits = needs is not None and needs <= budget
            status = "fits" if fits else does_not_fit(needs) + ": planned to fit, measured over the budget"
            rows.append({**base, "budget_bytes": budget, "fits": fits, "needs_bytes": needs, "status": status})
            continue
        if not m:  # skipped (fairscale on CPU)
            for budget in budgets:
                rows.append({**base, "budget_bytes": budget, "fits": False, "needs_bytes": None,
                             "status": rec["status"]})
            continue
        needs = m["peak_bytes"]
        for budget in budgets:
            fits = needs <= budget
            rows.append({**base, "budget_bytes": budget, "fits": fits, "needs_bytes": needs,
                         "status": "fits" if fits else does_not_fit(needs)})
    return rows


def write_csv(rows: list[dict[str, Any]], path: Path, columns: Sequence[str] = CSV_COLUMNS) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})


# --------------------------------------------------------------------------- comparison and targets


def paired_ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """Median over repeats of a's tokens/s over b's in the same repeat (round r of every plan runs in the same
    pass over the plans, so a slow phase of the machine hits both): steadier than a ratio of medians."""
    ra, rb = a.get("tokens_per_s_rounds"), b.get("tokens_per_s_rounds")
    if not ra or not rb:
        return None
    ra, rb = ([float(x) for x in r.split(";")] if isinstance(r, str) else r for r in (ra, rb))
    return statistics.median(x / y for x, y in zip(ra, rb))


def compare(rows: list[dict[str, Any]], baselines: Sequence[str] = BASELINES) -> list[dict[str, Any]]:
    """Per budget of one (model, link): OSDP against the fastest of the ``baselines`` whose measured peak fits."""
    out = []
    for budget in sorted({r["budget_bytes"] for r in rows if r["strategy"] == "osdp"}):
        at = {r["strategy"]: r for r in rows if r["budget_bytes"] == budget}
        osdp = at["osdp"]
        fitting = [at[s] for s in (*baselines, "fairscale") if s in at and at[s]["fits"] and at[s]["tokens_per_s"]]
        best = max(fitting, key=lambda r: r["tokens_per_s"], default=None)
        t = osdp["tokens_per_s"] if osdp["fits"] else None
        out.append({
            "budget_bytes": budget,
            "osdp": osdp,
            "baselines": {s: at[s] for s in (*baselines, "fairscale") if s in at},
            "ablation": {s: at[s] for s in ABLATIONS if s in at},
            "best": best,
            "vs_best": paired_ratio(osdp, best) if (t and best) else None,
            "vs_best_of_medians": t / best["tokens_per_s"] if (t and best) else None,
            "peak_within_budget": osdp["peak_bytes"] is None or osdp["peak_bytes"] <= budget,
        })
    return out


def prediction_errors(rows: list[dict[str, Any]]) -> list[float]:
    """Predicted over measured tokens/s, less one, of every distinct plan that ran (one point per plan)."""
    seen, out = set(), []
    for r in rows:
        key = r.get("plan_hash") or r["strategy"]
        if key in seen or not r.get("tokens_per_s") or not r.get("predicted_tokens_per_s"):
            continue
        seen.add(key)
        out.append(r["predicted_tokens_per_s"] / r["tokens_per_s"] - 1)
    return out


def verdicts(comparison: list[dict[str, Any]], rows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The targets over one (model, link): OSDP >= 0.98x the best fitting baseline at every budget where one
    fits, >= 1.10x at some budget, measured peak within the budget everywhere; predicted tokens/s within 10%
    of measured (median over the plans that ran)."""
    errors = [abs(e) for e in prediction_errors(rows or [])]
    vs_best = [c["vs_best"] for c in comparison if c["vs_best"] is not None]
    missing = [c["budget_bytes"] for c in comparison if c["best"] is not None and c["vs_best"] is None]
    return {
        "osdp_vs_best_min": min(vs_best, default=None),
        "osdp_vs_best_max": max(vs_best, default=None),
        "osdp_vs_best_ok": bool(vs_best) and not missing and all(v >= TARGET_EVERY for v in vs_best),
        "osdp_gain_ok": any(v >= TARGET_SOME for v in vs_best),
        "peak_within_budget_ok": all(c["peak_within_budget"] for c in comparison),
        "budgets_without_osdp_plan": [c["budget_bytes"] for c in comparison if c["osdp"]["tokens_per_s"] is None],
        "budgets_where_no_baseline_fits": [c["budget_bytes"] for c in comparison if c["best"] is None],
        "prediction_error_median": statistics.median(errors) if errors else None,
        "prediction_error_worst": max(errors, default=None),
        "prediction_ok": bool(errors) and statistics.median(errors) <= 0.10,
    }


def cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    if r["fits"]:
        return f"{r['tokens_per_s']:,.0f}"
    if r["status"].startswith("skipped"):
        return "skipped (CUDA only)"
    return does_not_fit(r["needs_bytes"])


def _short(strategy: str) -> str:
    return strategy.replace("osdp-uniform-", "uniform ")


def summary_markdown(results: list[dict[str, Any]], rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# Sweep ({meta['profile']}): throughput per rank vs memory budget per rank", ""]
    lines += [f"- command: `{meta['command']}`",
              f"- date: {meta['date']}; took {meta['seconds'] / 60:.1f} min",
              f"- machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores, "
              f"{meta['machine']['platform']}; Python {meta['machine']['python']}, torch {meta['machine']['torch']}",
              f"- ranks: {meta['world_size']} CPU processes (gloo), 1 thread each; optimizer AdamW, fp32",
              f"- osdp source: {meta.get('osdp_source', 'not recorded')}",
              "- collectives (osdp.distributed.collectives, every strategy alike): "
              f"{run_mod.describe_collectives(run_mod.recorded_collectives(meta))}",
              f"- repeats: {meta['rounds']} interleaved repeats per run, each at least {meta.get('min_steps', '?')} "
              f"timed steps (~{meta['time_per_run_s']} s) after 2 warm-up steps, a step timed on the slowest rank; "
              "tokens/s are medians over repeats (in brackets: the slowest and fastest repeat); OSDP / best is the "
              "median over repeats of the ratio within the repeat (paired), the ratio of the medians beside it; "
              "efficiency = compute-only step (one rank, same micro-batch, no communication) / the run's step",
              f"- load average (1 min) before / after each part: "
              + "; ".join(f"{p['model']} {p['link']}: {p['load_before'][0]:.1f} / {p['load_after'][0]:.1f}"
                          for p in meta["parts"]),
              ""]
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for result in results:
        link = result["link"]
        mine = [r for r in rows if r["model"] == result["model"] and r["link"] == link["name"]]
        comparison = compare(mine)
        v = verdicts(comparison, mine)
        ratio = link.get("measured_flop_per_byte")
        lines += [f"## {result['model']}, {link['name']}: {link.get('label', '')}", ""]
        bw = link.get("measured_busbw_bytes_per_s", {})
        # the link's own bandwidth (the largest message's; the fit's in results from before it was recorded)
        link_bw = link.get("measured_largest_busbw_bytes_per_s") or bw.get("all_gather")
        lines += [f"Measured on this group: fp32 FLOP/s {result['device_info']['flops'].get('float32', 0) / 1e9:.0f} G "
                  f"per rank; all-gather busbw {bw.get('all_gather', 0) / 1e6:.0f} MB/s, reduce-scatter "
                  f"{bw.get('reduce_scatter', 0) / 1e6:.0f} MB/s, all-reduce {bw.get('all_reduce', 0) / 1e6:.0f} MB/s; "
                  + (f"{ratio:.0f} FLOP per byte of all-gather (the fitted beta's) with the FLOP/s measured in "
                     f"this run" if ratio else "")
                  + (f", {link['measured_largest_flop_per_byte']:.0f} at the largest message "
                     f"({link['measured_largest_busbw_bytes_per_s'] / 1e6:.0f} MB/s, the link's rate)"
                     if link.get("measured_largest_flop_per_byte") else "")
                  + (f"; {link['core_flops'] / link_bw:.0f} with the core's best FLOP/s "
                     f"({link['core_flops'] / 1e9:.0f} G, measured before the sweep; target "
                     f"{link['target_flop_per_byte']:.0f}, {link.get('ratio_of', '')})" if link.get("core_flops") and link_bw else "")
                  + ".",
                  f"Micro-batch {mine[0]['batch_size']} x {mine[0]['seq_len']} tokens per rank. Least budget any plan "
                  f"fits (predicted): {mib(result['lowest_budget_bytes'])}; torch-ddp needs "
                  f"{mib(result['ddp_needs_bytes'])} (measured). Compute-only: "
                  f"{result['compute_only']['tokens_per_s']:,.0f} tokens/s per rank.", ""]
        head = ["budget", "OSDP tokens/s", "OSDP peak", "OSDP efficiency", *BASELINES, "best baseline",
                "OSDP / best", "ratio of medians", "OSDP plan"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for c in comparison:
            o = c["osdp"]
            lines.append("| " + " | ".join([
                mib(c["budget_bytes"]),
                f"{o['tokens_per_s']:,.0f} ({o['tokens_per_s_min']:,.0f}..{o['tokens_per_s_max']:,.0f})"
                if o["tokens_per_s"] else does_not_fit(o["needs_bytes"]),
                mib(o["peak_bytes"]) + ("" if c["peak_within_budget"] else " **over**"),
                fmt(o.get("efficiency")),
                *[cell(c["baselines"].get(s)) for s in BASELINES],
                c["best"]["strategy"] if c["best"] else "none fits",
                fmt(c["vs_best"]), fmt(c["vs_best_of_medians"]),
                (o.get("plan_summary") or "").split(": ", 1)[-1],
            ]) + " |")
        runs = {r["strategy"]: r for r in mine if r["strategy"] != "osdp" and r["tokens_per_s"]}
        lines += ["", "Baselines and the ablation (OSDP's uniform plans), measured: " + "; ".join(
            f"{s} {r['tokens_per_s']:,.0f} tokens/s ({r['tokens_per_s_min']:,.0f}..{r['tokens_per_s_max']:,.0f}), "
            f"efficiency {fmt(r['efficiency'])}, peak {mib(r['peak_bytes'])}"
            + (f" (predicted {mib(r['predicted_peak_bytes'])})" if r.get("predicted_peak_bytes") else "")
            for s, r in runs.items()), ""]
        lines += [f"Targets: OSDP / best fitting baseline >= {TARGET_EVERY} at every budget where one fits: "
                  f"{'met' if v['osdp_vs_best_ok'] else 'MISSED'} (min {fmt(v['osdp_vs_best_min'])}); "
                  f">= {TARGET_SOME} at some budget: {'met' if v['osdp_gain_ok'] else 'MISSED'} "
                  f"(max {fmt(v['osdp_vs_best_max'])}); OSDP's measured peak within the budget: "
                  f"{'met' if v['peak_within_budget_ok'] else 'MISSED'}."
                  + (f" No baseline fits at {', '.join(mib(x) for x in v['budgets_where_no_baseline_fits'])}."
                     if v["budgets_where_no_baseline_fits"] else "")
                  + f" Predicted tokens/s within 10% of measured (median over the {len(prediction_errors(mine))} "
                  f"plans that ran): {'met' if v['prediction_ok'] else 'MISSED'} (median "
                  f"{fmt(v['prediction_error_median'])}, worst {fmt(v['prediction_error_worst'])}; the calibration: "
                  f"{result.get('calibration', {}).get('measured_at', 'not recorded')}).", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the sweep


def wait_for_quiet(minutes: float) -> None:
    if minutes <= 0:
        return
    deadline = time.time() + 60 * minutes
    while os.getloadavg()[0] > QUIET_LOAD and time.time() < deadline:
        print(f"sweep: load average {os.getloadavg()[0]:.1f} > {QUIET_LOAD}: waiting (up to "
              f"{(deadline - time.time()) / 60:.0f} more min)", flush=True)
        time.sleep(30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="gpt2-mini, both links (the default)")
    size.add_argument("--full", action="store_true", help="gpt2-mini and gpt2-cpu-medium, more budgets and repeats")
    ap.add_argument("--models", nargs="+", help="override the models (a model of the profile keeps its micro-batch and "
                    "sequence length; another gets micro-batch 8 at its own sequence length)")
    ap.add_argument("--links", nargs="+", default=list(LINKS), help="loopback, gpu-ratio, tbf:RATE (default both)")
    ap.add_argument("--budgets", type=int, help="number of OSDP budgets per model and link")
    ap.add_argument("--rounds", type=int, help="interleaved repeats per run")
    ap.add_argument("--time-per-run", type=float, help="seconds of timed steps per run and repeat (at least "
                    "--min-steps steps)")
    ap.add_argument("--min-steps", type=int, default=run_mod.MIN_STEPS, help="timed steps per run and repeat, at least")
    run_mod.add_collective_args(ap)
    ap.add_argument("--no-ablation", action="store_true", help="leave out OSDP's uniform plans (osdp-uniform-*)")
    ap.add_argument("--jobs-at-once", type=int, default=0,
                    help="models alive at once per repeat (0: all; fewer for large models)")
    ap.add_argument("--fairscale", action="store_true", help="also fairscale FSDP (CUDA only; skipped on CPU)")
    ap.add_argument("--link-rate", help="fix the gpu-ratio link's rate (e.g. 630mbit) instead of measuring FLOP/s")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="MIN",
                    help=f"before each part, wait up to MIN minutes for the 1-min load average to drop below {QUIET_LOAD}")
    ap.add_argument("--out", type=Path, help="output folder (default experiments/results/sweep-<quick|full>)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--from-runs", type=Path, metavar="DIR",
                    help="run nothing: rewrite DIR's sweep.csv, summary.md and figures from its runs.json")
    ap.add_argument("--merge", nargs="+", type=Path, metavar="PART_DIR",
                    help="run nothing: one report in --out from sweeps run a part at a time (their runs.json)")
    args = ap.parse_args(argv)
    if args.from_runs:
        return report(args.from_runs, plots=not args.no_plots)
    if args.merge:
        if not args.out:
            ap.error("--merge needs --out")
        return merge(args.merge, args.out, plots=not args.no_plots)
    profile_name = "full" if args.full else "quick"
    collectives = run_mod.collectives_from_args(args)
    profile = dict(PROFILES[profile_name])
    # one part of a profile (--full --models gpt2-cpu-medium) runs as it does in the whole profile
    models = profile["models"] if not args.models else {m: profile["models"].get(m, (8, None)) for m in args.models}
    budgets = args.budgets or profile["budgets"]
    rounds = args.rounds or profile["rounds"]
    per_run = args.time_per_run or profile["time_per_run_s"]
    out = args.out or RESULTS / f"sweep-{profile_name}"
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    command = "python experiments/sweep.py " + " ".join(argv if argv is not None else sys.argv[1:])

    wait_for_quiet(args.wait_quiet)  # the gpu-ratio link's rate comes from this core's FLOP/s: measure it quiet
    links = []
    for name in args.links:
        if name == "gpu-ratio" and args.link_rate:
            link = run_mod.resolve_link("tbf:" + args.link_rate)
            link.update(name="gpu-ratio", target_flop_per_byte=run_mod.gpu_flop_per_byte())
        else:
            link = run_mod.resolve_link(name)
        if link["kind"] == "veth":
            why = run_mod.netns.missing_tools()
            if why:
                print(f"sweep: skipping link {name}: {why}", file=sys.stderr)
                continue
            if name == "gpu-ratio" and not args.link_rate:
                print(f"sweep: calibrating {link['label']} against its largest all-gather message's bandwidth",
                      flush=True)
                link = run_mod.calibrate_gpu_ratio(link, collectives=collectives,
                                                   on_line=lambda line: print(f"  {line}", flush=True))
                link.pop("probe_device_info")
                if not link["calibrated"]:
                    print(f"sweep: WARNING: the gpu-ratio link is {link['probe_flop_per_byte']:.0f} FLOP/byte, not "
                          f"within 10% of the target {link['target_flop_per_byte']:.0f} in two probes in a row",
                          flush=True)
        links.append(link)
        print(f"sweep: link {link['name']}: {link['label']}"
              + (f" (this core: {link['core_flops'] / 1e9:.0f} GFLOP/s fp32)" if "core_flops" in link else ""), flush=True)

    results, parts, calibrations = [], [], {}
    # One cache per sweep: each model is described once, in this sweep, and shared by both links; each link
    # is calibrated once, in its own run before the measured ones (what osdp.wrap plans with on that link).
    with tempfile.TemporaryDirectory(prefix="osdp-sweep-cache-") as cache:
        env = dict(os.environ, OSDP_CACHE_DIR=cache, OMP_NUM_THREADS="1")
        for link in links:
            wait_for_quiet(args.wait_quiet)
            print(f"sweep: calibrating over {link['name']}", flush=True)
            got = run_mod.launch({"model": "gpt2-tiny", "batch_size": 1, "link": link, "calibrate": "force",
                                  **collectives}, env=env,
                                 on_line=lambda line: print(f"  {line}", flush=True))
            calibrations[link["name"]] = got["calibration"]
            print(f"sweep: {got['summary']}", flush=True)
            check_calibrated_link(link, got["calibration"])
        total = len(models) * len(links)
        for model, (batch, seq) in models.items():
            for link in links:
                wait_for_quiet(args.wait_quiet)
                n = len(parts) + 1
                t0 = time.time()
                print(f"sweep: [{n}/{total}] {model} over {link['name']} "
                      f"({(t0 - start) / 60:.1f} min so far, load {os.getloadavg()[0]:.1f})", flush=True)
                strategies = [*BASELINES, *([] if args.no_ablation else ABLATIONS),
                              *(["fairscale"] if args.fairscale else [])]
                spec = {"model": model, "batch_size": batch, "seq_len": seq, "strategies": strategies,
                        "auto_budgets": budgets, "rounds": rounds, "time_per_run_s": per_run,
                        "min_steps": args.min_steps, **collectives,
                        "jobs_at_once": args.jobs_at_once, "link": link}
                load_before = os.getloadavg()
                result = run_mod.launch(spec, env=env,
                                        on_line=lambda line: print(f"  {line}", flush=True))
                results.append(result)
                parts.append({"model": model, "link": link["name"], "load_before": load_before,
                              "load_after": os.getloadavg(), "seconds": time.time() - t0})
                print(f"sweep: [{n}/{total}] done in {(time.time() - t0) / 60:.1f} min", flush=True)

    meta = {"osdp_source": source_commit() or "unknown", "profile": profile_name, "command": command, "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "seconds": time.time() - start, "machine": results[0]["machine"] if results else machine_info(),
            "world_size": 2, "rounds": rounds, "time_per_run_s": per_run, "min_steps": args.min_steps,
            **collectives, "budgets": budgets, "parts": parts, "links": links,
            "calibrations": calibrations}
    (out / "runs.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    report(out, plots=not args.no_plots)
    print(f"sweep: wrote {out} in {(time.time() - start) / 60:.1f} min")
    return 0


def check_calibrated_link(link: dict[str, Any], calibration: dict[str, Any]) -> float | None:
    """The FLOP per byte of the largest all-gather message in the calibration the runs plan with, printed with a
    warning when more than 10% from the link's target (None for a link without one)."""
    if not link.get("target_flop_per_byte"):
        return None
    info = calibration["device_info"]
    flop_per_byte = info["flops"]["float32"] / run_mod.shaped_busbw(link, info)  # what calibrate_gpu_ratio aims
    off = flop_per_byte / link["target_flop_per_byte"] - 1
    print(f"sweep: {'WARNING: ' if abs(off) > 0.10 else ''}the calibration's link gives {flop_per_byte:.0f} FLOP "
          f"per byte of its largest all-gather message, {off:+.0%} from the target "
          f"{link['target_flop_per_byte']:.0f}", flush=True)
    return flop_per_byte


def merge(parts: Sequence[Path], out: Path, plots: bool = True) -> int:
    """One report from sweeps run a part at a time (``--full --models X --links Y``, each its own ``--out``):
    their records together in ``out/runs.json``, the meta saying where each part came from."""
    runs = [json.loads((p / "runs.json").read_text()) for p in parts]
    metas = [r["meta"] for r in runs]
    settings = {(m["profile"], m["rounds"], m["time_per_run_s"], *run_mod.recorded_collectives(m).values())
                for m in metas}
    if len(settings) > 1:
        raise SystemExit("sweep --merge: the parts were run with different settings (profile, repeats, time per "
                         "run or osdp.distributed.collectives's collectives); merge only parts of one profile")
    sources = sorted({m.get("osdp_source", "unknown") for m in metas})
    meta = {
        **metas[0],
        "osdp_source": ", ".join(sources),
        "command": "; ".join(m["command"] for m in metas) + f"; python experiments/sweep.py --merge ... --out {out}",
        "date": ", ".join(m["date"] for m in metas),
        "seconds": sum(m["seconds"] for m in metas),
        "parts": [{**part, "osdp_source": m.get("osdp_source"), "date": m["date"]} for m in metas for part in m["parts"]],
        "links": [link for m in metas for link in m["links"]],
        # keyed by part and link: two parts on one link (two models) were calibrated apart
        "calibrations": {f"{p.name} {k}": v for p, m in zip(parts, metas) for k, v in m.get("calibrations", {}).items()},
        "merged_from": [str(p) for p in parts],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs.json").write_text(json.dumps({"meta": meta, "results": [x for r in runs for x in r["results"]]},
                                              indent=1, default=str))
    return report(out, plots=plots)


def report(out: Path, plots: bool = True) -> int:
    """sweep.csv, summary.md and the figures from ``out/runs.json``."""
    data = json.loads((out / "runs.json").read_text())
    results, meta = data["results"], data["meta"]
    rows = [row for result in results for row in rows_of(result)]
    write_csv(rows, out / "sweep.csv")
    (out / "summary.md").write_text(summary_markdown(results, rows, meta))
    if plots:
        import plots as plots_mod

        plots_mod.plot_all(out)
    print((out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
