"""A state dict's value brought to the layout of the parameter it loads into.

A wrapped model holds each parameter as its plan keeps it: a replicated unit's
as a plain tensor, a sharded unit's as a DTensor on the unit's mesh, a split
weight as a Shard(0) DTensor. PyTorch copies a value into its parameter as it
is, so a state dict saved under one layout would not load under another; yet
the plan is chosen by a budget the user may change between runs, and a split
Linear loads the plain weight of the ``nn.Linear`` it replaced.
``to_parameter_layout`` is the load pre-hook that mends this: a DTensor laid out
otherwise becomes its full tensor (a collective, as loading a sharded state
dict is: every rank loads), a full tensor this rank's part of it (no
communication). ``in_layout_of`` does it for one value (optimizer state too,
``osdp.fsdp_ext.optimizer_state``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor


def to_parameter_layout(module: nn.Module, state_dict, prefix: str, *_) -> None:
    """Load pre-hook (``register_load_state_dict_pre_hook``): each of ``module``'s own parameters' values in
    ``state_dict`` in that parameter's layout."""
    for name, param in module.named_parameters(recurse=False):
        key = prefix + name
        value = state_dict.get(key)
        if isinstance(value, torch.Tensor) and value.shape == param.shape:  # else load_state_dict reports it
            state_dict[key] = in_layout_of(param, value)


def in_layout_of(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (of ``param``'s global shape) laid out as ``param`` is: itself where it is already; a DTensor laid
    out otherwise gathered first (a collective: every rank brings the same values), a full tensor cut to this
    rank's part."""
    if isinstance(value, DTensor):
        if isinstance(param, DTensor) and (value.device_mesh, value.placements) == (param.device_mesh,
                                                                                    param.placements):
            return value
        value = value.full_tensor()
    if isinstance(param, DTensor):
        local = value.detach().to(param.device)
        return distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)
    return value
