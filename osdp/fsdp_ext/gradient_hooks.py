"""Gradient hooks on the parameters FSDP2 computes with: the user's, carried from the parameters they were
registered on, and osdp's refusal of ``torch.autograd.grad`` with respect to them (``fsdp_ext.forward_errors``).

FSDP2 computes with gathered parameters it makes at a unit's first gather; hooks registered on the parameters
before wrapping (``p.register_hook(fn)`` in a model's ``__init__``) would never run. DDP runs them on each rank's
gradient before its reduction, and so do these. Replicated parameters stay the objects they were, with their
hooks; the reducer registers the refusal on them (``fsdp_ext.replicate``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from osdp._torch_private import fsdp_hook_gathered_gradients, fsdp_modules
from osdp.fsdp_ext.forward_errors import refuse_returned_gradients


def hook_gathered_gradients(model: nn.Module, before: dict[str, nn.Parameter]) -> None:
    """The gradient hooks the model's parameters had (``before``: by name, before the plan was applied) on the
    parameters FSDP2 computes with (a replicated parameter stays the object it was, with its hooks), and the
    refusal of ``torch.autograd.grad`` with respect to them."""
    hooks = {}
    for name, p in before.items():
        if p._backward_hooks:
            owner, _, attribute = name.rpartition(".")
            hooks[(id(model.get_submodule(owner)), attribute)] = list(p._backward_hooks.values())
    paths = {id(module): path for path, module in model.named_modules()}

    def hooks_of(owner: nn.Module, attribute: str, gathered: torch.Tensor) -> list:
        name = f"{paths[id(owner)]}.{attribute}" if paths.get(id(owner)) else attribute
        return hooks.get((id(owner), attribute), []) + [refuse_returned_gradients(gathered, name)]

    for module in fsdp_modules(model):
        fsdp_hook_gathered_gradients(module, hooks_of)
