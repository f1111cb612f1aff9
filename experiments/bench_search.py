"""How fast is the search? Synthetic but realistic instances, solved end to end.

* gpt48: the OSDP paper's 48-layer, hidden-1536 GPT on 8 ranks with an 8 GiB
  budget: 97 units (attention and MLP of every layer, plus the root holding the
  embeddings and final norm), the 24-option table, 4 micro-batch candidates.
  The paper's pure-Python DP took about 12 s per batch candidate on this model.
* deep500: the same blocks, 249 layers + root + head = 500 units.
* mixed500: 500 units of 50 different widths, so transient sizes (the
  thresholds the max term enumerates) are many and distinct.

Costs are an analytic stand-in for the measured cost model: FLOPs at a fixed
rate, alpha-beta collectives with partial overlap, fp32 parameters with Adam,
activations of a non-fused attention.

Multi-node (``--cases multi-node``): what ``osdp plan --nodes 8 --gpus-per-node 8``
searches for gpt2-xl and llama-1b, the real cost model on the multi-node presets
(28 options: the 24 world-scoped and zero2/zero3 x checkpoint within the node),
described analytically at micro-batches 1, 2, 4 and 8 and every unit
granularity, at the preset's memory (osdp plan's default budget) and at 12 GiB
(where replicating cannot fit); the time is the planner's ``search_seconds``
(the plan's JSON field), best of ``--repeats``. Target: 100 ms.

Planner (``--cases planner``): the searches ``osdp plan`` runs for gpt-48l-h1536 on 8 ranks at 8 GiB (target
50 ms) and gpt2-xl on 8 nodes x 8 GPUs at 16 GiB (target 100 ms): medians of ``--repeats``, pricing on the
schedule included, building the search problems timed apart.

Run: python experiments/bench_search.py [--cases synthetic|multi-node|planner]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from osdp.machine.identity import machine_info
from osdp.search import OPTIONS, Problem, pareto_frontier, plot_frontier, sweep_batch_sizes
from osdp.search.problem import format_bytes

WORLD = 8
FLOPS = 100e12  # achieved FLOP/s
BUS_BW = 50e9  # bytes/s per rank for ring collectives
ALPHA = 30e-6  # seconds per collective message
OVERLAP = 0.7  # fraction of compute that hides communication
SEQ, VOCAB, HEADS = 1024, 50257, 16
STATE_BYTES = 16  # fp32 param + grad + Adam m and v
GiB = 2**30


def unit_costs(params: int, flops_per_sample: float, act_bytes: int, ckpt_bytes: int, batch: int, splittable: bool):
    """[O] time, mem, transient, allowed of one unit under every option of OPTIONS."""
    O = len(OPTIONS)
    t, mem, tr, ok = np.zeros(O), np.zeros(O, np.int64), np.zeros(O, np.int64), np.zeros(O, bool)
    full = 4 * params  # fp32 gathered bytes
    ring = (WORLD - 1) / WORLD * full / BUS_BW
    compute = 3 * flops_per_sample * batch / FLOPS
    for o, (mode, split, ckpt, _) in enumerate(OPTIONS):
        ok[o] = split == 1 or (mode == "zero3" and splittable)
        work = compute * (4 / 3 if ckpt else 1.0)
        if mode == "replicate":  # bucketed all-reduce, overlaps best
            comm, exposed_frac = 2 * ring + ALPHA, 0.5
            states = STATE_BYTES * params
            transient = 0
        elif mode == "zero2":  # gather once, keep until backward; reduce-scatter grads
            comm, exposed_frac = 2 * ring + 2 * ALPHA, 1.0
            states = STATE_BYTES * params // WORLD + full
            transient = full  # unsharded gradient before its reduce-scatter
        else:  # zero3: gather for forward and backward, k messages each
            comm, exposed_frac = 3 * ring + 3 * split * ALPHA, 1.0
            states = STATE_BYTES * params // WORLD
            transient = 2 * (full // split) + full // split  # this slice, the prefetched one, its gradient
        t[o] = work + exposed_frac * max(0.0, comm - OVERLAP * work) + 0.02 * comm
        mem[o] = states + batch * (ckpt_bytes if ckpt else act_bytes)
        tr[o] = transient
    return t, mem, tr, ok


def gpt(layers: int, hidden, batch: int, head_unit: bool = False) -> Problem:
    """A GPT: per layer an attention and an MLP unit; the root holds embeddings (and the head if tied)."""
    hidden = np.broadcast_to(np.asarray(hidden), (layers,))
    rows, names = [], []
    for i, h in enumerate(hidden.tolist()):
        attn_p, mlp_p = 4 * h * h + 6 * h, 8 * h * h + 7 * h
        attn_flops = 2 * attn_p * SEQ + 4 * SEQ * SEQ * h
        attn_act = 4 * (6 * SEQ * h) + 8 * HEADS * SEQ * SEQ
        mlp_act = 4 * (10 * SEQ * h)
        rows.append(unit_costs(attn_p, attn_flops, attn_act, 4 * SEQ * h, batch, True))
        rows.append(unit_costs(mlp_p, 2 * mlp_p * SEQ, mlp_act, 4 * SEQ * h, batch, True))
        names += [f"h.{i}.attn", f"h.{i}.mlp"]
    h0 = int(hidden[0])
    root_p = VOCAB * h0 + SEQ * h0 + 2 * h0
    logits = 4 * SEQ * VOCAB * 2  # logits and their softmax
    rows.append(unit_costs(root_p, 2 * VOCAB * h0 * SEQ, logits, logits, batch, False))
    names.append("")
    if head_unit:
        rows.append(unit_costs(VOCAB * h0, 2 * VOCAB * h0 * SEQ, logits // 2, logits // 2, batch, True))
        names.append("lm_head")
    t, mem, tr, ok = (np.stack(x) for x in zip(*rows))
    return Problem(t, mem, tr, ok, base=512 * 2**20, batch_size=batch, units=names, options=OPTIONS)


def instances() -> dict[str, list[Problem]]:
    widths = np.random.default_rng(0).choice(np.arange(1024, 4096 + 1, 64), size=50)
    return {
        "gpt48": [gpt(48, 1536, b) for b in (1, 2, 4, 8)],
        "deep500": [gpt(249, 1536, b, head_unit=True) for b in (1, 2, 4, 8)],
        "mixed500": [gpt(249, np.repeat(widths, 5)[:249], b, head_unit=True) for b in (1, 2, 4, 8)],
    }


BUDGETS = {"gpt48": 8 * GiB, "deep500": 40 * GiB, "mixed500": 120 * GiB}
TARGETS = {"gpt48": 0.050, "deep500": 1.0, "mixed500": 1.0}


def timed(fn, repeats: int):
    """Best of ``repeats`` wall times (the machine is shared) and the last result."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


MULTI_NODE_CASES = [  # (model, preset) at 8 nodes x 8 GPUs
    ("gpt2-xl", "h100-nvlink-ndr400"), ("llama-1b", "h100-nvlink-ndr400"),
    ("gpt2-xl", "h100-nvlink-100gbe"), ("llama-1b", "h100-nvlink-100gbe"),
]
MULTI_NODE_TARGET_S = 0.100


def multi_node(repeats: int, out: Path, machine: dict) -> None:
    from osdp.cli.plan import DEFAULT_BATCH_CANDIDATES, describe_for
    from osdp.describe.sources import from_reference
    from osdp.machine.presets import device_preset
    from osdp.planner import find_plan

    rows = []
    header = f"{'model':<9} {'device':<19} {'budget':>10} {'units':>5} {'options':>7} {'search s':>9} " \
             f"{'target s':>8} {'step ms':>8} {'@node':>5}  plan"
    print(header)
    print("-" * len(header))
    for model, device in MULTI_NODE_CASES:
        dev = device_preset(device, 64)
        descriptions = describe_for(from_reference(model, None), dev, DEFAULT_BATCH_CANDIDATES, "fp32")
        for budget in (dev.memory_bytes, 12 * GiB):
            results = [find_plan(descriptions, dev, DEFAULT_BATCH_CANDIDATES, budget=budget) for _ in range(repeats)]
            seconds = min(r.search_seconds for r in results)
            plan = results[-1].plan
            problem = results[-1].problems[0]
            node_scoped = sum(u.shard_scope == "node" for u in plan.units)
            rows.append({
                "model": model, "device": device, "nodes": dev.topology.nodes,
                "ranks_per_node": dev.topology.ranks_per_node, "budget_bytes": budget,
                "batch_candidates": list(DEFAULT_BATCH_CANDIDATES),
                "granularities": [d.granularity for d in descriptions],
                "units": len(plan.units), "options": problem.num_options, "search_seconds": seconds,
                "search_seconds_all": [r.search_seconds for r in results], "target_seconds": MULTI_NODE_TARGET_S,
                "predicted_step_s": plan.predicted_step_s, "predicted_peak_bytes": plan.predicted_peak_bytes,
                "batch_size": plan.batch_size, "node_scoped_units": node_scoped, "plan": plan.summary(),
            })
            print(f"{model:<9} {device:<19} {format_bytes(budget):>10} {len(plan.units):>5} {problem.num_options:>7} "
                  f"{seconds:>9.4f} {MULTI_NODE_TARGET_S:>8.3f} {plan.predicted_step_s * 1e3:>8.1f} {node_scoped:>5}  "
                  f"{plan.summary()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "repeats": repeats, "results": rows}, indent=2) + "\n")
    print(f"wrote {out}")


PLANNER_CASES = [  # what `osdp plan` searches: (label, argv), and the target for its search time
    ("gpt-48l-h1536, 8 ranks, 8 GiB", ["--model", "gpt-48l-h1536", "--world-size", "8", "--device-mem", "8GiB"], 0.050),
    ("gpt2-xl, 8 nodes x 8, 16 GiB", ["--model", "gpt2-xl", "--nodes", "8", "--gpus-per-node", "8",
                                      "--device-mem", "16GiB"], 0.100),
]


def planner(repeats: int, out: Path, machine: dict) -> None:
    """The planner's search as ``osdp plan`` runs it (the real cost model, every unit granularity, the default
    batch candidates, pricing on the schedule included): the median of ``repeats`` searches; building the
    search problems from the descriptions is timed apart, and describing the model is not part of either."""
    import statistics

    from osdp.cli.plan import DEFAULT_BATCH_CANDIDATES, describe_for, device_for, model_source, parse_args
    from osdp.cost.context import options_for, scope_option_sets
    from osdp.planner import _candidates, find_plan
    from osdp.sizes import parse_size

    rows = []
    print(f"{'case':<32} {'options':>7} {'build s':>8} {'search s (median)':>18} {'target s':>8}  plan")
    for label, argv, target in PLANNER_CASES:
        args = parse_args(argv)
        device, budget = device_for(args), parse_size(args.device_mem)
        descriptions = describe_for(model_source(args), device, DEFAULT_BATCH_CANDIDATES, "fp32")
        settings = dict(precision="fp32", optimizer="adamw", calibration=None)
        build_s, _ = timed(lambda: _candidates(descriptions, device, DEFAULT_BATCH_CANDIDATES, settings), 1)
        results = [find_plan(descriptions, device, DEFAULT_BATCH_CANDIDATES, budget=budget) for _ in range(repeats)]
        search_s = statistics.median(r.search_seconds for r in results)
        plan = results[-1].plan
        # the option tables solved apart (on several nodes the world's and the node's: scope_option_sets)
        tables = [len(t or options_for(device)) for t in scope_option_sets(device)]
        rows.append({"case": label, "argv": argv, "options": "+".join(map(str, tables)),
                     "build_seconds": build_s, "search_seconds": search_s,
                     "search_seconds_all": [r.search_seconds for r in results], "target_seconds": target,
                     "plan": plan.summary(), "predicted_step_s": plan.predicted_step_s,
                     "predicted_peak_bytes": plan.predicted_peak_bytes, "batch_size": plan.batch_size})
        print(f"{label:<32} {rows[-1]['options']:>7} {build_s:>8.3f} {search_s:>18.4f} {target:>8.3f}  {plan.summary()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "repeats": repeats, "results": rows}, indent=2) + "\n")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cases", choices=["all", "synthetic", "multi-node", "planner"], default="all")
    parser.add_argument("--planner-out", default=str(Path(__file__).parent / "results" / "bench_search_planner.json"))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_search.json"))
    parser.add_argument("--multi-node-out",
                        default=str(Path(__file__).parent / "results" / "bench_search_multi_node.json"))
    args = parser.parse_args()

    machine = {**machine_info(), "numpy": np.__version__}
    if args.cases in ("all", "planner"):
        planner(args.repeats, Path(args.planner_out), machine)
    if args.cases == "planner":
        return
    if args.cases in ("all", "multi-node"):
        multi_node(args.repeats, Path(args.multi_node_out), machine)
    if args.cases == "multi-node":
        return
    rows = []
    header = f"{'instance':<10} {'units':>5} {'options':>7} {'batches':>7} {'levels':>7} {'resolution':>11} " \
             f"{'slack':>10} {'solve s':>8} {'target s':>8} {'frontier s':>10} {'best':>26}"
    print(header)
    print("-" * len(header))
    for name, problems in instances().items():
        budget = BUDGETS[name]
        seconds, sweep = timed(lambda: sweep_batch_sizes(problems, budget), args.repeats)
        best = sweep.best
        frontier_s, points = timed(lambda: pareto_frontier(problems, max_peak=budget), 1)
        levels = max(c.solution.levels for c in sweep.candidates if c.solution)
        row = {
            "instance": name,
            "units": problems[0].num_units,
            "options": problems[0].num_options,
            "batch_candidates": [p.batch_size for p in problems],
            "budget_bytes": budget,
            "grid_levels": levels,
            "resolution_bytes": best.resolution,
            "slack_bytes": best.slack_bytes,
            "solve_seconds": seconds,
            "target_seconds": TARGETS[name],
            "frontier_seconds": frontier_s,
            "frontier_points": len(points),
            "best_batch_size": best.batch_size,
            "best_samples_per_s": best.samples_per_s,
            "best_peak_bytes": best.peak_bytes,
            "candidates": [
                {"batch_size": c.batch_size, "min_peak_bytes": c.min_peak_bytes,
                 "samples_per_s": c.solution.samples_per_s if c.solution else None,
                 "peak_bytes": c.solution.peak_bytes if c.solution else None,
                 "levels": c.solution.levels if c.solution else None,
                 "search_seconds": c.solution.search_seconds if c.solution else None}
                for c in sweep.candidates
            ],
        }
        rows.append(row)
        if name == "gpt48":
            plot_frontier(points, str(Path(args.out).with_name("frontier_gpt48.png")), budget=budget,
                          title="48-layer GPT (hidden 1536), 8 ranks: predicted frontier")
        print(f"{name:<10} {row['units']:>5} {row['options']:>7} {len(problems):>7} {levels:>7} "
              f"{format_bytes(best.resolution):>11} {format_bytes(best.slack_bytes):>10} {seconds:>8.4f} "
              f"{TARGETS[name]:>8.3f} {frontier_s:>10.3f} "
              f"{f'b={best.batch_size} {best.samples_per_s:.1f}/s {format_bytes(best.peak_bytes)}':>26}")
    print(f"machine: {machine}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "repeats": args.repeats, "results": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
