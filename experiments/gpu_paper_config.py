"""The OSDP paper's configuration on one GPU: gpt-48l-h1536 as rank 0 of 8, under an 8 GiB budget.

    python experiments/gpu_paper_config.py                                   # a machine with one CUDA GPU
    python experiments/gpu_paper_config.py --model gpt2-tiny --device cpu --budget 5MiB   # smoke check, seconds
    python experiments/gpu_paper_config.py --plans all --extra-budgets 6GiB 4GiB --measured-compute

The paper (IJCAI 2023) reports, for a 48-layer GPT with hidden size 1536 on 8
GPUs with an 8 GB limit, OSDP using 8057 of 8192 MB against 5657 MB for
fairscale FSDP, and ~21% more throughput (192 vs 158 seq/s). One GPU cannot
run 8 ranks, so this process poses as rank 0 of 8 through the fake process
group (``osdp._torch_private.init_fake_process_group``): FSDP2 shards,
gathers and frees exactly as rank 0 of 8 would, so the **compute and the
memory are real**, but the **collectives are not executed** (their outputs
are left unfilled) and take no time. So the step times here are compute (and
FSDP's own work) only; the communication is the cost model's (the
``--preset`` link, h100-nvlink by default), reported beside them.

Steps: plan OSDP at the budget (the model described analytically on the meta
device: FLOPs at this GPU's measured matmul rate, memory from a fake-tensor
trace; collectives from the preset; micro-batch chosen among
``--batch-sizes``), then train the OSDP plan and FSDP (zero3 everywhere, the
same micro-batch) for a few steps each on the real device: median step time
after warm-up and the peak of one step (``torch.cuda.max_memory_allocated``;
on CPU osdp.machine.memory's live-bytes tracker). Writes ``gpu_paper_config.json``
and ``gpu_paper_config.png`` to ``--out``.

``--plans`` adds ZeRO-2 and the fixed plans of ``osdp validate`` (checkpointing,
splits, mixed modes; ``all`` for every one), ``--extra-budgets`` OSDP's plans at
other budgets, all at OSDP's micro-batch. Every run records the predicted
peak and, with the collectives left out (the fake group has none), the
predicted compute step from the analytic description and, with
``--measured-compute``, from the model measured on this device
(``osdp.describe.measured.describe``), beside the measured ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_paper_config"
FIXED_PLANS = ("fsdp", "zero2", "fsdp-ckpt", "split2", "split4-ckpt", "mixed-z2-ckpt", "mixed-all")
PLANS = ("osdp", *FIXED_PLANS)
PAPER = {"osdp_peak_mb": 8057, "budget_mb": 8192, "fsdp_peak_mb": 5657, "osdp_seq_per_s": 192,
         "fairscale_fsdp_seq_per_s": 158, "world_size": 8, "gpus": "8 GPUs (paper: 8 GB limit per GPU)"}
NOTE = "fake process group: rank 0 of 8; compute and memory real, collectives not executed"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-48l-h1536")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--budget", default="8GiB", help="memory budget per rank (the paper: 8 GB)")
    p.add_argument("--plans", nargs="+", default=["osdp", "fsdp"], choices=[*PLANS, "all"],
                   help="plans to train (default: osdp fsdp; all: every one)")
    p.add_argument("--extra-budgets", nargs="*", default=[], help="OSDP's plans at these budgets too")
    p.add_argument("--measured-compute", action="store_true",
                   help="also describe the model on the device and predict each plan's compute from that")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="micro-batch candidates")
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's (1024 for gpt-48l-h1536)")
    p.add_argument("--mixed-precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--preset", default="h100-nvlink", help="collective costs for planning (osdp plan --list-devices)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per plan")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if "all" in args.plans:
        args.plans = list(PLANS)
    return args


def device_info_for(args, device: torch.device):
    """The preset's collectives at ``--world-size``, this device's measured matmul FLOP/s and matmul
    workspaces."""
    from osdp.machine.measure import measure_flops
    from osdp.machine.presets import device_preset
    from osdp.machine.workspace import device_workspace_bytes

    info = device_preset(args.preset, args.world_size)
    flops = {"float32": measure_flops(device, torch.float32)}
    if args.mixed_precision == "bf16":
        flops["bfloat16"] = measure_flops(device, torch.bfloat16)
    return dataclasses.replace(info, name=f"{info.name} collectives, {device.type} FLOP/s measured", flops=flops,
                               workspace_bytes=device_workspace_bytes(device))


def compute_only(info):
    """``info`` with free collectives: what a step costs under the fake group, which runs none."""
    from osdp.machine.collective_model import AlphaBeta, CollectiveModel

    free = CollectiveModel(info.world_size, {c: AlphaBeta(0.0, 0.0) for c in info.collectives.costs}, "none (fake group)")
    return dataclasses.replace(info, collectives=free)


def plans_to_run(args, description, info) -> tuple[dict[str, tuple[Any, int | None]], list[dict[str, Any]]]:
    """{name: (plan, its budget or None)} in the order to run, and the OSDP budgets no plan fits.

    OSDP at ``--budget`` (named "osdp") and at each of ``--extra-budgets``
    ("osdp@SIZE"); the fixed plans of ``--plans`` at OSDP's micro-batch.
    """
    from osdp.cli.validate import default_plans
    from osdp.planner import find_plan
    from osdp.search import BudgetTooSmall
    from osdp.sizes import parse_size

    candidates = sorted(set(args.batch_sizes))
    budgets = {"osdp": parse_size(args.budget)} if "osdp" in args.plans else {}
    budgets.update({f"osdp@{b}": parse_size(b) for b in args.extra_budgets})
    plans, not_fitting = {}, []
    for name, budget in budgets.items():
        try:
            result = find_plan(description, info, candidates, budget=budget, mixed_precision=args.mixed_precision,
                            model_signature=description.signature)
            plans[name] = result.plan, budget
        except BudgetTooSmall as e:
            not_fitting.append({"name": name, "budget_bytes": budget, "needs_bytes": e.min_peak_bytes, "error": str(e)})
    main = plans.get("osdp")
    batch = main[0].batch_size if main else candidates[0]
    fixed = default_plans(description, batch, args.world_size, splits=True)
    for name in (n for n in FIXED_PLANS if n in args.plans):
        plans[name] = dataclasses.replace(fixed[name], mixed_precision=args.mixed_precision), None
    return plans, not_fitting


def describe_on_device(args, device: torch.device, seq_len: int, batch_size: int):
    """The model measured on ``device`` (unsharded, one process): per-unit compute for the cost model."""
    from osdp import models
    from osdp.describe.measured import describe
    from osdp.models.data import synthetic_batch

    torch.manual_seed(0)
    with torch.device(device):
        model = models.build(args.model, seq_len=seq_len)
    config = models.get_config(args.model, seq_len=seq_len)
    batch = tuple(t.to(device) for t in synthetic_batch(config, batch_size, generator=torch.Generator().manual_seed(1)))
    description = None
    for top in (batch_size, max(1, batch_size // 2)):  # a smaller one (fitted linear in it) if the first does not fit
        try:
            description = describe(model, batch, batch_sizes=sorted({max(1, top // 2), top}),
                                   precisions=(args.mixed_precision,), optimizers=("adamw",), time_budget_s=8.0,
                                   cache=False, progress=False, name=args.model)
            break
        except torch.OutOfMemoryError:
            if top == 1:
                raise
            print(f"describing at micro-batch {top} ran out of memory: describing at {max(1, top // 2)}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    del model, batch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return description


def run_plan_fake(name: str, plan, args, device: torch.device, seq_len: int) -> dict[str, Any]:
    """Train ``plan`` as rank ``--rank`` of ``--world-size`` (fake group): step times and one step's peak."""
    import osdp
    from osdp import models
    from osdp.machine.memory import PeakMemory
    from osdp.models.data import synthetic_batch
    from osdp.optim import make_optimizer
    from osdp.runtime.step import train_step

    # what earlier plans left allocated (nothing, unless something keeps a dropped model alive): it counts in
    # this plan's measured peak
    leftover = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    torch.manual_seed(0)
    with torch.device(device):
        model = models.build(args.model, seq_len=seq_len)
    osdp.wrap(model, plan=plan, device=device)
    opt = make_optimizer("adamw", model.parameters())
    config = models.get_config(args.model, seq_len=seq_len)
    inputs, targets = (t.to(device) for t in synthetic_batch(config, plan.batch_size, generator=torch.Generator().manual_seed(1)))

    def step() -> float:
        return train_step(model, (inputs, targets), opt, device=device).seconds

    for _ in range(args.warmup):
        step()
    times = [step() for _ in range(args.steps)]
    with PeakMemory(device, model, opt, inputs, targets) as meter:
        step()
    stats = meter.stats()
    out = {
        "name": name, "plan_hash": plan.hash, "summary": plan.summary(), "batch_size": plan.batch_size,
        "step_s_median": statistics.median(times), "step_s": times,
        "peak_bytes": stats.peak_bytes, "peak_reserved_bytes": stats.peak_reserved_bytes,
        "baseline_bytes": stats.baseline_bytes,  # allocated when the step began: parameters, states, the batch
        "leftover_bytes": leftover,
        "peak_breakdown": dict(stats.peak_breakdown),
    }
    del model, opt, meter
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def experiment(args: argparse.Namespace) -> dict[str, Any]:
    import warnings

    import torch.distributed as dist

    from osdp import models
    from osdp._torch_private import init_fake_process_group
    from osdp.cost.schedule import predict
    from osdp.describe.analytic import describe_analytic
    from osdp.machine.identity import machine_info
    from osdp.sizes import parse_size

    models.quiet_view_warning()
    warnings.filterwarnings("ignore", message=r"Full backward hook is firing")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu with a small --model for a smoke check)")
    if device.type == "cpu":
        torch.set_num_threads(1)
    config = models.get_config(args.model)
    seq_len = args.seq_len or config.seq_len
    start = time.perf_counter()
    init_fake_process_group(rank=args.rank, world_size=args.world_size)
    try:
        info = device_info_for(args, device)
        candidates = sorted(set(args.batch_sizes))
        with torch.device("meta"):
            meta_model = models.build(args.model, seq_len=seq_len)
        example = torch.zeros(max(candidates), seq_len, dtype=torch.long, device="meta")
        description = describe_analytic(meta_model, (example, example), info, world_size=args.world_size,
                                        batch_sizes=candidates, precisions=(args.mixed_precision,), progress=False,
                                        name=args.model)
        record: dict[str, Any] = {"budget_bytes": parse_size(args.budget)}
        plans, not_fitting = plans_to_run(args, description, info)
        record["not_fitting"] = not_fitting
        if any(x["name"] == "osdp" for x in not_fitting):
            record["osdp_error"] = next(x["error"] for x in not_fitting if x["name"] == "osdp")
        measured_description = None
        if args.measured_compute and plans:
            batch = next(iter(plans.values()))[0].batch_size
            print(f"describing {args.model} on {device} (micro-batch {batch}) for the compute predictions", flush=True)
            measured_description = describe_on_device(args, device, seq_len, batch)
            record["measured_description"] = {"source": measured_description.source,
                                              "profile_seconds": measured_description.profile_seconds,
                                              "checks": measured_description.checks}
        free = compute_only(info)
        runs = []
        for name, (plan, budget) in plans.items():
            pred = predict(description, plan, info)
            print(f"{name}: {plan.summary()}, micro-batch {plan.batch_size}; predicted peak "
                  f"{pred.peak_bytes / 2**20:.1f} MiB, step {pred.step_s * 1e3:.1f} ms", flush=True)
            measured = run_plan_fake(name, plan, args, device, seq_len)
            comm = pred.breakdown["totals"]
            measured.update(budget_bytes=budget, predicted_step_s=pred.step_s, predicted_peak_bytes=pred.peak_bytes,
                            predicted_compute_analytic_s=predict(description, plan, free).step_s,
                            predicted_breakdown={k: v for k, v in comm.items()}, plan=plan.to_dict())
            if measured_description is not None:
                measured["predicted_compute_s"] = predict(measured_description, plan, free).step_s
            print(f"{name}: measured peak {measured['peak_bytes'] / 2**20:.1f} MiB "
                  f"({measured['peak_bytes'] / (budget or record['budget_bytes']):.1%} of the budget), compute step "
                  f"{measured['step_s_median'] * 1e3:.1f} ms ({NOTE})", flush=True)
            runs.append(measured)
    finally:
        dist.destroy_process_group()
    record.update(
        model=args.model, world_size=args.world_size, rank=args.rank, seq_len=seq_len,
        mixed_precision=args.mixed_precision, preset=args.preset, note=NOTE, runs=runs, paper=PAPER,
        device_info=info.to_dict(),
        machine={**machine_info(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        seconds=time.perf_counter() - start,
    )
    return record


def plot(record: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure

    runs = record["runs"]
    fig = Figure(figsize=(max(10, 1.3 * len(runs)), 4.5), layout="constrained")
    mem_ax, time_ax = fig.subplots(1, 2)
    names = [f"{r['name'].upper()}\nmicro-batch {r['batch_size']}" for r in runs]
    colors = [{"osdp": "tab:green", "fsdp": "tab:red"}.get(r["name"], f"C{i % 10}") for i, r in enumerate(runs)]
    MiB = 2**20
    mem_ax.bar(names, [r["peak_bytes"] / MiB for r in runs], color=colors, label="measured peak (this run)")
    mem_ax.scatter(names, [r["predicted_peak_bytes"] / MiB for r in runs], color="black", marker="_", s=600,
                   zorder=3, label="predicted peak")
    mem_ax.axhline(record["budget_bytes"] / MiB, color="black", linestyle="--", linewidth=1, label="budget")
    if record["model"] == "gpt-48l-h1536":
        paper = {"osdp": record["paper"]["osdp_peak_mb"], "fsdp": record["paper"]["fsdp_peak_mb"]}
        shown = [(n, paper[r["name"]]) for n, r in zip(names, runs) if r["name"] in paper]
        if shown:
            mem_ax.scatter(*zip(*shown), color="tab:purple", marker="*", s=120, zorder=4,
                           label="paper (OSDP 8057, FSDP 5657 MB)")
    for i, r in enumerate(runs):
        mem_ax.annotate(f"{r['peak_bytes'] / MiB:,.0f} MiB", (i, r["peak_bytes"] / MiB), ha="center",
                        textcoords="offset points", xytext=(0, 3), fontsize=8)
    mem_ax.tick_params(axis="x", labelsize=7)
    time_ax.tick_params(axis="x", labelsize=7)
    mem_ax.set_ylabel("peak memory of rank 0 (MiB)")
    mem_ax.set_title(f"{record['model']}, rank 0 of {record['world_size']}, budget "
                     f"{record['budget_bytes'] / MiB:,.0f} MiB", fontsize=9)
    mem_ax.legend(fontsize=7, loc="lower right")
    time_ax.bar(names, [r["step_s_median"] * 1e3 for r in runs], color=colors, label="measured step (compute only)")
    time_ax.scatter(names, [r["predicted_step_s"] * 1e3 for r in runs], color="black", marker="_", s=600, zorder=3,
                    label=f"predicted step (with {record['preset']} collectives)")
    time_ax.set_ylabel("ms per step")
    time_ax.set_title("step time: measured compute vs cost model", fontsize=9)
    time_ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{record['machine']['gpu'] or record['machine']['device']}: {NOTE}", fontsize=10)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    record = experiment(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_paper_config.json").write_text(json.dumps(record, indent=1, default=str))
    plot(record, args.out / "gpu_paper_config.png")
    MiB = 2**20
    for r in record["runs"]:
        budget = f" of {r['budget_bytes'] / MiB:,.1f}" if r["budget_bytes"] else ""
        print(f"{r['name']:13s} micro-batch {r['batch_size']}: peak {r['peak_bytes'] / MiB:8,.1f} MiB{budget} "
              f"(predicted {r['predicted_peak_bytes'] / MiB:,.1f}); compute step "
              f"{r['step_s_median'] * 1e3:.1f} ms (predicted step with communication {r['predicted_step_s'] * 1e3:.1f} ms)")
    for x in record["not_fitting"]:
        print(f"{x['name']}: {x['error']}")
    print(f"paper: OSDP {PAPER['osdp_peak_mb']} of {PAPER['budget_mb']} MB, FSDP {PAPER['fsdp_peak_mb']} MB")
    print(f"({NOTE}); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
