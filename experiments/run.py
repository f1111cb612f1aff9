"""One experiment part: a reference model on N data-parallel ranks, baselines and OSDP at budgets -> JSON records.

    python experiments/run.py --model gpt2-mini --strategy fsdp2+ac --json fsdp2-ac.json
    python experiments/run.py --model gpt2-mini --budget 60MiB --link gpu-ratio --json osdp.json
    python experiments/run.py --probe-link gpu-ratio     # the link's fitted collectives; nothing is trained
    python experiments/run.py --nproc 4 --link inter-node-ratio --strategy fsdp2-hsdp   # 2 nodes x 2 ranks

Strategies (a record's ``strategy``):

- the baselines of ``baselines.py`` (``ALL_BASELINES``): ``torch-ddp``,
  ``fsdp2``, ``fsdp2-zero2``, ``fsdp2-hsdp`` and each ``+ac``, built as users
  write them, without OSDP's planner;
- ``osdp`` at a budget: what ``osdp.wrap(model, device_mem=B,
  example_input=...)`` plans (the same ``describe`` call and
  ``planner.search``, on the collectives measured on this run's process
  group); every budget is its own run, also where two budgets get one plan;
- ``osdp-uniform-ddp``, ``osdp-uniform-zero2``, ``osdp-uniform-fsdp``: OSDP's
  own uniform plans (its units and ``apply_plan``, one mode everywhere), an
  ablation, not a baseline;
- ``osdp-replicate``, ``osdp-zero3``, ``osdp-zero2`` and each ``+ac``: the
  native twins' OSDP counterparts for ``bench_modes.py`` (``TWINS``): one
  mode everywhere at the unit granularity the search picks for it, with
  ``+ac`` the units inside the transformer blocks checkpointed;
- ``fairscale``: fairscale's FSDP, ZeRO-3 with one FSDP instance per OSDP
  unit; CUDA only (its FSDP uses CUDA streams unconditionally).

Measurement. Every run of a part lives in one process group. Each of
``rounds`` repeats is one ``osdp.runtime.jobs.run_jobs`` over all runs (every
model alive, one step of each in turn, so all see the same load; the order
rotates between repeats): 2 warm-up steps, then at least ``min_steps`` (20)
timed steps, then one step under ``osdp.machine.memory.PeakMemory``. A step takes as
long as its slowest rank; a repeat's step time is the median over its steps;
a run's peak is the largest over ranks and repeats (on CPU, ``osdp.machine.memory``
counts DDP's gradient buckets from DDP's own record of them). The
compute-only run, the plain model on every rank with the same micro-batch and
no communication, takes its turns too: a run's ``efficiency`` is its step time
over the compute-only one, the median over repeats of the ratio within a
repeat (the physical limit is 1.0).

Links (``resolve_link``): ``loopback``; ``gpu-ratio`` and ``inter-node-ratio``,
two network namespaces joined by a shaped veth (``netns.py``), each namespace
a node of nproc / 2 ranks (one torchrun per namespace, torchrun's
``LOCAL_WORLD_SIZE`` telling osdp the layout); ``tbf:RATE``.

Every reduction is a reduce-scatter and every gather an all-gather of
``osdp.distributed.collectives`` (``reduce_scatter`` and ``all_gather`` in the spec, default
``pairwise`` both: NCCL's traffic on gloo), for every strategy alike; the
result says which.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import netns  # noqa: E402
from baselines import ALL_BASELINES, TWIN_BASELINES  # noqa: E402

# OSDP's uniform plans (an ablation): strategy -> osdp.strategy_plan's name
ABLATIONS = {"osdp-uniform-ddp": "ddp", "osdp-uniform-zero2": "zero2", "osdp-uniform-fsdp": "fsdp"}
# OSDP's uniform plans beside their native twins (bench_modes.py): mode, and checkpointing of the units in
# the transformer blocks as the "+ac" baselines checkpoint each block; at the unit granularity OSDP's
# search picks for that mode when memory is no limit
TWINS = {
    f"osdp-{mode}{'+ac' if ac else ''}": (mode, ac) for mode in ("replicate", "zero3", "zero2") for ac in (False, True)
}
# and selectively checkpointed (osdp's policy, osdp.describe.recompute.selective_context), beside the native
# twins that apply the same per-op policy (baselines.TWIN_BASELINES)
TWINS.update({f"osdp-{mode}+sac": (mode, "selective") for mode in ("replicate", "zero3")})
EXTRA_STRATEGIES = ("fairscale",)
STRATEGIES = (*ALL_BASELINES, *TWIN_BASELINES, *ABLATIONS, *TWINS, *EXTRA_STRATEGIES)
COMPUTE_ONLY = "compute-only"  # the plain model, no communication: the efficiency reference
MIN_STEPS = 20  # timed steps per run and repeat, at least
# osdp.distributed.collectives's collectives, for every strategy alike: NCCL's traffic on gloo
DEFAULT_COLLECTIVES = {"reduce_scatter": "pairwise", "all_gather": "pairwise"}
# The GPU node whose compute-to-communication ratio the shaped link reproduces: osdp.machine's
# h100-nvlink preset, achievable bf16 FLOP/s (45% of 989 TFLOP/s) over all-gather busbw (360 GB/s).
GPU_RATIO_PRESET = "h100-nvlink"
# The network between two emulated nodes (sweep_nodes.py): the H100 nodes of osdp.machine's multi-node preset,
# joined by 8x 400 Gb/s NDR InfiniBand (inter_node_flop_per_byte).
INTER_NODE_PRESET = "h100-nvlink-ndr400"
DEFAULT_PORT = 29531


def gpu_flop_per_byte(preset: str = GPU_RATIO_PRESET) -> float:
    from osdp.machine.presets import DEVICE_PRESETS

    p = DEVICE_PRESETS[preset]
    return p.flops["bfloat16"] / p.bus_bandwidth["all_gather"]


def inter_node_flop_per_byte(preset: str = INTER_NODE_PRESET) -> float:
    """FLOP per byte a rank sends across nodes on ``preset``: its achievable bf16 FLOP/s over the bus bandwidth
    of its cross-node group while every local rank's group runs at once (the preset's ``topology.inter``, as
    hybrid sharding runs them), on two full nodes.

    h100-nvlink-ndr400: 0.45 x 989 TFLOP/s = 445 TFLOP/s per GPU; 8 NICs x 46 GB/s busbw per node, shared by
    its 8 GPUs: 46 GB/s per rank; 445.05e12 / 46e9 = 9,675 FLOP/byte. It is also a node's FLOP/s over its NICs'
    bytes/s (8 x 445 TFLOP/s over 368 GB/s). Inside the node, over NVLink's 360 GB/s, it is 1,236
    (``gpu_flop_per_byte``): the network is 7.8x scarcer.
    """
    from osdp.machine.presets import DEVICE_PRESETS, device_preset

    per_node = DEVICE_PRESETS[preset].gpus_per_node
    info = device_preset(preset, 2 * per_node, ranks_per_node=per_node)
    return info.flops["bfloat16"] / info.topology.inter.bus_bandwidth("all_gather")


def core_flops(repeats: int = 5) -> float:
    """This machine's fp32 matmul FLOP/s on one thread: the best of a few ``osdp.machine.measure.measure_flops``
    (the best, because other work on a shared machine only ever slows a measurement down)."""
    import torch

    from osdp.machine.measure import measure_flops

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return max(measure_flops("cpu", time_budget_s=0.3) for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)


def resolve_link(name: str, *, flops: float | None = None, ratio: float | None = None,
                 ranks_per_node: int = 2) -> dict[str, Any]:
    """``loopback``; ``gpu-ratio`` (veth + tbf at the rate giving this core's FLOP/s / bytes/s = the GPU
    node's ratio); ``inter-node-ratio`` (veth + tbf between two nodes of ``ranks_per_node`` ranks, at the rate
    giving each rank the GPU cluster's FLOP/byte across nodes); or ``tbf:RATE`` with RATE like 600mbit."""
    if name == "loopback":
        return {"name": "loopback", "kind": "loopback", "label": "loopback (gloo over 127.0.0.1)"}
    if name == "gpu-ratio":
        flops = flops or core_flops()
        ratio = ratio or gpu_flop_per_byte()
        rate = netns.rate_for_ratio(flops, ratio)
        return {
            "name": "gpu-ratio", "kind": "veth", "rate_bit_per_s": rate,
            "target_flop_per_byte": ratio, "core_flops": flops, "ratio_of": GPU_RATIO_PRESET,
            "label": f"veth + tbf {rate / 1e6:.0f} Mbit/s ({ratio:.0f} FLOP/byte, as {GPU_RATIO_PRESET})",
        }
    if name == "inter-node-ratio":
        flops = flops or core_flops()
        ratio = ratio or inter_node_flop_per_byte()
        # Ranks beyond the cores share them (4 single-threaded ranks on 2 cores: half a core each while all
        # compute), and the link must be as scarce against the compute a rank gets as the network is on GPUs.
        rank_flops = flops * min(1.0, (os.cpu_count() or 1) / (2 * ranks_per_node))
        per_rank = netns.rate_for_ratio(rank_flops, ratio)
        # tbf shapes a namespace's egress, which its ranks share as a node's GPUs share its NICs (their
        # cross-node groups run at once): the node gets the rate of all its ranks
        rate = per_rank * ranks_per_node
        return {
            "name": "inter-node-ratio", "kind": "veth", "rate_bit_per_s": rate, "level": "inter",
            "ranks_per_node": ranks_per_node, "target_flop_per_byte": ratio, "core_flops": flops,
            "rank_flops": rank_flops, "ratio_of": INTER_NODE_PRESET,
            "label": inter_node_label(rate, ranks_per_node, ratio),
        }
    if name.startswith("tbf:"):
        text = name[4:].lower()
        for suffix, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1)):
            if text.endswith(suffix):
                rate = int(float(text[: -len(suffix)]) * mult)
                break
        else:
            raise ValueError(f"link rate {text!r}: use e.g. tbf:600mbit")
        return {"name": name, "kind": "veth", "rate_bit_per_s": rate, "label": f"veth + tbf {rate / 1e6:.0f} Mbit/s"}
    raise ValueError(f"unknown link {name!r}: loopback, gpu-ratio, inter-node-ratio or tbf:RATE")


def inter_node_label(rate_bit_per_s: int, ranks_per_node: int, ratio: float) -> str:
    return (f"veth + tbf {rate_bit_per_s / 1e6:.0f} Mbit/s per node, {rate_bit_per_s / ranks_per_node / 1e6:.0f} "
            f"per rank ({ratio:.0f} FLOP/byte across nodes, as {INTER_NODE_PRESET})")


# --------------------------------------------------------------------------- the worker (every rank)


def run_fairscale(build, batch, *, device, time_budget_s: float, measure_memory: bool, unit_paths,
                  warmup: int = 2, min_steps: int = MIN_STEPS, max_steps: int = 200) -> dict[str, Any]:
    """Collective: fairscale's FSDP (ZeRO-3, one instance per OSDP unit): warm-up, timed steps, one peak step."""
    from osdp.distributed import all_gather_objects
    from osdp.machine.memory import PeakMemory
    from osdp.optim import make_optimizer
    from osdp.runtime.step import train_step

    if device.type != "cuda":
        raise RuntimeError("fairscale FSDP needs CUDA (it uses CUDA streams unconditionally)")
    from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP

    model = build().to(device)
    for path in sorted((p for p in unit_paths if p), key=lambda p: -p.count(".")):  # innermost first
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, leaf, FairscaleFSDP(getattr(parent, leaf), reshard_after_forward=True))
    model = FairscaleFSDP(model, reshard_after_forward=True)
    opt = make_optimizer("adamw", model.parameters())
    inputs, targets = batch

    def step() -> tuple[float, float]:
        times = train_step(model, (inputs, targets), opt, device=device)
        return times.seconds, times.fwd_bwd_seconds

    warm = [step() for _ in range(warmup)]
    wanted = int(time_budget_s / max(warm[-1][0], 1e-6))
    n = max(min_steps, min(max_steps, max(all_gather_objects(wanted))))
    timed = [step() for _ in range(n)]
    out: dict[str, Any] = {"step_s": [t for t, _ in timed], "fwd_bwd_s": [f for _, f in timed]}
    if measure_memory:
        with PeakMemory(device, model, opt) as meter:
            step()
        stats = meter.stats()
        out.update(peak_bytes=stats.peak_bytes, peak_breakdown=dict(stats.peak_breakdown))
    del model, opt
    return out


def block_list_path(model) -> str:
    """Module path of the model's transformer block list (``baselines.transformer_blocks``)."""
    from baselines import transformer_blocks

    blocks = transformer_blocks(model)
    return next(path for path, m in model.named_modules() if m is blocks)


def twin_plan(descriptions, mode: str, ac: bool | str, blocks: str, device_info, calibration, optimizer: str,
              settings: dict):
    """OSDP's plan with every unit in ``mode`` (checkpointing the units inside the blocks with ``ac``: True
    for full, "selective"), at the granularity its search would pick when memory is no limit
    (``osdp.planner.choose_granularity``)."""
    from osdp.cost.schedule import predict
    from osdp.planner import choose_granularity
    from osdp.schema.plan import Plan, UnitPlan

    plans = []
    for d in descriptions:
        if d.granularity == "nested":
            continue  # only ever searched per block, with the "block" description
        plan = Plan([UnitPlan(u.path, mode, checkpoint=ac if u.path.startswith(blocks + ".") else False)
                     for u in d.units], **settings)
        plan.meta["granularity"] = d.granularity
        step = predict(d, plan, device_info, optimizer=optimizer, calibration=calibration).step_s
        plans.append((d, plan, 1 / step))
    return plans[choose_granularity([(plan, speed) for _, plan, speed in plans])][1]


def param_fraction(description, plan, mode: str) -> float:
    """Share of the parameter bytes that ``plan`` puts in ``mode``."""
    total = sum(u.param_bytes for u in description.units) or 1
    by_path = {u.path: u.mode for u in plan.units}
    return sum(u.param_bytes for u in description.units if by_path.get(u.path, "zero3") == mode) / total


def auto_budgets(low: int, high: int, count: int) -> list[int]:
    """``count`` budgets from ``low`` to ``high`` inclusive, evenly spaced, rounded up to KiB."""
    if count <= 1 or high <= low:
        return [-(-high // 1024) * 1024]
    return sorted({-(-int(low + (high - low) * i / (count - 1)) // 1024) * 1024 for i in range(count)})


def work(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Collective (every rank, under torchrun): the runs of ``spec``; rank 0 returns the result."""
    from osdp.runtime.jobs import Job

    collectives = spec_collectives(spec)
    part = open_part(spec, join_group(spec, collectives))
    if spec.get("link_probe"):  # only the link: how fast gloo's collectives are over it
        return measure_link(spec, part, collectives)
    if spec.get("calibrate"):  # this link's calibration, in its own run before the measured ones
        return calibrate_group(spec, part)
    planning = describe_for_planning(part)
    runs, requests = strategy_runs(spec.get("strategies", []), part, planning)
    runs[COMPUTE_ONLY] = Job(part.build, None, part.batch)  # the efficiency reference
    budgets, lowest, ddp_needs = osdp_budgets(spec, runs, part, planning)
    for budget in budgets:
        job, request = osdp_run(budget, part, planning)
        if job is not None:
            runs[request["key"]] = job
        requests.append(request)
    repeats = Repeats(spec, runs, part, planning)
    repeats.measure_all()
    if part.rank != 0:
        return None
    records = [run_record(request, part, planning, repeats, collectives) for request in requests]
    return part_result(part, planning, repeats, records, collectives, lowest_budget=lowest, ddp_needs=ddp_needs)


@dataclass
class Part:
    """A part as one rank runs it: the model every run builds alike, this rank's micro-batch, the link, the
    progress messages and the clock of the part's ``seconds``."""

    model_name: str
    overrides: dict[str, Any]  # the spec's seq_len, where it sets one
    config: Any  # the model's config, overrides applied
    batch_size: int
    batch: tuple
    device: Any  # torch.device
    rank: int
    world_size: int
    link: dict[str, Any]
    say: Callable[[str], None]
    started: float

    @property
    def tokens(self) -> int:
        """Tokens of one step on one rank."""
        return self.batch_size * self.config.seq_len

    def build(self):
        import torch

        from osdp import models

        torch.manual_seed(0)  # every rank builds the same initial model
        return models.build(self.model_name, **self.overrides)

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started


def join_group(spec: dict[str, Any], collectives: dict[str, str]):
    """Collective: join the torchrun process group, the spec's collectives set first; the device."""
    from osdp import models
    from osdp.distributed import collectives as comm
    from osdp.distributed import init_from_env

    models.quiet_view_warning()
    comm.set_reduce_scatter(collectives["reduce_scatter"])  # before anything measures or wraps
    comm.set_all_gather(collectives["all_gather"])
    return init_from_env(spec.get("device", "auto"))


def open_part(spec: dict[str, Any], device) -> Part:
    """This rank's ``Part`` of ``spec``, its micro-batch drawn from a generator of its own (after ``join_group``:
    the progress messages are rank 0's)."""
    import torch
    import torch.distributed as dist

    from osdp import models
    from osdp.log import Progress
    from osdp.models.data import synthetic_batch

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model_name, b = spec["model"], int(spec["batch_size"])
    overrides = {"seq_len": spec["seq_len"]} if spec.get("seq_len") else {}
    config = models.get_config(model_name, **overrides)
    link = dict(spec.get("link") or {"name": "loopback", "kind": "loopback"})
    say = Progress(f"run {model_name} {link.get('name')}")
    started = time.perf_counter()
    g = torch.Generator().manual_seed(1000 + rank)
    batch = tuple(t.to(device) for t in synthetic_batch(config, b, generator=g))
    return Part(model_name, overrides, config, b, batch, device, rank, world_size, link, say, started)


def measure_link(spec: dict[str, Any], part: Part, collectives: dict[str, str]) -> dict[str, Any] | None:
    """Collective: only the link, how fast gloo's collectives are over it (``probe_link``); rank 0 returns it."""
    from osdp.distributed import broadcast_object
    from osdp.machine.measure import measure_device

    part.say(f"measuring collectives ({describe_collectives(collectives)}) and FLOP/s on the live group")
    device_info = broadcast_object(measure_device(time_budget_s=float(spec.get("collective_time_s", 3.0))))
    return {"device_info": device_info.to_dict(), **collectives} if part.rank == 0 else None


def calibrate_group(spec: dict[str, Any], part: Part) -> dict[str, Any] | None:
    """Collective: this link's calibration, in its own run before the measured ones; rank 0 returns it."""
    from osdp.calibration.measured import calibrate

    machine = calibrate(part.device, force=spec["calibrate"] == "force")
    return {"calibration": machine.to_dict(), "summary": machine.summary()} if part.rank == 0 else None


@dataclass
class Planning:
    """What OSDP plans a part with: the calibration osdp.wrap would use and the model's descriptions at each unit
    granularity (the search chooses between them)."""

    machine: Any  # osdp.calibration.measured's MachineCalibration
    descriptions: list
    blocks: str  # path of the transformer block list (block_list_path)
    signature: str  # the model's structure_signature
    settings: dict[str, Any]  # a plan's batch size, world size and model signature
    optimizer: str = "adamw"

    @property
    def device_info(self):
        return self.machine.device_info

    @property
    def calibration(self):
        return self.machine.calibration

    @property
    def description(self):
        return self.descriptions[0]

    def described(self, plan):
        """The description ``plan`` was made from."""
        from osdp.planner import description_of

        if "granularity" in plan.meta:  # searched, or a twin at the granularity the search would pick
            return description_of(plan, self.descriptions)
        return next(d for d in self.descriptions if set(d.paths) == set(plan.paths) | {""})

    def predicted(self, plan, tokens: int) -> dict[str, Any]:
        from osdp.cost.schedule import predict

        p = predict(self.described(plan), plan, self.device_info, optimizer=self.optimizer,
                    calibration=self.calibration)
        return {"predicted_step_s": p.step_s, "predicted_peak_bytes": p.peak_bytes,
                "predicted_tokens_per_s": tokens / p.step_s}


def describe_for_planning(part: Part) -> Planning:
    """Collective: the calibration (measured by an earlier run, spec "calibrate") and descriptions osdp.plan
    would plan with."""
    from osdp.calibration.measured import calibrate
    from osdp.describe.units import structure_signature
    from osdp.planner import planning_descriptions

    machine = calibrate(part.device, measure=False)
    part.say(machine.summary())
    model = part.build().to(part.device)
    part.say("describing the model as osdp.plan does (rank 0; cached in OSDP_CACHE_DIR), at each unit granularity")
    descriptions = planning_descriptions(model, part.batch)
    blocks = block_list_path(model)
    signature = structure_signature(model)
    del model
    settings = dict(batch_size=part.batch_size, world_size=part.world_size, model_signature=signature)
    return Planning(machine, descriptions, blocks, signature, settings)


def strategy_runs(strategies: list[str], part: Part,
                  planning: Planning) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """What to run for ``strategies``: key -> Job (or "fairscale"), and one request per record."""
    runs: dict[str, Any] = {}
    requests: list[dict[str, Any]] = []
    for s in strategies:
        run, request = strategy_run(s, part, planning)
        if run is not None:
            runs[s] = run
        requests.append(request)
    return runs, requests


def strategy_run(s: str, part: Part, planning: Planning) -> tuple[Any, dict[str, Any]]:
    """Strategy ``s``'s run (a Job, "fairscale", or None where it is skipped) and its request."""
    import functools

    from baselines import build_baseline

    import osdp
    from osdp.runtime.jobs import Job

    if s in ALL_BASELINES or s in TWIN_BASELINES:
        parallelize = functools.partial(build_baseline, s, device_type=part.device.type)
        return Job(part.build, None, part.batch, parallelize=parallelize), {"strategy": s, "key": s}
    if s in ABLATIONS:
        plan = osdp.strategy_plan(part.build(), ABLATIONS[s], **planning.settings)
    elif s in TWINS:
        mode, ac = TWINS[s]
        plan = twin_plan(planning.descriptions, mode, ac, planning.blocks, planning.device_info, planning.calibration,
                         planning.optimizer, planning.settings)
    elif s == "fairscale":
        if part.device.type != "cuda":
            return None, {"strategy": s, "key": None,
                          "status": "skipped: fairscale FSDP needs CUDA (it uses CUDA streams unconditionally)"}
        return "fairscale", {"strategy": s, "key": s}
    else:
        raise ValueError(f"unknown strategy {s!r}; use one of {', '.join(STRATEGIES)}")
    return Job(part.build, plan, part.batch), {"strategy": s, "key": s, "plan": plan}


def osdp_budgets(spec: dict[str, Any], runs: dict[str, Any], part: Part,
                 planning: Planning) -> tuple[list[int], int, int | None]:
    """Collective: the budgets OSDP runs at (the spec's, and with ``auto_budgets`` that many from the least any plan
    needs, predicted, to torch-ddp's peak, measured in one short untimed pass); that least; torch-ddp's peak."""
    from osdp.planner import least_budget
    from osdp.runtime.jobs import run_jobs

    budgets = [int(x) for x in spec.get("budgets") or []]
    lowest = least_budget(planning.descriptions, planning.device_info, [part.batch_size], optimizer=planning.optimizer,
                          calibration=planning.calibration)
    if not spec.get("auto_budgets"):
        return budgets, lowest, None
    if "torch-ddp" not in runs:
        raise ValueError("auto budgets go up to where torch-ddp fits: include torch-ddp in the strategies")
    part.say("measuring torch-ddp's peak memory: the budgets go up to it")
    out = run_jobs({"torch-ddp": runs["torch-ddp"]}, device=part.device, optimizer=planning.optimizer,
                   time_budget_s=0.1, min_steps=1, rounds=1)
    ddp_needs = out["torch-ddp"]["measured_peak_bytes"]
    budgets = sorted(set(budgets) | set(auto_budgets(lowest, ddp_needs, int(spec["auto_budgets"]))))
    return budgets, lowest, ddp_needs


def osdp_run(budget: int, part: Part, planning: Planning) -> tuple[Any, dict[str, Any]]:
    """Collective: OSDP's Job at ``budget`` (None where no plan fits) and its request; the plan is rank 0's search
    (what osdp.wrap plans), broadcast to every rank."""
    from osdp.distributed import broadcast_object
    from osdp.planner import find_plan
    from osdp.runtime.jobs import Job
    from osdp.schema.plan import Plan
    from osdp.search import BudgetTooSmall

    request: dict[str, Any] = {"strategy": "osdp", "budget_bytes": budget}
    outcome = None
    if part.rank == 0:
        try:
            found = find_plan(planning.descriptions, planning.device_info, [part.batch_size], budget=budget,
                              calibration=planning.calibration, optimizer=planning.optimizer,
                              model_signature=planning.signature).plan
            outcome = ("plan", found.to_json())
        except BudgetTooSmall as e:
            outcome = ("too small", e.min_peak_bytes)
    kind, payload = broadcast_object(outcome)
    if kind != "plan":
        return None, {**request, "key": None, "status": "budget too small", "needs_bytes": payload}
    plan = Plan.from_json(payload)
    # its own run, even where another budget has the same plan
    return Job(part.build, plan, part.batch), {**request, "key": f"osdp@{budget / 2**20:.2f}MiB", "plan": plan}


class Repeats:
    """The measured repeats of a part's runs (the module docstring's Measurement): per run and repeat, its step
    time (the median over its steps), how many steps it timed and each one's time; every rank's peak in the
    repeat with the highest."""

    def __init__(self, spec: dict[str, Any], runs: dict[str, Any], part: Part, planning: Planning):
        self.runs, self.part, self.optimizer = runs, part, planning.optimizer
        self.unit_paths = planning.description.paths  # fairscale's FSDP instances
        self.rounds = int(spec.get("rounds", 3))
        self.per_run_s = float(spec.get("time_per_run_s", 1.5))
        self.min_steps = int(spec.get("min_steps", MIN_STEPS))
        self.jobs_at_once = int(spec.get("jobs_at_once") or 0)  # models alive at once in run_jobs (0: all)
        # groups of runs alive and stepped together, one group after another (bench_modes' pairs: a run and its
        # twin step in turn, so each pair of their steps saw the same host); the rest of the runs form one group
        self.paired = self._with_the_rest([list(g) for g in spec.get("groups") or []])
        self.measured: dict[str, dict[str, Any]] = {}

    def _with_the_rest(self, paired: list[list[str]]) -> list[list[str]]:
        if not paired:
            return paired
        grouped = {k for g in paired for k in g}
        unknown = grouped - set(self.runs)
        if unknown:
            raise ValueError(f"groups name runs this spec does not have: {sorted(unknown)}")
        rest = [k for k in self.runs if k not in grouped and self.runs[k] != "fairscale"]
        return paired + ([rest] if rest else [])

    def measure_all(self) -> None:
        """Collective: every repeat of every run, the order rotated between repeats."""
        keys = list(self.runs)
        self.part.say(f"{len(keys)} runs (compute-only included), {self.rounds} repeats of at least "
                      f"{self.min_steps} timed steps each")
        for r in range(self.rounds):
            shift = r % len(keys)
            self.measure(keys[shift:] + keys[:shift], r)

    def measure(self, keys: list[str], r: int) -> None:
        """Collective: repeat ``r`` of ``keys`` with osdp.runtime.jobs.run_jobs (every model of a group alive, one
        step of each in turn, so all see the same load; by default one group of all), fairscale (CUDA only) after."""
        ours = [k for k in keys if self.runs[k] != "fairscale"]
        for group in filter(None, self.groups(ours, r)):
            self.measure_group(group)
        for k in keys:
            if self.runs[k] == "fairscale":
                self.measure_fairscale(k)
        self.part.say(f"repeat {r + 1}/{self.rounds} ({self.part.elapsed_s():.0f} s): " + ", ".join(
            f"{k} {self.part.tokens / self.measured[k]['rounds'][-1]:,.0f}" for k in keys) + " tokens/s per rank")

    def groups(self, ours: list[str], r: int) -> list[list[str]]:
        """The groups of repeat ``r``: the paired ones alone, in the rotated order, their members' order alternating
        between repeats; else all in one (``measure_group`` keeps ``jobs_at_once`` of them alive at a time)."""
        if self.paired:
            n = len(self.paired)
            return [g if r % 2 == 0 else g[::-1] for g in (self.paired[(i + r) % n] for i in range(n))]
        return [ours]

    def measure_group(self, group: list[str]) -> None:
        from osdp.runtime.jobs import run_jobs

        out = run_jobs({k: self.runs[k] for k in group}, device=self.part.device, optimizer=self.optimizer,
                       time_budget_s=self.per_run_s, min_steps=self.min_steps, rounds=1,
                       at_once=self.jobs_at_once or None)
        for k in group:
            self.note(k, out[k]["measured_step_s"], out[k]["steps"], out[k]["per_rank"], out[k]["step_s_each"])

    def measure_fairscale(self, key: str) -> None:
        from osdp.distributed import all_gather_objects

        mine = run_fairscale(self.part.build, self.part.batch, unit_paths=self.unit_paths, device=self.part.device,
                             time_budget_s=self.per_run_s, measure_memory=True, min_steps=self.min_steps)
        ranks = all_gather_objects(mine)
        each = [max(ts) for ts in zip(*(x["step_s"] for x in ranks))]  # a step takes as long as its slowest rank
        self.note(key, statistics.median(each), len(mine["step_s"]), ranks, each)

    def note(self, key: str, step_s: float, steps: int, per_rank: list[dict[str, Any]], each: list[float]) -> None:
        m = self.measured.setdefault(key, {"rounds": [], "steps": [], "each": [], "per_rank_peak": None})
        m["rounds"].append(step_s)
        m["steps"].append(steps)
        m["each"].append(each)
        peaks = [(x.get("peak_bytes"), x.get("peak_breakdown")) for x in per_rank]
        if m["per_rank_peak"] is None or max(p or 0 for p, _ in peaks) > max(p or 0 for p, _ in m["per_rank_peak"]):
            m["per_rank_peak"] = peaks  # the repeat with the highest peak, all its ranks

    @property
    def compute_rounds(self) -> list[float]:
        return self.measured[COMPUTE_ONLY]["rounds"]

    def summary(self, key: str | None) -> dict[str, Any] | None:
        """Run ``key``'s ``measured`` record; None where it did not run."""
        if key is None or key not in self.measured:
            return None
        return summarize_run(self.measured[key], self.compute_rounds, self.part.tokens)


def run_record(request: dict[str, Any], part: Part, planning: Planning, repeats: Repeats,
               collectives: dict[str, str]) -> dict[str, Any]:
    """One record of the result: the part, the request's strategy and plan with OSDP's prediction, and its
    measurements where it ran."""
    key = request.get("key")
    rec: dict[str, Any] = {
        "model": part.model_name, "world_size": part.world_size, "batch_size": part.batch_size,
        "seq_len": part.config.seq_len, "tokens_per_step_per_rank": part.tokens, "link": part.link.get("name"),
        "strategy": request["strategy"], "budget_bytes": request.get("budget_bytes"),
        "status": request.get("status", "ran"), "run": key, **collectives,
    }
    if "needs_bytes" in request:
        rec["needs_bytes"] = request["needs_bytes"]
    plan = request.get("plan")
    if plan is not None:
        rec.update(plan=plan.to_dict(), plan_hash=plan.hash, plan_summary=plan.summary(),
                   replicated_fraction=param_fraction(planning.described(plan), plan, "replicate"),
                   **planning.predicted(plan, part.tokens))
    measured = repeats.summary(key)
    if measured is not None:
        rec["measured"] = measured
    return rec


def link_with_measurements(link: dict[str, Any], device_info) -> dict[str, Any]:
    """``link`` with the bus bandwidths and FLOP per byte this part measured on it (of each level, on several
    nodes)."""
    flops = device_info.flops.get("float32")
    busbw = device_info.collectives.bus_bandwidth("all_gather")
    link_busbw = device_info.collectives.largest_message_bus_bandwidth("all_gather")
    link = {**link,
            "measured_busbw_bytes_per_s": {c: device_info.collectives.bus_bandwidth(c)
                                           for c in ("all_gather", "reduce_scatter", "all_reduce")},
            "measured_flop_per_byte": flops / busbw if flops and busbw else None,
            # the link's own: the largest message's, which the calibration aims (shaped_busbw)
            "measured_largest_busbw_bytes_per_s": link_busbw,
            "measured_largest_flop_per_byte": flops / link_busbw if flops and link_busbw else None}
    topology = device_info.topology
    if topology is not None:  # several nodes: each level's links, as the planner priced them
        for level in ("intra", "inter"):
            model = getattr(topology, level)
            link[f"measured_{level}_busbw_bytes_per_s"] = {c: model.bus_bandwidth(c)
                                                          for c in ("all_gather", "reduce_scatter", "all_reduce")}
        inter_busbw = topology.inter.bus_bandwidth("all_gather")
        link["measured_inter_flop_per_byte"] = flops / inter_busbw if flops and inter_busbw else None
    return link


def part_result(part: Part, planning: Planning, repeats: Repeats, records: list[dict[str, Any]],
                collectives: dict[str, str], *, lowest_budget: int, ddp_needs: int | None) -> dict[str, Any]:
    """Rank 0's result of the part: its records, the model, the link as measured, the calibration and
    descriptions planned with, the compute-only reference and the measurement's settings."""
    from osdp.machine.identity import machine_info

    device_info, descriptions = planning.device_info, planning.descriptions
    compute_rounds = repeats.compute_rounds
    return {
        "records": records,
        "model": part.model_name,
        "config": dict(vars(part.config)),
        "link": link_with_measurements(part.link, device_info),
        **collectives,
        "nodes": device_info.nodes,
        "ranks_per_node": part.world_size // device_info.nodes,
        "lowest_budget_bytes": lowest_budget,
        "ddp_needs_bytes": ddp_needs,
        "compute_only": {"step_s_rounds": compute_rounds, "step_s_median": statistics.median(compute_rounds),
                         "tokens_per_s": part.tokens / statistics.median(compute_rounds)},
        "device_info": device_info.to_dict(),
        "calibration": planning.machine.to_dict(),
        "description": {"source": planning.description.source,
                        "profile_seconds": sum(d.profile_seconds for d in descriptions),
                        "granularities": [d.granularity for d in descriptions],
                        "from_cache": all(getattr(d, "from_cache", False) for d in descriptions)},
        "rounds": repeats.rounds,
        "min_steps": repeats.min_steps,
        "time_per_run_s": repeats.per_run_s,
        "machine": machine_info(part.device),
        "seconds": part.elapsed_s(),
    }


def summarize_run(m: dict[str, Any], compute_rounds: list[float], tokens: int) -> dict[str, Any]:
    """A run's record: per repeat the median over its steps of the slowest rank's step; the median over repeats;
    efficiency = compute-only step / this step, paired by repeat; the highest peak over ranks and repeats."""
    per_round = list(m["rounds"])
    med = statistics.median(per_round)
    efficiency = [c / t for c, t in zip(compute_rounds, per_round)]
    return {
        "step_s_median": med,
        "step_s_rounds": per_round,
        "step_s_each": m["each"],  # per repeat, every timed step (slowest rank), in order
        "step_s_min": min(per_round),
        "step_s_max": max(per_round),
        "tokens_per_s": tokens / med,
        "tokens_per_s_rounds": [tokens / t for t in per_round],
        "efficiency": statistics.median(efficiency),
        "efficiency_rounds": efficiency,
        "peak_bytes": max((p or 0) for p, _ in m["per_rank_peak"]),
        "timed_steps": m["steps"],
        # ranks step together (every step ends in collectives): one step time, each rank's peak
        "per_rank": [{"rank": k, "peak_bytes": p, "peak_breakdown": bd} for k, (p, bd) in enumerate(m["per_rank_peak"])],
    }


def worker_main(spec_path: Path, out_path: Path) -> int:
    import torch.distributed as dist

    spec = json.loads(spec_path.read_text())
    if spec.get("one_node"):  # torchrun set LOCAL_WORLD_SIZE=1 in each namespace; the node is all the ranks
        os.environ["LOCAL_WORLD_SIZE"] = os.environ["WORLD_SIZE"]
    try:
        result = work(spec)
        if result is not None:
            out_path.write_text(json.dumps(result, indent=1, default=str))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------- the launcher


def launch(spec: dict[str, Any], *, nproc: int = 2, on_line: Callable[[str], None] = print,
           timeout_s: float | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``spec`` on ``nproc`` local ranks over ``spec['link']``; the result of rank 0.

    loopback: torchrun --standalone, one node. veth: two nodes of nproc / 2 ranks, one torchrun per
    namespace (static rendezvous on node 0's veth address), which gives its ranks WORLD_SIZE, RANK,
    LOCAL_RANK and LOCAL_WORLD_SIZE (the node layout osdp reads); gloo binds the veth address."""
    link = spec.get("link") or {"kind": "loopback"}
    env = dict(env or os.environ)
    last_lines: collections.deque[str] = collections.deque(maxlen=40)  # for the error, when on_line keeps them

    def show(line: str) -> None:
        last_lines.append(line)
        on_line(line)

    collectives = spec_collectives(spec)  # osdp.distributed.collectives's, on every rank
    env["OSDP_REDUCE_SCATTER"], env["OSDP_ALL_GATHER"] = collectives["reduce_scatter"], collectives["all_gather"]
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    # two namespaces of one rank each, on a link that shapes a node's own interconnect (gpu-ratio, tbf:RATE; not
    # inter-node-ratio), are the two ranks of one emulated node: osdp is told so, or it would plan two levels
    spec = {**spec, "one_node": link["kind"] == "veth" and nproc == 2 and link.get("level") != "inter"}
    with tempfile.TemporaryDirectory(prefix="osdp-run-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        worker = [str(Path(__file__).resolve()), "--worker", str(spec_path), "--out", str(out_path)]
        if link["kind"] == "loopback":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *worker]
            code = _run_local(cmd, env, show, timeout_s)
            codes = [code]
        elif link["kind"] == "veth":
            if nproc < 2 or nproc % 2:
                raise ValueError(f"the veth link joins two nodes of as many ranks: nproc must be even, got {nproc}")
            per_node = nproc // 2
            with netns.VethLink(rate_bit=link.get("rate_bit_per_s")) as veth:
                cmds = [[sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={i}",
                         f"--nproc-per-node={per_node}", f"--master-addr={veth.addresses[0]}",
                         f"--master-port={DEFAULT_PORT}", *worker] for i in range(2)]
                codes = netns.run_in_namespaces(veth, cmds, env, lambda node, line: show(line), timeout_s)
                link_desc = {**veth.describe(), "ranks_per_namespace": per_node}
            spec.setdefault("link_setup", link_desc)
        else:
            raise ValueError(f"unknown link kind {link['kind']!r}")
        if any(codes) or not out_path.exists():
            raise RuntimeError(f"the run failed (exit codes {codes}); its last lines:\n" + "\n".join(last_lines))
        result = json.loads(out_path.read_text())
    if "link_setup" in spec and "link" in result:
        result["link"]["setup"] = spec["link_setup"]
    return result


def spec_collectives(spec: dict[str, Any]) -> dict[str, str]:
    """The ``osdp.distributed.collectives`` implementations a spec asks for, defaults filled in."""
    return {name: spec.get(name) or default for name, default in DEFAULT_COLLECTIVES.items()}


def recorded_collectives(record: dict[str, Any]) -> dict[str, str]:
    """The ``osdp.distributed.collectives`` implementations a stored result ran with (those from before the all-gather setting
    ran gloo's own all-gather)."""
    return {"reduce_scatter": record.get("reduce_scatter", "native"), "all_gather": record.get("all_gather", "native")}


def describe_collectives(collectives: dict[str, str]) -> str:
    return f"{collectives['all_gather']} all-gather, {collectives['reduce_scatter']} reduce-scatter"


def add_collective_args(ap: argparse.ArgumentParser) -> None:
    """``--reduce-scatter`` and ``--all-gather``: osdp.distributed.collectives's implementations for every strategy alike."""
    for name in DEFAULT_COLLECTIVES:
        ap.add_argument(f"--{name.replace('_', '-')}", choices=["native", "pairwise"],
                        default=DEFAULT_COLLECTIVES[name],
                        help=f"osdp.distributed.collectives's {name.replace('_', '-')} for every strategy (pairwise: NCCL's traffic "
                             f"on gloo)")


def collectives_from_args(args: argparse.Namespace) -> dict[str, str]:
    return {name: getattr(args, name) for name in DEFAULT_COLLECTIVES}


def probe_link(link: dict[str, Any], *, collectives: dict[str, str] | None = None,
               env: dict[str, str] | None = None, on_line: Callable[[str], None] = print,
               nproc: int = 2) -> dict[str, Any]:
    """The collectives and FLOP/s measured on ``nproc`` ranks over ``link`` (``osdp.machine.measure.measure_device``;
    on two nodes of several ranks also each level's, ``topology``), nothing trained: the ``device_info`` dict."""
    spec = {"model": "gpt2-tiny", "batch_size": 1, "link": link, "link_probe": True, "collective_time_s": 2.0,
            **(collectives or DEFAULT_COLLECTIVES)}
    return launch(spec, env=env, on_line=on_line, nproc=nproc)["device_info"]


def link_nproc(link: dict[str, Any]) -> int:
    """Ranks a run over ``link`` takes: two nodes of the link's ranks per node (2 ranks, one per namespace,
    for the single-node links)."""
    return 2 * int(link.get("ranks_per_node", 1))


def shaped_busbw(link: dict[str, Any], device_info: dict[str, Any]) -> float:
    """The all-gather bus bandwidth the link's rate sets: that of the largest message measured (16 MiB), of the
    world group or, for an ``inter`` link, of the cross-node groups measured all at once
    (``osdp.machine.measure.measure_topology``). Not the fitted beta's: messages within the tbf burst pass at the
    veth's speed and pull the fit under the rate, by a different amount each probe."""
    from osdp.machine.collective_model import CollectiveModel

    if link.get("level") == "inter":
        collectives = device_info["topology"]["inter"]
    else:
        collectives = device_info["collectives"]
    return CollectiveModel.from_dict(collectives).largest_message_bus_bandwidth("all_gather")


def calibrate_gpu_ratio(link: dict[str, Any], *, env: dict[str, str] | None = None,
                        on_line: Callable[[str], None] = print, tolerance: float = 0.10, max_probes: int = 6,
                        collectives: dict[str, str] | None = None) -> dict[str, Any]:
    """Adjust a ``gpu-ratio`` or ``inter-node-ratio`` link's tbf rate until the FLOP/s a rank gets (the core's,
    or its share of one, ``rank_flops``) over the all-gather bus bandwidth of the largest message on it
    (``shaped_busbw``: the world's, or the cross-node groups') is the target FLOP per byte within
    ``tolerance``, in two probes in a row at that rate.

    Probe, scale the rate by wanted / measured bandwidth (the mean over the
    rate's probes), probe again: TCP, tbf and gloo each take a share of the
    nominal rate, and not in proportion to it. One probe is not trusted: on
    the shaped veth a probe within 10% was followed by a calibration at the
    same rate that fitted 38% under the aim (experiments/results/collectives.md),
    so a probe within tolerance is repeated, and the rate kept once two in a
    row are. Otherwise keeps the rate whose probes' mean is closest after
    ``max_probes``. Every probe is in ``calibration``.
    """
    target = link["target_flop_per_byte"]
    flops = link.get("rank_flops") or link["core_flops"]  # the compute a rank gets (resolve_link)
    want = flops / target  # bytes/s of all-gather busbw

    def within(flop_per_byte: float) -> bool:
        return abs(flop_per_byte / target - 1) <= tolerance

    rate, probes = link["rate_bit_per_s"], []
    for _ in range(max_probes):
        info = probe_link({**link, "rate_bit_per_s": rate}, collectives=collectives, env=env, on_line=on_line,
                          nproc=link_nproc(link))
        busbw = shaped_busbw(link, info)
        probes.append({"rate_bit_per_s": rate, "all_gather_busbw_bytes_per_s": busbw,
                       "flop_per_byte": flops / busbw, "device_info": info})
        on_line(f"calibration: tbf {rate / 1e6:.0f} Mbit/s -> all-gather busbw {busbw / 1e6:.1f} MB/s, "
                f"{flops / busbw:.0f} FLOP/byte (target {target:.0f})")
        previous = probes[-2] if len(probes) > 1 and probes[-2]["rate_bit_per_s"] == rate else None
        if within(flops / busbw) and previous is not None and within(previous["flop_per_byte"]):
            break  # confirmed
        if within(flops / busbw) and previous is None:
            continue  # once more at this rate before trusting it
        at_rate = [p["all_gather_busbw_bytes_per_s"] for p in probes if p["rate_bit_per_s"] == rate]
        rate = int(rate * want / statistics.fmean(at_rate))
    by_rate: dict[int, list[dict[str, Any]]] = {}
    for p in probes:
        by_rate.setdefault(p["rate_bit_per_s"], []).append(p)
    rate, kept = min(by_rate.items(), key=lambda item: abs(
        flops / statistics.fmean(p["all_gather_busbw_bytes_per_s"] for p in item[1]) / target - 1))
    busbw = statistics.fmean(p["all_gather_busbw_bytes_per_s"] for p in kept)
    confirmed = len(kept) >= 2 and all(within(p["flop_per_byte"]) for p in kept[-2:])
    return {**link, "rate_bit_per_s": rate, "nominal_rate_bit_per_s": link["rate_bit_per_s"],
            "probe_busbw_bytes_per_s": busbw,
            "probe_flop_per_byte": flops / busbw,
            "calibrated": confirmed,
            "calibration": [{k: v for k, v in p.items() if k != "device_info"} for p in probes],
            "probe_device_info": kept[-1]["device_info"],
            "label": inter_node_label(rate, link["ranks_per_node"], target) if link.get("level") == "inter" else
                     f"veth + tbf {rate / 1e6:.0f} Mbit/s ({target:.0f} FLOP/byte, "
                     f"as {link.get('ratio_of', GPU_RATIO_PRESET)})"}


def collective_table(device_info: dict[str, Any]) -> str:
    """The fitted alpha and beta of each collective, its bus bandwidth (the fit's, and the largest message's),
    and beta against the all-gather's: of the world group and, on several nodes, of a node's group and a
    cross-node group."""
    from osdp.machine.collective_model import COLLECTIVES, CollectiveModel

    groups = [("world", device_info["collectives"])]
    if device_info.get("topology"):
        groups += [("in a node", device_info["topology"]["intra"]), ("across nodes", device_info["topology"]["inter"])]
    lines = []
    for name, collectives in groups:
        model = CollectiveModel.from_dict(collectives)
        ag = model.costs["all_gather"].beta_s_per_byte
        lines.append(f"{'collective':<15} {'alpha (us)':>10} {'beta (ns/B)':>12} {'busbw (MB/s)':>13} "
                     f"{'largest (MB/s)':>15} {'beta / AG':>10}   {name}, {model.world_size} ranks")
        for c in COLLECTIVES:
            ab = model.costs[c]
            lines.append(f"{c:<15} {ab.alpha_s * 1e6:>10.1f} {ab.beta_s_per_byte * 1e9:>12.3f} "
                         f"{model.bus_bandwidth(c) / 1e6:>13.1f} {model.largest_message_bus_bandwidth(c) / 1e6:>15.1f} "
                         f"{ab.beta_s_per_byte / ag if ag else float('nan'):>10.2f}")
        lines.append(f"({model.source})")
    return "\n".join(lines)


def _run_local(cmd: list[str], env: dict[str, str], on_line: Callable[[str], None], timeout_s: float | None) -> int:
    import threading

    p = netns.spawn(cmd, env)  # stopped on SIGINT/SIGTERM/SIGHUP and at exit, like the namespaced ranks

    def pump():
        for line in p.stdout:
            on_line(line.rstrip("\n"))

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    try:
        p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        code = netns.stop(p)  # terminates the torchrun session we started if it is still running
        t.join(timeout=5)
    return code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="gpt2-mini")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--strategy", choices=STRATEGIES)
    how.add_argument("--budget", help="OSDP at this per-rank budget (e.g. 60MiB)")
    how.add_argument("--probe-link", metavar="LINK",
                     help="only measure the collectives over LINK (gpu-ratio: after calibrating its rate)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--link", default="loopback",
                    help="loopback, gpu-ratio, inter-node-ratio (two nodes of nproc / 2 ranks) or tbf:RATE (e.g. "
                         "tbf:600mbit)")
    ap.add_argument("--rounds", type=int, default=3, help="repeats (medians are reported)")
    ap.add_argument("--time-per-run", type=float, default=2.0, help="seconds of timed steps per repeat")
    ap.add_argument("--min-steps", type=int, default=MIN_STEPS, help="timed steps per repeat, at least")
    add_collective_args(ap)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--json", type=Path, help="write the record here")
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.out)
    collectives = collectives_from_args(args)
    if args.probe_link:
        link = resolve_link(args.probe_link, ranks_per_node=max(1, args.nproc // 2))
        if link["name"] in ("gpu-ratio", "inter-node-ratio"):
            link = calibrate_gpu_ratio(link, collectives=collectives)
            info = link.pop("probe_device_info")
            print(f"{link['label']}: {link['probe_flop_per_byte']:.0f} FLOP/byte measured "
                  f"({'within' if link['calibrated'] else 'NOT within'} 10% of the target in two probes in a row)")
        else:
            info = probe_link(link, collectives=collectives, nproc=args.nproc)
        print(f"{link.get('label', link['name'])}, {describe_collectives(collectives)}:\n{collective_table(info)}")
        if args.json:
            args.json.write_text(json.dumps({"link": link, "device_info": info, **collectives},
                                            indent=1, default=str))
        return 0
    from osdp.sizes import parse_size

    spec = {
        "model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len, "device": args.device,
        "strategies": [args.strategy or "fsdp2"] if not args.budget else [],
        "budgets": [parse_size(args.budget)] if args.budget else [],
        "rounds": args.rounds, "time_per_run_s": args.time_per_run, "min_steps": args.min_steps,
        **collectives, "link": resolve_link(args.link, ranks_per_node=max(1, args.nproc // 2)),
    }
    # what osdp.wrap would do on this machine: its cached calibration, measured first if there is none
    launch({**spec, "calibrate": "if missing"}, nproc=args.nproc)
    result = launch(spec, nproc=args.nproc)
    record = {**result["records"][0], "link_info": result["link"], "machine": result["machine"],
              "device_info": result["device_info"], "compute_only": result["compute_only"]}
    text = json.dumps(record, indent=1, default=str)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    m = record.get("measured")
    if m:
        predicted = (f"; predicted {record['predicted_tokens_per_s']:,.0f} tokens/s, "
                     f"{record['predicted_peak_bytes'] / 2**20:.1f} MiB" if record.get("predicted_tokens_per_s") else "")
        print(f"{record['strategy']}: {m['tokens_per_s']:,.0f} tokens/s per rank (median of {len(m['step_s_rounds'])} "
              f"repeats), efficiency {m['efficiency']:.2f}, peak {m['peak_bytes'] / 2**20:.1f} MiB{predicted}")
    else:
        print(f"{record['strategy']}: {record['status']}"
              + (f" (needs {record['needs_bytes'] / 2**20:.1f} MiB)" if record.get("needs_bytes") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
