"""Eager against ``torch.compile`` (Inductor) for a wrapped model: tokens/s under three plans, side by side.

    python experiments/compile_bench.py --out experiments/results/compile_bench.json

gpt2-mini (micro-batch 8 x 128 per rank) on 2 gloo ranks of one thread each, under DDP, FSDP (zero3) and a
plan that splits every unit it can in 2 (zero3 elsewhere). Each plan runs eager, compiled per unit
(``osdp.compile_units``, as torchtitan compiles each block) and compiled whole (``model.compile()``). Every
run's model is alive at once and they take one step each in turn (``osdp.runtime.jobs.run_jobs``), so all see
the same load; compilation happens in the warm-up steps, which are not timed. A step takes as long as its
slowest rank; a run's time is the median over its steps. Reported per plan: tokens/s of each way and the
compiled/eager ratio; and what Dynamo compiled (graphs) and where it broke the graph, with the reasons.
The plain model on every rank (``alone``: no wrapping, no communication) runs eager and compiled beside
them: what compiling does to the compute itself on this machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from accumulation_traffic import split_everywhere
from local_ranks import rank0_result

MODEL, BATCH, SEQ = "gpt2-mini", 8, 128
PLANS = ("ddp", "fsdp", "split")
ALONE = "alone"  # the plain model on every rank, no communication: what compiling does to the compute itself
WAYS = ("eager", "compiled-units", "compiled-model")


def _plan(name: str, model):
    import osdp

    return split_everywhere(model) if name == "split" else osdp.strategy_plan(model, name)


def _explained(reason: str) -> str:
    lines = [line.strip() for line in reason.splitlines() if line.strip().startswith("Explanation:")]
    return lines[0].removeprefix("Explanation:").strip() if lines else ""


def _measure(rank: int, world_size: int, steps: int, backend: str, mode: str | None) -> dict:
    from torch._dynamo.utils import counters

    import osdp
    from osdp import models
    from osdp.models.data import synthetic_batch
    from osdp.runtime.jobs import Job, run_jobs

    config = models.get_config(MODEL, seq_len=SEQ)
    batch = synthetic_batch(config, BATCH, SEQ, generator=torch.Generator().manual_seed(rank))

    def build():
        torch.manual_seed(0)
        return models.build(MODEL, seq_len=SEQ)

    def parallelize(plan_name: str, way: str):
        def apply(model):
            if plan_name != ALONE:
                osdp.wrap(model, plan=_plan(plan_name, model))
            kwargs = {"backend": backend, **({"mode": mode} if mode else {})}
            if way == "compiled-units":
                osdp.compile_units(model, **kwargs)
            elif way == "compiled-model":
                model.compile(**kwargs)
            return model

        return apply

    jobs = {f"{p}/{w}": Job(build, None, batch, parallelize=parallelize(p, w)) for p in (*PLANS, ALONE) for w in WAYS
            if not (p == ALONE and w == "compiled-units")}
    counters.clear()
    start = time.perf_counter()
    measured = run_jobs(jobs, device=torch.device("cpu"), optimizer="adamw", time_budget_s=0.0, warmup=3,
                        min_steps=steps, max_steps=steps, measure_peak=False)
    breaks = collections.Counter()
    for reason, n in counters["graph_break"].items():  # the first line names the reason; the rest explains
        breaks[str(reason).splitlines()[0] + " | " + _explained(str(reason))] += n
    return {
        "runs": {name: {"step_s": m["measured_step_s"], "steps": m["steps"]} for name, m in measured.items()},
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": dict(breaks.most_common()),
        "seconds": time.perf_counter() - start,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps per run (default 30)")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--mode", default=None, help="torch.compile mode (default: its default)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "compile_bench.json")
    args = p.parse_args(argv)
    from osdp import __version__

    result = rank0_result(_measure, 2, args.steps, args.backend, args.mode, timeout_s=3600)
    tokens = 2 * BATCH * SEQ  # per step, both ranks
    rows = []
    for plan in (*PLANS, ALONE):
        eager = result["runs"][f"{plan}/eager"]["step_s"]
        for way in WAYS:
            if f"{plan}/{way}" not in result["runs"]:
                continue
            step_s = result["runs"][f"{plan}/{way}"]["step_s"]
            rows.append({"plan": plan, "way": way, "step_s": step_s, "tokens_per_s": tokens / step_s,
                         "speedup_vs_eager": eager / step_s})
    record = {
        "model": MODEL, "micro_batch": BATCH, "seq_len": SEQ, "world_size": 2, "threads_per_rank": 1,
        "backend": args.backend, "mode": args.mode, "steps": args.steps, "osdp": __version__,
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_average": os.getloadavg(), "rows": rows, "graphs": result["graphs"],
        "graph_breaks": result["graph_breaks"], "seconds": result["seconds"],
    }
    print(f"{MODEL}, micro-batch {BATCH} x {SEQ} per rank, 2 gloo ranks, torch.compile backend={args.backend}")
    print(f"{'plan':<7} {'way':<16} {'step ms':>9} {'tokens/s':>10} {'vs eager':>9}")
    for r in rows:
        print(f"{r['plan']:<7} {r['way']:<16} {1e3 * r['step_s']:>9.1f} {r['tokens_per_s']:>10.0f} "
              f"{r['speedup_vs_eager']:>8.2f}x")
    print(f"graphs compiled (rank 0): {result['graphs']}; graph breaks by reason:")
    for reason, n in result["graph_breaks"].items():
        print(f"  {n:>3}  {reason[:200]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
