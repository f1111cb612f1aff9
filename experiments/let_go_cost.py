"""What letting go costs: time spent waiting for gloo to drop a collective's tensors, per training step.

    python experiments/let_go_cost.py --out experiments/results/let_go_cost.json

On CPU every FSDP2 all-gather and reduce-scatter of a wrapped model returns only once gloo's worker thread
has let go of its tensors (``osdp.distributed.collectives.Lent``), so that memory is freed where FSDP2 frees it. This trains
gpt2-mini (micro-batch 8 x 128 per rank) on 2 gloo ranks of one thread each under DDP, ZeRO-2 and FSDP
(zero3) plans and reports, per rank and plan, the step time, the collectives per step, how many found their
tensors still held when they completed, and the milliseconds per step spent waiting for those
(``osdp.distributed.collectives.let_go_stats``), after 3 warm-up steps, over 10 steps.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from local_ranks import rank0_result

MODEL, BATCH, SEQ, WARMUP, STEPS = "gpt2-mini", 8, 128, 3, 10
PLANS = ("ddp", "zero2", "fsdp")


def _measure(rank: int, world_size: int) -> list[dict]:
    import osdp
    from osdp import models
    from osdp.distributed import all_gather_objects
    from osdp.distributed import collectives as comm
    from osdp.models.data import synthetic_batch
    from osdp.runtime.step import train_step

    batch = synthetic_batch(models.get_config(MODEL, seq_len=SEQ), BATCH,
                            generator=torch.Generator().manual_seed(rank))
    rows = []
    for strategy in PLANS:
        torch.manual_seed(0)
        model = models.build(MODEL, seq_len=SEQ)
        osdp.wrap(model, strategy=strategy)
        optimizer = torch.optim.AdamW(model.parameters())

        def step():
            train_step(model, batch, optimizer)

        for _ in range(WARMUP):
            step()
        comm.let_go_stats(reset=True)
        start = time.perf_counter()
        for _ in range(STEPS):
            step()
        seconds = time.perf_counter() - start
        stats = comm.let_go_stats(reset=True)
        rows.append({
            "plan": strategy, "rank": rank, "step_ms": 1e3 * seconds / STEPS,
            "collectives_per_step": stats["collectives"] / STEPS, "waited_per_step": stats["waited"] / STEPS,
            "wait_ms_per_step": 1e3 * stats["seconds"] / STEPS,
        })
    return [row for rank_rows in all_gather_objects(rows) for row in rank_rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "let_go_cost.json")
    args = p.parse_args()
    rows = rank0_result(_measure, 2)
    print(f"{'plan':6} {'rank':>4} {'step ms':>8} {'collectives':>11} {'still held':>10} {'wait ms':>8} {'share':>7}")
    for r in rows:
        print(f"{r['plan']:6} {r['rank']:>4} {r['step_ms']:8.1f} {r['collectives_per_step']:11.1f} "
              f"{r['waited_per_step']:10.1f} {r['wait_ms_per_step']:8.3f} {r['wait_ms_per_step'] / r['step_ms']:7.2%}")
    from osdp.machine.identity import machine_info

    machine = {**machine_info(), "ranks": 2, "threads_per_rank": 1,
               "model": MODEL, "micro_batch": BATCH, "seq_len": SEQ, "warmup_steps": WARMUP, "steps": STEPS}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
