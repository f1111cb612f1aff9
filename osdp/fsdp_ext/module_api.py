"""Every unit answers as a ``fully_shard``-ed module does, whatever the plan made of it.

A plan leaves some parameters outside FSDP2: replicated units' (``fsdp_ext.
replicate``'s reducer) and split Linears' weights (``osdp.split``). Every unit
is still ``fully_shard``-ed (a replicated unit with all its parameters ignored:
an FSDP2 state with no parameter group), so ``isinstance(unit, FSDPModule)``
holds and FSDP2's methods are there; its class is then swapped for a subclass
(as ``fully_shard`` swaps in ``FSDP<cls>``) whose methods also reach those
parameters, so user code written for FSDP2 (gradient accumulation with
``set_requires_gradient_sync``, a divide factor, ``unshard``) means the same
under any plan:

* ``set_requires_gradient_sync`` / ``set_requires_all_reduce``: replicated
  parameters accumulate locally until set back (as FSDP2's HSDP, where the
  all-reduce is the only reduction a replicated parameter has); split weights
  keep their unsharded gradient (``SplitLinear.requires_gradient_sync``);
* ``set_gradient_divide_factor``: the replicated parameters' and split weights'
  sums are divided by the same factor (``set_force_sum_reduction_for_comms``
  changes how FSDP2 reduces, not what: the reducer sums already);
* ``set_reshard_after_forward``: units FSDP2's ``replicate`` holds (bf16
  plans) keep their parameters whole, as they must;
* ``unshard`` / ``reshard`` / ``set_reshard_after_backward`` and the rest:
  replicated parameters are always whole and split weights are gathered a
  slice at a time, so FSDP2's own method is all there is to do.

``recurse=True`` (FSDP2's default) reaches the units nested in the module,
``recurse=False`` the module's own parameters only, as FSDP2 does.

A module the plan did not make a unit answers too, where a user could have
``fully_shard``-ed it: a module the plan takes apart (a transformer block whose
attention and MLP are units) stands for the units inside it, a module inside a
unit (an embedding the root holds) for that unit (``StandIn``). So code written
for one wrapping, torchtitan's ``block.set_modules_to_forward_prefetch([next_block])``
or ``embedding.set_requires_gradient_sync(False)``, runs under every plan, and
prefetch lists may name any module of the model: prefetching a block the plan
took apart gathers its first unit early, as the plan's own prefetching does,
so memory stays as the plan priced it. Only the gradient divide
factor can mean something else there: it is a unit's, so a block's norms that
its enclosing unit holds follow that unit's factor (``divide_factors`` warns at
the next forward); set it on every module (as FSDP2 users do) and every plan
divides alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, UnshardHandle

from osdp._torch_private import fsdp_drop_gathered_gradients, fsdp_modules, replicated_by_fsdp2
from osdp.fsdp_ext.divide_factors import divide_factors_of
from osdp.fsdp_ext.evaluation import put_at_rest
from osdp.fsdp_ext.forward_errors import explaining, users_class_name
from osdp.fsdp_ext.forward_methods import registered_by_fsdp2, with_osdp_hooks
from osdp.fsdp_ext.replicate import ReplicaReducer, Slot
from osdp.machine.memory import iter_tensors


@dataclass
class UnitExtras:
    """What a unit holds outside FSDP2."""

    reducer: ReplicaReducer | None = None
    replicated: list[Slot] = field(default_factory=list)  # where its own parameters in the reducer are
    split_linears: list[nn.Module] = field(default_factory=list)  # its own SplitLinears


# Kept on the module itself, as FSDP2 keeps its state: a unit's extras reach the unit (its SplitLinears'
# parameter group holds it), so in a weak-keyed table outside the module they would keep it alive for ever.
_EXTRAS_ATTR = "_osdp_unit_extras"


def extras_of(module: nn.Module) -> UnitExtras | None:
    return module.__dict__.get(_EXTRAS_ATTR)


def _reached(module: nn.Module, recurse: bool) -> list[UnitExtras]:
    modules = module.modules() if recurse else [module]
    return [e for m in modules if (e := extras_of(m)) is not None]


def _replicated(module: nn.Module, recurse: bool) -> dict[ReplicaReducer, list[nn.Parameter]]:
    by_reducer: dict[ReplicaReducer, list[nn.Parameter]] = {}
    for e in _reached(module, recurse):
        if e.reducer is not None and e.replicated:
            by_reducer.setdefault(e.reducer, []).extend(slot.param for slot in e.replicated)
    return by_reducer


class WrappedTwiceError(RuntimeError):
    """A model osdp.wrap made data parallel, handed to ``DistributedDataParallel`` as well."""


class UnitModule:
    """Mixed in before ``FSDP<cls>``: FSDP2's methods, extended to what the plan left outside FSDP2."""

    def __setattr__(self, name: str, value: Any) -> None:
        if registered_by_fsdp2(value):  # register_fsdp_forward_method(unit, name): osdp's hooks run around it too
            value = with_osdp_hooks(value)
        super().__setattr__(name, value)

    @property
    def _ddp_params_and_buffers_to_ignore(self):
        # DistributedDataParallel reads this first thing, on every rank, before any collective: a second data
        # parallel wrapper would reduce every gradient twice (and cannot broadcast sharded units' DTensors)
        raise WrappedTwiceError(
            "this model is data parallel already (osdp.wrap): DistributedDataParallel around it would reduce every "
            "gradient a second time. Train it as it is; with the Hugging Face Trainer use "
            "osdp.integrations.hf.Trainer (same arguments), in an accelerate loop "
            "osdp.integrations.hf.prepare(accelerator, model, optimizer, dataloader)"
        )

    # parameters handed out are the ones training steps, never those an evaluating forward left gathered
    # (fsdp_ext.evaluation); parameters() goes through named_parameters()
    def named_parameters(self, *args, **kwargs):
        put_at_rest()
        return super().named_parameters(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        put_at_rest()
        return super().state_dict(*args, **kwargs)

    def reshard(self) -> None:
        put_at_rest()
        super().reshard()

    def reset_iter_state(self) -> None:
        """FSDP2's (on the root only), and the gradients a backward that raised left where the optimizer does
        not see them let go: a gathered parameter's, and a replicated one's its view does not show (the user's
        ``zero_grad`` cleared the view); see ``fsdp_ext.interrupted``."""
        super().reset_iter_state()
        for module in fsdp_modules(self):
            fsdp_drop_gathered_gradients(module)
        for reducer in {e.reducer for e in _reached(self, recurse=True) if e.reducer is not None}:
            reducer.reset_iter_state()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        super().set_requires_gradient_sync(requires_gradient_sync, recurse=recurse)
        for reducer, params in _replicated(self, recurse).items():
            reducer.set_requires_gradient_sync(params, requires_gradient_sync)
        for e in _reached(self, recurse):
            for linear in e.split_linears:
                linear.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        super().set_requires_all_reduce(requires_all_reduce, recurse=recurse)
        for reducer, params in _replicated(self, recurse).items():
            reducer.set_requires_all_reduce(params, requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        # a unit FSDP2's replicate holds (replicated in a bf16 plan) keeps its parameters whole: nothing to reshard
        for module in self.modules() if recurse else [self]:
            if isinstance(module, FSDPModule) and not replicated_by_fsdp2(module):
                FSDPModule.set_reshard_after_forward(module, reshard_after_forward, recurse=False)

    def set_gradient_divide_factor(self, factor: float) -> None:
        self._divide_gradients_by(factor)
        if (tracked := divide_factors_of(self)) is not None:
            factors, path = tracked
            factors.ask(factors.names_held_by(path), factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:  # FSDP2's earlier name
        self.set_gradient_divide_factor(factor)

    def _divide_gradients_by(self, factor: float) -> None:
        super().set_gradient_divide_factor(factor)
        for reducer, params in _replicated(self, recurse=False).items():
            reducer.set_gradient_divide_factor(params, factor)
        for e in _reached(self, recurse=False):
            for linear in e.split_linears:
                linear.gradient_divide_factor = factor
        if (tracked := divide_factors_of(self)) is not None:
            factors, path = tracked
            factors.apply(path, factor)

    # any module of the model may be named: a block the plan took apart stands for the units inside it
    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        super().set_modules_to_forward_prefetch(first_units(modules))

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        super().set_modules_to_backward_prefetch(first_units(modules, backward=True))


_CLASSES: dict[type, type] = {}


def extend_unit(module: nn.Module, extras: UnitExtras) -> None:
    """Make the ``fully_shard``-ed ``module`` answer for what ``extras`` holds (see the module docstring)."""
    if not isinstance(module, FSDPModule):
        raise TypeError(f"{type(module).__name__} is not fully_shard-ed")
    module.__dict__[_EXTRAS_ATTR] = extras
    cls = type(module)
    if issubclass(cls, UnitModule):
        return
    if cls not in _CLASSES:
        # FSDPModule.__new__ (indexing into a container) builds the class found this far down the MRO
        # and its forward says in the plan's terms what FSDP2 cannot carry across the unit's boundary; named as
        # the user's class (not FSDP2's FSDP<name>), as a module the plan did not make a unit is
        name = users_class_name(cls)
        _CLASSES[cls] = type(name, (UnitModule, cls), {"_orig_cls_mro_index": cls._orig_cls_mro_index + 2,
                                                       "forward": explaining(cls), "__qualname__": name})
    module.__class__ = _CLASSES[cls]


# -- modules the plan did not make units ------------------------------------------------------------------------

_STANDS_FOR_ATTR = "_osdp_stands_for"
_PREFETCH_ATTR = "_osdp_prefetch"


def units_of(module: nn.Module) -> list[FSDPModule]:
    """The units ``module`` of a wrapped model stands for, in forward (registration) order: itself if it is one,
    else the units inside it, else the unit holding it."""
    if isinstance(module, FSDPModule):
        return [module]
    units = module.__dict__.get(_STANDS_FOR_ATTR)
    if units is None:
        raise ValueError(f"{type(module).__name__} is not a module of a model osdp.wrap wrapped: FSDP2's prefetch "
                         "lists take modules of the wrapped model")
    return units


def first_units(modules: Iterable[nn.Module], backward: bool = False) -> list[FSDPModule]:
    """What prefetching ``modules`` gathers: each one's first unit to run (in backward where ``backward``), each
    unit once. A block the plan took apart is prefetched as the plan's own prefetching prefetches a unit (the
    next one, gathered early); its other units follow as it brings them, so the memory stays as the plan
    priced it."""
    units: list[FSDPModule] = []
    for module in modules:
        unit = units_of(module)[-1 if backward else 0]
        if unit not in units:
            units.append(unit)
    return units


class _Handles(UnshardHandle):
    def __init__(self, handles: list[UnshardHandle | None]):
        self.handles = [h for h in handles if h is not None]

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()
        self.handles = []


@dataclass
class _Prefetch:
    forward: list[FSDPModule] = field(default_factory=list)
    backward: list[FSDPModule] = field(default_factory=list)


class StandIn:
    """Mixed into a module the plan did not make a unit: FSDP2's methods, applied to the units it stands for
    (``units_of``). ``recurse`` is taken for what it means to a ``fully_shard``-ed module without units inside:
    all of the module's parameters."""

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        handle = _Handles([unit.unshard(async_op=True) for unit in units_of(self)])
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        for unit in units_of(self):
            unit.reshard()

    def set_gradient_divide_factor(self, factor: float) -> None:
        # the units standing behind this module divide all they hold: divide_factors warns where that is more
        for unit in units_of(self):
            unit._divide_gradients_by(factor)
        if (tracked := divide_factors_of(self)) is not None:
            factors, path = tracked
            factors.ask(factors.names_under(path), factor)

    set_reduce_scatter_divide_factor = set_gradient_divide_factor  # FSDP2's earlier name

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        # FSDP2 issues a unit's prefetches after its own all-gather: first the first unit this module stands for
        # (a no-op where it is the unit holding this module, gathered already), then the modules named
        _prefetch_of(self).forward = first_units([self, *modules])

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        _prefetch_of(self).backward = first_units([self, *modules], backward=True)


def _prefetch_of(module: nn.Module) -> _Prefetch:
    prefetch = module.__dict__.get(_PREFETCH_ATTR)
    if prefetch is None:  # hooks as FSDP2's own: in the module's pre-forward and at its outputs' first gradient
        prefetch = module.__dict__[_PREFETCH_ATTR] = _Prefetch()
        module.register_forward_pre_hook(_prefetch_in_forward)
        module.register_forward_hook(_prefetch_in_backward)
    return prefetch


@torch._dynamo.disable
def _prefetch_in_forward(module: nn.Module, args) -> None:
    for unit in _prefetch_of(module).forward:
        unit.unshard(async_op=True)  # FSDP2 waits for it in the unit's pre-forward


@torch._dynamo.disable
def _prefetch_in_backward(module: nn.Module, args, output) -> None:
    units = _prefetch_of(module).backward
    outputs = [t for t in iter_tensors(output) if t.requires_grad]
    if not (units and outputs and torch.is_grad_enabled()):
        return

    def prefetch(grad) -> None:  # once per backward, at the first of the outputs' gradients
        for unit in units:
            unit.unshard(async_op=True)  # FSDP2 waits for it in the unit's pre-backward

    torch.autograd.graph.register_multi_grad_hook(outputs, prefetch, mode="any")


def _to_units(name: str, recursive: bool):
    """A StandIn method calling FSDP2's ``name`` on each unit the module stands for (``recurse=False``, as those
    units together hold its parameters)."""

    def method(self, *args, **kwargs):
        if recursive:  # (value, recurse): the value only, recurse=False
            args, kwargs = args[:1], {**kwargs, "recurse": False}
        for unit in units_of(self):
            getattr(unit, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"FSDP2's ``{name}`` on every unit this module stands for."
    return method


# FSDP2's methods (those this torch has) that set something on a unit; the first with ``recurse``
_RECURSIVE = ("set_requires_gradient_sync", "set_requires_all_reduce", "set_reshard_after_forward",
              "set_reshard_after_backward", "set_reduce_scatter_unused_params", "set_reduce_scatter_max_input_buffers",
              "set_separate_reduce_scatter_group")
_PER_UNIT = ("reset_iter_state", "set_is_last_backward", "set_custom_all_gather", "set_custom_reduce_scatter",
             "set_all_reduce_hook", "set_post_optim_event", "set_force_sum_reduction_for_comms",
             "set_unshard_in_backward", "set_allocate_memory_from_process_group_for_comm", "set_symm_mem_for_comm",
             "_set_unshard_async_op")
for _name in (*_RECURSIVE, *_PER_UNIT):
    if hasattr(FSDPModule, _name):
        setattr(StandIn, _name, _to_units(_name, _name in _RECURSIVE))

_STAND_IN_CLASSES: dict[type, type] = {}


def stand_in_for_units(model: nn.Module, callers: Iterable[str]) -> None:
    """Record what every module of the wrapped ``model`` that is no unit stands for (``units_of``), and give
    those at ``callers`` (modules a user could have ``fully_shard``-ed) FSDP2's methods (``StandIn``)."""
    modules = dict(model.named_modules())

    def visit(module: nn.Module, holder: FSDPModule) -> None:
        for child in module.children():
            if isinstance(child, FSDPModule):
                visit(child, child)
                continue
            inside = [m for m in child.modules() if isinstance(m, FSDPModule)]
            child.__dict__[_STANDS_FOR_ATTR] = inside or [holder]
            visit(child, holder)

    visit(model, model)
    for path in callers:
        module = modules.get(path)
        if module is None or isinstance(module, (FSDPModule, StandIn)) or next(module.parameters(), None) is None:
            continue
        cls = type(module)
        if cls not in _STAND_IN_CLASSES:
            # named and placed as the class it extends, as FX and the user's repr know it
            _STAND_IN_CLASSES[cls] = type(cls.__name__, (StandIn, cls), {"__module__": cls.__module__})
        module.__class__ = _STAND_IN_CLASSES[cls]
