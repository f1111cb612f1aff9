"""Parameters a forward's caller put back in their place: registered again as the backward begins.

``torch.func.functional_call(model, dict(model.named_parameters()), args)`` (code written for ``torch.func``, meta
learning) swaps the parameters it is given into the model for the forward and puts back what it replaced when
the forward returns: the DTensors the model shows between steps, where the plan computes with other tensors
(a replicated unit's plain parameters, a zero2 unit's gathered ones, kept gathered for backward). A checkpointed
region's recompute in backward reads the module's attributes again; computing with the DTensors, it sent DTensor
gradients into plain ones and failed (a bare AssertionError under plans checkpointing the root or a replicated
unit). As a backward through the model begins, every unit's computing parameters are registered again: the
reducer's (``ReplicatedView.register_plain_again``, from its own backward hook) and FSDP2's gathered ones here.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook

from osdp._torch_private import fsdp_modules, fsdp_register_gathered_again, output_tensors


def register_gathered_again_as_backward_begins(model: nn.Module) -> None:
    """Make a backward through ``model``'s output (a wrapped model) register the gathered parameters of every
    unit FSDP2 holds gathered again, before any unit's backward runs."""
    units = fsdp_modules(model)

    def register_again(*_) -> None:
        for unit in units:
            fsdp_register_gathered_again(unit)

    @torch._dynamo.disable
    def hook(_module, _args, output):
        if torch.is_grad_enabled():
            outputs = [t for t in output_tensors(output) if t.requires_grad]
            if outputs:
                register_multi_grad_hook(outputs, register_again, mode="any")
        return output

    model.register_forward_hook(hook)
