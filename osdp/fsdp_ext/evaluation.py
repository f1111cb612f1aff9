"""What a forward without gradients (evaluation) leaves gathered, and until when.

A forward under ``no_grad``, or of a model frozen whole, has no backward to reshard what FSDP2 keeps gathered after
forward. Units inside the root are resharded at once (their memory is inference's). The root's parameters stay as
the forward used them, as FSDP2 keeps its root's: plain tensors, which evaluation loops combine with the forward's
outputs (CLIP's ``model.logit_scale.exp() * image @ text.T``). That must hold under every plan, so those of the
root's parameters the reducer replicates stay plain too (``fsdp_ext.replicated_view``); every other unit's are
DTensors then, whether the plan shards or replicates them.

They are put back at rest (sharded; the replicated ones shown as DTensors again) before anything that must see
the parameters training steps: an optimizer step (``fsdp_ext.earlier_optimizers``, which also puts the shards in
place of gathered parameters an optimizer was built from meanwhile), ``parameters()``, ``named_parameters()`` and
``state_dict()`` of any unit (``fsdp_ext.module_api``), ``reshard()``; and as the next forward begins, which
gathers them again. Those calls may come on one rank alone (rank 0 saving ``model.state_dict()``, logging
parameter norms), so the next forward must not take them as they are where they are still gathered: its rank
would skip the gather the others wait in.
Plain FSDP2 leaves them gathered there: an optimizer built after evaluation then steps the gathered copies,
which the next gather overwrites (up to 0.25 off one process).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from osdp._torch_private import output_tensors
from osdp.fsdp_ext.earlier_optimizers import settle_before_each_step, step_in_its_place
from osdp.fsdp_ext.replicate import ReplicaReducer

# the roots kept as a forward without gradients left them, each with where its reducer is found
_kept: "weakref.WeakKeyDictionary[nn.Module, Callable[[nn.Module], ReplicaReducer | None]]" = (
    weakref.WeakKeyDictionary())


def reshard_after_evaluating(model: nn.Module, not_last_of_group: set[nn.Module],
                             reducer_of: Callable[[nn.Module], ReplicaReducer | None]) -> None:
    """Reshard every FSDP2 unit inside ``model`` after a forward without gradients (a group's after its last
    module: none of ``not_last_of_group``); keep the root's parameters and its reducer's (``reducer_of(model)``,
    which must not hold the model) as the forward left them until something needs them at rest (see the module
    docstring)."""
    for module in model.modules():
        if isinstance(module, FSDPModule) and module is not model and module not in not_last_of_group:
            module.register_forward_hook(_reshard_after_forward_without_grad)

    @torch._dynamo.disable  # under model.compile(), as FSDP2's own hooks: bookkeeping, nothing to trace
    def keep_if_evaluating(root: nn.Module, args, output):
        if no_backward_follows(output):
            _kept[root] = reducer_of
            _step_at_rest_in_place_of_kept(root, reducer_of(root))
        return output

    model.register_forward_pre_hook(_used_again, prepend=True)
    model.register_forward_hook(keep_if_evaluating)
    settle_before_each_step(put_at_rest)


def put_at_rest() -> None:
    """Put every root kept as an evaluating forward left it at rest (before a step, or handing parameters out)."""
    while _kept:
        _put_root_at_rest(*_kept.popitem())


def _put_root_at_rest(root: nn.Module, reducer_of: Callable[[nn.Module], ReplicaReducer | None]) -> None:
    if isinstance(root, FSDPModule):
        FSDPModule.reshard(root)
    if (reducer := reducer_of(root)) is not None:
        reducer.rest()


@torch._dynamo.disable
def _reshard_after_forward_without_grad(module: FSDPModule, args, output):
    if no_backward_follows(output):
        FSDPModule.reshard(module)  # this unit's alone: a root kept meanwhile stays so
    return output


def no_backward_follows(output) -> bool:
    """Whether no backward can reach the module through ``output``: a forward without gradients, or one of a
    module frozen whole (a GAN's discriminator while its generator steps, a distillation's teacher) with
    gradients on. Left gathered, a zero2 unit would go on registering the gathered parameters, on which a
    ``requires_grad`` set on the parameters an optimizer holds (Lightning's ``toggle_optimizer``) never lands."""
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in output_tensors(output))


@torch._dynamo.disable
def _used_again(root: nn.Module, *_) -> None:
    # every rank gathers the root again, whether or not something put it at rest on this rank meanwhile
    if (reducer_of := _kept.pop(root, None)) is not None:
        _put_root_at_rest(root, reducer_of)


def _step_at_rest_in_place_of_kept(root: nn.Module, reducer: ReplicaReducer | None) -> None:
    # An optimizer built from kept parameters steps what is registered in their place at the step: the shards,
    # the replicated views (stepped on the plain parameters again: fsdp_ext.replicated_view). FSDP2 registers
    # one gathered parameter object per parameter for as long as the unit lives.
    state = root._get_fsdp_state() if isinstance(root, FSDPModule) else None
    for group in state._fsdp_param_groups if state is not None else ():
        for fsdp_param in group.fsdp_params:
            gathered = getattr(fsdp_param, "_unsharded_param", None)
            if gathered is not None:
                info = fsdp_param._module_info
                step_in_its_place(gathered, info.module, info.param_name, fsdp_param._param_fqn)
    for slot in reducer.root_slots if reducer is not None else ():
        step_in_its_place(slot.param, slot.module, slot.name, slot.path)
