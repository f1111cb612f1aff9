"""Gradients that exist on some ranks only: units holding modules the model calls depending on the data.

A mixture of experts calls the experts its router chose, so expert 3 may have
gradients on one rank and none on another (``Plan.routed`` names such
containers; ``osdp.describe.units.routed_containers`` finds them). FSDP2
reduces the gradients a unit's parameters have, so its ranks would reduce
different lists of tensors. Before such a unit reduces, its ranks agree (one
all-reduce of a flag per parameter) on the parameters some rank has a gradient
for; a rank without one reduces zeros for it. A parameter no rank has a gradient
for keeps none, as on one process (an optimizer skips it).

Replicated units' gradients are the reducer's (``fsdp_ext.replicate``), which
flags them per bucket itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from osdp._torch_private import FSDPGradient, fsdp_before_reduce, fsdp_device


def reduce_where_any_rank_has_gradients(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Make the ``fully_shard``-ed ``module`` reduce every gradient some rank of ``group`` has, zeros where this
    rank has none."""
    device = fsdp_device(module)

    def before_reduce(gradients: list[FSDPGradient]) -> None:
        if not gradients:
            return
        present = [g.present for g in gradients]
        anywhere = torch.tensor(present, dtype=torch.int32, device=device)
        dist.all_reduce(anywhere, group=group)
        for gradient, here, some_rank in zip(gradients, present, anywhere.tolist()):
            if some_rank and not here:
                gradient.fill_zeros()

    fsdp_before_reduce(module, before_reduce)
