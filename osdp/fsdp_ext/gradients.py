"""Gradient clipping over a wrapped model, whose gradients live in different forms per unit.

A plan leaves replicated units' gradients as plain tensors (DDP's reducer has made them equal on every
rank), sharded and split units' as DTensor shards, possibly on different meshes. ``torch.nn.utils.
clip_grad_norm_`` cannot take such a mix in one call (its foreach kernels refuse plain tensors beside
DTensors), so the norm is assembled here: each kind's local sum of |g|^p, summed over the mesh
dimensions its gradient is sharded on (one all-reduce per mesh and placement, not per tensor), plus the
replicated part, which every rank already holds whole.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(
    parameters: nn.Module | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model wrapped by ``osdp.wrap`` (or its parameters).

    Collective: call it on every rank. Returns the total norm of all gradients,
    the same on every rank and equal to what one process training the whole
    batch computes; scales the gradients in place by ``max_norm / (norm + 1e-6)``
    where that is below 1, as torch does.
    """
    params = parameters.parameters() if isinstance(parameters, nn.Module) else parameters
    grads = [p.grad for p in params if p.grad is not None]
    p = float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    sharded: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    replicated: list[torch.Tensor] = []
    for g in grads:
        if isinstance(g, DTensor):
            sharded[(g.device_mesh, tuple(g.placements))].append(g.to_local())
        else:
            replicated.append(g)
    device = grads[0].device
    parts = [_local_power(replicated, p, device)] if replicated else []
    for (mesh, placements), locals_ in sharded.items():
        part = _local_power(locals_, p, device)
        for dim, placement in enumerate(placements):
            if placement.is_partial():
                raise ValueError(f"a gradient with a Partial placement on {mesh} is not reduced yet; clip after "
                                 f"the backward that synchronises gradients")
            if placement.is_shard():  # each element lives on one rank of this dimension: combine them
                dist.all_reduce(part, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM,
                                group=mesh.get_group(dim))
        parts.append(part)
    stacked = torch.stack(parts)
    total = stacked.max() if math.isinf(p) else stacked.sum() ** (1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {p} of the gradients is non-finite, so it cannot be clipped")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(coef.to(local.device, local.dtype))
    return total


def _local_power(tensors: list[torch.Tensor], p: float, device: torch.device) -> torch.Tensor:
    """sum |x|^p over the elements of ``tensors`` (max |x| for p = inf), in fp32."""
    norms = [torch.linalg.vector_norm(t, p, dtype=torch.float32) for t in tensors if t.numel()]
    if not norms:
        return torch.zeros((), device=device)
    norms = torch.stack([n.to(device) for n in norms])
    return norms.max() if math.isinf(p) else (norms**p).sum()
