"""``osdp.check_replicas``: the ranks still train one model.

Whatever a plan replicates (a replicated unit's plain parameters on every rank;
the replicated mesh dimension of a node-scoped or bf16-replicated unit's
DTensors) must hold bitwise the same values on every rank that holds a copy.
A reducer that misses a gradient, or user code that changes one rank's
parameters, breaks that without an error: training goes on and the ranks
drift apart. This check compares a checksum of every such tensor over the
ranks that should agree (one all-gather per process group), so it is cheap
enough to call every few steps.
"""

from __future__ import annotations

from itertools import chain

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from osdp.distributed import all_gather_objects
from osdp.report import first_few

# words per step of the checksum: its temporaries (about 128 KiB on CPU, 6 MiB where each step is a kernel launch)
# stay small beside a step's peak
_CPU_CHUNK = 1 << 12
_DEVICE_CHUNK = 1 << 18


class ReplicaDivergence(RuntimeError):
    """Ranks that should hold the same values of a replicated tensor hold different ones."""


def checksum(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums over ``t``'s bytes in its logical order (plain and position-weighted): any changed bit
    changes them. Read a few rows at a time, so a tensor laid out otherwise (channels_last) is never copied
    whole: the checks run inside steps, whose peak the budget bounds."""
    t = t.detach().reshape(1) if t.dim() == 0 else t.detach()
    total = torch.zeros(2, dtype=torch.int64, device=t.device)
    if t.numel() == 0:
        return total
    words_per_step = _CPU_CHUNK if t.device.type == "cpu" else _DEVICE_CHUNK
    rows = max(1, words_per_step * 4 // (t[0].numel() * t.element_size()))
    position = 0
    for first in range(0, t.shape[0], rows):
        raw = t[first:first + rows].contiguous().view(-1).view(torch.uint8)
        words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
        for start in range(0, words.numel(), words_per_step):
            chunk = words[start:start + words_per_step].to(torch.int64)
            weight = torch.arange(position, position + chunk.numel(), dtype=torch.int64, device=t.device) % 65521 + 1
            total += torch.stack([chunk.sum(), (chunk * weight).sum()])
            position += chunk.numel()
    return total


def _replicated_copies(model: nn.Module, buffers: bool) -> dict[object, list[tuple[str, torch.Tensor]]]:
    """Per process group (None: every rank) whose ranks hold a copy each, the tensors that must agree."""
    by_group: dict[object, list[tuple[str, torch.Tensor]]] = {}
    tensors = chain(model.named_parameters(), model.named_buffers() if buffers else ())
    for name, t in tensors:
        if isinstance(t, DTensor):
            for dim, placement in enumerate(t.placements):
                if placement.is_replicate():
                    by_group.setdefault((t.device_mesh, dim), []).append((name, t.to_local()))
        else:
            by_group.setdefault(None, []).append((name, t))
    return by_group


@torch.no_grad()
def check_replicas(model: nn.Module, *, buffers: bool = False) -> None:
    """Raise ``ReplicaDivergence`` on every rank if any replicated parameter differs between the ranks holding
    it (with ``buffers``, buffers too: FSDP2 does not synchronise them, so BatchNorm statistics differ by
    design). Collective: call it on every rank, between steps."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    reports = all_gather_objects(differing_replicas(model, buffers))  # every rank raises the same error
    names = sorted({n for report in reports for n in report})
    if names:
        raise ReplicaDivergence(
            f"{len(names)} replicated tensors differ between the ranks that should hold them equal "
            f"({first_few(names, 6)}): the ranks no longer train the same model. Something changed one rank's values "
            "(code that runs on some ranks only, or a gradient that was not reduced)"
        )


@torch.no_grad()
def differing_replicas(model: nn.Module, buffers: bool = False) -> list[str]:
    """The replicated tensors whose copies differ over the ranks of a group this rank is in (collective: one
    all-gather of checksums per group; each rank sees its own groups' differences)."""
    differing: list[str] = []
    copies = _replicated_copies(model, buffers)
    for key in sorted(copies, key=lambda k: (k is not None, str(k))):  # the same order on every rank
        entries = copies[key]
        group = None if key is None else key[0].get_group(key[1])
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        local = torch.stack([checksum(t) for _, t in entries]).to(device)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        for i, (name, _) in enumerate(entries):
            if any(not torch.equal(g[i], gathered[0][i]) for g in gathered[1:]):
                differing.append(name)
    return differing

