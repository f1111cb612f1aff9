"""The measurements that need ranks computing at once (the compute scale, the wait of ranks that meet), and
the fit of FSDP2's runtime costs to the jobs' measured steps (``fit_calibration``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn as nn

from osdp.calibration.nets import CalibrationProfile, MeetingNet, NetSpec, _barrier
from osdp.cost.schedule import predict
from osdp.cost.terms import Calibration
from osdp.cost.unit import sqrt_segments
from osdp.describe.measured import describe_once
from osdp.distributed import all_gather_objects, broadcast_object, world
from osdp.machine.collective_model import COLLECTIVES, AlphaBeta, CollectiveModel
from osdp.machine.device_info import DeviceInfo
from osdp.machine.measure import combine_samples
from osdp.runtime.jobs import Job, meet_at_every_unit, quiet_meetings
from osdp.runtime.step import train_step
from osdp.schema.description import ModelDescription
from osdp.schema.plan import MODES, ROOT, replicates_with_ddp


def measure_compute_scale(device: torch.device, spec: NetSpec, rounds: int) -> dict[str, Any]:
    """Collective: how much longer the plain ``spec`` net's step takes with every rank computing at once
    (as in a job) than on rank 0 alone with the others waiting (as the planner describes a model).

    The two alternate round by round, so that a change of load on the machine
    hits both; the scale is the median over rounds of the slowest rank's step
    together over rank 0's alone.
    """
    from osdp.optim import make_optimizer

    torch.manual_seed(0)
    model = spec.build().to(device)
    optimizer = make_optimizer("adamw", model.parameters())
    x = torch.randn(spec.batch, spec.width, device=device)
    rank, _ = world()

    def step() -> float:
        return train_step(model, x, optimizer, device=device).seconds

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
    job: the compute between the meetings ``osdp.runtime.jobs.meet_at_every_unit`` makes."""
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
    from osdp.describe.batch import call_model
    from osdp.machine.timing import StepTimer

    if world()[1] == 1:  # a rank alone meets nobody: what a measurement would find is its hooks' noise
        return {"net": net.name, "wait_s_per_sqrt_s": 0.0, "points": [], "all_reduce_s": 0.0}
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
        rows, residuals, opt_rows, margins = [], [], [], []
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
    ckpt, (per_slice, per_gb, contention) = _fit_checkpoints_and_slices(
        descriptions, jobs, residual, base, param_overhead, per_byte["zero3"], device_info, optimizer)
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


def _fit_checkpoints_and_slices(descriptions: dict[str, ModelDescription], jobs: dict[str, Job],
                                residual: dict[str, float], base: Calibration, param_overhead: float,
                                zero3_s_per_byte: float, device_info: DeviceInfo,
                                optimizer: str) -> tuple[list[float], tuple[float, float, float]]:
    """What the checkpointed and the split jobs cost beyond their zero3 twin: per net, the cost per checkpointed
    unit; and, fitted over the nets, per split slice, per byte a split moves and per second of its gathers
    alongside compute."""
    from scipy.optimize import lsq_linear

    ckpt, split_rows, split_extra = [], [], []
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
            left_fsdp = param_overhead * len(weights) + zero3_s_per_byte * sum(4 * o * i for o, i in weights)
            split_extra.append(residual[f"calibration-{net}-split"] - zero3 + left_fsdp)
    if not split_rows:
        return ckpt, (0.0, 0.0, 0.0)
    # four rows for three terms, each a difference of two measured steps: unbounded, the contention took 0.7-4.3
    # over three quick calibrations of one machine. It is a fraction of the gathers' time alongside compute
    # (at most all of it: the gathers' thread takes the compute's core while they run), so it is bounded by 1
    bounds = ([0.0, 0.0, 0.0], [np.inf, np.inf, 1.0])
    slices = lsq_linear(np.array(split_rows, dtype=float), np.array(split_extra), bounds=bounds).x
    return ckpt, tuple(float(x) for x in slices)


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
