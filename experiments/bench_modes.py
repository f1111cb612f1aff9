"""Every OSDP mode beside PyTorch's own way of doing the same thing, in one process group, interleaved.

    python experiments/bench_modes.py                  # gpt2-mini and gpt2-cpu-medium, loopback and gpu-ratio
    python experiments/bench_modes.py --quick          # gpt2-mini only
    python experiments/bench_modes.py --models gpt2-mini --links loopback --rounds 5

Pairs (OSDP's uniform plan, from ``run.TWINS``; its native twin, from ``baselines.py``):

    osdp-replicate   vs torch-ddp        (DistributedDataParallel, its defaults)
    osdp-zero3       vs fsdp2            (fully_shard per block, then the root)
    osdp-zero2       vs fsdp2-zero2      (the same with reshard_after_forward=False)
    and each with full activation checkpointing of the blocks (+ac);
    osdp-replicate+sac vs torch-ddp+sac-osdp  (selective per-op checkpointing, osdp's policy on both sides)
    osdp-zero3+sac     vs fsdp2+sac-osdp

OSDP's plans take the unit granularity its search picks for the mode when
memory is no limit (attention and MLP apart, or whole blocks). Each model and
link is one ``run.py`` part: in each repeat the pairs run one after another
(their order rotated between repeats), a pair's two models alive together and
stepped in turn (which goes first alternating between repeats), a step timed on
the slowest rank, peaks measured in the same runs (on CPU with ``osdp.machine.memory``,
DDP's buckets included). A pair's speed ratio is the median, over every pair of
steps taken one after the other, of native step / OSDP step (> 1: OSDP
faster): each ratio compares two steps that saw the same host, which a shared
machine's drift between seconds does not bias. Its memory ratio is OSDP's peak
over the native one.

Writes ``experiments/results/bench_modes/bench_modes.json`` and ``.md``
(``--out`` to change), with the machine, torch, link and load, after each
part; each part's whole result also goes to ``OUT/parts/`` as it ends, and
``--from-runs OUT/parts`` rebuilds the report from them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run  # noqa: E402

from osdp.machine.identity import machine_info

PAIRS = [
    ("osdp-replicate", "torch-ddp"),
    ("osdp-zero3", "fsdp2"),
    ("osdp-zero2", "fsdp2-zero2"),
    ("osdp-replicate+ac", "torch-ddp+ac"),
    ("osdp-zero3+ac", "fsdp2+ac"),
    ("osdp-zero2+ac", "fsdp2-zero2+ac"),
    ("osdp-replicate+sac", "torch-ddp+sac-osdp"),
    ("osdp-zero3+sac", "fsdp2+sac-osdp"),
]
# the targets: OSDP's throughput >= 0.98x its twin's, its peak <= 1.02x
MIN_SPEED_RATIO, MAX_PEAK_RATIO = 0.98, 1.02
BATCH = {"gpt2-mini": 8, "gpt2-cpu-medium": 4}


def pair_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per pair of a run.py result: step times, peaks and the paired ratios."""
    by_strategy = {r["strategy"]: r for r in result["records"]}
    rows = []
    for ours, native in PAIRS:
        o, n = by_strategy[ours], by_strategy[native]
        om, nm = o["measured"], n["measured"]
        # the twins stepped in turn: each native step over the OSDP step beside it, within each repeat
        paired = [[nt / ot for nt, ot in zip(ns, os)] for ns, os in zip(nm["step_s_each"], om["step_s_each"])]
        speed = [statistics.median(r) for r in paired]
        rows.append({
            "model": result["model"], "link": result["link"].get("name"), "osdp": ours, "native": native,
            "granularity": (o.get("plan") or {}).get("meta", {}).get("granularity"),
            "osdp_step_s": om["step_s_median"], "native_step_s": nm["step_s_median"],
            "speed_ratio": statistics.median(x for r in paired for x in r), "speed_ratio_rounds": speed,
            "paired_steps": sum(map(len, paired)),
            "osdp_peak_bytes": om["peak_bytes"], "native_peak_bytes": nm["peak_bytes"],
            "peak_ratio": om["peak_bytes"] / nm["peak_bytes"],
            "osdp_efficiency": om["efficiency"], "native_efficiency": nm["efficiency"],
        })
    for row in rows:
        row["meets_targets"] = row["speed_ratio"] >= MIN_SPEED_RATIO and row["peak_ratio"] <= MAX_PEAK_RATIO
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| model | link | OSDP (units) | native | step OSDP / native ms | speed ratio (repeats) "
            "| peak OSDP / native MiB | peak ratio | targets |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        spread = ", ".join(f"{x:.2f}" for x in r["speed_ratio_rounds"])
        lines.append(
            f"| {r['model']} | {r['link']} | {r['osdp']} ({r['granularity']}) | {r['native']} "
            f"| {r['osdp_step_s'] * 1e3:.0f} / {r['native_step_s'] * 1e3:.0f} | **{r['speed_ratio']:.3f}** ({spread}) "
            f"| {r['osdp_peak_bytes'] / 2**20:.1f} / {r['native_peak_bytes'] / 2**20:.1f} | {r['peak_ratio']:.3f} "
            f"| {'met' if r['meets_targets'] else 'missed'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="gpt2-mini only")
    ap.add_argument("--models", nargs="+", default=None)
    ap.add_argument("--links", nargs="+", default=["loopback", "gpu-ratio"])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repeats per model and link")
    ap.add_argument("--min-steps", type=int, default=run.MIN_STEPS, help="timed steps per run and repeat, at least")
    ap.add_argument("--time-per-run", type=float, default=2.0)
    run.add_collective_args(ap)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "bench_modes")
    ap.add_argument("--from-runs", type=Path, metavar="DIR",
                    help="write the report from the parts an earlier run saved in DIR (its OUT/parts)")
    args = ap.parse_args(argv)
    models = args.models or (["gpt2-mini"] if args.quick else ["gpt2-mini", "gpt2-cpu-medium"])
    strategies = [s for pair in PAIRS for s in pair]

    command = "python experiments/bench_modes.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.from_runs:  # a report from parts saved by an earlier run (each part's run.py result)
        results = [json.loads(f.read_text()) for f in sorted(args.from_runs.glob("part-*.json"))]
        write_report(results, args, command, seconds=sum(r.get("seconds", 0.0) for r in results))
        return 0
    started = time.time()
    results = []
    parts = args.out / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    for link_name in args.links:
        link = run.resolve_link(link_name)
        if link["name"] == "gpu-ratio":
            link = run.calibrate_gpu_ratio(link, collectives=run.collectives_from_args(args))
            link.pop("probe_device_info", None)
        for model in models:
            spec = {
                "model": model, "batch_size": BATCH.get(model, 8), "strategies": strategies, "budgets": [],
                "groups": PAIRS,
                "rounds": args.rounds, "time_per_run_s": args.time_per_run, "min_steps": args.min_steps,
                **run.collectives_from_args(args), "link": link, "loadavg_before": os.getloadavg(),
            }
            print(f"bench_modes: {model} on {link.get('label', link['name'])}", flush=True)
            if model == models[0]:  # the link's calibration, which OSDP's plans are priced with, first
                run.launch({**spec, "calibrate": "force"})
            result = run.launch(spec)
            result["loadavg_before"] = spec["loadavg_before"]
            results.append(result)
            # each part kept as it ends: a long run stopped later keeps what it measured (--from-runs)
            (parts / f"part-{len(results)}-{model}-{link['name']}.json").write_text(json.dumps(result, default=str))
            print(table(pair_rows(result)), flush=True)
            write_report(results, args, command, seconds=time.time() - started)
    return 0


def write_report(results: list[dict[str, Any]], args: argparse.Namespace, command: str, seconds: float) -> None:
    """bench_modes.json and .md in ``args.out`` from the parts measured so far."""
    rows = [row for result in results for row in pair_rows(result)]
    args.out.mkdir(parents=True, exist_ok=True)
    machine = results[0]["machine"] if results else machine_info()
    rounds = sorted({r["rounds"] for r in results})
    summary = {
        "pairs": rows, "targets": {"min_speed_ratio": MIN_SPEED_RATIO, "max_peak_ratio": MAX_PEAK_RATIO},
        "all_met": all(r["meets_targets"] for r in rows), "machine": machine,
        "seconds": seconds, "command": command, "runs": results,
    }
    (args.out / "bench_modes.json").write_text(json.dumps(summary, indent=1, default=str))
    load = ", ".join(f"{r['model']}/{r['link'].get('name')} "
                     + (f"{r['loadavg_before'][0]:.1f}" if r.get("loadavg_before") else "not recorded")
                     for r in results)
    collectives = run.recorded_collectives(results[0]) if results else run.collectives_from_args(args)
    md = [
        "# OSDP's modes against PyTorch's own",
        "",
        f"`{command}` on {machine.get('cpu')} ({machine.get('cores')} cores), torch {machine.get('torch')}, "
        f"2 gloo ranks of one thread, {run.describe_collectives(collectives)}, "
        f"{'/'.join(map(str, rounds))} interleaved repeats of at least "
        f"{results[0]['min_steps'] if results else args.min_steps} timed steps; load average before each part: "
        f"{load}; {seconds / 60:.0f} min.",
        "",
        "Speed ratio: native step / OSDP step, median over every pair of steps the twins took one after the other "
        "(in brackets: that median within each repeat; > 1: OSDP faster; "
        f"target >= {MIN_SPEED_RATIO}). Peak ratio: OSDP / native (target <= {MAX_PEAK_RATIO}).",
        "",
        table(rows),
        "",
    ]
    (args.out / "bench_modes.md").write_text("\n".join(md))
    print("\n".join(md))
    print(f"written to {args.out}")


if __name__ == "__main__":
    sys.exit(main())
