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
* ``set_gradient_divide_factor`` / ``set_force_sum_reduction_for_comms``: the
  replicated parameters' average is divided by the same factor;
* ``unshard`` / ``reshard`` / ``set_reshard_after_backward`` and the rest:
  replicated parameters are always whole and split weights are gathered a
  slice at a time, so FSDP2's own method is all there is to do.

``recurse=True`` (FSDP2's default) reaches the units nested in the module,
``recurse=False`` the module's own parameters only, as FSDP2 does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from osdp.fsdp_ext.replicate import ReplicaReducer, Slot


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

    def set_gradient_divide_factor(self, factor: float) -> None:
        super().set_gradient_divide_factor(factor)
        for reducer, params in _replicated(self, recurse=False).items():
            reducer.set_gradient_divide_factor(params, factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        super().set_force_sum_reduction_for_comms(enable)
        for reducer, params in _replicated(self, recurse=False).items():
            reducer.set_gradient_divide_factor(params, 1.0 if enable else None)


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
        _CLASSES[cls] = type(cls.__name__, (UnitModule, cls), {"_orig_cls_mro_index": cls._orig_cls_mro_index + 2})
    module.__class__ = _CLASSES[cls]
