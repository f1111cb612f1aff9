"""The reduce-scatter every gradient reduction of osdp uses: the process group's own, or a pairwise exchange.

A reduce-scatter on NCCL (a ring) sends and receives (N-1)/N of the message per
rank, as an all-gather does. Gloo's reduce-scatter costs about an all-reduce
(its fitted per-byte cost is 1.5-1.9x the all-gather's on a shaped link, 2-3x
on loopback: experiments/results/collectives.md), which makes sharding look
dearer on CPU ranks than it is on GPUs, and CPU training slower than it needs
to be. With the ``pairwise`` implementation every rank sends chunk j of its
input to rank j and sums the N-1 chunks it receives with its own: (N-1)/N of
the message out and in per rank, NCCL's traffic, on any backend with
point-to-point ops.

The setting (``OSDP_REDUCE_SCATTER`` = ``native`` (default) or ``pairwise``, or
:func:`set_reduce_scatter`) is read where a reduction is made, and applies to
all of them alike:

- FSDP2 units: :func:`install` puts :class:`FSDPReduceScatter` on every
  ``fully_shard``-ed module of a model (``FSDPModule.set_custom_reduce_scatter``);
  ``osdp.wrap`` calls it, so do the experiments' baselines;
- split Linears' slice gradients (``osdp/split``, both the PyTorch loop and the
  C++ op);
- ``osdp.device.measure_collectives``, so that the cost model prices the
  reduce-scatter that runs.

It is meant for gloo: NCCL's own reduce-scatter already moves (N-1)/N, and
the split op's C++ path takes the pairwise one on CPU tensors only.

Set it the same way on every rank, before ``osdp.wrap``. The pairwise exchange
keeps at most (N-2)/N of the message in extra buffers (none on 2 ranks: the
peer's chunk is received straight into the output), fewer than gloo's own,
which copies the whole input. Sums run in a fixed order on every rank, so the
result is the same on all of them; it may differ from the native
reduce-scatter's in the last bits, as any two reduction orders do.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from osdp._torch_private import FSDPReduceScatterBase

IMPLEMENTATIONS = ("native", "pairwise")
ENV = "OSDP_REDUCE_SCATTER"

# reduce_scatter_single replaces reduce_scatter_tensor in recent torch.
native_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Point-to-point tags of pairwise reduce-scatters: one per call and group, the same on every rank
# because every rank makes the same calls in the same order. The C++ op (csrc/split_linear.cpp)
# counts its own from 1 << 25, so the two never meet; gloo tags must fit in 31 bits.
_TAG_BASE, _TAG_SPAN = 1 << 24, 1 << 20
_tags: dict[str, int] = {}
_setting: str | None = None  # None: from the environment


def _check(name: str, where: str) -> str:
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"{where}={name!r}: use one of {', '.join(IMPLEMENTATIONS)}")
    return name


def set_reduce_scatter(name: str | None) -> None:
    """``native``, ``pairwise``, or None to follow ``OSDP_REDUCE_SCATTER`` again (this process only)."""
    global _setting
    _setting = None if name is None else _check(name, "set_reduce_scatter")


def reduce_scatter_impl() -> str:
    """The implementation in use: ``native`` or ``pairwise``."""
    if _setting is not None:
        return _setting
    return _check(os.environ.get(ENV, "native"), ENV)


def _next_tag(group: dist.ProcessGroup) -> int:
    key = group.group_name
    count = _tags.get(key, 0)
    _tags[key] = count + 1
    return _TAG_BASE + count % _TAG_SPAN


def _is_average(op: Any) -> bool:
    if op == dist.ReduceOp.AVG:
        return True
    if op == dist.ReduceOp.SUM:
        return False
    raise ValueError(f"the pairwise reduce-scatter sums or averages; got reduce op {op!r} (use SUM or AVG)")


class _Pending:
    """A pairwise reduce-scatter in flight: ``wait()`` waits for its transfers and sums (once)."""

    def __init__(self, works: list, output: torch.Tensor, own: torch.Tensor, received: list[torch.Tensor],
                 divide_by: int | None):
        self._works, self._output, self._own, self._received = works, output, own, received
        self._divide_by = divide_by
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        if self._done:
            return True
        for work in self._works:
            work.wait()
        out = self._output.view(-1)
        out.add_(self._own)
        for chunk in self._received:
            out.add_(chunk)
        if self._divide_by:
            out.div_(self._divide_by)
        self._done = True
        self._works, self._own, self._received = [], None, []
        return True

    def is_completed(self) -> bool:
        return self._done


def pairwise_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                            group: dist.ProcessGroup | None = None, async_op: bool = False) -> _Pending | None:
    """``reduce_scatter_tensor(output, input, op, group)`` as N-1 point-to-point exchanges per rank.

    Rank r sends chunk j of ``input`` to rank j and receives chunk r of every
    peer's input, then sums them with its own chunk (in output, then the
    peers in order of distance) and divides for AVG. ``async_op``: returns an
    object whose ``wait()`` finishes it (the sums run there).
    """
    group = group or dist.group.WORLD
    n, rank = group.size(), group.rank()
    if not input.is_contiguous() or not output.is_contiguous():
        raise ValueError("the pairwise reduce-scatter needs contiguous input and output tensors")
    if input.numel() != n * output.numel() or input.dtype != output.dtype:
        raise ValueError(
            f"reduce-scatter of {input.numel()} {input.dtype} elements over {n} ranks into {output.numel()} "
            f"{output.dtype} elements: the input must hold world size x the output's elements, of the same dtype"
        )
    if output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr():
        raise ValueError("the pairwise reduce-scatter needs an output that does not share memory with its input")
    average = _is_average(op)
    chunks = input.view(n, -1)
    out = output.view(-1)
    works, received = [], []
    if n > 1:
        tag = _next_tag(group)
        for step in range(1, n):
            to, frm = (rank + step) % n, (rank - step) % n
            buffer = out if step == 1 else torch.empty_like(out)
            works.append(dist.irecv(buffer, group=group, group_src=frm, tag=tag))
            works.append(dist.isend(chunks[to], group=group, group_dst=to, tag=tag))
            if step > 1:
                received.append(buffer)
    else:
        out.zero_()
    pending = _Pending(works, output, chunks[rank], received, n if average and n > 1 else None)
    if async_op:
        return pending
    pending.wait()
    return None


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                   group: dist.ProcessGroup | None = None, async_op: bool = False):
    """The reduce-scatter of the current setting (see the module docstring); arguments as
    ``torch.distributed.reduce_scatter_tensor``."""
    if reduce_scatter_impl() == "pairwise":
        return pairwise_reduce_scatter(output, input, op=op, group=group, async_op=async_op)
    return native_reduce_scatter(output, input, op=op, group=group, async_op=async_op)


class FSDPReduceScatter(FSDPReduceScatterBase):
    """FSDP2's reduce-scatter as :func:`pairwise_reduce_scatter` (``FSDPModule.set_custom_reduce_scatter``)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False):
        return pairwise_reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def install(model: nn.Module) -> int:
    """Give every ``fully_shard``-ed module of ``model`` the reduce-scatter of the current setting; returns how
    many got the pairwise one (0 with ``native``: FSDP2's own stays). Call it after the last ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    if reduce_scatter_impl() != "pairwise":
        return 0
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.set_custom_reduce_scatter(FSDPReduceScatter())
    return len(modules)


def uses_pairwise(model: nn.Module) -> bool:
    """Whether any ``fully_shard``-ed module of ``model`` reduces with :class:`FSDPReduceScatter`."""
    from osdp._torch_private import fsdp_reduce_scatter_comm

    return any(isinstance(fsdp_reduce_scatter_comm(m), FSDPReduceScatter) for m in model.modules())
