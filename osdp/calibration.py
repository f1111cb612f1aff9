"""The calibration: what the ideal cost model misses on this machine, measured on the live process group.

``measure_calibration`` trains a synthetic model (``CalibrationNet``: units of
a few Linears, narrow and wide, small and large batch) under every mode, with
checkpointing and with split Linears (``calibration_jobs``, side by side with
``osdp.harness.run_jobs``), predicts each job with the cost model without
runtime overheads, and attributes what it does not explain
(``fit_calibration``): FSDP2's fixed and per-byte costs per unit by mode, per
parameter tensor, per checkpointed unit, per split slice and byte, the
contention of split slices' gathers with compute, the optimizer's per-tensor
cost, and the memory margin. Nothing of a model being planned enters it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from osdp.cost import Calibration, predict
from osdp.description import ModelDescription
from osdp.device import COLLECTIVES, AlphaBeta, CollectiveModel, DeviceInfo
from osdp.distributed import broadcast_object
from osdp.harness import Job, run_jobs
from osdp.plan import MODES, ROOT, Plan, UnitPlan
from osdp.profile import describe


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
    import osdp

    net = CalibrationNet().to(device)
    plan = Plan([UnitPlan(u.path, "zero3", split=1 if u.path == ROOT else 2) for u in osdp.discover_units(net)])
    try:
        osdp.wrap(net, plan=plan, device=device)
        return True
    except (RuntimeError, ValueError):
        return False


CALIBRATION_BATCH = 4
# (Linears per unit, width, batch): 2 and 4 Linears separate per-unit from per-parameter costs; the
# wide net's units (2 MiB, like a small transformer's) are 64x larger, which separates per-unit from
# per-byte costs, of FSDP and of split slices; with a large batch its slices' gathers run while
# there is compute to compete with
CALIBRATION_NETS = ((2, 64, 4), (4, 64, 4), (2, 512, 4), (2, 512, 64))


def calibration_jobs(
    device: torch.device, *, optimizer: str = "adamw", splits: bool = True
) -> tuple[dict[str, Job], dict[str, ModelDescription]]:
    """Collective: the synthetic-model jobs ``fit_calibration`` needs, and the nets' descriptions.

    The small-batch nets under every mode and zero3 with split 2, the narrow
    ones also zero3 with checkpointing; the large-batch net under zero3 and split 2.
    """
    jobs: dict[str, Job] = {}
    descriptions: dict[str, ModelDescription] = {}
    for linears, d, b in CALIBRATION_NETS:
        net = f"{linears}x{d}b{b}"
        build = lambda linears=linears, d=d: CalibrationNet(d=d, linears=linears)  # noqa: E731
        g = torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0)
        batch = (torch.randn(b, d, generator=g).to(device),)
        torch.manual_seed(0)
        description = describe(build().to(device), batch, cache=False, progress=False, optimizers=(optimizer,), repeats=5)
        descriptions[net] = broadcast_object(description)
        paths = descriptions[net].paths

        def plan(mode: str, split: int = 1, ckpt: bool = False, b: int = b) -> Plan:
            return Plan([UnitPlan(p, mode, 1 if p == ROOT else split, ckpt and p != ROOT) for p in paths],
                        batch_size=b)

        for mode in MODES if b == CALIBRATION_BATCH else ("zero3",):  # the rest needs no compute
            jobs[f"calibration-{net}-{mode}"] = Job(build, plan(mode), batch)
        if d == 64:
            jobs[f"calibration-{net}-ckpt"] = Job(build, plan("zero3", ckpt=True), batch)
        if splits:
            jobs[f"calibration-{net}-split"] = Job(build, plan("zero3", split=2), batch)
    return jobs, descriptions


def fit_calibration(
    descriptions: dict[str, ModelDescription],
    jobs: dict[str, Job],
    measured: dict[str, dict[str, Any]],
    device_info: DeviceInfo,
    *,
    overlap: float | None,
    optimizer: str = "adamw",
) -> Calibration:
    """What the cost model without runtime overheads does not explain on the calibration jobs, attributed
    (non-negative least squares): a fixed cost per unit and per byte of a unit by mode, and per parameter
    tensor (FSDP2's hooks, bookkeeping, copies, buffers), per checkpointed unit, per split slice, per
    byte a split moves (SplitLinear's loop) and per second its slices' gathers run alongside compute
    (the contention of gloo's threads with compute on a CPU with a core per rank), per parameter tensor
    in the optimizer step (DTensor dispatch); and the memory margin (median of measured minus modelled
    peak)."""
    from scipy.optimize import nnls

    base = Calibration(overlap=overlap, source="partial")
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
        opt_rows.append((m["measured_step_s"] - m["measured_fwd_bwd_s"] - opt_pred) / n_params)
        margins.append(m["measured_peak_bytes"] - pred.peak_bytes)
        if kind in MODES and job.plan.batch_size == CALIBRATION_BATCH:  # little compute: overheads only
            nbytes = sum(u.param_bytes for u in description.units)
            rows.append([len(description.units) * (kind == mode) for mode in MODES]
                        + [nbytes * (kind == mode) for mode in MODES] + [n_params])
            residuals.append(residual[name])
    scale = np.array([1.0] * 3 + [1e-9] * 3 + [1.0])  # condition the system: bytes are ~1e6 per unit
    coef = nnls(np.array(rows, dtype=float) * scale, np.array(residuals, dtype=float))[0] * scale
    param_overhead = float(coef[-1])
    split_rows, split_extra = [], []
    for net, description in descriptions.items():
        blocks = [u for u in description.units if u.path != ROOT]
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
            left_fsdp = param_overhead * len(weights) + coef[5] * sum(4 * o * i for o, i in weights)
            split_extra.append(residual[f"calibration-{net}-split"] - zero3 + left_fsdp)
    per_slice, per_gb, contention = (
        nnls(np.array(split_rows, dtype=float), np.array(split_extra))[0] if split_rows else (0.0, 0.0, 0.0)
    )
    return Calibration(
        unit_overhead_s={mode: float(c) for mode, c in zip(MODES, coef[:3])},
        unit_s_per_byte={mode: float(c) for mode, c in zip(MODES, coef[3:6])},
        param_overhead_s=param_overhead,
        checkpoint_overhead_s=max(0.0, statistics.median(ckpt)),
        optimizer_tensor_s=max(0.0, statistics.median(opt_rows)),
        slice_overhead_s=float(per_slice),
        slice_s_per_byte=float(per_gb) * 1e-9,
        slice_contention=float(contention),
        overlap=overlap,
        margin_bytes=max(0, int(statistics.median(margins))),
        source=f"measured on {device_info.name}, {device_info.world_size} ranks, {time.strftime('%Y-%m-%d')}",
    )


def measure_calibration(
    device_info: DeviceInfo,
    device: torch.device,
    *,
    optimizer: str = "adamw",
    progress: Callable[[str], None] | None = None,
) -> Calibration:
    """Collective: FSDP2's runtime overheads and the memory margin on this machine and world size
    (``calibration_jobs`` trained, then ``fit_calibration``)."""
    jobs, descriptions = calibration_jobs(device, optimizer=optimizer, splits=can_split(device))
    measured = run_jobs(jobs, device=device, optimizer=optimizer, time_budget_s=1.5, progress=progress)
    return fit_calibration(
        descriptions, jobs, measured, device_info, overlap=0.0 if device.type == "cpu" else None,
        optimizer=optimizer,
    )


def median_collectives(fits: Sequence[CollectiveModel]) -> CollectiveModel:
    """One alpha-beta model from several fits of the same group (median alpha and beta per collective)."""
    costs = {
        c: AlphaBeta(statistics.median(f.costs[c].alpha_s for f in fits),
                     statistics.median(f.costs[c].beta_s_per_byte for f in fits))
        for c in COLLECTIVES
    }
    return CollectiveModel(fits[0].world_size, costs, f"{fits[0].source}, median of {len(fits)} fits")
