"""``model.load_state_dict`` of a state dict saved under any plan, or by the unwrapped model.

``model.state_dict()`` holds each parameter as its plan keeps it: a replicated
unit's as a plain tensor, a sharded unit's as a DTensor on the unit's mesh, a
split weight as a Shard(0) DTensor. PyTorch copies a value into its parameter as
it is, so a state dict would load only under a plan that keeps every parameter
alike, and a plain full state dict (the unwrapped model's) into replicated units
only; yet the plan is chosen by a budget the user may change between runs.
Before a module loads, each of its parameters' values is brought to the
parameter's layout: a DTensor laid out otherwise to its full tensor (a
collective, as loading a sharded state dict is: every rank loads), a full tensor
to this rank's part of it (no communication).

Optimizer state follows its plan too: ``osdp.runtime.dcp`` saves and loads both
under any plan and on any number of ranks.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor


def load_under_any_plan(model: nn.Module) -> None:
    """Let every module of ``model`` owning parameters load them from any plan's layout."""
    for module in model.modules():
        if next(module.parameters(recurse=False), None) is not None:
            module.register_load_state_dict_pre_hook(_to_parameter_layout)


def _to_parameter_layout(module: nn.Module, state_dict, prefix: str, *_) -> None:
    for name, param in module.named_parameters(recurse=False):
        key = prefix + name
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor) or value.shape != param.shape:
            continue  # missing or of another shape: load_state_dict reports it
        if isinstance(value, DTensor):
            if isinstance(param, DTensor) and (value.device_mesh, value.placements) == (param.device_mesh,
                                                                                        param.placements):
                continue
            value = value.full_tensor()
        if isinstance(param, DTensor):
            local = value.detach().to(param.device)
            value = distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)
        state_dict[key] = value
