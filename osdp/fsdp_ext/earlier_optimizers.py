"""Optimizers built before ``osdp.wrap``: they step the parameters the plan put in their place.

FSDP2 replaces a unit's parameters with new ones (sharded DTensors); a parameter the plan replicates stays the
object it was. So an optimizer built from ``model.parameters()`` before wrapping would train the replicated
units and leave the sharded ones as they were, silently: what the user's code sees would depend on the plan.
Each wrap remembers where each replaced parameter lived (weakly: the model's parameters themselves carry no
weak reference, which ``torch.utils.swap_tensors`` in ``model.to()`` refuses, and nothing is kept alive), and a
global optimizer step pre-hook puts the new parameters into the param groups before a step, once per optimizer
and per change of its groups. An optimizer stepped before wrapping has state for the old
parameters: each rank keeps its own part of each tensor shaped like its parameter, laid out as the parameter
now is (its own values, no communication: the same on every rank where every rank stepped alike, as under a
replicating plan); state of another shape cannot be laid out so, and that step raises, saying what to do.

The same look-up serves gathered parameters an optimizer was built from after evaluation
(``fsdp_ext.evaluation``, ``step_in_its_place``), and what must be settled before any step (a root kept
gathered) runs first (``settle_before_each_step``).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

# id of an old parameter -> (a weak reference to it, one to the module it was registered on, its attribute name
# there, its name in the model); by id, as tensors compare by value (a WeakKeyDictionary would compare them),
# and forgotten when the old one is freed
_replaced: dict[int, tuple[weakref.ref, weakref.ref, str, str]] = {}
# optimizer -> what it was when last looked at: the wraps done by then and the shape of its param groups (a wrap
# since, or a group added, and it is looked at again)
_looked_at: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple]" = weakref.WeakKeyDictionary()
_changes = 0  # wraps and gathered parameters noted so far
_hook = None
_settle: list[Callable[[], None]] = []  # run before every step, before the look-up


def named_parameter_objects(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every parameter by each name it has (a tied one under each)."""
    return dict(model.named_parameters(remove_duplicate=False))


def remember_replaced(before: dict[str, nn.Parameter], model: nn.Module, kept: set[nn.Parameter]) -> None:
    """Note each parameter of ``before`` (``named_parameter_objects`` before the plan was applied) that the
    plan replaced, and make sure optimizers built earlier step the replacements. ``kept``: the parameters the
    reducer trains as they are (a module shows them as DTensor views of the same memory; stepping them is
    stepping those)."""
    global _changes
    _changes += 1
    after = named_parameter_objects(model)
    for name, old in before.items():
        new = after.get(name)
        if new is not None and new is not old and old not in kept:
            owner, _, attribute = name.rpartition(".")
            _note(old, model.get_submodule(owner), attribute, name)
    if _replaced:
        _ensure_hook()


def step_in_its_place(param: nn.Parameter, owner: nn.Module, attribute: str, name: str) -> None:
    """Make an optimizer holding ``param`` step what ``owner`` registers as ``attribute`` at the step instead."""
    global _changes
    entry = _replaced.get(id(param))
    if entry is None or entry[0]() is not param:
        _note(param, owner, attribute, name)
        _changes += 1
        _ensure_hook()


def settle_before_each_step(settle: Callable[[], None]) -> None:
    """Call ``settle()`` before every optimizer step, before the look-up (once however often asked)."""
    if settle not in _settle:
        _settle.append(settle)
    _ensure_hook()


def _note(old: nn.Parameter, owner: nn.Module, attribute: str, name: str) -> None:
    key = id(old)
    _replaced[key] = (weakref.ref(old, lambda _, key=key: _replaced.pop(key, None)), weakref.ref(owner), attribute,
                      name)


def _ensure_hook() -> None:
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_step_replacements)


def _as_looked_at(optimizer: torch.optim.Optimizer) -> tuple:
    return _changes, tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)


def _step_replacements(optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
    for settle in _settle:
        settle()
    if not _replaced:
        return
    if _looked_at.get(optimizer) == _as_looked_at(optimizer):
        return  # the common case: looked at already, nothing wrapped or added since
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            entry = _replaced.get(id(p))
            if entry is None or entry[0]() is not p or (owner := entry[1]()) is None:
                continue
            new = owner._parameters.get(entry[2])
            if new is None:
                continue
            if p in optimizer.state:
                optimizer.state[new] = _laid_out_as(new, optimizer.state.pop(p), optimizer, entry[3])
            params[i] = new
    _looked_at[optimizer] = _as_looked_at(optimizer)


def _laid_out_as(new: nn.Parameter, state: dict, optimizer: torch.optim.Optimizer, name: str) -> dict:
    """An old parameter's optimizer state, each tensor shaped like it laid out as ``new`` is."""
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.shape == new.shape and value.dim() > 0:
            if isinstance(new, DTensor):  # this rank's own values: no collective inside a step
                value = distribute_tensor(value.to(new.device), new.device_mesh, new.placements, src_data_rank=None)
            out[key] = value
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            raise RuntimeError(
                f"osdp: this {type(optimizer).__name__} was stepped before osdp.wrap, and its state {key!r} of the "
                f"parameter {name!r} (shape {tuple(value.shape)}, the parameter's {tuple(new.shape)}) cannot be "
                "laid out as the plan lays the parameter out. Build the optimizer after osdp.wrap, or load its "
                "state after wrapping (torch.distributed.checkpoint.state_dict.set_optimizer_state_dict)")
        else:
            out[key] = value  # a step count
    return out
