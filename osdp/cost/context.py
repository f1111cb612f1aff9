"""What every unit of a plan is priced with (``_Context``: the machine, the batch, the neighbours, DDP's
last bucket), and the option table the search offers.

Plans whose units all take one mode (``UNIFORM_MODES``) know their neighbours:
with every unit replicated or every unit zero2, no all-gather is prefetched
in backward (replicated units gather nothing, zero2 units keep forward's
parameters), and under DDP no reduce-scatter input is kept either. Such a plan
is priced with those neighbours, by ``predict`` and in a search problem of its
own (``build_problems``), so that DDP's plan is not charged 2 units' worth of
FSDP buffers that never exist (on gpt2-mini in whole blocks: 6 of 126 MiB).

"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Mapping, Sequence

import numpy as np

from osdp.cost.neighbours import sequence_order, unit_neighbours
from osdp.cost.terms import _REDUCE_BYTES, DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, OPTIMIZER_STATES, Calibration
from osdp.cost.unit import _as_option, _Context
from osdp.machine.device_info import DeviceInfo
from osdp.schema.description import ModelDescription
from osdp.schema.plan import (
    ROOT,
    Plan,
    PlanError,
    UnitPlan,
    display_path,
    replicates_with_ddp,
)
from osdp.search.problem import NODE_OPTIONS, OPTIONS, Option


def _context(
    description: ModelDescription,
    device: DeviceInfo,
    batch_size: int,
    precision: str,
    optimizer: str,
    calibration: Calibration | None,
    neighbours: Mapping[str, tuple[int, int]] | None = None,
) -> _Context:
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; the cost model knows {sorted(OPTIMIZER_STATES)}")
    calibration = calibration or Calibration()
    description.costs(precision)  # raises, saying how to fix it, if this precision was not described
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    shapes = {u.path: u.param_shapes for u in description.units}
    return _Context(
        device.world_size, batch_size, precision, optimizer, device, calibration,
        description.optimizer_s_per_byte.get(optimizer, 0.0) * calibration.compute_scale,
        unit_neighbours(description, precision, device.world_size) if neighbours is None else neighbours,
        _ddp_last_bucket([(p, shapes[p]) for p in [ROOT, *sequence_order(description)]]),
        math.ceil((description.input_bytes_per_sample + description.output_bytes_per_sample) * batch_size),
        description.buffer_bytes,
    )


# Modes whose plans (every unit in the mode) are priced with their neighbours' true buffers, not the worst case.
UNIFORM_MODES = ("replicate", "zero2")


def _uniform(ctx: _Context, mode: str) -> _Context:
    """``ctx`` for a plan whose units all take ``mode`` (one of ``UNIFORM_MODES``): no unit's backward finds a
    prefetched all-gather output, and a reduce-scatter input is kept only where FSDP2 reduces (not DDP)."""
    if mode not in UNIFORM_MODES:
        raise ValueError(f"mode must be one of {UNIFORM_MODES}, got {mode!r}")
    ddp = mode == "replicate" and replicates_with_ddp(ctx.precision)
    neighbours = {path: (0, 0 if ddp else after) for path, (_, after) in ctx.neighbours.items()}
    return replace(ctx, neighbours=neighbours)


def uniform_mode_of(options: Sequence[Option]) -> str | None:
    """The mode of ``UNIFORM_MODES`` that every option takes, or None."""
    modes = {o.mode for o in options}
    return next(iter(modes)) if len(modes) == 1 and modes <= set(UNIFORM_MODES) else None


def _ddp_last_bucket(forward_order: Sequence[tuple[str, Sequence[tuple[int, ...]]]]) -> dict[str, float]:
    """Per unit (in forward order, with its parameter shapes), the fraction of its gradient bytes in the
    bucket DDP reduces last, were every unit replicated. DDP fills buckets in the order backward produces
    gradients (reverse forward order, a unit's parameters in reverse; the root's taken as used first, as
    an embedding is): the first up to 1 MiB, then 25 MiB each, a bucket closing once it holds its size."""
    tensors = [(path, _REDUCE_BYTES * math.prod(s))
               for path, shapes in reversed(forward_order) for s in reversed(shapes)]
    size, cap, last = 0, DDP_FIRST_BUCKET_BYTES, []
    for path, nbytes in tensors:
        if size >= cap:
            size, cap, last = 0, DDP_BUCKET_BYTES, []
        last.append((path, nbytes))
        size += nbytes
    totals = {path: sum(_REDUCE_BYTES * math.prod(s) for s in shapes) for path, shapes in forward_order}
    return {path: sum(nb for p, nb in last if p == path) / totals[path] if totals[path] else 1.0 for path in totals}


def options_for(device: DeviceInfo) -> tuple[Option, ...]:
    """The option table the search offers on ``device``: ``OPTIONS``, and ``NODE_OPTIONS`` when the device
    spans several nodes of several ranks (on one node, node scope is world scope; on nodes of one rank, it
    is replicate: nothing to choose)."""
    t = device.topology
    several = t is not None and t.nodes > 1 and t.ranks_per_node > 1
    return OPTIONS + NODE_OPTIONS if several else OPTIONS


def scope_option_sets(device: DeviceInfo, precision: str = "fp32") -> tuple[tuple[Option, ...] | None, ...]:
    """The option tables the search solves apart, each giving plans whose parameters sit on one device mesh
    (None: ``options_for(device)`` whole, on one node). On several nodes: sharded over every rank or replicated
    (``OPTIONS``), or sharded within the node (``NODE_OPTIONS``), with the replicated units too where osdp's
    reducer shows them on the node mesh (fp32; FSDP2's ``replicate``, which bf16 plans use, takes only the
    world's). A plan on two meshes would fail what a training script does with all its parameters at once
    (``torch.nn.utils.clip_grad_norm_``, a norm summed over ``model.parameters()``): whether that runs would
    depend on the plan."""
    if options_for(device) == OPTIONS:
        return (None,)
    replicated = tuple(o for o in OPTIONS if o.mode == "replicate") if replicates_with_ddp(precision) else ()
    return OPTIONS, replicated + NODE_OPTIONS


def _options_of(
    description: ModelDescription, plan: Plan | Sequence[Any], device: DeviceInfo,
) -> list[Option]:
    """One option per described unit, from a Plan, or a list of options or indices into ``options_for(device)``."""
    if isinstance(plan, Plan):
        paths = set(plan.paths)
        unknown = sorted(paths - set(description.paths))
        if unknown:
            raise PlanError(f"unit '{display_path(unknown[0])}' of the plan is not a unit of {description.model}")
        missing = [p for p in description.paths if p not in paths and p != ROOT]
        if missing:
            raise PlanError(
                f"the plan has no decision for unit '{display_path(missing[0])}' (and {len(missing) - 1} more); "
                "plan every unit the description has"
            )
        by_path = {u.path: u for u in plan.units}
        default = UnitPlan(ROOT, mode="zero3")  # what osdp.wrap does with a plan that leaves the root out
        return [_as_option(by_path.get(p, default)) for p in description.paths]
    choices = list(plan)
    if len(choices) != len(description.units):
        raise ValueError(f"{len(choices)} choices for {len(description.units)} units")
    table = options_for(device)
    return [table[int(c)] if isinstance(c, (int, np.integer)) else _as_option(c) for c in choices]


def _base(ctx: _Context) -> int:
    """What every moment of every plan holds: the calibration's margin, the batch and the model's output, the
    model's buffers, the math libraries' workspaces."""
    return int(ctx.calibration.margin_bytes) + ctx.held_bytes + ctx.buffer_bytes + ctx.device.workspace_bytes
