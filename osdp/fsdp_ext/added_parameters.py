"""Parameters a model makes in its own forward, after ``osdp.wrap`` (a head sized from the first batch).

No unit holds them: their gradients would not be reduced, and each rank would train its own copy on its own
data, silently apart from one process (plain FSDP2 and DDP do the same). The first forwards after wrapping
check for them and raise on every rank (every rank runs the same forward, so all of them find the same).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from osdp.report import first_few

CHECKED_FORWARDS = 3  # a model building at its first forward, or at its first training one after an evaluation


def refuse_parameters_made_in_forward(model: nn.Module) -> None:
    """Raise at the end of each of the model's first forwards if it holds a trainable parameter under a name it did
    not have when wrapped (one frozen then and trained now is no new one)."""
    known = {name for name, _ in nn.Module.named_parameters(model, remove_duplicate=False)}
    checks_left = CHECKED_FORWARDS

    @torch._dynamo.disable  # under model.compile(), as FSDP2's own hooks
    def check(module: nn.Module, args, output):
        nonlocal checks_left
        checks_left -= 1
        if checks_left == 0:
            handle.remove()
        made = [name for name, _ in _named_trainable(module) if name not in known]
        if made:
            raise RuntimeError(
                f"osdp: the model made parameter(s) {first_few(made)} in its forward, after osdp.wrap: no unit "
                "holds them, so their gradients would not be reduced and every rank would train its own copy. "
                "Make them before wrapping: call the model once on an example batch first (or give osdp.wrap "
                "example_input=, whose forward makes them)"
            )
        return output

    handle = model.register_forward_hook(check)


def _named_trainable(model: nn.Module):
    # nn.Module's own walk: a unit's named_parameters() would put a root kept after evaluation at rest
    return [(n, p) for n, p in nn.Module.named_parameters(model, remove_duplicate=False) if p.requires_grad]
