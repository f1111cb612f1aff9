"""Units: the modules a plan makes decisions for.

A unit is a module whose parameters are gathered, sharded and reduced together
(one FSDP2 parameter group). The default discovery works on any ``nn.Module``:

* a module whose children are all leaves (``attn`` holding q/k/v/proj
  Linears, ``mlp`` holding its Linears) is a unit: the granularity of a
  transformer sub-block; at ``granularity="block"`` a module holding two or
  more such sub-blocks (the transformer block) is the unit instead;
* a parameter-owning leaf whose parent is not such a module (an embedding, a
  head) is a unit; at ``granularity="block"`` only if it is at least as large
  as the smallest block: a small one (a position embedding) stays with the
  root, where a per-block ``fully_shard`` leaves it, rather than paying two
  all-gathers and a reduce-scatter of its own;
* at ``granularity="nested"`` the units are those of ``"block"``, and inside
  each block its sub-blocks too: the block keeps what they do not hold (its
  norms; a block with nothing of its own is no unit here). The planner
  prices each block both ways, from this description and the ``"block"``
  one, and chooses per block (``osdp.describe.granularity``);
* norm-like modules, whose parameters are all one-dimensional, are never units
  of their own: their few bytes stay with the enclosing unit (usually the root)
  rather than paying a collective each;
* a parameter shared by several modules (tied embeddings, a module registered
  twice) belongs to one unit at the lowest common ancestor of its owners, and
  a module that runs more than once per forward is moved up the same way, as
  is one whose forward writes to its inputs in place (FSDP2 hands a unit its
  inputs through a custom autograd Function, whose outputs cannot be written);
* units follow the calls, not only the module tree: a container that cannot be
  called (``ModuleDict``, ``ModuleList``, ``ParameterDict``: no ``forward``)
  is never a unit, the module that calls its children is (FSDP2 gathers a
  unit in its forward hooks, which a container never runs); and given a
  traced forward (:func:`trace_calls`), a parameter used while its unit's
  forward is not running (a weight read by the parent's functional code, a
  module whose children are called through a lambda) moves that unit up to a
  module whose forward encloses every use;
* the root is always a unit and takes every parameter not in another unit.

Units with the same structure (class, parameter names, shapes and dtypes) get
the same ``signature``, so repeated transformer blocks are measured once.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch
import torch.nn as nn
from torch.nn.utils import parametrize
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from osdp._torch_private import TorchDispatchMode
from osdp.machine.memory import iter_tensors, written_tensors
from osdp.schema.plan import ROOT, display_path

# Unit sizes the planner chooses between: a transformer's attention and MLP apart, or whole blocks; and
# whole blocks with their sub-blocks nested in them, what the planner prices a block taken apart with when it
# chooses per block.
GRANULARITIES = ("sub-block", "block", "nested")


@dataclass(frozen=True)
class Unit:
    path: str  # module path ("" for the root)
    module_type: str
    numel: int  # parameters this unit owns (not those of nested units)
    param_bytes: int
    signature: str  # equal for structurally identical units
    nested: tuple[str, ...] = ()  # units directly inside this one

    @property
    def name(self) -> str:
        return display_path(self.path)


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ROOT


def _is_within(path: str, ancestor: str) -> bool:
    return ancestor == ROOT or path == ancestor or path.startswith(ancestor + ".")


def _common_ancestor(paths: Iterable[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _module_paths(model: nn.Module) -> dict[int, list[str]]:
    """Every path at which each module object is registered (a shared module has several)."""
    paths: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(path)
    return paths


def _param_owners(model: nn.Module) -> dict[int, list[str]]:
    """For each parameter, every module path that registers it directly."""
    owners: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(path)
    return owners


def _has_matrix_param(module: nn.Module) -> bool:
    return any(p.dim() >= 2 for p in module.parameters())


def is_callable(module: nn.Module) -> bool:
    """Whether ``module`` has a forward of its own (containers such as ``ModuleDict`` do not: FSDP2 refuses
    them, and their hooks would never run). Read without calling the class's descriptors: a TorchScript
    module's ``forward`` raises when read from its class."""
    return inspect.getattr_static(type(module), "forward") is not nn.Module.forward


def _called_ancestor(path: str, modules: Mapping[str, nn.Module]) -> str:
    """``path`` itself if its module can be called, else its nearest ancestor that can; a module inside a
    parametrization (``weight_norm``'s ``conv.parametrizations.weight``, which computes the weight whenever the
    module's forward reads it) is the parametrized module's."""
    while path != ROOT and (not is_callable(modules[path]) or _in_parametrization(path, modules)):
        path = _parent(path)
    return path


def _own_children(module: nn.Module) -> list[nn.Module]:
    """The module's children but its parametrizations (a parametrized Linear is a leaf)."""
    skip = module.parametrizations if parametrize.is_parametrized(module) else None
    return [c for c in module.children() if c is not skip]


def _own_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The module's own parameters, those its parametrizations hold included (a ``weight_norm``'d Linear's
    ``weight`` is computed from ``parametrizations.weight.original0`` and ``original1``)."""
    own = list(module.parameters(recurse=False))
    if parametrize.is_parametrized(module):
        own += list(module.parametrizations.parameters())
    return own


def _in_parametrization(path: str, modules: Mapping[str, nn.Module]) -> bool:
    parts = path.split(".")
    return any(part == "parametrizations" and parametrize.is_parametrized(modules[".".join(parts[:i])])
               for i, part in enumerate(parts))


@dataclass
class CallTrace:
    """What one forward did: how often each module ran, and, per parameter (by id), the modules running
    (outermost first) wherever an operation used it."""

    counts: dict[str, int] = field(default_factory=dict)
    uses: dict[int, set[tuple[str, ...]]] = field(default_factory=dict)
    # modules that wrote in place to one of their floating-point inputs while their forward ran
    writes_inputs: set[str] = field(default_factory=set)
    # per module, the shape of its first tensor input at its first call
    first_input: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # modules the ranks' examples called different numbers of times (``uneven_calls``), found before the trace
    uneven: tuple[str, ...] = ()
    # whether ``counts`` holds every module the forward called (a traced forward), so one it lacks never ran
    complete: bool = False


class _ParameterUses(TorchFunctionMode):
    """Notes the running modules at every operation that takes a parameter (reading an attribute such as
    ``.shape`` is no use). A tensor sharing a parameter's storage (``p.data``, ``p.detach()``, a view) is a
    use of it too: a momentum encoder written as ``t.data.mul_(m).add_(o.data)`` uses ``o`` where it runs."""

    def __init__(self, params: Mapping[int, nn.Parameter], running: list[str], uses: dict):
        super().__init__()
        self.params, self.running, self.uses = params, running, uses
        self.by_storage: dict[int, list[int]] = {}
        for key, p in params.items():
            if (storage := _storage_of(p)) is not None:
                self.by_storage.setdefault(storage, []).append(key)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") != "__get__":
            for t in tree_leaves((args, kwargs)):
                if not isinstance(t, torch.Tensor):
                    continue
                if isinstance(t, nn.Parameter) and id(t) in self.params:
                    used = (id(t),)
                else:
                    storage = _storage_of(t)
                    used = self.by_storage.get(storage, ()) if storage is not None else ()
                for key in used:
                    self.uses.setdefault(key, set()).add(tuple(self.running))
        return func(*args, **kwargs)


def _storage_of(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):  # a subclass without one storage (a DTensor)
        return None


class _InputWrites(TorchDispatchMode):
    """Notes the running modules whose floating-point inputs an op writes to in place (``nn.ReLU(inplace=True)``
    first in a module's forward)."""

    def __init__(self, running: list[str], inputs: list[set[int]], writers: set[str]):
        super().__init__()
        self.running, self.inputs, self.writers = running, inputs, writers

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in written_tensors(func, args, kwargs or {}):
            key = t.untyped_storage()._cdata
            self.writers.update(path for path, keys in zip(self.running, self.inputs) if key in keys)
        return func(*args, **(kwargs or {}))


def trace_calls(model: nn.Module, run) -> CallTrace:
    """Run ``run()`` (a forward of ``model``) and note what it called, where it used each parameter, and
    which modules wrote to their inputs."""
    trace = CallTrace(complete=True)
    running: list[str] = [ROOT]
    inputs: list[set[int]] = [set()]  # per running module, the storages of its floating-point inputs
    handles = []
    for path, module in model.named_modules():
        def enter(_m, args, kwargs, path=path):
            trace.counts[path] = trace.counts.get(path, 0) + 1
            first = next(iter_tensors((args, kwargs)), None)
            if first is not None:
                trace.first_input.setdefault(path, tuple(first.shape))
            running.append(path)
            inputs.append({t.untyped_storage()._cdata for t in iter_tensors((args, kwargs))
                           if t.is_floating_point() and t.layout == torch.strided})

        def leave(_m, _args, _out):
            running.pop()
            inputs.pop()

        handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(module.register_forward_hook(leave, always_call=True))
    params = {id(p): p for p in model.parameters()}
    try:
        with _ParameterUses(params, running, trace.uses), _InputWrites(running, inputs, trace.writes_inputs):
            run()
    finally:
        for h in handles:
            h.remove()
    return trace


def count_calls(model: nn.Module, run) -> dict[str, int]:
    """Run ``run()`` (a forward of ``model``) and count how often each module is called."""
    return trace_calls(model, run).counts


def uneven_calls(model: nn.Module, counts_by_rank: Sequence[Mapping[str, int]]) -> tuple[str, ...]:
    """The outermost modules owning parameters that the ranks' forwards (``counts_by_rank``: ``count_calls`` of
    each rank's example) called different numbers of times: a branch on the data (``if mask.any():
    self.refine(x[mask])``) that some ranks' batches take. Such a module is no unit of its own, as a routed
    container's members are not."""
    owning = {path for path, m in model.named_modules() if next(m.parameters(), None) is not None}
    differ = sorted(path for path in owning - {ROOT}
                    if len({counts.get(path, 0) for counts in counts_by_rank}) > 1)
    return tuple(p for p in differ if not any(q != p and _is_within(p, q) for q in differ))


def _candidates(model: nn.Module, granularity: str = "sub-block") -> list[str]:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    modules = dict(model.named_modules())
    # a parametrization's modules (weight_norm's) are part of the module it parametrizes, never a sub-block
    outside_parametrizations = {path: m for path, m in modules.items() if not _in_parametrization(path, modules)}
    # a container of sub-block shape (the Linears of an MLP kept in a ModuleDict) is the module that calls them
    sub_block = {
        _called_ancestor(path, modules)
        for path, m in outside_parametrizations.items()
        if path != ROOT
        and _own_children(m)
        and all(not _own_children(c) for c in _own_children(m))
        and _has_matrix_param(m)
    } - {ROOT}
    leaves = {
        _called_ancestor(path, modules)
        for path, m in outside_parametrizations.items()
        if path != ROOT
        and not _own_children(m)
        and not any(_is_within(path, b) for b in sub_block)
        and any(p.dim() >= 2 for p in _own_parameters(m))
    } - {ROOT}
    if granularity == "block":  # a module holding two or more sub-blocks (attention and MLP) replaces them
        parents: dict[str, list[str]] = {}
        for path in sub_block:
            parents.setdefault(_parent(path), []).append(path)
        for parent, children in parents.items():
            # a ModuleList's children are blocks already: it holds layers (it runs none of them)
            if parent != ROOT and len(children) > 1 and not isinstance(modules[parent], nn.ModuleList):
                sub_block = (sub_block - set(children)) | {parent}
    return sorted(sub_block | leaves)


def fully_shardable(model: nn.Module, units: Iterable[str]) -> set[str]:
    """The modules a user could have ``fully_shard``-ed where ``units`` are the plan's: every module some plan
    could make a unit (a sub-block, a block, a leaf with a matrix parameter) and every callable module holding
    one of ``units``."""
    modules = dict(model.named_modules())
    holding = set()
    for path in units:
        while path != ROOT:
            path = _parent(path)
            if is_callable(modules[path]):
                holding.add(path)
    return (set(_candidates(model, "sub-block")) | set(_candidates(model, "block")) | holding) - {ROOT}


def alike_members(model: nn.Module, container: nn.Module, path: str) -> list[list[str]]:
    """The paths of ``container``'s (at ``path`` in ``model``) members that own parameters, grouped by structure:
    the groups of two or more. A member registered first elsewhere (one Linear in an encoder's list and a
    decoder's) is that container's: hooks and call counts know a module by its first path."""
    first_path = {id(m): p for p, m in model.named_modules()}
    alike: dict[str, list[str]] = {}
    for name, member in container.named_children():
        member_path = f"{path}.{name}" if path else name
        if next(member.parameters(), None) is not None and first_path.get(id(member)) == member_path:
            alike.setdefault(_signature(member), []).append(member_path)
    return [members for members in alike.values() if len(members) > 1]


def routed_containers(model: nn.Module, calls: CallTrace) -> list[str]:
    """The containers (``ModuleList``, ``ModuleDict``) whose members the forward calls depending on the data, as
    a mixture of experts calls the experts it routed rows to: among members of the same structure that own
    parameters, some ran and some did not, or they ran on inputs differing only in their first dimension.

    Such a member is no unit of its own: FSDP2 gathers a unit when its forward runs, and a rank whose batch
    skipped it would wait for the others at another gather. Its gradients exist on the ranks that called it
    only: ``osdp.fsdp_ext.unused`` reduces them in the unit holding the container."""
    routed = []
    for path, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
            continue
        for members in alike_members(model, container, path):
            ran = [m for m in members if calls.counts.get(m, 0)]
            shapes = {calls.first_input[m] for m in ran if m in calls.first_input}
            rows_differ = len(shapes) > 1 and len({s[1:] for s in shapes}) == 1
            if (ran and len(ran) < len(members)) or rows_differ:
                routed.append(path)
                break
    return routed


def enclosing(path: str, routed: Iterable[str]) -> str | None:
    """The first of ``routed`` (containers, and modules called unevenly) that ``path`` is or is inside, if any."""
    return next((c for c in routed if c != ROOT and _is_within(path, c)), None)


def _resolve_sharing(model: nn.Module, candidates: Iterable[str], calls: CallTrace | None) -> set[str]:
    """Move candidates that share parameters, run twice or never, whose parameters are used outside their forward
    or that are called depending on the data (``routed_containers``, ``CallTrace.uneven``) up to a common
    ancestor that can be called."""
    modules = dict(model.named_modules())
    module_paths = _module_paths(model)
    owners = _param_owners(model)
    routed = [*routed_containers(model, calls), *calls.uneven] if calls is not None else []
    resolved: set[str] = set()
    for path in candidates:
        while path != ROOT:
            container = enclosing(path, routed)
            if container is not None:
                path = _called_ancestor(_parent(container), modules)
                continue
            module = modules[path]
            outside = [
                owner
                for p in module.parameters()
                for owner in owners[id(p)]
                if not _is_within(owner, path)
            ]
            outside += [q for q in module_paths[id(module)] if q != path]
            if calls is not None:  # used where this unit's forward is not running: not gathered there; the
                # innermost forward running around the use outside this unit (a module inside it may be running,
                # called through a method of this one: a VAE's ``encode``)
                outside += [next(r for r in reversed(running) if not _is_within(r, path))
                            for p in module.parameters() for running in calls.uses.get(id(p), ())
                            if path not in running]
            if outside:
                path = _called_ancestor(_common_ancestor([path, *outside]), modules)
                continue
            if calls is not None and calls.complete and not calls.counts.get(path):
                # the example never called it (an auxiliary head, a feature left off): no forward of its own costs
                # anything, and a group FSDP2 never gathers is one PyTorch's FSDPMemTracker fails on in backward
                path = _called_ancestor(_parent(path), modules)
                continue
            if calls is not None and (calls.counts.get(path, 0) > 1 or path in calls.writes_inputs):
                # FSDP2 would gather it at each call; or hand it its inputs as views of a custom Function (its
                # post-backward hook), which autograd does not let a forward write to
                path = _called_ancestor(_parent(path), modules)
                continue
            break
        if path != ROOT:
            resolved.add(path)
    return resolved


def _signature(module: nn.Module) -> str:
    parts = [type(module).__qualname__]
    for name, sub in module.named_modules():
        parts.append(f"{name}:{type(sub).__qualname__}")
    for name, p in module.named_parameters():
        parts.append(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}")
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]


def unit_parameters(model: nn.Module, paths: Iterable[str]) -> dict[str, list[nn.Parameter]]:
    """The parameters each unit owns (``param_homes``; the root is always a unit), in ``model.parameters()`` order."""
    homes = param_homes(model, paths)
    owned: dict[str, list[nn.Parameter]] = {p: [] for p in set(paths) | {ROOT}}
    for param in model.parameters():
        owned[homes[id(param)]].append(param)
    return owned


def build_units(model: nn.Module, paths: Iterable[str]) -> list[Unit]:
    """Describe the given unit paths (the root is always added), bottom-up: children before parents."""
    modules = dict(model.named_modules())
    paths = set(paths) | {ROOT}
    missing = sorted(p for p in paths if p not in modules)
    if missing:
        raise KeyError(missing[0])
    owned = unit_parameters(model, paths)
    numel = {p: sum(t.numel() for t in owned[p]) for p in paths}
    nbytes = {p: sum(t.numel() * t.element_size() for t in owned[p]) for p in paths}
    nested = nesting(paths)
    ordered = sorted(paths, key=lambda p: (-(p.count(".") + 1) if p else 1, p))
    return [
        Unit(
            path=p,
            module_type=type(modules[p]).__name__,
            numel=numel[p],
            param_bytes=nbytes[p],
            signature=_signature(modules[p]) if p != ROOT else "root",
            nested=nested[p],
        )
        for p in ordered
    ]


def nesting(paths: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """For each unit path (the root among them), the units nested in it with no other unit between."""
    paths = set(paths) | {ROOT}
    return {p: tuple(sorted(q for q in paths if q != p and _is_within(q, p) and _nearest_unit(q, paths) == p))
            for p in paths}


def param_homes(model: nn.Module, paths: Iterable[str]) -> dict[int, str]:
    """id(parameter) -> the unit (of ``paths``, the root among them) that owns it: the deepest unit
    containing the common ancestor of every module that registers it (a tied weight: their ancestor)."""
    units = set(paths) | {ROOT}
    return {pid: _innermost(_common_ancestor(owners), units) for pid, owners in _param_owners(model).items()}


def holding_unit(path: str, units: Iterable[str]) -> str:
    """The innermost of ``units`` (module paths; the root is always one) that ``path`` is in."""
    return _innermost(path, set(units) | {ROOT})


def _innermost(path: str, units: set[str]) -> str:
    """``path`` if it is one of ``units`` (the root among them), else the closest unit above it: a walk up its
    ancestors, not a scan of every unit (a model of hundreds of units has thousands of parameters)."""
    return path if path in units else _nearest_unit(path, units)


def _nearest_unit(path: str, units: set[str]) -> str:
    """The closest unit strictly above ``path``."""
    while path != ROOT:
        path = _parent(path)
        if path in units:
            return path
    return ROOT


def discover_units(
    model: nn.Module, calls: CallTrace | Mapping[str, int] | None = None, granularity: str = "sub-block"
) -> list[Unit]:
    """The default units of ``model``, bottom-up, root last.

    ``calls`` (a forward traced by :func:`trace_calls`, or only its call counts)
    moves modules that run more than once up to their parent, and units whose
    parameters are used outside their forward up to where they are used.
    ``granularity="block"`` takes each module holding two or more sub-blocks
    (a transformer block: attention and MLP) as one unit instead of its
    sub-blocks: fewer, larger units pay FSDP2's per-unit costs fewer times,
    smaller ones need less memory gathered at a time. The planner searches both, and
    each block whole or apart with ``granularity="nested"`` (whole blocks, their
    sub-blocks inside them).
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if calls is not None and not isinstance(calls, CallTrace):
        calls = CallTrace(counts=dict(calls))
    if granularity == "nested":
        coarse = [u.path for u in discover_units(model, calls, "block")]
        fine = _resolve_sharing(model, _candidates(model, "sub-block"), calls)
        blocks = set(coarse) - {ROOT}
        units = build_units(model, coarse + [p for p in fine if p not in blocks and _parent(p) in blocks])
        empty = {u.path for u in units if u.numel == 0 and u.path != ROOT}  # a block its sub-blocks fill
        return build_units(model, [u.path for u in units if u.path not in empty]) if empty else units
    units = build_units(model, _resolve_sharing(model, _candidates(model, granularity), calls))
    if granularity == "block":
        small = _small_leaves(model, units)
        if small:
            units = build_units(model, [u.path for u in units if u.path not in small])
    return units


def _small_leaves(model: nn.Module, units: list[Unit]) -> set[str]:
    """Leaf-module units smaller than the smallest unit with children (none if there is no such unit)."""
    modules = dict(model.named_modules())
    leaves = {u.path for u in units if u.path != ROOT and not _own_children(modules[u.path])}
    blocks = [u.numel for u in units if u.path != ROOT and u.path not in leaves]
    if not blocks:
        return set()
    return {u.path for u in units if u.path in leaves and u.numel < min(blocks)}


def structure_signature(model: nn.Module) -> str:
    """A hash of the model's structure: plans made for one model are refused by another."""
    return _signature(model)


def checkpointable(units: Sequence[Unit]) -> list[Unit]:
    """The units a plan may checkpoint: not the root, none enclosing other units."""
    return [u for u in units if u.path != ROOT and not u.nested]


def sparse_gradients_message(names: str) -> str:
    """Why parameters with sparse gradients (``nn.Embedding(sparse=True)``, ``F.embedding(..., sparse=True)``)
    cannot be trained under a plan, and what works."""
    return (f"{names}: sparse gradients (an embedding looked up with sparse=True), which FSDP2 cannot "
            "reduce-scatter and osdp does not all-reduce; look it up with sparse=False (dense gradients), or "
            "freeze it")
