"""One unit under one option: ``unit_cost``.

Per unit u and option o = (mode, split k, checkpoint, shard scope), at micro-batch b on N
ranks, from the unit's description (``osdp.schema.description``: parameter shapes,
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
    A unit no input of which requires grad (token ids, a frozen part's
    output) is reduced only as the whole backward ends (FSDP2's final
    callback): after its backward it holds its unsharded parameters and
    gradients until then (in the schedule's peak only).
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
group (k consecutive identical blocks as one FSDP2 unit)
    one block's costs k times (compute, activations, per-tensor and
    per-checkpoint costs), the k blocks' parameters in one all-gather and one
    reduce-scatter, the per-unit overhead and the ranks' meetings once; the
    forward of its last block runs beside the earlier blocks' activations, and
    its backward beside the later blocks' unsharded gradients.
shard scope (on a device with a topology of several nodes)
    a unit sharded within its node holds 1/ranks_per_node of its states,
    gathers and reduce-scatters over the node's group (``Topology.intra``),
    and all-reduces its reduced shard over the cross-node group
    (``Topology.inter``); a unit sharded over every rank, and a replicated
    one, pays the world group's costs (``DeviceInfo.collectives``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from osdp.cost.terms import (
    _DTYPE_BYTES,
    _FOREACH_TEMPS,
    _REDUCE_BYTES,
    DDP_BUCKET_BYTES,
    OPTIMIZER_STATES,
    USED_FLAG_BYTES,
    Calibration,
    OptionCost,
    _padded_numel,
    _remove,
    reduce_scatter_buffer_bytes,
)
from osdp.machine.collective_model import CollectiveModel
from osdp.machine.device_info import DeviceInfo
from osdp.schema.description import UnitProfile
from osdp.schema.plan import (
    checkpoint_policy,
    ROOT,
    PlanError,
    UnitPlan,
    replicates_with_ddp,
    runs_as,
    reshards_after_forward,
)
from osdp.search.problem import Option


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
    # the micro-batch and what the model returns for it (``logits, loss = model(x, y)``): the training loop holds
    # both through the step
    held_bytes: int = 0
    # the model's buffers, which every rank holds all step whatever the plan (ModelDescription.buffer_bytes)
    buffer_bytes: int = 0

    @property
    def compute_bytes(self) -> int:
        return _DTYPE_BYTES[self.precision]


def _widening(unit: UnitProfile) -> Callable[[int], int]:
    """Bytes counted at 4 per parameter element -> at the unit's own bytes per element where that is more (the
    same where its parameters are fp32). Narrower parameters (a model cast to bf16 whole) stay priced as fp32:
    what a rank holds for them is not all as narrow (priced at their width, such a plan measured 1.5% over)."""
    if unit.numel == 0 or unit.param_bytes <= 4 * unit.numel:
        return lambda nbytes: nbytes
    return lambda nbytes: math.ceil(nbytes * unit.param_bytes / (4 * unit.numel))


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
    if ckpt and not all(c.checkpointable for c in unit.costs.values()):
        return (f"{where} cannot be checkpointed: the forward writes to one of its inputs in place, which a "
                "recompute would read")
    if ckpt == "selective" and k > 1:
        return f"{where}: selective checkpointing cannot tell a split Linear's matmuls apart"
    if ckpt == "selective" and any(c.sac_bytes is None or c.sac_recompute_s is None for c in unit.costs.values()):
        return f"{where} was not described for selective checkpointing"
    if scope == "node" and (mode == "replicate" or k > 1):
        return f"{where}: shard scope 'node' needs mode 'zero2' or 'zero3' without split"
    if unit.blocks > 1 and mode == "replicate":
        return f"{where} is a group of {unit.blocks} blocks: a replicated unit gathers nothing to group"
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


# Over 80 lines: the price of one unit under one option, term by term in the order docs/COST_MODEL.md derives
# them; its terms feed each other (the gathers' bytes the memory, the compute what the collectives hide behind),
# and split into functions they would travel as a dozen arguments.
def unit_cost(unit: UnitProfile, option: UnitPlan | Sequence[Any], ctx: _Context) -> OptionCost:
    """Time, additive memory and transient memory of ``unit`` under ``option`` (see the module docstring)."""
    option = _as_option(option)
    mode, k, ckpt, scope = option
    reason = _impossible(unit, option)
    if reason:
        raise PlanError(reason)
    mode = runs_as(unit.path, mode, ctx.precision)
    n, b, dt = ctx.n, ctx.b, ctx.compute_bytes
    cal, opt = ctx.calibration, ctx.optimizer
    # the terms below count 4 bytes per parameter element (fp32); a model keeping some in another dtype (a complex
    # spectral weight, a float64 scale) holds their shards, gradients, optimizer states and reductions that wide,
    # and gathers them so in an fp32 plan (a bf16 plan gathers its bf16 copies)
    widen = _widening(unit)
    if ctx.precision == "fp32":
        dt = widen(dt)
    costs = unit.costs[ctx.precision]
    enclosing = bool(unit.nested) or unit.path == ROOT
    blocks = unit.blocks  # a group of k identical blocks: its costs are one block's (UnitProfile.group)

    split = list(unit.split_shapes) if k > 1 else []
    fsdp_shapes = _remove(unit.param_shapes, split)
    group_n, gather_group, across_nodes = _shard_group(ctx, scope)
    shard_n = 1 if mode == "replicate" else group_n
    fsdp_padded = sum(_padded_numel(s, shard_n) for s in fsdp_shapes)
    fsdp_full = sum(math.prod(s) for s in fsdp_shapes)
    split_rows = []  # per split Linear: (rows per rank, largest slice's rows per rank, in_features, slices)
    split_outputs = []  # per split Linear: (out_features, rows per rank, largest slice's rows per rank)
    if split:
        from osdp.split import split_layout

        for out_f, in_f in split:
            rows, pieces = split_layout(out_f, n, k)
            split_rows.append((rows, max(pieces), in_f, len(pieces)))
            split_outputs.append((out_f, rows, max(pieces)))
    shard_numel = fsdp_padded // shard_n + sum(rows * in_f for rows, _, in_f, _ in split_rows)

    # -- memory ------------------------------------------------------------------
    states = OPTIMIZER_STATES[opt]
    persistent = widen(4 * shard_numel * (1 + states)) + (4 * len(unit.param_shapes) if opt == "adamw" else 0)
    gathered = dt * fsdp_padded  # FSDP's unsharded parameters (and its flat all-gather buffer)
    rs_input = widen(_REDUCE_BYTES * fsdp_padded)
    grad = widen(4 * shard_numel)
    policy = checkpoint_policy(ckpt)
    kept = costs.kept_bytes(b, policy)  # per block
    act = blocks * kept
    foreach = ctx.device.device_type == "cuda"
    foreach_temps = widen(_FOREACH_TEMPS[opt] * 4 * shard_numel) if foreach else 0
    largest_shard = widen(max((4 * math.ceil(math.prod(s) / shard_n) for s in unit.param_shapes), default=0))
    ddp = mode == "replicate" and replicates_with_ddp(ctx.precision)
    # what the unit holds all step, from its forward until its backward, and from its backward to the step's end
    if ddp:  # DDP: parameters used in place, gradients are views into buckets that live all step
        held = 0
        grad += USED_FLAG_BYTES * len(unit.param_shapes)  # the reducer's flag per parameter, in its bucket
        always, before, after = persistent + grad, act, 0
        rs_input = largest_shard  # a fresh gradient, before the reducer copies it into its bucket
    else:
        held = gathered if (mode != "zero3" and not enclosing) else 0
        # a unit enclosing others stays gathered through the whole step
        always, before, after = persistent + (gathered if enclosing else 0), act + held, grad
    # on CPU the reduce-scatter's own buffers (native: a copy of its input) are alive while it runs, after FSDP2
    # freed the unsharded gradients it copied into that input (as large in fp32; half as large in bf16)
    reduce_copy = reduce_scatter_buffer_bytes(ctx.device, rs_input, group_n) if mode != "replicate" else 0
    # the foreach optimizer's temporaries exist only in its step, every unit's at once: not in the backward
    mem = always + max(before, after + foreach_temps)
    # FSDP2 reduces a unit's gradients when its inputs' gradients are computed; one whose inputs need none (token
    # ids, a frozen part's output) is reduced only in the root's final callback: from its backward to the end of the
    # whole backward it holds its unsharded parameters and gradients, instead of its reduced shard. Left out of the
    # additive bound, which the schedule's peak checks: it matters only while the units before it in forward order
    # run their backward, and for the first unit (an embedding) no unit does
    late = gathered + dt * fsdp_full if (costs.reduced_at_end and not ddp and not enclosing) else 0

    # the working sets beyond what mem already counts of this unit's activations. In a group, the last block's
    # forward runs with the earlier blocks' activations kept; a block's backward with the later blocks' unsharded
    # gradients (reduced only after the group's backward) or the earlier blocks' activations, the larger at worst
    block_grad = dt * fsdp_full // blocks
    temp_fwd = costs.fwd_peak_bytes.signed_bytes(b) + (blocks - 1) * kept - act
    temp_bwd = ((costs.recompute_peak_bytes if ckpt else costs.bwd_peak_bytes).signed_bytes(b)
                + (blocks - 1) * max(kept, block_grad) - act)
    flat = gathered if mode != "replicate" else 0  # all-gather output kept until the next unit gathers
    # when its backward ends FSDP copies the unsharded gradients (in the working set) into the reduce buffer
    post = costs.bwd_end_bytes.signed_bytes(b) + (blocks - 1) * block_grad - act + rs_input
    if late:  # nothing is reduced yet: the unsharded gradients in the working set are what it holds on (late)
        post -= rs_input + dt * fsdp_full
    else:
        # FSDP2 reshards (frees what ``before`` holds beyond the activations) and frees the unsharded gradients
        # before it reduces: then the input, its copy (on CPU) and the new shard are alive
        reduce_out = widen(_REDUCE_BYTES * fsdp_padded // shard_n)
        post += max(reduce_copy + reduce_out - dt * fsdp_full - (max(before, after) - act), 0)
    if policy == "selective" and costs.sac_unsaved_bytes is not None:  # kept beside the backward's working set
        unsaved = costs.sac_unsaved_bytes.signed_bytes(b)  # until the backward ends
        temp_bwd, post = temp_bwd + unsaved, post + unsaved
    prefetched, rs_previous = ctx.neighbours.get(unit.path, (0, 0))
    own = gathered if (mode == "zero3" and not enclosing) else 0
    if enclosing:
        fwd = temp_fwd + flat
        # the root stays gathered into backward (any mode), and FSDP2 dropped its flat buffer after the
        # copy-out in forward (on gloo too: osdp.distributed.collectives.Lent)
        bwd = temp_bwd + prefetched + rs_previous
    else:
        fwd = temp_fwd + own + flat
        bwd = temp_bwd + own + prefetched + rs_previous
        if costs.run_in_backward and mode != "replicate":
            # the model's own reentrant checkpoint reruns the forward in backward, where FSDP2 gathers the unit
            # again while the flat buffer it prefetched it into is still held
            bwd += gathered
        post += prefetched
    if split_rows:
        slice_fwd = max(2 * n * q * in_f * dt for _, q, in_f, _ in split_rows)  # the two gather buffers
        slice_bwd = max(
            _split_backward_bytes(n, dt, rows, q, in_f, out_f,
                                  reduce_scatter_buffer_bytes(ctx.device, _REDUCE_BYTES * n * q * in_f, n))
            for (rows, q, in_f, _), (out_f, _, _) in zip(split_rows, split_outputs))
        tokens = costs.split_rows(b) if costs.split_rows is not None else 0.0
        out_fwd, out_bwd = zip(*(_split_output_bytes(tokens * dt, n, *o) for o in split_outputs))
        fwd, bwd = fwd + slice_fwd + max(out_fwd), bwd + slice_bwd + max(out_bwd)
    # the root's backward working set by where it runs (older descriptions: none, priced at bwd wherever it runs):
    # before any unit's backward nothing is reduced yet, after them all nothing is prefetched
    by_place = {}
    if unit.path == ROOT and costs.bwd_head_bytes is not None:
        split_extra = bwd - (temp_bwd + prefetched + rs_previous)
        by_place = {
            "bwd_head_bytes": costs.bwd_head_bytes.signed_bytes(b) - act + prefetched + split_extra,
            "bwd_between_bytes": costs.bwd_between_bytes.signed_bytes(b) - act + prefetched + rs_previous + split_extra,
            "bwd_tail_bytes": costs.bwd_tail_bytes.signed_bytes(b) - act + rs_previous + split_extra,
        }
    optimizer_temp = 0 if foreach else 2 * largest_shard
    transient = max(fwd, bwd, post, optimizer_temp)

    # -- time --------------------------------------------------------------------
    recompute = blocks * costs.recompute_seconds(b, policy) if ckpt else 0.0
    fwd_s, bwd_s = blocks * costs.fwd_s(b), blocks * costs.bwd_s(b)
    compute = cal.compute_scale * (fwd_s + bwd_s + recompute)
    world = ctx.device.collectives
    if ddp:
        # DDP all-reduces 25 MiB buckets across units: each unit pays its bytes and its share of an alpha
        reduced = widen(_REDUCE_BYTES * fsdp_full)
        comm = _collective(world, "all_reduce", DDP_BUCKET_BYTES) * reduced / DDP_BUCKET_BYTES if reduced else 0.0
    elif mode == "replicate":
        comm = _collective(world, "all_reduce", widen(_REDUCE_BYTES * fsdp_full))
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
    per_byte = cal.unit_s_per_byte.get(mode, 0.0) * widen(4 * fsdp_full) * _link_share(gather_group, world)
    hideable = 0.0
    if ddp:  # DDP's all-reduce, gloo's in-training cost of it included, runs while backward goes on
        # the all-reduce alone: DDP copies gradients into its buckets on the backward's thread
        hideable = min(comm * (1.0 - ctx.ddp_last_bucket.get(unit.path, 1.0)), cal.compute_scale * bwd_s)
        hidden = max(overlap * compute, cal.ddp_overlap * hideable)
        exposed, per_byte = max(comm + per_byte - hidden, 0.0), 0.0
    else:
        exposed = max(comm - overlap * compute, 0.0)
    # once per FSDP2 unit, a group's too: its hooks, its meetings and its collectives' latency; per tensor and
    # per checkpointed module (each block of a group is checkpointed on its own): for every block
    overhead = (
        cal.unit_overhead_s.get(mode, 0.0) + (cal.root_overhead_s.get(mode, 0.0) if unit.path == ROOT else 0.0)
        + (0.0 if ddp else cal.param_overhead_s * len(fsdp_shapes))
        + (blocks * cal.checkpoint_overhead_s if ckpt else 0.0)
        + per_byte
        + cal.slice_overhead_s * slices + cal.slice_s_per_byte * slice_bytes
        + cal.slice_contention * min(split_comm, compute)
    )
    # FSDP2's collectives make the ranks meet as the unit's forward and its backward begin or end: each meeting
    # waits for the rank that drifted furthest behind while computing since the last one
    meeting_wait = 0.0
    if not ddp and n > 1:
        backward = bwd_s + recompute
        meeting_wait = cal.meeting_wait_s_per_sqrt_s * sqrt_segments(
            cal.compute_scale * fwd_s, cal.compute_scale * backward)
    optimizer_s = (  # the per-tensor cost is DTensor dispatch: DDP's parameters are plain tensors
        (0.0 if ddp else ctx.calibration.optimizer_tensor_s * len(unit.param_shapes))
        + ctx.optimizer_s_per_byte * widen(4 * shard_numel)
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
        "optimizer_step_bytes": foreach_temps,  # beside after_backward_bytes in the optimizer step only
        # held instead of after_backward_bytes until the whole backward ends, and what its reduce then adds: FSDP2
        # reshards its parameters, then copies the unsharded gradients into the reduce-scatter input and reduces it
        # into the new shard while both are alive
        "until_backward_ends_bytes": late, "final_reduce_bytes": (
            max(rs_input + grad + max(dt * fsdp_full, reduce_copy) - gathered - dt * fsdp_full, 0) if late else 0),
        "gather_output_bytes": flat,
        # what its neighbours meet of it in the plan (``plan_neighbours``): the all-gather output FSDP2 prefetches
        # in backward (a unit resharded after forward) and the reduce-scatter input FSDP2 keeps after its backward
        "backward_gather_bytes": flat if reshards_after_forward(unit.path, mode) else 0,
        # (a replicated unit's too where FSDP2 runs it, on a shard group of one: DDP's reducer keeps no input; a
        # unit reduced as the backward ends keeps none in backward)
        "kept_reduce_input_bytes": 0 if (ddp or late) else rs_input,
        **by_place,
    }
    return OptionCost(time_s, int(mem), int(transient), parts)


def _split_backward_bytes(n: int, dt: int, rows: int, q: int, in_f: int, out_f: int, reduce_buffers: int) -> int:
    """What a split Linear's backward loop (``osdp.split._loop.backward``) holds beyond an ``nn.Linear``'s backward
    (whose working set the describe measured): the two gather buffers; two slices' weight gradients in flight,
    each cast for the reduce and with its reduce-scatter's own buffers (``reduce_buffers`` bytes on CPU), the
    newer one's product still in the compute dtype before its cast; and this rank's rows of the weight gradient
    (fp32) instead of the whole weight's gradient (in the compute dtype)."""
    slice_numel = n * q * in_f
    buffers = 2 * dt * slice_numel
    cast = dt * slice_numel if dt != _REDUCE_BYTES else 0
    in_flight = 2 * _REDUCE_BYTES * slice_numel + reduce_buffers + max(reduce_buffers, cast)
    return buffers + in_flight + 4 * rows * in_f - dt * out_f * in_f


def _split_output_bytes(row_bytes: float, n: int, out_features: int, rows: int, q: int) -> tuple[int, int]:
    """What a split Linear's loop (``osdp.split._loop``) holds beyond an ``nn.Linear``'s output and output gradient,
    in its forward and its backward, for inputs of ``row_bytes`` per output column: each slice's product (every
    rank's q columns, before it is copied into the output) and each slice's output gradient (copied out of the
    whole); where the ranks' rows overhang ``out_features`` (padded tail ranks), the output in the padded layout,
    copied into one without the padding as the forward ends, and the output gradient padded to that layout."""
    padded = n * rows != out_features
    fwd = max(n * q + n * rows - out_features, n * rows) if padded else n * q
    bwd = n * q + (n * rows if padded else 0)
    return math.ceil(row_bytes * fwd), math.ceil(row_bytes * bwd)


def sqrt_segments(*seconds: float) -> float:
    """The sum of the square roots of the compute seconds between meetings: what the ranks' wait grows with
    (``Calibration.meeting_wait_s_per_sqrt_s``)."""
    return sum(math.sqrt(max(s, 0.0)) for s in seconds)
