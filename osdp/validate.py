"""Check the cost model against reality: ``osdp validate --model NAME --nproc N``.

On N local ranks (gloo on CPU, NCCL on CUDA; launched through torchrun when not
already under it), every rank:

1. measures the collectives on the live group (``osdp.device``) and describes
   the model (``osdp.profile.describe``), all ranks at once, so that compute
   is timed under the same contention as training; rank 0's description is
   used everywhere;
2. trains every plan side by side, one step of each in turn, and with them
   the jobs the prediction needs that involve no plan of this model: FSDP2's
   runtime overheads on a synthetic model (``calibration_jobs`` /
   ``fit_calibration``), and the plain model's compute and optimizer step
   with the ranks meeting at every unit as they do under any plan; the
   collectives are re-fitted a few times in between. A shared machine's load
   changes within seconds; taking turns step by step spreads it over all
   jobs instead of penalising one;
3. takes each plan's step time as the median over its steps of the slowest
   rank, and its peak memory per rank from one tracked step
   (``osdp.memory.PeakMemory``: live tensor bytes on CPU,
   ``max_memory_allocated`` on CUDA), the largest over ranks.

Rank 0 prints predicted against measured with the error of each, the median
and worst errors and the Kendall tau of the step-time ranking, and writes them
to ``--json``: one record per plan with ``plan``, ``predicted_step_s``,
``measured_step_s``, ``predicted_peak_bytes``, ``measured_peak_bytes``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from osdp import models
from osdp.cost import Calibration, predict
from osdp.optim import OPTIMIZERS
from osdp.device import measure_collectives, measure_device
from osdp.distributed import broadcast_object, init_from_env, launch_local
from osdp.calibration import calibration_jobs, can_split, fit_calibration, median_collectives
from osdp.harness import Job, run_jobs
from osdp.log import Progress
from osdp.plan import ROOT, Plan, UnitPlan
from osdp.description import ModelDescription
from osdp.profile import describe
from osdp.report import format_bytes, format_table

# --------------------------------------------------------------------------- plans


def default_plans(
    description: ModelDescription, batch_size: int, world_size: int, *, splits: bool = True
) -> dict[str, Plan]:
    """The four baselines and mixed plans using every mode, split, checkpointing and bf16 (if described).

    Blocks alternate between their first and second kind of unit (attention,
    MLP) where a plan treats them differently; the root and embeddings follow
    the plan's "other" setting.
    """
    units = description.units
    kinds = sorted({u.signature for u in units if u.split_shapes and u.path != ROOT})
    first = kinds[0] if kinds else None

    def plan(choose: Callable[[Any], tuple[str, int, bool]], precision: str = "fp32", strategy: str | None = None) -> Plan:
        decisions = []
        for u in units:
            mode, k, ckpt = choose(u)
            if not u.split_shapes:
                k = 1
            if u.nested:
                ckpt = False
            decisions.append(UnitPlan(u.path, mode, k, ckpt))
        p = Plan(decisions, batch_size=batch_size, mixed_precision=precision, world_size=world_size,
                 model_signature=description.signature)
        if strategy:
            p.meta["strategy"] = strategy
        return p

    def block(u) -> bool:
        return bool(u.split_shapes) and u.path != ROOT

    plans = {
        "ddp": plan(lambda u: ("replicate", 1, False), strategy="ddp"),
        "zero2": plan(lambda u: ("zero2", 1, False), strategy="zero2"),
        "fsdp": plan(lambda u: ("zero3", 1, False), strategy="fsdp"),
        "fsdp-ckpt": plan(lambda u: ("zero3", 1, block(u))),
        "ddp-ckpt": plan(lambda u: ("replicate", 1, block(u))),
        "mixed-rep-z3": plan(lambda u: ("replicate", 1, False) if u.signature == first else ("zero3", 1, False)),
        "mixed-z2-ckpt": plan(lambda u: ("zero2", 1, True) if u.signature == first else ("zero3", 1, False)),
    }
    if splits:
        plans["split2"] = plan(lambda u: ("zero3", 2, False))
        plans["split4-ckpt"] = plan(lambda u: ("zero3", 4, block(u) and u.signature != first))
        plans["mixed-all"] = plan(
            lambda u: ("replicate", 1, True) if u.signature == first
            else ("zero3", 2, False) if block(u) else ("zero2", 1, False)
        )
    else:
        plans["mixed-all"] = plan(
            lambda u: ("replicate", 1, True) if u.signature == first
            else ("zero3", 1, False) if block(u) else ("zero2", 1, False)
        )
    if "bf16" in description.precisions:
        plans["fsdp-bf16"] = plan(lambda u: ("zero3", 1, False), "bf16")
        plans["mixed-bf16"] = plan(
            lambda u: ("zero2", 1, False) if u.signature == first else ("zero3", 1, block(u)), "bf16"
        )
    return plans


# --------------------------------------------------------------------------- reporting


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    from scipy.stats import kendalltau

    if len(a) < 2:
        return float("nan")
    return float(kendalltau(a, b).statistic)


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst relative errors of time and memory, Kendall tau of the time ranking."""
    t_err = [abs(r["step_error"]) for r in records]
    m_err = [abs(r["peak_error"]) for r in records]
    return {
        "plans": len(records),
        "step_error_median": statistics.median(t_err),
        "step_error_worst": max(t_err),
        "peak_error_median": statistics.median(m_err),
        "peak_error_worst": max(m_err),
        "kendall_tau_step": kendall_tau(
            [r["predicted_step_s"] for r in records], [r["measured_step_s"] for r in records]
        ),
    }


def format_report(records: Sequence[dict[str, Any]], summary: dict[str, Any]) -> str:
    rows = [
        [
            r["plan"],
            f"{r['predicted_step_s'] * 1e3:.1f}", f"{r['measured_step_s'] * 1e3:.1f}", f"{100 * r['step_error']:+.1f}%",
            format_bytes(r["predicted_peak_bytes"]), format_bytes(r["measured_peak_bytes"]), f"{100 * r['peak_error']:+.1f}%",
        ]
        for r in records
    ]
    table = format_table(
        rows, ["plan", "pred ms", "meas ms", "time err", "pred peak", "meas peak", "mem err"], "lrrrrrr"
    )
    s = summary
    return (
        f"{table}\n"
        f"step time: median error {100 * s['step_error_median']:.1f}%, worst {100 * s['step_error_worst']:.1f}%, "
        f"Kendall tau {s['kendall_tau_step']:.2f}; peak memory: median error "
        f"{100 * s['peak_error_median']:.1f}%, worst {100 * s['peak_error_worst']:.1f}%"
    )


# --------------------------------------------------------------------------- the command


def validate(
    model_name: str,
    *,
    device: torch.device,
    batch_size: int = 8,
    seq_len: int | None = None,
    plan_names: Sequence[str] | None = None,
    precisions: Sequence[str] = ("fp32",),
    optimizer: str = "adamw",
    rounds: int = 4,
    time_budget_s: float = 4.0,
    calibration: Calibration | None = None,
) -> dict[str, Any]:
    """Collective: predicted against measured for a set of plans of a reference model (see the module docstring).

    Without a given ``calibration``, its synthetic jobs run side by side with
    the plans, so that both see the same machine; ``rounds``: how often the
    collectives are re-fitted meanwhile.
    """
    from osdp.data import synthetic_batch

    rank, world_size = dist.get_rank(), dist.get_world_size()
    overrides = {"seq_len": seq_len} if seq_len else {}
    config = models.get_config(model_name, **overrides)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return models.build(model_name, **overrides)

    g = torch.Generator().manual_seed(1000 + rank)
    batch = tuple(t.to(device) for t in synthetic_batch(config, batch_size, generator=g))
    start = time.perf_counter()
    say = Progress(f"validate {model_name}")
    say("measuring collectives and compute")
    device_info = broadcast_object(measure_device(time_budget_s=2.0))
    collectives = [device_info.collectives]
    splits = can_split(device)
    model = build().to(device)
    say(f"describing {model_name} (every rank at once, as in training)")
    description = describe(model, batch, precisions=precisions, optimizers=(optimizer,), progress=rank == 0)
    description = broadcast_object(description)
    del model
    plans = default_plans(description, batch_size, world_size, splits=splits)
    if plan_names:
        unknown = sorted(set(plan_names) - set(plans))
        if unknown:
            raise ValueError(f"unknown plan(s) {unknown}; known: {', '.join(plans)}")
        plans = {n: plans[n] for n in plan_names}
    # The plain model's compute and optimizer step, timed twice in every round among the plans: what
    # describe timed, under the same load as the plans (a shared machine's load changes over minutes).
    names = list(plans)
    half = len(names) // 2
    jobs = {
        "compute": Job(build, None, batch, lockstep=True),
        **{name: Job(build, plans[name], batch) for name in names[:half]},
        "compute-2": Job(build, None, batch, lockstep=True),
        **{name: Job(build, plans[name], batch) for name in names[half:]},
    }
    calibration_descriptions: dict[int, ModelDescription] = {}
    if calibration is None:
        calibration_part, calibration_descriptions = calibration_jobs(device, optimizer=optimizer, splits=splits)
        jobs = {**calibration_part, **jobs}
    measured = run_jobs(
        jobs, device=device, optimizer=optimizer, rounds=rounds, time_budget_s=time_budget_s, progress=say,
        each_round=lambda: collectives.append(measure_collectives(time_budget_s=1.0)),
    )
    device_info = dataclasses.replace(device_info, collectives=median_collectives(collectives))
    if calibration is None:
        calibration = fit_calibration(
            calibration_descriptions, calibration_part, measured, device_info,
            overlap=0.0 if device.type == "cpu" else None,
            optimizer=optimizer,
        )
    say(f"calibration: {json.dumps(calibration.to_dict())}")
    described_s = sum(c.fwd_s(batch_size) + c.bwd_s(batch_size) for c in description.costs("fp32"))
    reference = [measured[k] for k in ("compute", "compute-2")]
    # compute in lockstep (ranks meet at every unit, as they do under any plan), less the meetings themselves
    meetings = 2 * sum(1 for u in description.units if u.path != ROOT) * device_info.collectives.time("all_reduce", 4)
    compute_scale = (statistics.fmean(m["measured_fwd_bwd_s"] for m in reference) - meetings) / described_s
    optimizer_s = statistics.fmean(m["measured_step_s"] - m["measured_fwd_bwd_s"] for m in reference)
    param_bytes = sum(u.param_bytes for u in description.units)
    description = dataclasses.replace(
        description.with_compute_scale(compute_scale),
        optimizer_s_per_byte={**description.optimizer_s_per_byte, optimizer: optimizer_s / param_bytes},
    )
    records = []
    for name, plan in plans.items():
        pred = predict(description, plan, device_info, optimizer=optimizer, calibration=calibration)
        m = measured[name]
        records.append({
            "plan": name,
            "plan_hash": plan.hash,
            "summary": plan.summary(),
            "predicted_step_s": pred.step_s,
            "measured_step_s": m["measured_step_s"],
            "step_error": pred.step_s / m["measured_step_s"] - 1,
            "predicted_peak_bytes": pred.peak_bytes,
            "measured_peak_bytes": m["measured_peak_bytes"],
            "peak_error": pred.peak_bytes / m["measured_peak_bytes"] - 1,
            "predicted": {k: v for k, v in pred.breakdown.items() if k != "units"},
            "measured_fwd_bwd_s": m["measured_fwd_bwd_s"],
            "measured_peak_breakdown": [r["peak_breakdown"] for r in m["per_rank"]],
            "steps": m["steps"],
            "plan_json": plan.to_dict(),
        })
    return {
        "model": model_name,
        "config": dict(vars(config)),
        "world_size": world_size,
        "batch_size": batch_size,
        "optimizer": optimizer,
        "machine": {
            "platform": platform.platform(), "processor": description.device, "device": str(device),
            "torch": torch.__version__, "threads_per_rank": torch.get_num_threads(),
        },
        "device_info": device_info.to_dict(),
        "calibration": calibration.to_dict(),
        "profile_seconds": description.profile_seconds,
        "compute_scale": compute_scale,
        "profile_checks": description.checks,
        "summary": summarize(records),
        "records": records,
        "seconds": time.perf_counter() - start,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="osdp validate", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-tiny", help=f"reference model ({', '.join(models.names())})")
    p.add_argument("--nproc", type=int, default=2, help="local ranks to launch when not under torchrun (default 2)")
    p.add_argument("--batch-size", type=int, default=8, help="micro-batch per rank (default 8)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--plans", nargs="+", default=None, help="names of plans to run (default: all; see --list-plans)")
    p.add_argument("--bf16", action="store_true", help="also validate mixed-precision (bf16) plans")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--time-budget", type=float, default=4.0, help="seconds of timed steps per job (default 4)")
    p.add_argument("--rounds", type=int, default=4, help="times the collectives are re-fitted meanwhile (default 4)")
    p.add_argument("--calibration", type=Path, help="a calibration JSON (from a previous --json) instead of measuring")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--json", type=Path, help="write the records and summary here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ:
        return launch_local(args.nproc, "osdp.validate", argv)
    device = init_from_env(args.device)
    try:
        calibration = None
        if args.calibration is not None:
            data = json.loads(args.calibration.read_text())
            calibration = Calibration.from_dict(data.get("calibration", data))
        result = validate(
            args.model, device=device, batch_size=args.batch_size, seq_len=args.seq_len, plan_names=args.plans,
            precisions=("fp32", "bf16") if args.bf16 else ("fp32",), optimizer=args.optimizer,
            rounds=args.rounds, time_budget_s=args.time_budget, calibration=calibration,
        )
        if dist.get_rank() == 0:
            print(f"{args.model}, {result['world_size']} ranks, micro-batch {args.batch_size}, {args.optimizer}, "
                  f"{result['machine']['processor']}")
            print(format_report(result["records"], result["summary"]), flush=True)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(result, indent=1, default=str))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
