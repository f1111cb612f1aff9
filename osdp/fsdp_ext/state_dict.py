"""A wrapped model's state dict, in the same form under every plan, and loaded from any.

``model.state_dict()`` answers as a ``fully_shard``-ed model's does: every parameter's value is a DTensor, so
that code written for FSDP2 (``value.full_tensor()``, ``distribute_tensor(full, value.device_mesh,
value.placements)``: FSDP2's tutorial saves and loads so) works whatever the plan. The replicated units'
parameters are plain tensors in the model (the reducer's, ``fsdp_ext.replicate``); their values are shown as
DTensors replicated on the world mesh, views of the same memory (``show_replicated_as_dtensors``).

``model.load_state_dict`` of a state dict saved under any plan, or by the unwrapped model: every module
owning parameters brings each value to its parameter's layout before it loads
(``osdp.distributed.layouts.to_parameter_layout``).

Optimizer state follows its plan too: ``osdp.runtime.dcp`` saves and loads both
under any plan and on any number of ranks, and each rank's own ``optimizer.state_dict()``
loads under another plan on as many ranks (``fsdp_ext.optimizer_state``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from osdp.distributed.layouts import to_parameter_layout
from osdp.split import SplitLinear


def load_under_any_plan(model: nn.Module) -> None:
    """Let every module of ``model`` owning parameters load them from any plan's layout."""
    for module in model.modules():
        # a SplitLinear registers the hook itself: it loads so without a plan too
        if next(module.parameters(recurse=False), None) is not None and not isinstance(module, SplitLinear):
            module.register_load_state_dict_pre_hook(to_parameter_layout)


def show_replicated_as_dtensors(model: nn.Module, slots, mesh: DeviceMesh) -> None:
    """State-dict hooks showing the reducer's parameters (at ``slots``: ``fsdp_ext.replicate.Slot``) as
    DTensors replicated on ``mesh``; ``state_dict(keep_vars=True)`` still gives the parameters themselves."""
    names: dict[nn.Module, set[str]] = {}
    for slot in slots:
        names.setdefault(slot.module, set()).add(slot.name)
    for module, own in names.items():
        module.register_state_dict_post_hook(_as_replicated(own, mesh))


def _as_replicated(names: set[str], mesh: DeviceMesh):
    def hook(module: nn.Module, state_dict, prefix: str, _local_metadata) -> None:
        for name in names:
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and not isinstance(value, (DTensor, nn.Parameter)):
                state_dict[prefix + name] = DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return hook
