"""Gradient traffic per optimizer step under gradient accumulation: how many bytes each kind of unit
reduce-scatters when one step takes k micro-batches (``osdp.set_requires_gradient_sync`` False on all but
the last).

    python experiments/accumulation_traffic.py --out experiments/results/accumulation_traffic.json

gpt2-mini on 2 gloo ranks, a plan that splits every unit it can (zero3, k = 2) and keeps the others
zero3; split Linears run the PyTorch loop here and every reduction is ``osdp.distributed.collectives``'s pairwise
reduce-scatter, so that each can be counted (the C++ op issues the same ones; the bytes are the same
with the native reduce-scatter). Counted: the inputs of every reduce-scatter per optimizer step, split
slices apart from FSDP2's units. One reduction per accumulation window means the bytes do not
grow with k.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
from local_ranks import rank0_result

MODEL, BATCH, SEQ = "gpt2-mini", 8, 64


def split_everywhere(model, k: int = 2):
    """The plan that splits every unit but the root in k where it can, zero3 everywhere."""
    import osdp
    from osdp.schema.plan import ROOT, Plan, UnitPlan
    from osdp.split import splittable_linears

    modules = dict(model.named_modules())
    return Plan([UnitPlan(u.path, "zero3", split=k if u.path != ROOT and splittable_linears(
        modules[u.path], exclude={modules[p] for p in u.nested}, root=model) else 1)
        for u in osdp.discover_units(model)])


def _count(rank: int, world_size: int, micro_batches: list[int]) -> dict:
    import osdp
    from osdp import models
    from osdp.distributed import collectives as comm
    from osdp.models.data import synthetic_batch
    from osdp.split import set_backend

    set_backend("python")
    # every reduction through osdp.distributed.collectives's pairwise reduce-scatter (the same traffic as NCCL's), so that
    # each can be counted: FSDP2 units' through FSDPReduceScatter, the rest are split slices
    comm.set_reduce_scatter("pairwise")
    counts = {"all": 0, "fsdp": 0}
    pairwise, fsdp_call = comm.pairwise_reduce_scatter, comm.FSDPReduceScatter.__call__

    def counted(output, input, *args, **kwargs):
        counts["all"] += input.numel() * input.element_size()
        return pairwise(output, input, *args, **kwargs)

    def fsdp_counted(self, output_tensor, input_tensor, *args, **kwargs):
        counts["fsdp"] += input_tensor.numel() * input_tensor.element_size()
        return fsdp_call(self, output_tensor, input_tensor, *args, **kwargs)

    comm.pairwise_reduce_scatter, comm.FSDPReduceScatter.__call__ = counted, fsdp_counted
    rows = []
    for k in micro_batches:
        torch.manual_seed(0)
        model = models.build(MODEL, seq_len=SEQ)
        plan = split_everywhere(model)
        osdp.wrap(model, plan=plan)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        batch = synthetic_batch(models.get_config(MODEL, seq_len=SEQ), BATCH,
                                generator=torch.Generator().manual_seed(rank))
        per_micro = BATCH // k
        for step in range(2):  # the second step is counted
            counts.update(all=0, fsdp=0)
            for i in range(k):
                osdp.set_requires_gradient_sync(model, i == k - 1)
                micro = tuple(t[i * per_micro:(i + 1) * per_micro] for t in batch)
                (model(*micro) / k).backward()
            opt.step()
            opt.zero_grad()
        rows.append({"micro_batches": k, "split_reduce_scatter_bytes": counts["all"] - counts["fsdp"],
                     "fsdp_reduce_scatter_bytes": counts["fsdp"],
                     "split_units": sum(u.split > 1 for u in plan.units)})
    return {"rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "accumulation_traffic.json")
    args = p.parse_args(argv)
    from osdp import __version__

    result = rank0_result(_count, 2, args.micro_batches, timeout_s=600)
    record = {"model": MODEL, "batch": BATCH, "seq_len": SEQ, "world_size": 2, "osdp": __version__,
              "torch": torch.__version__, "machine": platform.processor() or platform.machine(), **result}
    print(f"{MODEL}, micro-batch {BATCH} x {SEQ} per rank split into k, 2 gloo ranks: bytes reduce-scattered "
          "per optimizer step")
    print(f"{'k':>3}  {'split slices':>14}  {'FSDP2 units':>14}")
    for r in record["rows"]:
        print(f"{r['micro_batches']:>3}  {r['split_reduce_scatter_bytes']:>14,}  {r['fsdp_reduce_scatter_bytes']:>14,}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
