"""Apply a Plan to a module in place with FSDP2.

Every unit becomes one FSDP2 parameter group, applied bottom-up and then on
the root, as ``fully_shard`` expects:

* ``zero3``: ``fully_shard`` on the 1-D mesh, resharding after forward;
* ``zero2``: the same without resharding after forward (gathered parameters
  are kept from forward until backward); the root runs this way in zero3 too,
  as FSDP2's root does (``UnitPlan.reshards_after_forward``);
* ``shard_scope: node`` (zero2, zero3): on the (nodes, ranks_per_node) mesh
  instead, FSDP2's hybrid sharding: sharded within the node, replicated
  across nodes, gradients reduce-scattered within the node and all-reduced
  across; ranks per node are torchrun's ``LOCAL_WORLD_SIZE``;
* ``replicate``: the parameters of every replicated unit go to one reducer
  (``fsdp_ext.replicate``): bucketed all-reduces overlapped with backward and
  no second copy of the parameters, as ``DistributedDataParallel``; plain
  tensors in forward and backward, shown between steps as DTensors replicated
  on the world mesh, views of the same memory (``fsdp_ext.replicated_view``),
  so that every parameter is a DTensor as in a ``fully_shard``-ed model. The unit is still ``fully_shard``-ed, with those
  parameters ignored, so that it answers FSDP2's methods
  (``fsdp_ext.module_api``). In bf16 plans replicated units are FSDP2's
  ``replicate`` on the same 1-D mesh as the sharded ones, whose
  ``MixedPrecisionPolicy`` makes the bf16 copy that compute needs: their
  parameters are DTensors replicated on the mesh the sharded ones are sharded
  on, which ``torch.nn.utils.clip_grad_norm_`` and the optimizers take
  together. A replicated root runs as zero2 in bf16: FSDP2's root, which
  drives every unit's hooks, must be ``fully_shard``-ed, and zero2 holds less
  and moves less than replicating it would (``schema.plan.runs_as``);
* ``split: k``: the unit's large Linears become ``SplitLinear`` (k slices,
  gathered one at a time); FSDP2 leaves their weights alone;
* ``group``: k consecutive identical units as one FSDP2 unit, ``fully_shard``
  on the list of their modules (``fsdp_ext.groups``): one all-gather and one
  reduce-scatter for the k of them, each module still answering FSDP2's
  methods (for the whole group, as FSDP2 does);
* ``checkpoint``: activation checkpointing of the unit (``osdp.describe.recompute``:
  module paths and state-dict keys do not change, ``torch.compile`` traces
  it); modules that keep a forward cache are called without it while
  training (``osdp.describe.forward_caches``).

Before anything is changed, every rank validates the plan against the model
and checks that all ranks hold the same plan hash; any failure is raised on
every rank, so nothing hangs and the model is left untouched.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from osdp.describe.forward_caches import disable_caches_in_training
from osdp.describe.kept import fingerprint
from osdp.describe.recompute import checkpoint_unit
from osdp.describe.units import (
    Unit,
    build_units,
    enclosing,
    fully_shardable,
    holding_unit,
    is_callable,
    param_homes,
    structure_signature,
    unit_parameters,
)
from osdp.distributed import all_gather_objects, ranks_per_node, world
from osdp.distributed import collectives as comm
from osdp.distributed.group import ensure_process_group, job_device
from osdp.fsdp_ext.forward_errors import double_backward_error, refuse_dtensor_gradients_into_outputs
from osdp.fsdp_ext.gradient_hooks import hook_gathered_gradients
from osdp.fsdp_ext.groups import group_members
from osdp.fsdp_ext.forward_writes import ForwardWrites
from osdp.fsdp_ext.interrupted import start_clean_after_a_backward_cut_short
from osdp.fsdp_ext.restored_parameters import register_gathered_again_as_backward_begins
from osdp.fsdp_ext.mixed_precision import keep_mixed_precision_current
from osdp.fsdp_ext.added_parameters import refuse_parameters_made_in_forward
from osdp.fsdp_ext.assigned_data import make_data_assignable_at_first_forward, make_parameters_data_assignable
from osdp.fsdp_ext.divide_factors import track_divide_factors
from osdp.fsdp_ext.meta import built_on_meta, check_alike, check_materialized_at_first_forward
from osdp.fsdp_ext.earlier_optimizers import named_parameter_objects, remember_replaced
from osdp.fsdp_ext.optimizer_state import lay_out_loaded_optimizer_state
from osdp.fsdp_ext.evaluation import reshard_after_evaluating
from osdp.fsdp_ext.model_checks import PLAN_ATTR, check_model
from osdp.fsdp_ext.module_api import StandIn, UnitExtras, extend_unit, stand_in_for_units
from osdp.fsdp_ext.replicate import ReplicaReducer
from osdp.fsdp_ext.replicated_view import ReplicatedView
from osdp.fsdp_ext.state_dict import load_under_any_plan, show_replicated_as_dtensors
from osdp.fsdp_ext.unused import reduce_where_any_rank_has_gradients
from osdp._torch_private import (
    fsdp_gather_outside_inference_mode,
    fsdp_keep_forward_writes,
    fsdp_pre_backward,
    fsdp_refuse_graph_building_backward,
    fsdp_replicate,
    has_fsdp_replicate,
)
from osdp.machine.memory import iter_tensors, register_gradient_storages
from osdp.schema.plan import ROOT, Plan, PlanError, UnitPlan, display_path, replicates_with_ddp
from osdp.split import SplitLinear, apply_split, split_parameters, splittable_linears

_REPLICATED_ATTR = "_osdp_replicated"

SHARD_DIM = "shard"
REPLICATE_DIM = "replicate"


class Meshes:
    """The meshes a plan needs: 1-D over the world, for units sharded or replicated over it, and
    (nodes, ranks_per_node) for units sharded within their node (made only for plans that have one)."""

    def __init__(self, device_type: str, world_size: int, ranks_per_node: int, node_scoped: bool):
        # Always explicit: with a gloo group on a machine with GPUs the default mesh would pick CUDA.
        self.world: DeviceMesh = init_device_mesh(device_type, (world_size,), mesh_dim_names=(SHARD_DIM,))
        # torch 2.9 has no FSDP2 replicate on a 1-D mesh: replicated units in bf16 are fully_shard-ed on an
        # (N, 1) mesh there, a mesh of their own
        self.replicated: DeviceMesh | None = None if has_fsdp_replicate() else init_device_mesh(
            device_type, (world_size, 1), mesh_dim_names=(REPLICATE_DIM, SHARD_DIM))
        self.node: DeviceMesh | None = None
        if node_scoped:
            self.node = init_device_mesh(device_type, (world_size // ranks_per_node, ranks_per_node),
                                         mesh_dim_names=(REPLICATE_DIM, SHARD_DIM))

    def for_unit(self, decision: UnitPlan) -> DeviceMesh:
        return self.node if decision.shard_scope == "node" else self.world

    @property
    def for_replicated_views(self) -> DeviceMesh:
        """The mesh the reducer's parameters are shown on: the node-scoped units' where the plan has them, so
        that a plan the search makes (one shard scope: ``osdp.cost.context.scope_option_sets``) holds every
        DTensor on one mesh."""
        return self.node if self.node is not None else self.world


def mixed_precision_policy(setting: str) -> MixedPrecisionPolicy:
    if setting == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def complete_plan(model: nn.Module, plan: Plan) -> Plan:
    """The plan with the root unit made explicit (zero3 unless the plan names it)."""
    if ROOT in plan.paths:
        return plan
    return replace(plan, units=[*plan.units, UnitPlan(ROOT, mode="zero3")], meta=dict(plan.meta))


def validate_plan(model: nn.Module, plan: Plan, world_size: int) -> tuple[list[Unit], dict[str, list[str]]]:
    """Check a (completed) plan against a model that passed ``check_model``; return its units bottom-up and its
    groups (``fsdp_ext.groups.group_members``).

    Raises PlanError."""
    if plan.world_size is not None and plan.world_size != world_size:
        raise PlanError(
            f"the plan was made for world size {plan.world_size} but this job has {world_size} ranks; "
            "re-plan for this world size"
        )
    if plan.model_signature is not None and plan.model_signature != structure_signature(model):
        raise PlanError(
            "the plan was made for a different model (structure signature "
            f"{plan.model_signature} vs this model's {structure_signature(model)}); re-plan for this model"
        )
    modules = dict(model.named_modules())
    for u in plan.units:
        if u.path not in modules:
            close = [p for p in modules if p and (p.endswith(u.path) or u.path.endswith(p))][:3]
            hint = f"; did you mean {close}?" if close else ""
            raise PlanError(f"unit '{display_path(u.path)}': no such module in the model{hint}")
    for u in plan.units:
        if not is_callable(modules[u.path]):
            raise PlanError(
                f"unit '{display_path(u.path)}' is a {type(modules[u.path]).__name__}, which has no forward of its "
                "own: FSDP2 gathers a unit in its forward, so make the module that calls its children the unit"
            )
    for container in plan.routed:
        if container not in modules:
            raise PlanError(f"routed container '{display_path(container)}': no such module in the model")
        inside = [p for p in plan.paths if enclosing(p, [container])]
        if inside:
            raise PlanError(
                f"unit '{display_path(inside[0])}' is inside '{display_path(container)}', whose members the model "
                "calls depending on the data: a rank whose batch skips it would wait for the others at another "
                "gather; make the module calling them the unit"
            )
    units = build_units(model, plan.paths)
    for unit in units:
        if unit.numel == 0 and unit.path != ROOT:
            raise PlanError(
                f"unit '{unit.name}' owns no parameters (they all belong to units nested in it, or it "
                "has none); remove it from the plan"
            )
        decision = plan.unit(unit.path)
        if decision.split > 1:
            if not splittable_linears(modules[unit.path], exclude=_kept_whole(modules, unit, plan), root=model):
                raise PlanError(
                    f"unit '{unit.name}' cannot be split (split={decision.split}): it holds no Linear large "
                    "enough to split that is not tied to another module; use split=1"
                )
    return units, group_members(model, plan, units)


def job_ranks_per_node(plan: Plan) -> int:
    """This job's ranks per node (torchrun's LOCAL_WORLD_SIZE); PlanError unless they divide the world into
    whole nodes of the size the plan was made for (on one node, node scope is world scope)."""
    try:
        local_ranks = ranks_per_node()
    except ValueError as e:
        raise PlanError(str(e)) from None
    if plan.ranks_per_node is not None and plan.ranks_per_node != local_ranks:
        raise PlanError(
            f"the plan was made for nodes of {plan.ranks_per_node} ranks but this job runs {local_ranks} per node "
            "(torchrun's LOCAL_WORLD_SIZE); re-plan for this layout"
        )
    return local_ranks


def check_same_plan_everywhere(plan: Plan, local_error: Exception | None, local_ranks: int | None = None,
                               on_meta: bool = False) -> None:
    """Collective: raise on every rank if any rank failed validation, holds another plan, counts another
    number of ranks per node, or built the model on the meta device where others did not (``on_meta``)."""
    reports = all_gather_objects((plan.hash, None if local_error is None else str(local_error), local_ranks,
                                  on_meta))
    failed = [(r, msg) for r, (_, msg, _, _) in enumerate(reports) if msg is not None]
    if failed:
        if local_error is not None:
            raise local_error
        rank, msg = failed[0]
        raise PlanError(f"rank {rank} rejected the plan: {msg}")
    check_alike([meta for _, _, _, meta in reports])
    layouts = {n for _, _, n, _ in reports}
    if len(layouts) > 1:
        raise PlanError(
            f"ranks count different numbers of ranks per node ({sorted(layouts)}, from LOCAL_WORLD_SIZE); "
            "launch every node with the same --nproc-per-node"
        )
    hashes = [h for h, _, _, _ in reports]
    if len(set(hashes)) > 1:
        by_hash: dict[str, list[int]] = {}
        for r, h in enumerate(hashes):
            by_hash.setdefault(h, []).append(r)
        groups = "; ".join(f"ranks {ranks} hold plan {h}" for h, ranks in by_hash.items())
        raise PlanError(
            f"ranks hold different plans ({groups}); every rank must apply the same plan "
            "(load the same JSON, or let osdp search once and broadcast)"
        )


def _check_here(model: nn.Module, plan: Plan, device: torch.device, world_size: int
                ) -> tuple[list[Unit], dict[str, list[str]], int | None, PlanError | None]:
    """The plan's units and groups and the job's ranks per node, or the ``PlanError`` this rank found (every
    rank learns of it next, ``check_same_plan_everywhere``)."""
    local_ranks = None
    try:
        local_ranks = job_ranks_per_node(plan)
        check_model(model, device)
        return (*validate_plan(model, plan, world_size), local_ranks, None)
    except PlanError as e:
        return [], {}, local_ranks, e


def apply_plan(
    model: nn.Module, plan: Plan, device: torch.device | str | None = None, find_unused_parameters: bool | None = None,
) -> nn.Module:
    """Apply ``plan`` to ``model`` in place (collective over the default process group).

    ``find_unused_parameters`` is accepted for code written against osdp 0.x and means nothing now: a
    parameter without a gradient in a backward is always handled (``fsdp_ext.replicate``).
    """
    if find_unused_parameters is not None:
        warnings.warn("osdp: find_unused_parameters is no longer needed (parameters left without a gradient "
                      "are always handled) and is ignored", DeprecationWarning, stacklevel=3)
    ensure_process_group()
    _, world_size = world()
    device = torch.device(device) if device is not None else job_device()
    plan = complete_plan(model, plan)
    units, groups, local_ranks, error = _check_here(model, plan, device, world_size)
    on_meta = error is None and built_on_meta(model)
    check_same_plan_everywhere(plan, error, local_ranks, on_meta)
    make_contiguous(model)
    before = named_parameter_objects(model)  # what an optimizer built before wrapping holds
    shardable = fully_shardable(model, plan.paths)  # before a split replaces a Linear

    node_scoped = any(u.shard_scope == "node" for u in plan.units)
    meshes = Meshes(device.type, world_size, local_ranks, node_scoped)
    modules = dict(model.named_modules())
    mp_policy = mixed_precision_policy(plan.mixed_precision)
    writes = ForwardWrites(model)
    replicate_with_ddp = replicates_with_ddp(plan.mixed_precision)
    owned = unit_parameters(model, plan.paths)
    replicated: set[nn.Parameter] = set()  # left to the reducer, so ignored by every fully_shard
    extras: dict[str, UnitExtras] = {}
    fsdp_held: set[str] = set()  # units whose parameters FSDP2 holds (not the reducer)
    grouped = {p: members for members in groups.values() for p in members}
    for unit in units:  # bottom-up, root last
        if unit.path in extras:
            continue  # sharded with its group
        decision = plan.unit(unit.path)
        members = grouped.get(unit.path, [unit.path])  # a group's units share its settings (Plan checks)
        group = _split_and_checkpoint(model, plan, unit, members, decision, meshes.world, mp_policy)
        module = model.get_submodule(unit.path)
        by_ddp = decision.mode == "replicate" and replicate_with_ddp
        own = [p for path in members for p in owned[path]]
        to_reducer = set(own) if by_ddp else not_shardable(own)
        replicated.update(to_reducer)
        if not by_ddp:
            fsdp_held.update(members)
        _make_fsdp_unit(group if len(group) > 1 else module, unit.path, decision, by_ddp, meshes, mp_policy,
                        ignored=(split_parameters(module) | replicated) or None, written=writes.record)
        for path in members:
            extras[path] = UnitExtras(split_linears=[m for m in _own_modules(module, {modules[p] for p in unit.nested})
                                                     if isinstance(m, SplitLinear)])
    hook_gathered_gradients(model, before)
    reducer = _reduce_unevenly_used(model, plan, replicated, fsdp_held)
    for path, extra in extras.items():
        if reducer is not None:
            own = set(owned[path])
            extra.reducer, extra.replicated = reducer, [s for s in reducer.slots if s.param in own]
        extend_unit(model.get_submodule(path), extra)
    if reducer is not None:
        reducer.root_slots = extras[ROOT].replicated
    stand_in_for_units(model, shardable)
    _track_divide_factors(model, plan, grouped)
    _around_the_units(model, plan, groups)
    start_clean_after_a_backward_cut_short(model, reducer)  # registered last: before the other pre-forwards
    model.register_forward_hook(writes.after_forward)  # after FSDP2's and the reducer's: checks after their ends
    comm.install(model)  # the reduce-scatter of osdp.distributed.collectives's setting on every unit (FSDP2's own by default)
    load_under_any_plan(model)
    lay_out_loaded_optimizer_state()  # and an optimizer's state_dict, at its next step
    _at_rest_as_dtensors(model, reducer, meshes, on_meta)
    if on_meta:
        check_materialized_at_first_forward(model)
    refuse_parameters_made_in_forward(model)
    remember_replaced(before, model, replicated)
    setattr(model, PLAN_ATTR, plan)
    return model


def _at_rest_as_dtensors(model: nn.Module, reducer: ReplicaReducer | None, meshes: Meshes, on_meta: bool) -> None:
    """Between steps every parameter is a DTensor, as under FSDP2 (the reducer's shown as views of its plain
    ones), and one whose ``.data`` can be assigned (``fsdp_ext.assigned_data``)."""
    if reducer is not None:
        show_replicated_as_dtensors(model, reducer.slots, meshes.for_replicated_views)
        reducer.view = ReplicatedView(reducer.slots, meshes.for_replicated_views)
    make_parameters_data_assignable(model)
    if on_meta:  # to_empty makes new ones before the first forward
        make_data_assignable_at_first_forward(model)


def _around_the_units(model: nn.Module, plan: Plan, groups: dict[str, list[str]]) -> None:
    """What the units' forwards and backwards need around FSDP2's: resharding in eval, bf16 copies kept current,
    caches off where a recompute must save what the forward saved, a graph-building backward and DTensors in
    the loss refused, gathered parameters registered again as a backward begins."""
    _resharded_when_evaluating(model, groups)
    if plan.mixed_precision == "bf16":
        keep_mixed_precision_current(model)
    if any(d.checkpoint for d in plan.units):
        disable_caches_in_training(model)  # a recomputed forward must save what the first one saved
    refuse_dtensor_gradients_into_outputs(model)
    register_gathered_again_as_backward_begins(model)  # where the forward's caller put others in their place
    for path, unit in ((p, m) for p, m in model.named_modules() if isinstance(m, FSDPModule)):
        fsdp_refuse_graph_building_backward(unit, lambda path=path: double_backward_error(display_path(path)))


def _track_divide_factors(model: nn.Module, plan: Plan, grouped: dict[str, list[str]]) -> None:
    homes = param_homes(model, plan.paths)
    held_by = {name: homes[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
    answering = {m: path for path, m in model.named_modules() if isinstance(m, (FSDPModule, StandIn))}
    track_divide_factors(model, held_by, grouped, answering)


def _make_fsdp_unit(target: nn.Module | list[nn.Module], path: str, decision: UnitPlan, by_ddp: bool, meshes: Meshes,
                    mp_policy: MixedPrecisionPolicy, ignored: set[nn.Parameter] | None,
                    written: Callable[[str, torch.Tensor], None]) -> None:
    """``fully_shard`` the unit's module (or its group's), or, replicated by FSDP2 (bf16), ``replicate`` it.

    Every unit is FSDP2's, a replicated one in fp32 holding none of its parameters (``by_ddp``: the reducer has
    them): it answers FSDP2's methods, and the root stays the root (otherwise every top-level sharded unit would
    be a root of its own, keeping its parameters gathered after forward and prefetching nothing). So a replicated
    root in bf16 runs as zero2 (``schema.plan.runs_as``). What a forward writes to the gathered parameters in
    place is kept, as it is where the plan replicates them."""
    by_fsdp_replicate = decision.mode == "replicate" and not by_ddp and path != ROOT
    if by_fsdp_replicate and meshes.replicated is None:
        fsdp_replicate(target, mesh=meshes.world, mp_policy=mp_policy, ignored_params=ignored)
    else:
        fully_shard(target, mesh=meshes.replicated if by_fsdp_replicate else meshes.for_unit(decision),
                    reshard_after_forward=decision.reshards_after_forward, mp_policy=mp_policy,
                    ignored_params=ignored)
    first = target[0] if isinstance(target, list) else target
    if hasattr(first, "_get_fsdp_state"):
        # a forward's in-place writes to its gathered parameters stay, as unsharded
        fsdp_keep_forward_writes(first, fingerprint, written)
        fsdp_gather_outside_inference_mode(first)  # an evaluation first under inference_mode, then training


def _reduce_unevenly_used(model: nn.Module, plan: Plan, replicated: set[nn.Parameter],
                          fsdp_held: set[str]) -> ReplicaReducer | None:
    """The reducer of the ``replicated`` parameters (None if none), after making the FSDP2 units holding routed
    modules (``Plan.routed``) reduce the gradients some rank has (``fsdp_ext.unused``)."""
    for path in {holding_unit(c, plan.paths) for c in plan.routed} & fsdp_held:
        reduce_where_any_rank_has_gradients(model.get_submodule(path))
    if not replicated:
        return None
    in_order = {n: p for n, p in model.named_parameters() if p in replicated}
    # A bucket holding a routed parameter is reduced when its gradient arrives, or at the backward's end on a
    # rank that skipped it: its own group keeps that from crossing FSDP2's collectives in another order.
    reducer = ReplicaReducer(model, in_order, group=dist.new_group() if plan.routed else None)
    setattr(model, _REPLICATED_ATTR, reducer)
    return reducer


def make_contiguous(model: nn.Module) -> None:
    """Lay every parameter out contiguously, in place (the same Parameter, the same values): FSDP2 shards only
    contiguous parameters, and a model trained in channels_last has 4-D convolution weights that are not. Done
    under every plan, so that no plan shows another layout; convolutions still give channels_last outputs for
    channels_last inputs."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_contiguous():
                p.data = p.data.contiguous()


def not_shardable(params: list[nn.Parameter]) -> set[nn.Parameter]:
    """The parameters of a sharded unit that the reducer replicates instead, as FSDP2 cannot shard them with the
    others: 0-d ones (``fully_shard`` refuses scalars: ReZero's gates, a temperature) and those whose dtype is not
    the unit's (a float64 temperature beside float32 weights; one FSDP2 parameter group has one dtype)."""
    numel_by_dtype = collections.Counter()
    for p in params:
        if p.dim():
            numel_by_dtype[p.dtype] += p.numel()
    main = numel_by_dtype.most_common(1)[0][0] if numel_by_dtype else None
    return {p for p in params if p.dim() == 0 or p.dtype != main}


def _kept_whole(modules: dict[str, nn.Module], unit: Unit, plan: Plan) -> list[nn.Module]:
    """What a split of ``unit`` leaves alone: the units nested in it, and routed containers (a rank that skipped one
    of their members would not join the gathers of its slices)."""
    return [modules[p] for p in (*unit.nested, *plan.routed) if p in modules]


def _split_and_checkpoint(model: nn.Module, plan: Plan, unit: Unit, members: list[str], decision: UnitPlan,
                          mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy) -> list[nn.Module]:
    """Split the unit's Linears and checkpoint its modules (the unit's, or its group's: ``members``, in the model's
    order) as ``decision`` says; those modules."""
    modules = dict(model.named_modules())
    if decision.split > 1:  # never in a group
        apply_split(modules[unit.path], decision.split, mesh, exclude=_kept_whole(modules, unit, plan), root=model,
                    mp_policy=mp_policy)
    group = [model.get_submodule(p) for p in members]
    if decision.checkpoint_policy != "none":
        for module in group:
            checkpoint_unit(module, decision.checkpoint_policy)
    return group


def _own_modules(unit: nn.Module, nested: set[nn.Module]) -> list[nn.Module]:
    """The modules of ``unit`` that are not inside a unit nested in it."""
    own, stack = [], [unit]
    while stack:
        module = stack.pop()
        own.append(module)
        stack.extend(c for c in module.children() if c not in nested)
    return own


def reducer_storages(model: nn.Module) -> list[torch.UntypedStorage]:
    """Storages the DDP reducer of a wrapped model's replicated units owns (its gradient buckets)."""
    replicated = _reducer_of(model)
    return [] if replicated is None else replicated.bucket_storages()


register_gradient_storages(reducer_storages)  # osdp.machine.memory counts the reducer's buckets


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Whether the next backward reduces gradients (False: accumulate them locally), for every unit.

    The same as ``model.set_requires_gradient_sync(...)``, which a wrapped model has as every
    ``fully_shard``-ed one does (``fsdp_ext.module_api``).
    """
    plan_of(model)  # raises unless wrapped
    model.set_requires_gradient_sync(requires_gradient_sync)


def _resharded_when_evaluating(model: nn.Module, groups: dict[str, list[str]]) -> None:
    """``fsdp_ext.evaluation`` on the model, and ``_pre_backward_through_views`` on every FSDP2 unit."""
    not_last = {model.get_submodule(p) for members in groups.values() for p in members[:-1]}
    reshard_after_evaluating(model, not_last, _reducer_of)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.register_forward_hook(_pre_backward_through_views)


def _reducer_of(model: nn.Module) -> ReplicaReducer | None:
    return getattr(model, _REPLICATED_ATTR, None)


# FSDP2 warns of what _pre_backward_through_views handles, at every forward of such a unit
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")


def _pre_backward_through_views(module: FSDPModule, args, output):
    # FSDP2 hooks its pre-backward (gather the unit's parameters) on the unit's output tensors. A unit returning
    # a view (``y.view(b, t, h)``, MultiheadAttention's ``transpose``) whose caller writes to it in place
    # (``h += x``) rebases the view's autograd history and drops that hook: backward then runs on the sharded
    # parameters and fails. The view's base is written too, and its history keeps a hook registered now.
    if torch.is_grad_enabled():
        for t in iter_tensors(output):
            if t.requires_grad and t._base is not None and t._base.requires_grad:
                t._base.register_hook(fsdp_pre_backward(module))
    return output


def plan_of(model: nn.Module) -> Plan:
    plan = getattr(model, PLAN_ATTR, None)
    if plan is None:
        raise ValueError("this model has not been wrapped by osdp.wrap")
    return plan
