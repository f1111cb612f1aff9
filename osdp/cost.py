"""The cost model: step time and peak memory per rank of any plan, and the search problem.

Every plan is costed unit by unit, with the same function behind ``predict``
and ``build_problem``, so the search is exact under this model:

    step_s = sum_u time[u, o_u]
    peak  ~= base + sum_u mem[u, o_u] + max_u transient[u, o_u]   (the search's additive bound)

and ``predict`` gives the peak over the step's schedule (``schedule_peak``), with
the plan's own neighbours (``plan_neighbours``); the planner re-prices the
search's candidates so (``osdp.planner.search``).

Per unit u and option o = (mode, split k, checkpoint, shard scope), at micro-batch b on N
ranks, from the unit's description (``osdp.description``: parameter shapes,
per-b compute times, saved activations, working-set peaks) and FSDP2's
schedule on torch 2.13 (``docs/COST_MODEL.md`` derives each term):

time
    forward + backward compute (+ the measured recompute when checkpointed); the
    collectives of the mode on the device's alpha-beta model (zero3: two
    all-gathers and a reduce-scatter, but one all-gather for the root, which
    stays gathered from forward to backward as FSDP2's root does; zero2: one
    and one; replicate: an all-reduce; split k: the split weights in k slices each way), of which the
    part the device cannot hide behind the unit's compute (``overlap``: 0 with
    gloo, where FSDP2's collectives block; 1 on CUDA streams; DDP's bucketed
    all-reduce runs on gloo's thread while backward goes on, so a calibrated
    fraction of it hides behind the unit's backward, except the bucket DDP
    reduces last, after the whole backward); the wait at the meetings FSDP2's
    collectives make (ranks computing the same work drift apart, as a random
    walk: a calibrated wait per square root of the compute between meetings,
    a unit's forward and its backward); FSDP2's runtime
    overheads measured once per machine (``Calibration``): per unit by mode,
    per byte of the unit by mode (copies into and out of collective buffers,
    fresh buffers, gloo's behaviour in training beyond the alpha-beta model;
    a node-scoped unit pays it in proportion to its node's link),
    per parameter, per checkpointed unit, per slice and per byte of slices,
    and split slices' gathers competing with compute for the cores; the
    optimizer step on the unit's shard.
mem (additive)
    sharded (replicated) parameters and optimizer state, plus the larger of
    what the unit holds before its backward (saved activations, or only its
    inputs when checkpointed; the unsharded copy zero2 and replicate keep) and
    after it (its reduced gradient; on CUDA also the foreach optimizer's
    temporaries). The two never coexist, so this is tight when the peak is
    at the turn from forward to backward, as it is for activation-heavy
    training. A unit enclosing others (the root) stays unsharded all step.
transient (only the largest counts)
    the unit's working set beyond its activations while its forward, backward
    or recomputation runs, measured net of the root's activations that do not
    exist then (the root is never checkpointed, so this holds for every plan);
    plus FSDP2's buffers at that moment: its own gathered parameters and flat
    all-gather output (zero3), the buffer of the unit it prefetches and the
    reduce-scatter input FSDP2 keeps from the unit before (both at their full
    size: a conservative bound, exact when the neighbour is unsplit zero3
    sharded over every rank);
    its own reduce-scatter input when its backward ends; split Linears' two
    slice buffers and two unreduced slice gradients; the single-tensor (CPU)
    optimizer's temporaries.
base
    the calibration's measured margin.
shard scope (on a device with a topology of several nodes)
    a unit sharded within its node holds 1/ranks_per_node of its states,
    gathers and reduce-scatters over the node's group (``Topology.intra``),
    and all-reduces its reduced shard over the cross-node group
    (``Topology.inter``); a unit sharded over every rank, and a replicated
    one, pays the world group's costs (``DeviceInfo.collectives``).

The true peak is a maximum over the schedule; the search's decomposition adds each
unit's worst phase and the one largest transient, so it over-estimates, most where a
unit's neighbours are not what the bound assumes and where the largest working set
runs while few units hold their activations (a unit's backward after those after it
have let theirs go); it leaves out the all-gather output FSDP2 keeps in forward.
``schedule_peak`` walks the schedule instead.

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
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import numpy as np

from osdp.device import CollectiveModel, DeviceInfo
from osdp.plan import MODES, Plan, PlanError, ROOT, UnitPlan, display_path, replicates_with_ddp, reshards_after_forward
from osdp.description import ModelDescription, UnitProfile
from osdp.search.problem import NODE_OPTIONS, OPTIONS, Option, Problem, SubUnits

# fp32 state tensors per parameter (momentum, Adam's two moments)
OPTIMIZER_STATES = {"sgd": 0, "sgd-momentum": 1, "adamw": 2}  # by osdp.optim.OPTIMIZERS
# bytes of temporaries per byte of parameter shard in a foreach (CUDA) step: Adam's sqrt(v) list
_FOREACH_TEMPS = {"sgd": 0, "sgd-momentum": 0, "adamw": 1}
_DTYPE_BYTES = {"fp32": 4, "bf16": 2}
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket_cap_mb
DDP_FIRST_BUCKET_BYTES = 2**20  # and its first bucket's (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
_REDUCE_BYTES = 4  # gradients are reduced in fp32 (MixedPrecisionPolicy(reduce_dtype=float32) for bf16)
# osdp's reducer (fsdp_ext.replicate) carries a used flag per replicated parameter in its bucket, fp32
USED_FLAG_BYTES = 4


@dataclass(frozen=True)
class Calibration:
    """Runtime costs of FSDP2 on one machine and world size, measured once (not per model).

    ``osdp.calibration.measure_calibration`` measures them on the live process
    group with a synthetic model; ``Calibration()`` is the ideal runtime (no
    overheads, full overlap on CUDA, none on CPU), for planning offline.
    """

    # how much longer the job's compute (and optimizer step) takes than the description says: a model is
    # described on one rank with the others idle; in the job every rank computes at once
    compute_scale: float = 1.0

    unit_overhead_s: Mapping[str, float] = field(default_factory=lambda: dict.fromkeys(MODES, 0.0))
    # once per step, charged to the root unit by its mode: the work of a step, not of a unit (FSDP2's root
    # hooks and final callback, DDP's reducer, the ranks meeting); without it a model with fewer units than
    # the calibration nets would be charged too little
    root_overhead_s: Mapping[str, float] = field(default_factory=lambda: dict.fromkeys(MODES, 0.0))
    # per fp32 byte of a unit's FSDP-managed parameters, by mode: what grows with a unit's size beyond the
    # collectives' alpha-beta model (copies into and out of collective buffers, fresh buffers, gloo's
    # in-training behaviour)
    unit_s_per_byte: Mapping[str, float] = field(default_factory=lambda: dict.fromkeys(MODES, 0.0))
    param_overhead_s: float = 0.0  # per parameter tensor of a unit, per step (FSDP's per-parameter work)
    checkpoint_overhead_s: float = 0.0  # per checkpointed unit, per step (beyond the recomputed forward)
    optimizer_tensor_s: float = 0.0  # per parameter tensor, per optimizer step (DTensor dispatch)
    slice_overhead_s: float = 0.0  # per split slice gathered or reduced
    slice_s_per_byte: float = 0.0  # per byte split slices move, beyond the collectives' model
    # fraction of the time a split unit's asynchronous slice collectives run alongside its compute that
    # adds to the step (on CPU gloo's threads compete with compute for the cores; ~0 on CUDA)
    slice_contention: float = 0.0
    overlap: float | None = None  # fraction of a unit's compute that hides its collectives; None: by device
    # fraction of DDP's all-reduce of a bucket, up to the unit's backward time, that runs hidden while the
    # backward goes on (every bucket but the last reduced, which has nothing left to hide behind); beyond
    # ``overlap``, which on CPU is 0: FSDP2's gloo collectives block, DDP's run on gloo's own thread
    ddp_overlap: float = 0.0
    # seconds a rank waits, per square root of the seconds it computed since the ranks last met, at each
    # collective that makes the ranks meet (FSDP2's; DDP's run behind the backward): ranks computing the same
    # work drift apart like a random walk, and every meeting waits for the slowest
    meeting_wait_s_per_sqrt_s: float = 0.0
    margin_bytes: int = 0
    source: str = "ideal FSDP2 runtime (not measured: no overheads, compute as described)"

    def overlap_for(self, device: DeviceInfo) -> float:
        if self.overlap is not None:
            return self.overlap
        return 1.0 if device.device_type == "cuda" else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "compute_scale": self.compute_scale,
            "unit_overhead_s": dict(self.unit_overhead_s),
            "root_overhead_s": dict(self.root_overhead_s),
            "unit_s_per_byte": dict(self.unit_s_per_byte),
            "param_overhead_s": self.param_overhead_s,
            "checkpoint_overhead_s": self.checkpoint_overhead_s,
            "optimizer_tensor_s": self.optimizer_tensor_s,
            "slice_overhead_s": self.slice_overhead_s,
            "slice_s_per_byte": self.slice_s_per_byte,
            "slice_contention": self.slice_contention,
            "overlap": self.overlap,
            "ddp_overlap": self.ddp_overlap,
            "meeting_wait_s_per_sqrt_s": self.meeting_wait_s_per_sqrt_s,
            "margin_bytes": self.margin_bytes,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Calibration":
        return cls(**d)


@dataclass(frozen=True)
class OptionCost:
    """One unit under one option: the three numbers the search adds up, and their parts."""

    time_s: float
    mem_bytes: int
    transient_bytes: int
    parts: Mapping[str, float]


@dataclass
class Prediction:
    step_s: float
    peak_bytes: int
    breakdown: dict[str, Any]


# --------------------------------------------------------------------------- bytes


def _padded_numel(shape: Sequence[int], n: int) -> int:
    """Elements FSDP2 stores for a parameter sharded on n ranks: dim 0 padded to a multiple of n."""
    if not shape:
        return n
    rows = math.ceil(shape[0] / n) * n
    return rows * math.prod(shape[1:])


def _remove(shapes: Sequence[tuple[int, ...]], taken: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    rest = list(shapes)
    for s in taken:
        rest.remove(tuple(s))
    return rest


@dataclass(frozen=True)
class _Context:
    n: int
    b: int
    precision: str
    optimizer: str
    device: DeviceInfo
    calibration: Calibration
    optimizer_s_per_byte: float
    # per unit, FSDP buffers of its neighbours in forward order that exist during its backward
    # whatever its own option: the previous unit's all-gather output (FSDP2 prefetches it; taken as
    # if zero3 sharded over every rank, the worst case: padding to a multiple of the world size is at
    # least the padding to a multiple of ranks per node, which divide it) and the next unit's
    # reduce-scatter input (kept until this one reduces). Taking the worst case keeps each unit's cost a
    # function of its own option only, which the search needs
    neighbours: Mapping[str, tuple[int, int]]
    # per unit, the fraction of its parameter bytes in the bucket DDP reduces last, were every unit
    # replicated (the first units in forward order): nothing of the backward is left to hide that all-reduce
    ddp_last_bucket: Mapping[str, float]
    input_bytes: int = 0  # the micro-batch itself, live through the step

    @property
    def compute_bytes(self) -> int:
        return _DTYPE_BYTES[self.precision]


def _collective(group: CollectiveModel, kind: str, nbytes: float, messages: int = 1) -> float:
    if nbytes <= 0 or group.world_size == 1:
        return 0.0
    return messages * group.time(kind, nbytes / messages)


def _as_option(option: UnitPlan | Sequence[Any]) -> Option:
    if isinstance(option, UnitPlan):
        return Option(option.mode, option.split, option.checkpoint, option.shard_scope)
    return Option(*option)


def _impossible(unit: UnitProfile, option: Option) -> str | None:
    """Why ``unit`` cannot take ``option``, or None if it can."""
    mode, k, ckpt, scope = option
    where = f"unit '{unit.name}'"
    if k > 1 and mode != "zero3":
        return f"{where}: split={k} needs mode 'zero3'"
    if k > 1 and not unit.split_shapes:
        return f"{where} cannot be split: it holds no splittable Linear"
    if ckpt and unit.nested:
        return f"{where}: checkpointing a unit that encloses other units is not modelled"
    if scope == "node" and (mode == "replicate" or k > 1):
        return f"{where}: shard scope 'node' needs mode 'zero2' or 'zero3' without split"
    return None


def _link_share(group: CollectiveModel, world: CollectiveModel) -> float:
    """How much of the per-byte runtime cost a unit whose collectives run on ``group`` pays: the calibration
    fits it on units sharded over the world, where it grows with the world's links (gloo's in-training
    behaviour beyond the alpha-beta model), so a unit on another group pays it in proportion to that group's
    all-gather per-byte cost (1 on the world itself)."""
    if group is world:
        return 1.0
    beta, world_beta = group.costs["all_gather"].beta_s_per_byte, world.costs["all_gather"].beta_s_per_byte
    return beta / world_beta if world_beta > 0 else 1.0


def _shard_group(ctx: _Context, scope: str) -> tuple[int, CollectiveModel, CollectiveModel | None]:
    """(ranks a sharded unit is sharded over, the group its gathers and reduce-scatters run on, the group its
    reduced shard is all-reduced over, if any). Without a topology the job is one node: node scope is world
    scope, as ``osdp.fsdp_ext.apply`` runs it."""
    topology = ctx.device.topology
    if scope == "world" or topology is None:
        return ctx.n, ctx.device.collectives, None
    return topology.ranks_per_node, topology.intra, topology.inter


def unit_cost(unit: UnitProfile, option: UnitPlan | Sequence[Any], ctx: _Context) -> OptionCost:
    """Time, additive memory and transient memory of ``unit`` under ``option`` (see the module docstring)."""
    option = _as_option(option)
    mode, k, ckpt, scope = option
    reason = _impossible(unit, option)
    if reason:
        raise PlanError(reason)
    n, b, dt = ctx.n, ctx.b, ctx.compute_bytes
    cal, opt = ctx.calibration, ctx.optimizer
    costs = unit.costs[ctx.precision]
    enclosing = bool(unit.nested) or unit.path == ROOT

    split = list(unit.split_shapes) if k > 1 else []
    fsdp_shapes = _remove(unit.param_shapes, split)
    group_n, gather_group, across_nodes = _shard_group(ctx, scope)
    shard_n = 1 if mode == "replicate" else group_n
    fsdp_padded = sum(_padded_numel(s, shard_n) for s in fsdp_shapes)
    fsdp_full = sum(math.prod(s) for s in fsdp_shapes)
    split_rows = []  # per split Linear: (rows per rank, largest slice's rows per rank, in_features, slices)
    if split:
        from osdp.split import split_layout

        for out_f, in_f in split:
            rows, pieces = split_layout(out_f, n, k)
            split_rows.append((rows, max(pieces), in_f, len(pieces)))
    shard_numel = fsdp_padded // shard_n + sum(rows * in_f for rows, _, in_f, _ in split_rows)

    # -- memory ------------------------------------------------------------------
    states = OPTIMIZER_STATES[opt]
    persistent = 4 * shard_numel * (1 + states) + (4 * len(unit.param_shapes) if opt == "adamw" else 0)
    gathered = dt * fsdp_padded  # FSDP's unsharded parameters (and its flat all-gather buffer)
    rs_input = _REDUCE_BYTES * fsdp_padded
    grad = 4 * shard_numel
    act = costs.ckpt_bytes.bytes(b) if ckpt else costs.act_bytes.bytes(b)
    foreach = ctx.device.device_type == "cuda"
    foreach_temps = _FOREACH_TEMPS[opt] * 4 * shard_numel if foreach else 0
    largest_shard = max((4 * math.ceil(math.prod(s) / shard_n) for s in unit.param_shapes), default=0)
    ddp = mode == "replicate" and replicates_with_ddp(ctx.precision)
    # what the unit holds all step, from its forward until its backward, and from its backward to the step's end
    if ddp:  # DDP: parameters used in place, gradients are views into buckets that live all step
        held = 0
        grad += USED_FLAG_BYTES * len(unit.param_shapes)  # the reducer's flag per parameter, in its bucket
        always, before, after = persistent + grad, act, foreach_temps
        rs_input = largest_shard  # a fresh gradient, before the reducer copies it into its bucket
    else:
        held = gathered if (mode != "zero3" and not enclosing) else 0
        # a unit enclosing others stays gathered through the whole step
        always, before, after = persistent + (gathered if enclosing else 0), act + held, grad + foreach_temps
    mem = always + max(before, after)

    # the working sets beyond what mem already counts of this unit's activations
    temp_fwd = costs.fwd_peak_bytes.signed_bytes(b) - act
    temp_bwd = (costs.recompute_peak_bytes if ckpt else costs.bwd_peak_bytes).signed_bytes(b) - act
    flat = gathered if mode != "replicate" else 0  # all-gather output kept until the next unit gathers
    # when its backward ends FSDP copies the unsharded gradients (in the working set) into the reduce buffer
    post = costs.bwd_end_bytes.signed_bytes(b) - act + rs_input
    prefetched, rs_previous = ctx.neighbours.get(unit.path, (0, 0))
    own = gathered if (mode == "zero3" and not enclosing) else 0
    if enclosing:
        fwd = temp_fwd + flat
        # the root stays gathered into backward (any mode), and FSDP2 dropped its flat buffer after the
        # copy-out in forward (on gloo too: osdp.comm.Lent)
        bwd = temp_bwd + prefetched
    else:
        fwd = temp_fwd + own + flat
        bwd = temp_bwd + own + prefetched + rs_previous
        post += prefetched
    if split_rows:
        slice_fwd = max(2 * n * q * in_f * dt for _, q, in_f, _ in split_rows)
        slice_bwd = max(2 * n * q * in_f * (dt + _REDUCE_BYTES) for _, q, in_f, _ in split_rows)
        fwd, bwd = fwd + slice_fwd, bwd + slice_bwd
    optimizer_temp = 0 if foreach else 2 * largest_shard
    transient = max(fwd, bwd, post, optimizer_temp)

    # -- time --------------------------------------------------------------------
    compute = cal.compute_scale * (costs.fwd_s(b) + costs.bwd_s(b) + (costs.recompute_seconds(b) if ckpt else 0.0))
    world = ctx.device.collectives
    if ddp:
        # DDP all-reduces 25 MiB buckets across units: each unit pays its bytes and its share of an alpha
        reduced = _REDUCE_BYTES * fsdp_full
        comm = _collective(world, "all_reduce", DDP_BUCKET_BYTES) * reduced / DDP_BUCKET_BYTES if reduced else 0.0
    elif mode == "replicate":
        comm = _collective(world, "all_reduce", _REDUCE_BYTES * fsdp_full)
    else:
        gathers = 2 if reshards_after_forward(unit.path, mode) else 1
        comm = (gathers * _collective(gather_group, "all_gather", gathered)
                + _collective(gather_group, "reduce_scatter", rs_input))
        if across_nodes is not None:  # HSDP: the node's reduced shard, all-reduced with the other nodes'
            comm += _collective(across_nodes, "all_reduce", rs_input / shard_n)
    slices = slice_bytes = 0
    split_comm = 0.0
    for rows, q, in_f, pieces in split_rows:
        weight = n * rows * in_f
        gathers = 3 if ckpt else 2  # forward, backward (input gradient), recomputed forward
        split_comm += gathers * _collective(world, "all_gather", dt * weight, pieces)
        split_comm += _collective(world, "reduce_scatter", _REDUCE_BYTES * weight, pieces)
        slices += (gathers + 1) * pieces
        slice_bytes += (gathers * dt + _REDUCE_BYTES) * weight
    comm += split_comm
    overlap = cal.overlap_for(ctx.device)
    per_byte = cal.unit_s_per_byte.get(mode, 0.0) * 4 * fsdp_full * _link_share(gather_group, world)
    hideable = 0.0
    if ddp:  # DDP's all-reduce, gloo's in-training cost of it included, runs while backward goes on
        # the all-reduce alone: DDP copies gradients into its buckets on the backward's thread
        hideable = min(comm * (1.0 - ctx.ddp_last_bucket.get(unit.path, 1.0)), cal.compute_scale * costs.bwd_s(b))
        hidden = max(overlap * compute, cal.ddp_overlap * hideable)
        exposed, per_byte = max(comm + per_byte - hidden, 0.0), 0.0
    else:
        exposed = max(comm - overlap * compute, 0.0)
    overhead = (
        cal.unit_overhead_s.get(mode, 0.0) + (cal.root_overhead_s.get(mode, 0.0) if unit.path == ROOT else 0.0)
        + (0.0 if ddp else cal.param_overhead_s * len(fsdp_shapes))
        + (cal.checkpoint_overhead_s if ckpt else 0.0)
        + per_byte
        + cal.slice_overhead_s * slices + cal.slice_s_per_byte * slice_bytes
        + cal.slice_contention * min(split_comm, compute)
    )
    # FSDP2's collectives make the ranks meet as the unit's forward and its backward begin or end: each meeting
    # waits for the rank that drifted furthest behind while computing since the last one
    meeting_wait = 0.0
    if not ddp and n > 1:
        backward = costs.bwd_s(b) + (costs.recompute_seconds(b) if ckpt else 0.0)
        meeting_wait = cal.meeting_wait_s_per_sqrt_s * sqrt_segments(
            cal.compute_scale * costs.fwd_s(b), cal.compute_scale * backward)
    optimizer_s = (  # the per-tensor cost is DTensor dispatch: DDP's parameters are plain tensors
        (0.0 if ddp else ctx.calibration.optimizer_tensor_s * len(unit.param_shapes))
        + ctx.optimizer_s_per_byte * 4 * shard_numel
    )
    time_s = compute + exposed + meeting_wait + overhead + optimizer_s
    parts = {
        "compute_s": compute, "comm_s": comm, "split_comm_s": split_comm, "exposed_comm_s": exposed,
        "ddp_hideable_s": hideable, "meeting_wait_s": meeting_wait,
        "overhead_s": overhead,
        "optimizer_s": optimizer_s, "persistent_bytes": persistent, "activation_bytes": act,
        "held_bytes": held, "gradient_bytes": grad, "fwd_transient_bytes": fwd, "bwd_transient_bytes": bwd,
        "post_backward_bytes": post, "optimizer_temp_bytes": optimizer_temp,
        "always_bytes": always, "before_backward_bytes": before, "after_backward_bytes": after, "ddp": float(ddp),
        "gather_output_bytes": flat,
        # what its neighbours meet of it in the plan (``plan_neighbours``): the all-gather output FSDP2 prefetches
        # in backward (a unit resharded after forward) and the reduce-scatter input FSDP2 keeps after its backward
        "backward_gather_bytes": flat if reshards_after_forward(unit.path, mode) else 0,
        "kept_reduce_input_bytes": rs_input if mode in ("zero2", "zero3") else 0,
    }
    return OptionCost(time_s, int(mem), int(transient), parts)


def sqrt_segments(*seconds: float) -> float:
    """The sum of the square roots of the compute seconds between meetings: what the ranks' wait grows with
    (``Calibration.meeting_wait_s_per_sqrt_s``)."""
    return sum(math.sqrt(max(s, 0.0)) for s in seconds)


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
        math.ceil(description.input_bytes_per_sample * batch_size),
    )


def sequence_order(description: ModelDescription) -> list[str]:
    """The units that run one after another, in forward order: all but those enclosing others (the root)."""
    enclosing = {u.path for u in description.units if u.nested or u.path == ROOT}
    return [p for p in description.forward_order if p not in enclosing]


def unit_neighbours(description: ModelDescription, precision: str, world_size: int) -> dict[str, tuple[int, int]]:
    """Per unit, the bytes of its neighbours' FSDP buffers that exist during its backward (``_Context.neighbours``):
    the previous unit's all-gather output and the next unit's reduce-scatter input, were both zero3. A unit
    enclosing others (a block with its sub-blocks nested in it) takes the largest prefetch among them."""
    padded = {u.path: sum(_padded_numel(s, world_size) for s in u.param_shapes) for u in description.units}
    order = sequence_order(description)
    neighbours = {}
    for i, path in enumerate(order):
        before = _DTYPE_BYTES[precision] * padded[order[i - 1]] if i > 0 else 0
        after = _REDUCE_BYTES * padded[order[i + 1]] if i + 1 < len(order) else 0
        neighbours[path] = (before, after)
    if order:  # the root's backward comes first and prefetches the last unit
        neighbours[ROOT] = (_DTYPE_BYTES[precision] * padded[order[-1]], 0)
    for unit in description.units:  # another enclosing unit's backward runs between those of the units inside it
        inside = [neighbours[p][0] for p in order if p.startswith(unit.path + ".")] if unit.path != ROOT else []
        if inside:
            neighbours[unit.path] = (max(inside), 0)
    return neighbours


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


def predict(
    description: ModelDescription,
    plan_or_choices: Plan | Sequence[Any],
    device_info: DeviceInfo,
    *,
    batch_size: int | None = None,
    precision: str | None = None,
    optimizer: str = "adamw",
    calibration: Calibration | None = None,
) -> Prediction:
    """Step time and peak memory per rank of a plan (or one option per unit, in description order).

    ``batch_size`` and ``precision`` default to the plan's. The peak is the schedule's
    (``schedule_peak``, with the plan's neighbours); for a plan whose options are all in
    ``options_for(device_info)`` the step time and ``breakdown["bound_peak_bytes"]`` are exactly
    ``build_problem(...)``'s ``step_time`` and ``peak`` for the same choice, with ``uniform_mode=``
    the plan's mode where all its units take one of ``UNIFORM_MODES``.
    """
    if isinstance(plan_or_choices, Plan):
        batch_size = batch_size or plan_or_choices.batch_size
        precision = precision or plan_or_choices.mixed_precision
        if plan_or_choices.world_size not in (None, device_info.world_size):
            raise PlanError(
                f"the plan is for {plan_or_choices.world_size} ranks, the device for {device_info.world_size}"
            )
        per_node = device_info.world_size // device_info.nodes
        if plan_or_choices.ranks_per_node not in (None, per_node):
            raise PlanError(
                f"the plan is for nodes of {plan_or_choices.ranks_per_node} ranks, the device "
                f"'{device_info.name}' has {device_info.nodes} node(s) of {per_node}; price it on a device of "
                f"that layout (a multi-node preset with ranks_per_node={plan_or_choices.ranks_per_node})"
            )
    if batch_size is None:
        raise ValueError("give batch_size= (the plan has none)")
    ctx = _context(description, device_info, batch_size, precision or "fp32", optimizer, calibration)
    options = _options_of(description, plan_or_choices, device_info)
    mode = uniform_mode_of(options)
    if mode is not None:
        ctx = _uniform(ctx, mode)
    bounding = [unit_cost(u, o, ctx) for u, o in zip(description.units, options)]  # as the search prices them
    mem = np.array([c.mem_bytes for c in bounding], dtype=np.int64)
    transient = np.array([c.transient_bytes for c in bounding], dtype=np.int64)
    ctx = replace(ctx, neighbours=plan_neighbours(description, bounding))
    costs = [unit_cost(u, o, ctx) for u, o in zip(description.units, options)]
    times = np.array([c.time_s for c in costs], dtype=np.float64)
    base = _base(ctx)
    step_s = float(times.sum())
    peak, moment = schedule_peak(description, costs, base)
    totals = {k: float(sum(c.parts[k] for c in costs)) for k in costs[0].parts}
    breakdown = {
        "base_bytes": base,
        "peak_moment": moment,
        # the search's additive bound on the peak (``build_problem``): base + mem + transient
        "bound_peak_bytes": base + int(mem.sum()) + int(transient.max()),
        "mem_bytes": int(mem.sum()),
        "transient_bytes": int(transient.max()),
        "largest_transient_unit": description.units[int(transient.argmax())].path,
        "totals": totals,
        "units": {
            u.path: {"option": list(o), "time_s": c.time_s, "mem_bytes": c.mem_bytes,
                     "transient_bytes": c.transient_bytes, **c.parts}
            for u, o, c in zip(description.units, options, costs)
        },
    }
    return Prediction(step_s, peak, breakdown)


def plan_neighbours(description: ModelDescription, costs: Sequence[OptionCost]) -> dict[str, tuple[int, int]]:
    """Per unit, the neighbours' FSDP buffers that exist during its backward in a plan whose units cost
    ``costs`` (``_Context.neighbours``; what the search bounds by ``unit_neighbours``): the all-gather output of
    the FSDP2 unit whose forward ended just before its own (FSDP2 prefetches it; none unless that unit reshards
    after forward) and the reduce-scatter input of the one whose backward ended just before its own began (the
    unit whose forward began next). DDP's units are no FSDP2 units: they are passed over."""
    by_path = dict(zip(description.paths, costs))
    ends = [p for p in description.forward_order if p in by_path] or [*sequence_order(description), ROOT]
    # forwards begin in the order they end, but a unit enclosing others begins before them
    span = {p: min(i for i, q in enumerate(ends) if q == p or p == ROOT or q.startswith(p + ".")) for p in ends}
    begins = sorted(ends, key=lambda p: (span[p], -len(ends) if p == ROOT else p.count(".")))
    fsdp = {p for p in ends if not by_path[p].parts["ddp"]}
    ends, begins = [p for p in ends if p in fsdp], [p for p in begins if p in fsdp]
    neighbours = dict.fromkeys(description.paths, (0, 0))
    for path in fsdp:
        i, j = ends.index(path), begins.index(path)
        before = int(by_path[ends[i - 1]].parts["backward_gather_bytes"]) if i > 0 else 0
        after = int(by_path[begins[j + 1]].parts["kept_reduce_input_bytes"]) if j + 1 < len(begins) else 0
        neighbours[path] = (before, after)
    return neighbours


def schedule_peak(description: ModelDescription, costs: Sequence[OptionCost], base: int) -> tuple[int, str]:
    """The peak per rank over the step's schedule of units costing ``costs`` (one per unit, in description
    order), and the moment it is reached.

    The units that run one after another (``sequence_order``) run their forwards in order and their
    backwards in reverse: while unit v runs, each unit before it holds what it keeps until its backward
    (``before_backward_bytes``), each unit after it (in backward) what it keeps from its backward on
    (``after_backward_bytes``); v works on what it holds until its backward (its transients on top), and
    as its backward ends reduces into what it keeps after; the optimizer step finds every unit after its
    backward. Units enclosing others (the root) are counted at the larger of their two all step, their
    working set at the fullest moment inside them. In forward, what the unit that gathered last left
    lingers (FSDP2 frees an all-gather output when the next is waited for, or as the root's forward ends).
    """
    by_path = dict(zip(description.paths, costs))
    order = sequence_order(description)

    def part(path: str, name: str) -> int:
        return int(by_path[path].parts[name])

    def own(path: str) -> int:
        return max(part(path, "before_backward_bytes"), part(path, "after_backward_bytes"))

    sequence = set(order)
    enclosing = [p for p in description.paths if p not in sequence]
    fixed = base + sum(part(p, "always_bytes") for p in description.paths) + sum(own(p) for p in enclosing)
    before = np.array([part(p, "before_backward_bytes") for p in order], dtype=np.int64)
    after = np.array([part(p, "after_backward_bytes") for p in order], dtype=np.int64)
    held_before = np.cumsum(before) - before  # by the units earlier in forward order
    held_after = int(after.sum()) - np.cumsum(after)  # by the units later in forward order
    # In forward FSDP2 keeps a unit's all-gather output until the next unit's all-gather is waited for, or the
    # root's forward ends: what the unit that gathered last left lingers while units that gather nothing run
    left, linger_forward = 0, []
    for path in order:
        gathered = part(path, "gather_output_bytes")
        linger_forward.append(0 if gathered else left)
        left = gathered or left
    forward = fixed + held_before + before  # with the unit's own activations (no gradients yet)
    backward = fixed + held_before + np.array([own(p) for p in order], dtype=np.int64) + held_after
    optimizer = fixed + int(after.sum())
    moments = [(optimizer, "the optimizer step")]
    for i, path in enumerate(order):
        moments += [
            (int(forward[i]) + linger_forward[i] + part(path, "fwd_transient_bytes"),
             f"forward of {display_path(path)}"),
            # its backward works on what it held until then; as it ends it reduces into what it keeps after
            (int(backward[i]) - own(path) + int(before[i]) + part(path, "bwd_transient_bytes"),
             f"backward of {display_path(path)}"),
            (int(backward[i]) + part(path, "post_backward_bytes"), f"the end of the backward of {display_path(path)}"),
            (optimizer + own(path) - int(after[i]) + part(path, "optimizer_temp_bytes"), "the optimizer step"),
        ]
    for path in enclosing:
        inside = [i for i, p in enumerate(order) if path == ROOT or p.startswith(path + ".")]
        fullest = max([optimizer, *(int(backward[i]) for i in inside)])
        working = max(part(path, k) for k in ("bwd_transient_bytes", "post_backward_bytes", "optimizer_temp_bytes"))
        moments.append((fullest + working, f"the working set of {display_path(path)}"))
        # its forward, at the latest with every unit inside holding its activations
        fullest_forward = max([fixed, *(int(forward[i]) + linger_forward[i] for i in inside)])
        working = part(path, "fwd_transient_bytes")
        if path == ROOT:  # the head, after the last unit's forward: what was gathered last is freed as it ends
            gathered = part(path, "gather_output_bytes")
            fullest_forward = max(fullest_forward + working,
                                  fixed + int(before.sum()) + working - gathered + (left or gathered))
        else:
            fullest_forward += working
        moments.append((fullest_forward, f"the forward of {display_path(path)}"))
    return max(moments, key=lambda m: m[0])


def _base(ctx: _Context) -> int:
    return int(ctx.calibration.margin_bytes) + ctx.input_bytes


def build_problem(
    description: ModelDescription,
    device_info: DeviceInfo,
    batch_size: int,
    *,
    precision: str = "fp32",
    optimizer: str = "adamw",
    calibration: Calibration | None = None,
    options: Sequence[Option] | None = None,
    uniform_mode: str | None = None,
    neighbours: Mapping[str, tuple[int, int]] | None = None,
) -> Problem:
    """The search problem at one micro-batch size: every unit under every option (default:
    ``options_for(device_info)``), costed by ``unit_cost``. ``uniform_mode`` (one of ``UNIFORM_MODES``):
    only that mode's options are allowed, and priced with the neighbours a plan all in that mode has.
    ``neighbours``: the neighbours' buffers each unit is priced with, instead of the description's own
    (``unit_neighbours``; ``osdp.granularity`` prices units with the neighbours they may have in a plan
    that takes other blocks whole)."""
    ctx = _context(description, device_info, batch_size, precision, optimizer, calibration, neighbours)
    if uniform_mode is not None:
        ctx = _uniform(ctx, uniform_mode)
    options = options_for(device_info) if options is None else [_as_option(o) for o in options]
    U, O = len(description.units), len(options)
    time_ = np.zeros((U, O), dtype=np.float64)
    mem = np.zeros((U, O), dtype=np.int64)
    transient = np.zeros((U, O), dtype=np.int64)
    allowed = np.zeros((U, O), dtype=bool)
    for i, unit in enumerate(description.units):
        for j, option in enumerate(options):
            if _impossible(unit, option) or uniform_mode not in (None, option.mode):
                continue
            c = unit_cost(unit, option, ctx)
            time_[i, j], mem[i, j], transient[i, j], allowed[i, j] = c.time_s, c.mem_bytes, c.transient_bytes, True
    # No group ids: repeated blocks cost the same time, but their memory depends on their place in the
    # schedule (neighbours' buffers, what the root has freed by then); the solver merges identical rows.
    return Problem(
        time=time_, mem=mem, transient=transient, allowed=allowed, base=_base(ctx), batch_size=batch_size,
        units=description.paths, options=list(options),
    )


def build_problems(description: ModelDescription, device_info: DeviceInfo, batch_size: int,
                   **settings: Any) -> list[Problem]:
    """What the search solves at one micro-batch size: ``build_problem`` over every option, and one problem
    per mode of ``UNIFORM_MODES`` whose plans are priced with their true neighbours (the fastest plan that
    fits is the fastest over all of them)."""
    return [build_problem(description, device_info, batch_size, **settings),
            *(build_problem(description, device_info, batch_size, uniform_mode=m, **settings) for m in UNIFORM_MODES)]


def choice_of(problem: Problem, plan: Plan) -> np.ndarray:
    """The Problem's option index for each unit of ``plan`` (the root defaults to zero3)."""
    by_path = {u.path: u for u in plan.units}
    index = {_as_option(o): i for i, o in enumerate(problem.options)}
    choice = []
    for path in problem.units:
        key = _as_option(by_path.get(path, UnitPlan(ROOT, mode="zero3")))
        if key not in index:
            raise PlanError(f"unit '{display_path(path)}': option {key} is not in the problem's option table")
        choice.append(index[key])
    return np.array(choice, dtype=np.int64)


def plan_from_choice(problem: Problem, choice: Sequence[int], **settings: Any) -> Plan:
    """A Plan taking option ``choice[u]`` for every unit of ``problem``; a unit whose option is a ``SubUnits``
    becomes its parts, each with its option."""
    units = []
    for path, c in zip(problem.units, choice):
        option = problem.options[int(c)]
        if isinstance(option, SubUnits):
            units += [UnitPlan(_join(path, name), *part) for name, part in option.parts]
        else:
            units.append(UnitPlan(path, *_as_option(option)))
    return Plan(units=units, batch_size=problem.batch_size, **settings)


def _join(path: str, name: str) -> str:
    return ".".join(p for p in (path, name) if p)
