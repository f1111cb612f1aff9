"""OSDP against the multi-node baselines on two emulated nodes: 4 CPU ranks as 2 nodes x 2, across a shaped link.

    python experiments/sweep_nodes.py --quick   # gpt2-tiny, 3 budgets, 2 short repeats: checks the pipeline
    python experiments/sweep_nodes.py           # gpt2-mini, 6 budgets, 5 repeats: the experiment

The nodes are two network namespaces of two ranks each (``netns.py``, one
torchrun per namespace through ``run.launch``, so every rank has torchrun's
``LOCAL_WORLD_SIZE=2``). Ranks of a node talk over its loopback, unshaped;
ranks of different nodes through a veth pair whose egress is shaped with tc
tbf so that each rank has the FLOP per byte across nodes of an H100 node on
8x 400 Gb/s InfiniBand (``run.inter_node_flop_per_byte``: 9,675, osdp.machine's
``h100-nvlink-ndr400``), the rate calibrated until gloo's measured cross-node
all-gather bandwidth gives it within 10% (``--link-rate`` fixes the rate
instead; ``--quick`` takes the nominal one).

One process group (``run.py``) measures OSDP's calibration on this layout
first, in its own run (what ``osdp.wrap`` plans with: the world's collectives
and each level's, ``DeviceInfo.topology``), then per model describes it,
measures torch-ddp's peak and plans OSDP at budgets from the least any plan
needs (predicted) up to that peak, each budget its own run, searched over
world- and node-scoped units; and trains every run in interleaved repeats
beside the six baselines of ``baselines.MULTI_NODE_BASELINES`` (torch DDP,
FSDP2 per block over the world, FSDP2 HSDP per block, each with and without
full activation checkpointing) and the compute-only reference. A step takes
as long as the slowest rank; peaks are measured in the same runs.

Per budget it reports OSDP over the fastest baseline whose measured peak fits
and over FSDP2 across the world (the faster fitting of ``fsdp2`` and
``fsdp2+ac``), both the median over repeats of the ratio within a repeat, and
the issue's targets: OSDP >= 0.98x the best fitting baseline at every budget,
>= 1.2x FSDP across the world at some budget, measured peak <= budget.

Writes to ``--out`` (default experiments/results/sweep-nodes, with --quick
experiments/results/sweep-nodes/quick): ``runs.json`` (every record),
``sweep.csv`` (``sweep.py``'s columns and the node layout), ``summary.json``
(the comparison per budget and the targets), ``summary.md`` and the figures
of ``plots.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as run_mod  # noqa: E402
import sweep  # noqa: E402
from baselines import MULTI_NODE_BASELINES  # noqa: E402

from osdp.machine.identity import source_commit

NODES, RANKS_PER_NODE = 2, 2
WORLD_SIZE = NODES * RANKS_PER_NODE
LINK = "inter-node-ratio"
PROFILES = {  # model -> (micro-batch per rank, sequence length)
    "quick": {"models": {"gpt2-tiny": (8, 64)}, "budgets": 3, "rounds": 2, "time_per_run_s": 0.3, "min_steps": 3,
              "calibrate_link": False, "calibration_profile": "tiny"},
    "default": {"models": {"gpt2-mini": (8, 128)}, "budgets": 6, "rounds": 5, "time_per_run_s": 1.5,
                "min_steps": 10, "calibrate_link": True, "calibration_profile": "full"},
}
WORLD_FSDP = ("fsdp2", "fsdp2+ac")  # FSDP2 sharding across the world, with or without checkpointing
HSDP = ("fsdp2-hsdp", "fsdp2-hsdp+ac")
CSV_COLUMNS = ["model", "world_size", "nodes", "ranks_per_node", *sweep.CSV_COLUMNS[2:]]
# the targets on the emulated 2 x 2
TARGET_EVERY, TARGET_OVER_WORLD_FSDP = 0.98, 1.2


# --------------------------------------------------------------------------- comparison and targets


def fastest_fitting(rows: dict[str, dict[str, Any]], strategies: tuple[str, ...]) -> dict[str, Any] | None:
    fitting = [rows[s] for s in strategies if s in rows and rows[s]["fits"] and rows[s]["tokens_per_s"]]
    return max(fitting, key=lambda r: r["tokens_per_s"], default=None)


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per budget: ``sweep.compare`` over the multi-node baselines, and OSDP over FSDP2 across the world and
    over HSDP (each the faster fitting of its two variants), paired by repeat."""
    out = []
    for c in sweep.compare(rows, MULTI_NODE_BASELINES):
        osdp = c["osdp"]
        ran = osdp["fits"] and osdp["tokens_per_s"]
        for key, group in (("fsdp_world", WORLD_FSDP), ("hsdp", HSDP)):
            other = fastest_fitting(c["baselines"], group)
            c[key] = other
            c[f"vs_{key}"] = sweep.paired_ratio(osdp, other) if (ran and other) else None
        out.append(c)
    return out


def verdicts(comparison: list[dict[str, Any]], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets: OSDP >= 0.98x the best fitting baseline at every budget where one fits (a budget where OSDP
    did not run or did not fit counts as missed), >= 1.2x FSDP2 across the world at some budget, the measured
    peak within the budget everywhere; and the cost model's error on the plans that ran."""
    vs_best = [c["vs_best"] for c in comparison if c["vs_best"] is not None]
    missing = [c["budget_bytes"] for c in comparison if c["best"] is not None and c["vs_best"] is None]
    vs_world = [c["vs_fsdp_world"] for c in comparison if c["vs_fsdp_world"] is not None]
    errors = [abs(e) for e in sweep.prediction_errors(rows)]
    return {
        "vs_best_min": min(vs_best, default=None),
        "vs_best_ok": bool(vs_best) and not missing and all(v >= TARGET_EVERY for v in vs_best),
        "budgets_missing_osdp": missing,
        "vs_fsdp_world_max": max(vs_world, default=None),
        "vs_fsdp_world_ok": any(v >= TARGET_OVER_WORLD_FSDP for v in vs_world),
        "peak_within_budget_ok": all(c["peak_within_budget"] for c in comparison),
        "budgets_where_no_baseline_fits": [c["budget_bytes"] for c in comparison if c["best"] is None],
        "prediction_error_median": statistics.median(errors) if errors else None,
        "prediction_error_worst": max(errors, default=None),
    }


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _name(r: dict[str, Any] | None) -> str:
    return r["strategy"] if r else "none fits"


def level_line(result: dict[str, Any]) -> str:
    """The links as this run measured them: each group's all-gather bus bandwidth and FLOP per byte."""
    link, flops = result["link"], result["device_info"]["flops"].get("float32") or 0
    parts = []
    for what, key in (("world", "measured_busbw_bytes_per_s"), ("in a node", "measured_intra_busbw_bytes_per_s"),
                      ("across nodes", "measured_inter_busbw_bytes_per_s")):
        busbw = (link.get(key) or {}).get("all_gather")
        if busbw:
            parts.append(f"{what} {busbw / 1e6:.1f} MB/s ({flops / busbw:,.0f} FLOP/byte)")
    return (f"Measured in this run: fp32 {flops / 1e9:.1f} GFLOP/s per rank (the slowest rank, all computing); "
            "all-gather busbw " + ", ".join(parts) + ".")


def summary_markdown(results: list[dict[str, Any]], per_model: dict[str, dict[str, Any]],
                     meta: dict[str, Any]) -> str:
    link = meta["link"]
    lines = [f"# Two emulated nodes ({meta['profile']}): throughput per rank vs memory budget per rank", "",
             f"- command: `{meta['command']}`",
             f"- date: {meta['date']}; took {meta['seconds'] / 60:.1f} min",
             f"- machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores, {meta['machine']['platform']}; "
             f"Python {meta['machine']['python']}, torch {meta['machine']['torch']}",
             f"- osdp source: {meta['osdp_source']}",
             f"- ranks: {WORLD_SIZE} CPU processes (gloo, 1 thread each) as {NODES} nodes x {RANKS_PER_NODE}: a "
             "network namespace per node, its ranks over its loopback; optimizer AdamW, fp32",
             f"- link between the nodes: {link.get('label')}; target {link.get('target_flop_per_byte', 0):,.0f} "
             f"FLOP/byte per rank across nodes ({link.get('ratio_of')})"
             + (f", with {link['rank_flops'] / 1e9:.1f} GFLOP/s per rank (this core's best "
                f"{link['core_flops'] / 1e9:.1f}, shared by {WORLD_SIZE} ranks on {meta['machine']['cores']} cores)"
                if link.get("rank_flops") else ", the rate fixed by --link-rate")
             + (f"; calibrated: {link['probe_flop_per_byte']:,.0f} FLOP/byte measured on the cross-node groups"
                if link.get("probe_flop_per_byte") else "; nominal rate, not calibrated"),
             f"- OSDP's calibration: {meta.get('calibration_profile')} profile, measured on this layout before the "
             "runs",
             "- collectives (osdp.distributed.collectives, every strategy alike): "
             f"{run_mod.describe_collectives(run_mod.recorded_collectives(meta))}",
             f"- repeats: {meta['rounds']} interleaved repeats per run, each at least {meta['min_steps']} timed steps "
             f"(~{meta['time_per_run_s']} s) after 2 warm-up steps, a step timed on the slowest rank; tokens/s are "
             "medians over repeats (in brackets: the slowest and fastest repeat); ratios are medians over repeats "
             "of the ratio within the repeat",
             "- load average (1 min) before / after each part: "
             + "; ".join(f"{p['model']}: {p['load_before'][0]:.1f} / {p['load_after'][0]:.1f}" for p in meta["parts"]),
             ""]
    for result in results:
        model = result["model"]
        comparison, v = per_model[model]["comparison"], per_model[model]["verdicts"]
        lines += [f"## {model}", "", level_line(result),
                  f"Micro-batch {result['records'][0]['batch_size']} x {result['records'][0]['seq_len']} tokens per "
                  f"rank. Least budget any plan fits (predicted): {sweep.mib(result['lowest_budget_bytes'])}; "
                  f"torch-ddp needs {sweep.mib(result['ddp_needs_bytes'])} (measured). Compute-only: "
                  f"{result['compute_only']['tokens_per_s']:,.0f} tokens/s per rank.", ""]
        head = ["budget", "OSDP tokens/s", "OSDP peak", "OSDP predicted", *MULTI_NODE_BASELINES, "best baseline",
                "OSDP / best", "OSDP / FSDP2 world", "OSDP / HSDP", "OSDP plan"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for c in comparison:
            o = c["osdp"]
            lines.append("| " + " | ".join([
                sweep.mib(c["budget_bytes"]),
                f"{o['tokens_per_s']:,.0f} ({o['tokens_per_s_min']:,.0f}..{o['tokens_per_s_max']:,.0f})"
                if o["tokens_per_s"] else sweep.does_not_fit(o["needs_bytes"]),
                sweep.mib(o["peak_bytes"]) + ("" if c["peak_within_budget"] else " **over**"),
                f"{o['predicted_tokens_per_s']:,.0f}" if o.get("predicted_tokens_per_s") else "-",
                *[sweep.cell(c["baselines"].get(s)) for s in MULTI_NODE_BASELINES],
                _name(c["best"]), _ratio(c["vs_best"]),
                f"{_ratio(c['vs_fsdp_world'])} ({_name(c['fsdp_world'])})",
                f"{_ratio(c['vs_hsdp'])} ({_name(c['hsdp'])})",
                (o.get("plan_summary") or "").split(": ", 1)[-1],
            ]) + " |")
        lines += ["", f"Targets: OSDP / best fitting baseline >= {TARGET_EVERY} at every budget where one fits: "
                  f"{'met' if v['vs_best_ok'] else 'MISSED'} (min {_ratio(v['vs_best_min'])}); OSDP / FSDP2 across "
                  f"the world >= {TARGET_OVER_WORLD_FSDP} at some budget: "
                  f"{'met' if v['vs_fsdp_world_ok'] else 'MISSED'} (max {_ratio(v['vs_fsdp_world_max'])}); "
                  f"measured peak within the budget: {'met' if v['peak_within_budget_ok'] else 'MISSED'}."
                  + (f" No baseline fits at {', '.join(sweep.mib(x) for x in v['budgets_where_no_baseline_fits'])}."
                     if v["budgets_where_no_baseline_fits"] else "")
                  + f" Cost model, |predicted / measured tokens/s - 1| over the plans that ran: median "
                  f"{_ratio(v['prediction_error_median'])}, worst {_ratio(v['prediction_error_worst'])}.", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the sweep


def node_link(args: argparse.Namespace, profile: dict[str, Any]) -> dict[str, Any]:
    """The shaped link between the nodes: a fixed rate, or the inter-node-ratio rate (calibrated unless the
    profile or --no-link-calibration says not)."""
    if args.link_rate:
        link = run_mod.resolve_link("tbf:" + args.link_rate)
        link.update(name=LINK, level="inter", ranks_per_node=RANKS_PER_NODE,
                    target_flop_per_byte=run_mod.inter_node_flop_per_byte(), ratio_of=run_mod.INTER_NODE_PRESET)
        return link
    link = run_mod.resolve_link(LINK, ranks_per_node=RANKS_PER_NODE)
    if profile["calibrate_link"] and not args.no_link_calibration:
        print(f"sweep-nodes: calibrating {link['label']} against gloo's cross-node all-gather bandwidth", flush=True)
        link = run_mod.calibrate_gpu_ratio(link, collectives=run_mod.collectives_from_args(args),
                                           on_line=lambda line: print(f"  {line}", flush=True))
        link.pop("probe_device_info")
        if not link["calibrated"]:
            print(f"sweep-nodes: WARNING: the link gives {link['probe_flop_per_byte']:.0f} FLOP/byte across nodes, "
                  f"more than 10% from the target {link['target_flop_per_byte']:.0f}", flush=True)
    return link


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="gpt2-tiny, 3 budgets, 2 short repeats, nominal link rate")
    ap.add_argument("--models", nargs="+", help="override the models (micro-batch 8, the model's sequence length)")
    ap.add_argument("--budgets", type=int, help="number of OSDP budgets per model")
    ap.add_argument("--rounds", type=int, help="interleaved repeats per run")
    ap.add_argument("--time-per-run", type=float, help="seconds of timed steps per run and repeat")
    ap.add_argument("--min-steps", type=int, help="timed steps per run and repeat, at least")
    run_mod.add_collective_args(ap)
    ap.add_argument("--link-rate", help="fix the node's link rate (e.g. 80mbit, shared by its ranks) instead of "
                    "deriving it from this core's FLOP/s")
    ap.add_argument("--no-link-calibration", action="store_true", help="the nominal rate, without probing the link")
    ap.add_argument("--calibration-profile", choices=["full", "tiny"],
                    help="OSDP's calibration profile (default: full; tiny with --quick)")
    ap.add_argument("--jobs-at-once", type=int, default=0, help="models alive at once per repeat (0: all)")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="MIN",
                    help=f"first wait up to MIN minutes for the 1-min load average to drop below {sweep.QUIET_LOAD}")
    ap.add_argument("--timeout", type=float, default=None, help="seconds each launched part may take")
    ap.add_argument("--out", type=Path, help="output folder (default experiments/results/sweep-nodes[/quick])")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--from-runs", type=Path, metavar="DIR",
                    help="run nothing: rewrite DIR's sweep.csv, summary files and figures from its runs.json")
    args = ap.parse_args(argv)
    if args.from_runs:
        return report(args.from_runs, plots=not args.no_plots)
    if run_mod.netns.missing_tools():
        print(f"sweep-nodes: cannot emulate two nodes here: {run_mod.netns.missing_tools()}", file=sys.stderr)
        return 2
    profile_name = "quick" if args.quick else "default"
    profile = PROFILES[profile_name]
    models = profile["models"] if not args.models else {m: (8, None) for m in args.models}
    budgets = args.budgets or profile["budgets"]
    rounds = args.rounds or profile["rounds"]
    per_run = args.time_per_run or profile["time_per_run_s"]
    min_steps = args.min_steps or profile["min_steps"]
    calibration_profile = args.calibration_profile or profile["calibration_profile"]
    out = args.out or (sweep.RESULTS / "sweep-nodes" / ("quick" if args.quick else ""))
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    command = "python experiments/sweep_nodes.py " + " ".join(argv if argv is not None else sys.argv[1:])
    show = lambda line: print(f"  {line}", flush=True)  # noqa: E731

    sweep.wait_for_quiet(args.wait_quiet)  # the link's rate comes from this core's FLOP/s: measure it quiet
    link = node_link(args, profile)
    print(f"sweep-nodes: link {link['label']}", flush=True)
    results, parts = [], []
    # One cache per sweep: OSDP's calibration of this layout and link, measured once in its own run before the
    # measured ones (what osdp.wrap plans with), and the model descriptions.
    with tempfile.TemporaryDirectory(prefix="osdp-sweep-nodes-cache-") as cache:
        env = dict(os.environ, OSDP_CACHE_DIR=cache, OMP_NUM_THREADS="1", OSDP_CALIBRATION_PROFILE=calibration_profile)
        print(f"sweep-nodes: OSDP's calibration ({calibration_profile}) on {NODES} nodes x {RANKS_PER_NODE}",
              flush=True)
        got = run_mod.launch({"model": "gpt2-tiny", "batch_size": 1, "link": link, "calibrate": "force",
                              **run_mod.collectives_from_args(args)},
                             nproc=WORLD_SIZE, env=env, on_line=show, timeout_s=args.timeout)
        calibration = got["calibration"]
        print(f"sweep-nodes: {got['summary']}", flush=True)
        for n, (model, (batch, seq)) in enumerate(models.items(), 1):
            t0 = time.time()
            print(f"sweep-nodes: [{n}/{len(models)}] {model} ({(t0 - start) / 60:.1f} min so far, "
                  f"load {os.getloadavg()[0]:.1f})", flush=True)
            spec = {"model": model, "batch_size": batch, "seq_len": seq, "strategies": list(MULTI_NODE_BASELINES),
                    "auto_budgets": budgets, "rounds": rounds, "time_per_run_s": per_run, "min_steps": min_steps,
                    **run_mod.collectives_from_args(args), "jobs_at_once": args.jobs_at_once, "link": link}
            load_before = os.getloadavg()
            results.append(run_mod.launch(spec, nproc=WORLD_SIZE, env=env, on_line=show, timeout_s=args.timeout))
            parts.append({"model": model, "link": LINK, "load_before": load_before, "load_after": os.getloadavg(),
                          "seconds": time.time() - t0})
            print(f"sweep-nodes: [{n}/{len(models)}] done in {(time.time() - t0) / 60:.1f} min", flush=True)

    meta = {"osdp_source": source_commit() or "unknown", "profile": profile_name, "command": command,
            "date": time.strftime("%Y-%m-%d %H:%M %Z"), "seconds": time.time() - start,
            "machine": results[0]["machine"], "world_size": WORLD_SIZE, "nodes": NODES,
            "ranks_per_node": RANKS_PER_NODE, "rounds": rounds, "time_per_run_s": per_run, "min_steps": min_steps,
            **run_mod.collectives_from_args(args), "budgets": budgets, "parts": parts, "link": link,
            "calibration_profile": calibration_profile, "calibration": calibration}
    (out / "runs.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    report(out, plots=not args.no_plots)
    print(f"sweep-nodes: wrote {out} in {(time.time() - start) / 60:.1f} min")
    return 0


def report(out: Path, plots: bool = True) -> int:
    """sweep.csv, summary.json, summary.md and the figures from ``out/runs.json``."""
    data = json.loads((out / "runs.json").read_text())
    results, meta = data["results"], data["meta"]
    rows, per_model = [], {}
    for result in results:
        mine = [{**row, "nodes": result["nodes"], "ranks_per_node": result["ranks_per_node"]}
                for row in sweep.rows_of(result)]
        comparison = compare(mine)
        per_model[result["model"]] = {"comparison": comparison, "verdicts": verdicts(comparison, mine)}
        rows += mine
    sweep.write_csv(rows, out / "sweep.csv", CSV_COLUMNS)
    (out / "summary.json").write_text(json.dumps({
        model: {"verdicts": m["verdicts"], "budgets": [
            {"budget_bytes": c["budget_bytes"], "osdp_tokens_per_s": c["osdp"]["tokens_per_s"],
             "osdp_peak_bytes": c["osdp"]["peak_bytes"], "osdp_plan": c["osdp"].get("plan_summary"),
             "best": _name(c["best"]), "vs_best": c["vs_best"], "fsdp_world": _name(c["fsdp_world"]),
             "vs_fsdp_world": c["vs_fsdp_world"], "hsdp": _name(c["hsdp"]), "vs_hsdp": c["vs_hsdp"],
             "peak_within_budget": c["peak_within_budget"]} for c in m["comparison"]]}
        for model, m in per_model.items()}, indent=1))
    (out / "summary.md").write_text(summary_markdown(results, per_model, meta))
    if plots:
        import plots as plots_mod

        loaded = plots_mod.load_rows(out)
        ranks = f"{WORLD_SIZE} CPU ranks as {NODES} nodes x {RANKS_PER_NODE} (gloo)"
        for result in results:
            model = result["model"]
            note = f"{meta['date']}, 1-min load average at start: " + "; ".join(
                f"{p['load_before'][0]:.1f}" for p in meta["parts"] if p["model"] == model)
            plots_mod.plot_throughput(loaded, model, [result["link"]], out / f"throughput_{model}.png", note=note,
                                      ranks=ranks)
            plots_mod.plot_memory(results, model, out / f"memory_{model}.png")
        plots_mod.plot_predicted(results, out / "predicted_vs_measured.png")
    print((out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
