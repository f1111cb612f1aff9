"""The schedule's peak (``osdp.cost.schedule.schedule_peak``) against the measured peak, plan by plan, on 2 gloo ranks.

    python experiments/schedule_peak.py --out experiments/results/schedule_peak.json

gpt2-tiny (sequence 32, micro-batch 4), at every unit granularity: every unit replicated, zero2, zero3, and
random mixes of those with and without checkpointing (seeded); and ``NAMED`` plans. Each plan is priced as ``osdp.wrap`` prices
it (the describe cache, this job's cached calibration: run ``osdp calibrate --nproc 2`` first), applied, and
trained for two steps, then two tracked steps (``osdp.machine.memory.PeakMemory``). Prints predicted against
measured with the moment the prediction puts the peak at, and the additive bound the search uses beside it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

GRANULARITIES = ("block", "sub-block", "nested")
PLANS = ("replicate", "zero2", "zero3", "random1", "random2", "random3", "random4")
MIXED = [("replicate", 1, False), ("zero2", 1, False), ("zero3", 1, False), ("replicate", 1, True),
         ("zero2", 1, True), ("zero3", 1, True)]
# written out: DDP units (replicated, fp32) inside a zero2 root, a checkpointed one among them
NAMED = {("sub-block", "ddp-in-zero2"): {
    "blocks.0.attn": ("zero2", 1, False), "blocks.0.mlp": ("zero3", 1, False),
    "blocks.1.attn": ("replicate", 1, False), "blocks.1.mlp": ("replicate", 1, True),
    "wpe": ("zero2", 1, True), "": ("zero2", 1, False)}}


def _plan(description, name: str, batch_size: int):
    import osdp

    named = NAMED.get((description.granularity, name))
    if named is not None:
        return osdp.Plan([osdp.UnitPlan(p, *named[p]) for p in description.paths], batch_size=batch_size)
    if not name.startswith("random"):
        return osdp.Plan([osdp.UnitPlan(p, name) for p in description.paths], batch_size=batch_size)
    rng = random.Random(int(name.removeprefix("random")))
    enclosing = {u.path for u in description.units if u.nested or u.path == ""}
    # units enclosing others are not checkpointed (the cost model does not price it)
    return osdp.Plan([osdp.UnitPlan(p, *rng.choice([o for o in MIXED if not (p in enclosing and o[2])]))
                      for p in description.paths], batch_size=batch_size)


def _measure(rank: int, world_size: int, granularity: str, name: str) -> dict:
    import osdp
    from osdp import models
    from osdp.calibration.measured import calibrate
    from osdp.cost.schedule import predict
    from osdp.models.data import synthetic_batch
    from osdp.optim import make_optimizer
    from osdp.planner import planning_description
    from osdp.runtime.step import peaks_per_step

    config = models.get_config("gpt2-tiny", seq_len=32)
    batch = synthetic_batch(config, 4, 32, generator=torch.Generator().manual_seed(rank))
    torch.manual_seed(0)
    model = models.build("gpt2-tiny", seq_len=32)
    machine = calibrate(measure=False)
    description = planning_description(model, batch, granularity=granularity)
    plan = _plan(description, name, 4)
    pred = predict(description, plan, machine.device_info, calibration=machine.calibration)
    osdp.wrap(model, plan=plan)
    optimizer = make_optimizer("adamw", model.parameters())
    peaks = peaks_per_step(model, optimizer, batch, warmup=2, steps=2)
    return {"granularity": granularity, "plan": name, "summary": plan.summary(),
            "units": [[u.path, u.mode, u.checkpoint] for u in plan.units],
            "predicted_peak_bytes": pred.peak_bytes, "bound_peak_bytes": pred.breakdown["bound_peak_bytes"],
            "peak_moment": pred.breakdown["peak_moment"], "measured_peak_bytes": max(peaks),
            "measured_each": peaks}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("experiments/results/schedule_peak.json"))
    args = p.parse_args(argv)
    from osdp.distributed.local_ranks import run_local_ranks
    from osdp.machine.identity import machine_info

    start = time.perf_counter()
    records = []
    print(f"{'granularity':<10} {'plan':<9} {'predicted':>10} {'measured':>10} {'error':>7} {'bound':>10} "
          f"{'error':>7}  moment")
    for granularity in GRANULARITIES:
        for name in [*PLANS, *(n for g, n in NAMED if g == granularity)]:
            r = run_local_ranks(_measure, 2, granularity, name, timeout_s=300, collective_timeout_s=60,
                                threads=1, pin=True)[0]
            r["error"] = r["predicted_peak_bytes"] / r["measured_peak_bytes"] - 1
            r["bound_error"] = r["bound_peak_bytes"] / r["measured_peak_bytes"] - 1
            records.append(r)
            print(f"{granularity:<10} {name:<9} {r['predicted_peak_bytes']:>10,} {r['measured_peak_bytes']:>10,} "
                  f"{r['error']:>+7.2%} {r['bound_peak_bytes']:>10,} {r['bound_error']:>+7.2%}  {r['peak_moment']}",
                  flush=True)
    errors = sorted(abs(r["error"]) for r in records)
    summary = {"plans": len(records), "error_median": errors[len(errors) // 2], "error_worst": errors[-1],
               "under_worst": min(r["error"] for r in records),
               "within_1KiB": sum(abs(r["predicted_peak_bytes"] - r["measured_peak_bytes"]) <= 1024 for r in records),
               "bound_error_median": sorted(abs(r["bound_error"]) for r in records)[len(records) // 2]}
    print(json.dumps(summary))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine_info(torch.device("cpu")), "seconds": time.perf_counter() - start,
                                    "summary": summary, "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
