"""The calibration: what the ideal cost model misses on this machine, measured once and cached.

``osdp calibrate`` (or the first ``osdp.wrap(device_mem=...)`` on a machine
without one) measures, on the live process group:

* the collectives' alpha-beta costs (``osdp.device.measure_collectives``,
  re-fitted a few times while the jobs below run, the median kept);
* the compute scale: how much longer a model computes in a job of this world
  size, every rank computing at once, than its description says (described on
  rank 0 with the others idle, as the planner describes a model): a plain
  synthetic model's step, all ranks at once against rank 0 alone, in turn;
* the wait of ranks that meet: a plain synthetic model's step, every rank at
  once, meeting at every unit against once a step (``measure_meeting_wait``;
  under FSDP2 every unit's collectives make the ranks meet, and ranks that
  computed the same drift apart as they compute);
* FSDP2's runtime costs: a synthetic model (``CalibrationNet``: units of a few
  Linears, narrow and wide, few and many units, small and large batch) trained under every mode,
  with checkpointing and with split Linears (``calibration_jobs``, side by side
  with ``osdp.harness.run_jobs``); what the cost model without overheads does
  not explain is attributed (``fit_calibration``) to fixed costs per step and
  per unit and per-byte costs by mode, per parameter tensor, per checkpointed unit, per split
  slice and byte, the contention of split slices' gathers with compute, the
  optimizer's cost per tensor, and the memory margin.

Nothing of a model being planned enters it. The result (``MachineCalibration``:
the collectives and the cost model's ``Calibration``) is cached under
``$OSDP_CACHE_DIR/calibration``, keyed by everything it depends on
(``CalibrationKey``: hosts, device, backend, world size, threads per rank,
network interface, torch version); ``osdp.plan``, ``osdp.wrap``, ``osdp
validate`` and the experiments read it from there. A calibration for another
key is never used: the lookup is by the whole key, and a file given by hand
whose key differs is refused with the differences named.

Tests use a tiny calibration (``OSDP_CALIBRATION_PROFILE=tiny``: smaller nets,
a few steps each), keyed apart, so it is never taken for a real one.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from osdp.cost import Calibration, predict, sqrt_segments
from osdp.description import ModelDescription
from osdp.device import (COLLECTIVES, AlphaBeta, CollectiveModel, DeviceInfo, combine_samples, measure_collectives,
                         measure_device)
from osdp.fsdp_ext.apply import apply_plan
from osdp.distributed import all_gather_objects, broadcast_object, world
from osdp.harness import Job, meet_at_every_unit, quiet_meetings, run_jobs
from osdp.log import Progress, log
from osdp.machine import cpu_model, host
from osdp.plan import MODES, Plan, ROOT, UnitPlan, replicates_with_ddp
from osdp.profile import cache_dir, describe_once
from osdp.store import write_atomically
from osdp.units import discover_units

CALIBRATION_VERSION = 13  # bump when what is measured changes: older cache entries are not read
PROFILE_ENV = "OSDP_CALIBRATION_PROFILE"


class CalibrationError(RuntimeError):
    """No usable calibration for this job (the message says how to make one)."""


# --------------------------------------------------------------------------- the synthetic model


class _CalibrationBlock(nn.Module):
    def __init__(self, d: int, linears: int):
        super().__init__()
        self.n = linears
        for i in range(linears):  # direct children, so that the block is the unit (a ModuleList has no forward)
            self.add_module(f"fc{i}", nn.Linear(d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for i in range(self.n):
            y = torch.relu(getattr(self, f"fc{i}")(y))
        return x + y


class CalibrationNet(nn.Module):
    """The synthetic model FSDP2's overheads are measured on: ``blocks`` units of ``linears`` Linears each."""

    def __init__(self, blocks: int = 8, d: int = 64, linears: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(_CalibrationBlock(d, linears) for _ in range(blocks))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x).square().mean()


def can_split(device: torch.device) -> bool:
    """Collective: whether this build of osdp applies split plans (every rank finds the same)."""
    net = CalibrationNet().to(device)
    plan = Plan([UnitPlan(u.path, "zero3", split=1 if u.path == ROOT else 2) for u in discover_units(net)])
    try:
        apply_plan(net, plan, device=device)
        return True
    except (RuntimeError, ValueError):
        return False


# --------------------------------------------------------------------------- what is measured


@dataclass(frozen=True)
class NetSpec:
    """One calibration net and the jobs it runs."""

    linears: int  # per unit
    width: int
    batch: int
    modes: tuple[str, ...]  # trained under each
    overheads: bool  # little compute: its mode jobs are the rows per-unit and per-byte costs are fitted on
    checkpoint: bool = False  # also zero3 with every block checkpointed
    split: bool = True  # also zero3 with every block split in 2
    compute: bool = False  # the compute scale is measured on its plain model
    blocks: int = 8  # units besides the root

    @property
    def name(self) -> str:
        return f"{self.blocks}x{self.linears}x{self.width}b{self.batch}"

    def build(self) -> "CalibrationNet":
        return CalibrationNet(blocks=self.blocks, d=self.width, linears=self.linears)


@dataclass(frozen=True)
class MeetingNet:
    """The transformer the ranks' meeting wait is measured on (``measure_meeting_wait``): the wait depends on
    what the ranks compute between meetings, and a transformer's attention, norms and activations are what
    the planned models compute. Its shape is none of the presets'."""

    n_layer: int
    n_embd: int
    n_head: int
    seq_len: int
    batch: int

    @property
    def name(self) -> str:
        return f"gpt-{self.n_layer}x{self.n_embd}s{self.seq_len}b{self.batch}"

    def build(self) -> nn.Module:
        from osdp.models import build

        return build("gpt2-tiny", n_layer=self.n_layer, n_embd=self.n_embd, n_head=self.n_head,
                     seq_len=self.seq_len)

    def batch_of(self, b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``b`` sequences and their targets (the model returns its loss)."""
        from osdp.models import get_config

        g = torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0)
        vocab = get_config("gpt2-tiny").vocab_size
        ids = torch.randint(0, vocab, (b, self.seq_len + 1), generator=g).to(device)
        return ids[:, :-1], ids[:, 1:]


@dataclass(frozen=True)
class CalibrationProfile:
    """How much to measure: the nets, and seconds per job and for the collectives."""

    name: str
    nets: tuple[NetSpec, ...]
    run_s: float  # timed seconds per job
    min_steps: int
    warmup: int
    collectives_s: float  # the first fit; each re-fit takes half
    refits: int
    describe_repeats: int
    compute_rounds: int
    meeting_net: MeetingNet
    # a calibration whose fixed step varied more than this (``spread``) was measured on a busy machine and
    # is not cached; None: not checked (the tiny nets' steps, ~1 ms, are too short to tell)
    busy_spread: float | None = None


# 2 and 4 Linears per unit separate per-unit from per-parameter costs; 3 blocks against 8 separate what a
# step costs once from what each unit costs; the wide nets' units (2 MiB, like a small transformer's) are
# 64x larger, which separates per-unit from per-byte costs, of FSDP and of split slices; with a large batch
# the wide net computes ~100x more (the compute scale is measured on it), and its slices' gathers run while
# there is compute to compete with.
PROFILES = {
    "full": CalibrationProfile(
        "full",
        (
            NetSpec(2, 64, 4, MODES, overheads=True, checkpoint=True),
            NetSpec(4, 64, 4, MODES, overheads=True, checkpoint=True),
            NetSpec(2, 64, 4, MODES, overheads=True, split=False, blocks=3),
            NetSpec(2, 512, 4, MODES, overheads=True),
            NetSpec(2, 512, 64, ("zero3",), overheads=False, compute=True),
            # 8 MiB units, 64 MiB in all: DDP reduces three buckets while backward goes on (longer than their
            # all-reduce, as in a transformer), then the last
            NetSpec(2, 1024, 64, ("replicate",), overheads=False, split=False),
        ),
        run_s=1.2, min_steps=5, warmup=2, collectives_s=2.0, refits=3, describe_repeats=5, compute_rounds=15,
        meeting_net=MeetingNet(n_layer=2, n_embd=128, n_head=4, seq_len=64, batch=8), busy_spread=1.5,
    ),
    # for tests: every term measured, at toy sizes, in a few seconds; keyed apart from "full"
    "tiny": CalibrationProfile(
        "tiny",
        (
            NetSpec(2, 64, 2, MODES, overheads=True, checkpoint=True),  # 64 wide: splittable
            NetSpec(4, 64, 2, MODES, overheads=True, checkpoint=True),
            NetSpec(2, 64, 2, MODES, overheads=True, split=False, blocks=3),
            NetSpec(2, 128, 2, MODES, overheads=True),
            NetSpec(2, 128, 32, ("zero3",), overheads=False, compute=True),
        ),
        run_s=0.6, min_steps=5, warmup=1, collectives_s=0.3, refits=2, describe_repeats=3, compute_rounds=9,
        meeting_net=MeetingNet(n_layer=2, n_embd=32, n_head=2, seq_len=16, batch=2),
    ),
}


def profile_from_env() -> CalibrationProfile:
    name = os.environ.get(PROFILE_ENV) or "full"
    if name not in PROFILES:
        raise CalibrationError(f"{PROFILE_ENV}={name!r}: use one of {sorted(PROFILES)}")
    return PROFILES[name]


def _net_and_batch(spec: NetSpec, device: torch.device) -> tuple[Callable[[], nn.Module], tuple[torch.Tensor]]:
    build = spec.build
    g = torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0)
    return build, (torch.randn(spec.batch, spec.width, generator=g).to(device),)


def calibration_jobs(device: torch.device, profile: CalibrationProfile, *, splits: bool = True) -> dict[str, Job]:
    """The synthetic-model jobs ``fit_calibration`` needs: ``calibration-NET-KIND`` (KIND a mode, ``ckpt``
    or ``split``)."""
    jobs: dict[str, Job] = {}
    for spec in profile.nets:
        build, batch = _net_and_batch(spec, device)
        paths = [u.path for u in discover_units(build())]

        def plan(mode: str, split: int = 1, ckpt: bool = False, b: int = spec.batch) -> Plan:
            return Plan([UnitPlan(p, mode, 1 if p == ROOT else split, ckpt and p != ROOT) for p in paths],
                        batch_size=b)

        for mode in spec.modes:
            jobs[f"calibration-{spec.name}-{mode}"] = Job(build, plan(mode), batch)
        if spec.checkpoint:
            jobs[f"calibration-{spec.name}-ckpt"] = Job(build, plan("zero3", ckpt=True), batch)
        if spec.split and splits:
            jobs[f"calibration-{spec.name}-split"] = Job(build, plan("zero3", split=2), batch)
    return jobs


def describe_nets(device: torch.device, profile: CalibrationProfile, *, optimizer: str = "adamw") -> dict[str, ModelDescription]:
    """Collective: the calibration nets' descriptions, made as the planner makes them
    (``osdp.profile.describe_once``: rank 0 alone)."""
    descriptions = {}
    for spec in profile.nets:
        build, batch = _net_and_batch(spec, device)
        torch.manual_seed(0)
        descriptions[spec.name] = describe_once(
            build().to(device), batch, cache=False, progress=False, optimizers=(optimizer,),
            repeats=profile.describe_repeats,
        )
    return descriptions


def _described_compute_s(description: ModelDescription, b: int) -> float:
    return sum(c.fwd_s(b) + c.bwd_s(b) for c in description.costs("fp32"))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def measure_compute_scale(device: torch.device, spec: NetSpec, rounds: int) -> dict[str, Any]:
    """Collective: how much longer the plain ``spec`` net's step takes with every rank computing at once
    (as in a job) than on rank 0 alone with the others waiting (as the planner describes a model).

    The two alternate round by round, so that a change of load on the machine
    hits both; the scale is the median over rounds of the slowest rank's step
    together over rank 0's alone.
    """
    from osdp.optim import make_optimizer
    from osdp.timing import StepTimer

    torch.manual_seed(0)
    model = spec.build().to(device)
    optimizer = make_optimizer("adamw", model.parameters())
    x = torch.randn(spec.batch, spec.width, device=device)
    rank, _ = world()

    def step() -> float:
        with StepTimer(device) as timer:
            model(x).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return timer.seconds

    step()  # warm-up: optimizer state, allocator
    alone, together = [], []
    for _ in range(rounds):
        _barrier()
        alone.append(step() if rank == 0 else 0.0)
        _barrier()
        together.append(step())
    alone = broadcast_object(alone)
    together = [max(ts) for ts in zip(*all_gather_objects(together))]
    ratios = [t / a for t, a in zip(together, alone)]
    return {
        "scale": statistics.median(ratios), "ratios": ratios,
        "alone_s": statistics.median(alone), "together_s": statistics.median(together),
        "spread": spread(alone),
    }


def pooled_compute_scale(*measurements: dict[str, Any] | None) -> float:
    """The compute scale over every round of ``measure_compute_scale`` made at different moments (before the
    calibration's jobs and after them): the median of all their rounds, so that a load on the machine at one
    moment, for fewer than half the rounds, does not move it. (Once, seven of the first measurement's fifteen
    rounds ran at 1.4-2.1x: its median said 1.19x, the measurement after the jobs 1.10x, and every plan of the
    run that planned with 1.19x measured 2-16% faster than predicted.)"""
    return statistics.median(r for m in measurements if m for r in m["ratios"])


def _meeting_segments(description: ModelDescription, compute_scale: float, b: int) -> float:
    """``sqrt_segments`` over a plain model's units but the root, their forward and backward seconds in the
    job: the compute between the meetings ``osdp.harness.meet_at_every_unit`` makes."""
    return sqrt_segments(*(compute_scale * f(b) for u in description.units if u.path != ROOT
                           for f in (u.costs["fp32"].fwd_s, u.costs["fp32"].bwd_s)))


def measure_meeting_wait(
    device: torch.device, net: MeetingNet, compute_scale: float, collectives: CollectiveModel, rounds: int,
    *, repeats: int = 3,
) -> dict[str, Any]:
    """Collective: ``Calibration.meeting_wait_s_per_sqrt_s``, the wait of ranks meeting as FSDP2's collectives
    make them meet, per square root of the seconds computed since they last met.

    The plain ``net`` computes with every rank at once, in turn freely (the
    ranks meet once a step) and meeting where every unit starts its forward and
    its backward (``meet_at_every_unit``), at its batch and at 4x (longer
    segments); per size the median over rounds of the difference of the slowest
    ranks' steps, less the meetings' own all-reduce, over the sum of the segments'
    square roots (the net's description, rank 0 alone as the planner describes,
    scaled to the job by ``compute_scale``) gives the wait, fitted through the
    origin over both sizes.
    """
    from osdp.profile import call_model
    from osdp.timing import StepTimer

    torch.manual_seed(0)
    free, meeting = net.build().to(device), net.build().to(device)
    meet_at_every_unit(meeting)
    sizes = (net.batch, 4 * net.batch)
    description = describe_once(net.build().to(device), net.batch_of(sizes[-1], device), batch_sizes=sizes,
                                cache=False, progress=False, repeats=repeats)
    meetings = 2 * sum(1 for u in description.units if u.path != ROOT)
    all_reduce = collectives.time("all_reduce", 4)

    def step(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> float:
        with quiet_meetings(), StepTimer(device) as timer:
            call_model(model, batch).backward()
        model.zero_grad(set_to_none=True)
        return timer.seconds

    points = []
    for b in sizes:
        batch = net.batch_of(b, device)
        step(free, batch), step(meeting, batch)  # warm-up
        times: list[tuple[float, float]] = []
        for _ in range(rounds):
            _barrier()
            alone = step(free, batch)
            _barrier()
            times.append((alone, step(meeting, batch)))
        per_rank = all_gather_objects(times)
        extra = statistics.median(max(t[1] for t in ts) - max(t[0] for t in ts) for ts in zip(*per_rank))
        points.append({"batch": b, "extra_s": extra, "meetings": meetings,
                       "sqrt_segments": _meeting_segments(description, compute_scale, b)})
    waits = [(p["extra_s"] - p["meetings"] * all_reduce, p["sqrt_segments"]) for p in points]
    fitted = sum(w * r for w, r in waits) / sum(r * r for _, r in waits)
    return {"net": net.name, "wait_s_per_sqrt_s": max(0.0, fitted), "points": points, "all_reduce_s": all_reduce}


def spread(times: Sequence[float]) -> float:
    """How unsteady repeated timings of one fixed computation are: their 90th over their 10th percentile."""
    q = statistics.quantiles(times, n=10, method="inclusive")
    return q[-1] / q[0]


# The full profile's busy_spread: its fixed step (~50 ms) timed alone on rank 0, 15 rounds, varied
# 1.16x-1.28x (90th over 10th percentile) on this 2-core VM when quiet; while another 2-rank job ran
# beside it, 1.9x-3.3x, and everything measured then (per-unit costs 3-7x, the compute scale 1.7-2.0x
# instead of 1.06-1.08) describes that competition, not the machine.
BUSY_RETRIES = 2  # measure again this many times, a few seconds apart, before settling for a busy one
BUSY_WAIT_S = 5.0


def fit_calibration(
    profile: CalibrationProfile,
    compute_scale: float,
    descriptions: dict[str, ModelDescription],
    jobs: dict[str, Job],
    measured: dict[str, dict[str, Any]],
    device_info: DeviceInfo,
    *,
    overlap: float | None,
    optimizer: str = "adamw",
    meeting_wait: float = 0.0,
) -> Calibration:
    """With compute times scaled by ``compute_scale`` (``measure_compute_scale``), what the cost model without
    runtime overheads does not explain on the calibration jobs, attributed (non-negative least squares): a
    fixed cost per step, per unit and per byte of a unit by mode, and per parameter tensor (FSDP2's hooks, bookkeeping, copies, buffers, the
    ranks meeting), per checkpointed unit, per split slice, per byte a split moves (SplitLinear's loop) and
    per second its slices' gathers run alongside compute (the contention of gloo's threads with compute on a
    CPU with a core per rank), per parameter tensor in the optimizer step (DTensor dispatch); and the memory
    margin: the worst measured minus modelled peak over the jobs, which every plan keeps free (what the model
    leaves out on this machine, so a budget stays a promise; the median left half of the jobs over it)."""
    from scipy.optimize import nnls

    specs = {spec.name: spec for spec in profile.nets}
    ddp_overlap, previous = 0.0, None
    # DDP's hidden fraction and the overheads each enter the other's fit, a little: to a fixed point
    for _ in range(20):
        if previous is not None and abs(ddp_overlap - previous) < 1e-9:
            break
        previous = ddp_overlap
        base = Calibration(compute_scale=compute_scale, overlap=overlap, ddp_overlap=ddp_overlap,
                           meeting_wait_s_per_sqrt_s=meeting_wait, source="partial")
        rows, residuals, opt_rows, margins, ckpt = [], [], [], [], []
        residual: dict[str, float] = {}
        for name, job in jobs.items():
            _, net, kind = name.split("-")
            description = descriptions[net]
            pred = predict(description, job.plan, device_info, optimizer=optimizer, calibration=base)
            opt_pred = pred.breakdown["totals"]["optimizer_s"]
            m = measured[name]
            residual[name] = m["measured_fwd_bwd_s"] - (pred.step_s - opt_pred)
            n_params = sum(len(u.param_shapes) for u in description.units)
            ddp = kind == "replicate" and replicates_with_ddp(job.plan.mixed_precision)
            if not ddp:  # DTensor dispatch
                opt_rows.append((m["measured_step_s"] - m["measured_fwd_bwd_s"] - opt_pred) / n_params)
            margins.append(m["measured_peak_bytes"] - pred.peak_bytes)
            if kind in MODES and specs[net].overheads:  # little compute: overheads only
                nbytes = sum(u.param_bytes for u in description.units)
                rows.append([len(description.units) * (kind == mode) for mode in MODES]
                            + [float(kind == mode) for mode in MODES]  # once per step (the root's)
                            + [nbytes * (kind == mode) for mode in MODES] + [0 if ddp else n_params])
                residuals.append(residual[name])
        scale = np.array([1.0] * 6 + [1e-9] * 3 + [1.0])  # condition the system: bytes are ~1e6 per unit
        coef = nnls(np.array(rows, dtype=float) * scale, np.array(residuals, dtype=float))[0] * scale
        per_unit, per_step, per_byte = (dict(zip(MODES, map(float, coef[i:i + 3]))) for i in (0, 3, 6))
        param_overhead = float(coef[-1])
        ddp_overlap = _fit_ddp_overlap(
            dataclasses.replace(base, unit_overhead_s=per_unit, root_overhead_s=per_step, unit_s_per_byte=per_byte,
                                param_overhead_s=param_overhead, ddp_overlap=0.0),
            specs, descriptions, jobs, measured, device_info, optimizer,
        )
    split_rows, split_extra = [], []
    for net, description in descriptions.items():
        blocks = [u for u in description.units if u.path != ROOT]
        if f"calibration-{net}-zero3" not in residual:
            continue
        zero3 = residual[f"calibration-{net}-zero3"]
        if f"calibration-{net}-ckpt" in residual:
            ckpt.append((residual[f"calibration-{net}-ckpt"] - zero3) / len(blocks))
        if f"calibration-{net}-split" in residual:
            weights = [s for u in blocks for s in u.split_shapes]
            # each split weight leaves FSDP (one parameter and its bytes less) and moves in 2 slices:
            # gathered twice (forward, backward) and its gradient reduced, fp32; its gathers run
            # asynchronously, alongside the unit's compute
            units = predict(description, jobs[f"calibration-{net}-split"].plan, device_info, optimizer=optimizer,
                            calibration=base).breakdown["units"]
            alongside = sum(min(units[u.path]["split_comm_s"], units[u.path]["compute_s"]) for u in blocks)
            split_rows.append([3 * 2 * len(weights), 1e-9 * sum(3 * 4 * o * i for o, i in weights), alongside])
            left_fsdp = param_overhead * len(weights) + per_byte["zero3"] * sum(4 * o * i for o, i in weights)
            split_extra.append(residual[f"calibration-{net}-split"] - zero3 + left_fsdp)
    per_slice, per_gb, contention = (
        nnls(np.array(split_rows, dtype=float), np.array(split_extra))[0] if split_rows else (0.0, 0.0, 0.0)
    )
    return Calibration(
        compute_scale=compute_scale,
        unit_overhead_s=per_unit,
        root_overhead_s=per_step,
        unit_s_per_byte=per_byte,
        param_overhead_s=param_overhead,
        checkpoint_overhead_s=max(0.0, statistics.median(ckpt)) if ckpt else 0.0,
        optimizer_tensor_s=max(0.0, statistics.median(opt_rows)),
        slice_overhead_s=float(per_slice),
        slice_s_per_byte=float(per_gb) * 1e-9,
        slice_contention=float(contention),
        overlap=overlap,
        ddp_overlap=ddp_overlap,
        meeting_wait_s_per_sqrt_s=meeting_wait,
        margin_bytes=max(0, int(max(margins))),
        source=f"measured on {device_info.name}, {device_info.world_size} ranks, {time.strftime('%Y-%m-%d')}",
    )


def _fit_ddp_overlap(
    overheads: Calibration,
    specs: Mapping[str, NetSpec],
    descriptions: Mapping[str, ModelDescription],
    jobs: Mapping[str, Job],
    measured: Mapping[str, Mapping[str, Any]],
    device_info: DeviceInfo,
    optimizer: str,
) -> float:
    """The fraction of DDP's all-reduce that the backward hides (``Calibration.ddp_overlap``), from the
    replicated jobs of nets with buckets before the last: how much faster they ran than with none hidden."""
    fractions = []
    for name, job in jobs.items():
        _, net, kind = name.split("-")
        if kind != "replicate" or specs[net].overheads or not replicates_with_ddp(job.plan.mixed_precision):
            continue
        pred = predict(descriptions[net], job.plan, device_info, optimizer=optimizer, calibration=overheads)
        totals = pred.breakdown["totals"]
        if totals["ddp_hideable_s"] > 0:
            unexplained = (pred.step_s - totals["optimizer_s"]) - measured[name]["measured_fwd_bwd_s"]
            fractions.append(unexplained / totals["ddp_hideable_s"])
    return min(1.0, max(0.0, statistics.median(fractions))) if fractions else 0.0


def median_collectives(fits: Sequence[CollectiveModel]) -> CollectiveModel:
    """One alpha-beta model from several fits of the same group (median alpha and beta per collective)."""
    costs = {
        c: AlphaBeta(statistics.median(f.costs[c].alpha_s for f in fits),
                     statistics.median(f.costs[c].beta_s_per_byte for f in fits))
        for c in COLLECTIVES
    }
    return CollectiveModel(fits[0].world_size, costs, f"{fits[0].source}, median of {len(fits)} fits",
                           combine_samples(fits, statistics.median))


# --------------------------------------------------------------------------- the cached record


@dataclass(frozen=True)
class CalibrationKey:
    """Everything a calibration depends on: one measured under another key is never used."""

    hosts: tuple[str, ...]  # every rank's host name, sorted, once each
    device: str  # the GPU's name, or the CPU's model
    device_type: str
    backend: str
    world_size: int
    threads: int  # per rank
    interface: str  # the network interface gloo / NCCL are told to use, if any
    torch: str
    profile: str = "full"
    reduce_scatter: str = "native"  # osdp.comm's implementations, which the collectives were measured with
    all_gather: str = "native"
    ranks_per_node: int = 0  # the job's node layout (torchrun's LOCAL_WORLD_SIZE): its topology is measured
    version: int = CALIBRATION_VERSION

    @classmethod
    def current(cls, device: torch.device, profile: str | None = None) -> "CalibrationKey":
        """Collective: this job's key (every rank's host, rank 0's view of the rest); ``profile`` defaults
        to ``OSDP_CALIBRATION_PROFILE`` (``full`` when unset)."""
        profile = profile or profile_from_env().name
        _, world_size = world()
        hosts = tuple(sorted(set(all_gather_objects(host()))))
        backend = str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else "none"
        interface = os.environ.get("NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME", "")
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
        from osdp import comm

        from osdp.distributed import ranks_per_node

        return cls(hosts, name, device.type, backend, world_size, torch.get_num_threads(), interface,
                   torch.__version__, profile, comm.reduce_scatter_impl(), comm.all_gather_impl(),
                   min(ranks_per_node(), world_size))

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def describe(self) -> str:
        where = ", ".join(self.hosts) if len(self.hosts) <= 2 else f"{len(self.hosts)} hosts"
        return (f"{self.device} ({self.device_type}, {self.backend}), {self.world_size} ranks of {self.threads} "
                f"thread(s) on {where}" + (f" over {self.interface}" if self.interface else "")
                + (f" as nodes of {self.ranks_per_node}" if 0 < self.ranks_per_node < self.world_size else "")
                + f", torch {self.torch}" + (f", {self.profile} profile" if self.profile != "full" else ""))

    def differences(self, other: "CalibrationKey") -> list[str]:
        """What differs, each as "field OTHER'S (this job: THIS ONE'S)"."""
        mine, theirs = dataclasses.asdict(self), dataclasses.asdict(other)
        return [f"{k} {theirs[k]!r} (this job: {mine[k]!r})" for k in mine if mine[k] != theirs[k]]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CalibrationKey":
        return cls(**{**d, "hosts": tuple(d["hosts"])})


@dataclass(frozen=True)
class MachineCalibration:
    """A machine's calibration: its collectives and the cost model's runtime terms, under its key."""

    key: CalibrationKey
    device_info: DeviceInfo  # collectives (and matmul FLOP/s) on the live group
    calibration: Calibration  # the cost model's terms
    seconds: float = 0.0  # how long measuring it took
    measured_at: str = ""
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # what was measured, for the record

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": dataclasses.asdict(self.key), "device_info": self.device_info.to_dict(),
            "calibration": self.calibration.to_dict(), "seconds": self.seconds, "measured_at": self.measured_at,
            "details": dict(self.details),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "MachineCalibration":
        return cls(CalibrationKey.from_dict(d["key"]), DeviceInfo.from_dict(d["device_info"]),
                   Calibration.from_dict(d["calibration"]), float(d.get("seconds", 0.0)),
                   str(d.get("measured_at", "")), dict(d.get("details", {})))

    def summary(self) -> str:
        c = self.calibration
        per_unit = ", ".join(f"{m} {1e3 * c.unit_overhead_s.get(m, 0):.2f}" for m in MODES)
        per_step = ", ".join(f"{m} {1e3 * c.root_overhead_s.get(m, 0):.2f}" for m in MODES)
        return (f"calibration of {self.key.describe()}, measured {self.measured_at} in {self.seconds:.0f} s: "
                f"compute x{c.compute_scale:.2f}; per step (ms) {per_step}; per unit (ms) {per_unit}; "
                # s per sqrt(s) as ms per sqrt(ms): the wait at a meeting after 1 ms of compute
                f"ranks meeting {1e3 * c.meeting_wait_s_per_sqrt_s * 1e-3 ** 0.5:.2f} ms per sqrt(ms); "
                f"margin {c.margin_bytes} B")


def calibration_dir() -> Path:
    return cache_dir() / "calibration"


def calibration_path(key: CalibrationKey) -> Path:
    return calibration_dir() / f"{key.device_type}-{key.world_size}ranks-{key.digest()}.json"


def read_calibration(path: Path, key: CalibrationKey | None = None) -> MachineCalibration:
    """The calibration in ``path``; with ``key``, refused (CalibrationError, naming what differs) unless
    it was measured under that key."""
    try:
        found = MachineCalibration.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CalibrationError(f"{path} is not a calibration osdp can read ({type(e).__name__}: {e})") from e
    if key is not None and found.key != key:
        raise CalibrationError(
            f"the calibration in {path} was measured for another job: " + "; ".join(key.differences(found.key))
            + f". Measure one for this job: osdp calibrate --nproc {key.world_size}"
        )
    return found


def cached_calibration(key: CalibrationKey) -> MachineCalibration | None:
    """The cached calibration for exactly ``key``, or None."""
    path = calibration_path(key)
    if not path.exists():
        return None
    try:
        return read_calibration(path, key)
    except CalibrationError:
        return None  # unreadable or (never by construction) another key's: measured again


def other_calibrations(key: CalibrationKey) -> list[str]:
    """The cached calibrations that do not fit ``key``, each with what differs."""
    out = []
    for path in sorted(calibration_dir().glob("*.json")):
        try:
            other = read_calibration(path)
        except CalibrationError:
            continue
        if other.key != key:
            out.append(f"{path.name}: {'; '.join(key.differences(other.key))}")
    return out


def _where(path: Path | None) -> str:
    return f"cached in {path}" if path is not None else "not cached (see the warning)"


def _save(record: MachineCalibration) -> Path | None:
    """Cache ``record``; None if the cache cannot be written (the run goes on, with a warning)."""
    path = calibration_path(record.key)
    return path if write_atomically(path, json.dumps(record.to_dict(), indent=1)) else None


# --------------------------------------------------------------------------- measuring


def measure_calibration(
    device: torch.device,
    profile: CalibrationProfile | None = None,
    *,
    optimizer: str = "adamw",
    progress: Callable[[str], None] | None = None,
) -> MachineCalibration:
    """Collective: measure this machine's calibration now (see the module docstring); not cached here."""
    profile = profile or profile_from_env()
    start = time.perf_counter()
    key = CalibrationKey.current(device, profile.name)
    if progress:
        progress("collectives")
    fits = [measure_collectives(time_budget_s=profile.collectives_s)]
    splits = can_split(device)
    if progress:
        progress("compute: every rank at once against rank 0 alone")
    (compute_net,) = [spec for spec in profile.nets if spec.compute]
    compute = measure_compute_scale(device, compute_net, profile.compute_rounds)
    for retry in range(BUSY_RETRIES if profile.busy_spread else 0):
        if compute["spread"] <= profile.busy_spread:
            break
        if progress:
            progress(f"the machine looks busy (a fixed step's time varies {compute['spread']:.2f}x, quiet is "
                     f"<= {profile.busy_spread}x): waiting, then measuring again ({retry + 1}/{BUSY_RETRIES})")
        time.sleep(BUSY_WAIT_S)
        compute = measure_compute_scale(device, compute_net, profile.compute_rounds)
    if progress:
        progress("describing the calibration nets")
    descriptions = describe_nets(device, profile, optimizer=optimizer)
    jobs = calibration_jobs(device, profile, splits=splits)
    measured = run_jobs(
        jobs, device=device, optimizer=optimizer, time_budget_s=profile.run_s, warmup=profile.warmup,
        min_steps=profile.min_steps, rounds=profile.refits, progress=progress,
        each_round=lambda: fits.append(measure_collectives(time_budget_s=profile.collectives_s / 2)),
    )
    device_info = broadcast_object(measure_device(collectives=median_collectives(fits)))  # + matmul FLOP/s
    # the machine may have got busy while the jobs ran: the same check once more, at the end
    after = measure_compute_scale(device, compute_net, profile.compute_rounds) if profile.busy_spread else None
    busy = max(compute["spread"], after["spread"] if after else 0.0)
    compute_scale = pooled_compute_scale(compute, after)
    if progress:
        progress("ranks meeting at every unit against once a step")
    meeting = measure_meeting_wait(device, profile.meeting_net, compute_scale, device_info.collectives,
                                   profile.compute_rounds, repeats=profile.describe_repeats)
    calibration = fit_calibration(profile, compute_scale, descriptions, jobs, measured, device_info,
                                  overlap=0.0 if device.type == "cpu" else None, optimizer=optimizer,
                                  meeting_wait=meeting["wait_s_per_sqrt_s"])
    details = {
        "compute": compute,
        "compute_after": after,
        "compute_scale": compute_scale,
        "meeting": meeting,
        "busy": bool(profile.busy_spread and busy > profile.busy_spread),  # then ``calibrate`` does not cache it
        "busy_spread": busy,
        "jobs": {name: {"measured_step_s": m["measured_step_s"], "measured_fwd_bwd_s": m["measured_fwd_bwd_s"],
                        "measured_peak_bytes": m["measured_peak_bytes"], "steps": m["steps"]}
                 for name, m in measured.items()},
        "described_compute_s": {spec.name: _described_compute_s(descriptions[spec.name], spec.batch)
                                for spec in profile.nets},
    }
    seconds = broadcast_object(time.perf_counter() - start)
    when = broadcast_object(time.strftime("%Y-%m-%d %H:%M"))
    calibration = dataclasses.replace(calibration, source=f"measured {when} for {key.describe()}")
    return MachineCalibration(key, device_info, calibration, seconds, when, details)


def job_device() -> torch.device:
    """The device a job on the default process group computes on: CUDA with NCCL, else CPU."""
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def calibrate(device: torch.device | None = None, *, force: bool = False, measure: bool = True,
              progress: bool = True) -> MachineCalibration:
    """Collective: this job's calibration, from the cache, else measured now and cached (rank 0 writes it).

    ``force`` measures again even if one is cached. ``measure=False`` raises
    CalibrationError instead of measuring (``osdp validate`` and the
    experiments, which must predict with a calibration made by an earlier,
    separate process). Every rank returns the same calibration.
    """
    device = device or job_device()
    profile = profile_from_env()
    key = CalibrationKey.current(device, profile.name)
    found = None if force else cached_calibration(key) if world()[0] == 0 else None
    found = broadcast_object(found)
    if found is not None:
        if found.details.get("busy"):
            log(f"the calibration of this job was measured on a busy machine (a fixed step's time varied "
                f"{found.details['busy_spread']:.2f}x): its predictions carry that noise; measure it again when "
                f"the machine is quiet: osdp calibrate --force --nproc {key.world_size}")
        return found
    others = other_calibrations(key) if world()[0] == 0 else []
    if not measure:
        raise CalibrationError(
            f"no calibration for this job ({key.describe()}) in {calibration_dir()}"
            + (" (there are some for other jobs: " + " | ".join(others) + ")" if others else "")
            + f"; measure one first, in its own run: osdp calibrate --nproc {key.world_size}"
        )
    show = Progress("calibrate", progress)
    show(f"no calibration for this job ({key.describe()}) in {calibration_dir()}"
         + (f" (only for other jobs: {' | '.join(others)})" if others else "")
         + ": measuring it once (about a minute on 2 CPU ranks)")
    record = measure_calibration(device, profile, progress=show)
    # Cached even when the machine was busy (a shared cloud VM may stay so): with the noise it was measured
    # under, which every later job is told of, rather than measured again on every run.
    path = _save(record) if world()[0] == 0 else None
    if record.details.get("busy"):
        show.done(f"done in {record.seconds:.0f} s, {_where(path)} with the noise it was measured under: the "
                  f"machine was busy (a fixed step's time varied {record.details['busy_spread']:.2f}x, quiet is <= "
                  f"{profile.busy_spread}x). When it is quiet: osdp calibrate --force --nproc {key.world_size}")
    else:
        show.done(f"done in {record.seconds:.0f} s, {_where(path)}")
    return record


# --------------------------------------------------------------------------- the command


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="osdp calibrate", description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="local ranks to launch when not under torchrun (default 2)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--force", action="store_true", help="measure again even if this job's calibration is cached")
    p.add_argument("--json", type=Path, help="also write the calibration here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from osdp.distributed import init_from_env, launch_local

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if "RANK" not in os.environ:
        return launch_local(args.nproc, "osdp.calibration", argv)
    device = init_from_env(args.device)
    try:
        record = calibrate(device, force=args.force)
        if world()[0] == 0:
            print(record.summary())
            print(f"cached in {calibration_path(record.key)}")
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(record.to_dict(), indent=1))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
