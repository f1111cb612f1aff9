"""The split-Linear loop in PyTorch: the reference for, and fallback of, csrc/split_linear.cpp.

Both implementations take the same arguments and issue the same collectives
in the same order. Layout (see ``SplitLinear``): each
rank holds ``rows_per_rank`` rows of the weight (FSDP2's Shard(0) chunk, padded
on the tail ranks), cut into pieces of ``piece_sizes`` rows; slice i is piece i
of every rank, gathered rank-major into a buffer of shape (N * q_i, in).
"""

from __future__ import annotations

import contextlib
from collections import deque

import torch
import torch.distributed as dist

from osdp.distributed import collectives as comm


class MemoryCounter:
    """Live and peak bytes of the buffers the loop holds: counted when it allocates one and when it lets go
    (after the collective given it let go too: ``osdp.distributed.collectives.Lent``)."""

    KINDS = ("gathered", "grad")

    def __init__(self) -> None:
        self.live = dict.fromkeys(self.KINDS, 0)
        self.peak = dict.fromkeys(self.KINDS, 0)

    def allocate(self, kind: str, t: torch.Tensor) -> torch.Tensor:
        self.live[kind] += t.nbytes
        self.peak[kind] = max(self.peak[kind], self.live[kind])
        return t

    def release(self, kind: str, t: torch.Tensor) -> None:
        self.live[kind] -= t.nbytes

    def stats(self) -> dict[str, int]:
        return {
            "gathered_bytes": self.live["gathered"],
            "peak_gathered_bytes": self.peak["gathered"],
            "grad_bytes": self.live["grad"],
            "peak_grad_bytes": self.peak["grad"],
        }

    def reset_peak(self) -> None:
        self.peak = dict(self.live)


COUNTER = MemoryCounter()
memory_stats = COUNTER.stats
reset_peak_memory_stats = COUNTER.reset_peak


def _offsets(piece_sizes: list[int]) -> list[int]:
    offsets, off = [], 0
    for q in piece_sizes:
        offsets.append(off)
        off += q
    return offsets


def _pad_columns(grad_out: torch.Tensor, n: int, rows_per_rank: int, out_features: int) -> torch.Tensor:
    """The output gradient widened to the padded layout (N * rows_per_rank columns; the tail ranks' padding zero)."""
    if n * rows_per_rank == out_features:
        return grad_out
    return torch.nn.functional.pad(grad_out, (0, n * rows_per_rank - out_features))


def _avg(group: dist.ProcessGroup) -> dist.ReduceOp:
    # Data-parallel mean, like FSDP2 (which also avoids AVG on a single rank).
    return dist.ReduceOp.AVG if group.size() > 1 else dist.ReduceOp.SUM


class _Gatherer:
    """All-gathers slice i+1 into one of two buffers while slice i, in the other, is used (``pairwise``:
    with ``osdp.distributed.collectives.pairwise_all_gather``)."""

    def __init__(self, w_local: torch.Tensor, group: dist.ProcessGroup, piece_sizes: list[int], dtype: torch.dtype,
                 pairwise: bool = False):
        self.w, self.group, self.sizes, self.dtype = w_local, group, piece_sizes, dtype
        self.gather = comm.pairwise_all_gather if pairwise else comm.native_all_gather
        self.offsets = _offsets(piece_sizes)
        n, q_max = group.size(), max(piece_sizes)
        count = 2 if len(piece_sizes) > 1 else 1
        self.buffers = [COUNTER.allocate("gathered", w_local.new_empty(n * q_max, w_local.shape[1], dtype=dtype)) for _ in range(count)]
        self.work: dict[int, tuple[comm.Lent, torch.Tensor]] = {}

    def __enter__(self) -> "_Gatherer":
        return self

    def __exit__(self, *exc) -> None:
        for buffer in self.buffers:
            COUNTER.release("gathered", buffer)
        self.buffers, self.work = [], {}

    def _piece(self, i: int) -> torch.Tensor:
        off, q = self.offsets[i], self.sizes[i]
        real = min(max(self.w.shape[0] - off, 0), q)
        if real == q and self.w.dtype == self.dtype and self.w.is_contiguous():
            return self.w[off : off + q]
        piece = self.w.new_zeros(q, self.w.shape[1], dtype=self.dtype)  # padding rows of the tail ranks stay zero
        piece[:real].copy_(self.w[off : off + real])
        return piece

    def start(self, i: int) -> None:
        out = self.buffers[i % len(self.buffers)][: self.group.size() * self.sizes[i]]
        gather = comm.Lent(self.gather, (out, self._piece(i)), group=self.group, async_op=True)
        self.work[i] = (gather, out)

    def wait(self, i: int) -> torch.Tensor:
        gather, out = self.work.pop(i)
        gather.wait()
        return out


def forward(x: torch.Tensor, w_local: torch.Tensor, group: dist.ProcessGroup, piece_sizes: list[int],
            out_features: int, pairwise_gather: bool = False) -> torch.Tensor:
    """``x @ W.T`` for a 2-D ``x``, W gathered slice by slice (``pairwise_gather``: see ``backward``)."""
    n, c, m = group.size(), sum(piece_sizes), x.shape[0]
    out = x.new_empty(m, n * c)
    out_by_rank = out.view(m, n, c)
    with _Gatherer(w_local, group, piece_sizes, x.dtype, pairwise_gather) as gatherer:
        gatherer.start(0)
        for i, (off, q) in enumerate(zip(gatherer.offsets, piece_sizes)):
            w_i = gatherer.wait(i)
            if i + 1 < len(piece_sizes):
                gatherer.start(i + 1)
            out_by_rank[:, :, off : off + q] = torch.mm(x, w_i.t()).view(m, n, q)
    return out if n * c == out_features else out[:, :out_features].contiguous()


def backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    w_local: torch.Tensor,
    group: dist.ProcessGroup,
    piece_sizes: list[int],
    out_features: int,
    need_input_grad: bool,
    need_weight_grad: bool,
    reduce_dtype: torch.dtype | None,
    pairwise_reduce: bool = False,
    pairwise_gather: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(grad of x, this rank's rows of the data-parallel mean of grad W).

    The input gradient needs W again, gathered slice by slice as in forward;
    the weight gradient does not, so a layer whose input needs no gradient
    gathers nothing. Each slice's weight gradient is reduce-scattered behind
    the next slice's compute; at most two are in flight, so unreduced slice
    gradients never exceed 2/k of the weight. ``pairwise_reduce`` / ``pairwise_gather``: reduce-scatter /
    all-gather with ``osdp.distributed.collectives``'s pairwise collectives (NCCL's traffic on gloo) instead of the group's own.
    """
    n, c, m = group.size(), sum(piece_sizes), x.shape[0]
    offsets = _offsets(piece_sizes)
    grad_by_rank = _pad_columns(grad_out, n, c, out_features).view(m, n, c)
    reduce_dtype = reduce_dtype or x.dtype
    grad_x = torch.zeros_like(x) if need_input_grad else None
    grad_w = w_local.new_empty(c, w_local.shape[1]) if need_weight_grad else None
    pending: deque = deque()  # (reduction, unreduced input, reduced output if not written in place, offset)

    def finish(reduction, unreduced, reduced, off) -> None:
        reduction.wait()
        COUNTER.release("grad", unreduced)
        if reduced is not None:
            grad_w[off : off + reduced.shape[0]].copy_(reduced)

    with (_Gatherer(w_local, group, piece_sizes, x.dtype, pairwise_gather) if need_input_grad
          else contextlib.nullcontext()) as gatherer:
        if gatherer is not None:
            gatherer.start(0)
        for i, (off, q) in enumerate(zip(offsets, piece_sizes)):
            g_i = grad_by_rank[:, :, off : off + q].reshape(m, n * q)
            if gatherer is not None:
                w_i = gatherer.wait(i)
                if i + 1 < len(piece_sizes):
                    gatherer.start(i + 1)
                grad_x.addmm_(g_i, w_i)
            if grad_w is not None:
                unreduced = COUNTER.allocate("grad", torch.mm(g_i.t(), x).to(reduce_dtype))  # (n * q, in), rank-major
                in_place = reduce_dtype == grad_w.dtype
                dst = grad_w[off : off + q] if in_place else grad_w.new_empty(q, grad_w.shape[1], dtype=reduce_dtype)
                reduce = comm.pairwise_reduce_scatter if pairwise_reduce else comm.native_reduce_scatter
                reduction = comm.Lent(reduce, (dst, unreduced), op=_avg(group), group=group, async_op=True)
                pending.append((reduction, unreduced, None if in_place else dst, off))
                while len(pending) > 1:
                    finish(*pending.popleft())
    while pending:
        finish(*pending.popleft())
    if grad_w is not None and grad_w.shape[0] != w_local.shape[0]:
        grad_w = grad_w[: w_local.shape[0]]
    return grad_x, grad_w


def accumulate_weight_grad(
    accumulated: torch.Tensor | None, grad_out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup,
    piece_sizes: list[int], out_features: int, reduce_dtype: torch.dtype | None,
) -> torch.Tensor:
    """``accumulated`` plus this micro-batch's unreduced weight gradient, in the padded full layout
    (N * rows_per_rank, in): no communication (gradient accumulation without sync)."""
    grad_out = _pad_columns(grad_out, group.size(), sum(piece_sizes), out_features)
    grad_w = torch.mm(grad_out.t(), x).to(reduce_dtype or x.dtype)
    if accumulated is None:
        return COUNTER.allocate("grad", grad_w)
    return accumulated.add_(grad_w)


def reduce_accumulated(
    accumulated: torch.Tensor, w_local: torch.Tensor, group: dist.ProcessGroup, piece_sizes: list[int],
    pairwise: bool = False,
) -> torch.Tensor:
    """This rank's rows of the data-parallel mean of an accumulated weight gradient: one reduce-scatter per
    slice, as the synchronising backward makes them, for the whole accumulation window."""
    n, c = group.size(), sum(piece_sizes)
    by_rank = accumulated.view(n, c, accumulated.shape[1])
    reduce = comm.pairwise_reduce_scatter if pairwise else comm.native_reduce_scatter
    reduced = accumulated.new_empty(c, accumulated.shape[1])
    pending = []
    for off, q in zip(_offsets(piece_sizes), piece_sizes):
        unreduced = by_rank[:, off : off + q].reshape(n * q, -1)  # slice i, rank-major, as backward() sends it
        pending.append(comm.Lent(reduce, (reduced[off : off + q], unreduced), op=_avg(group), group=group,
                                 async_op=True))
    for reduction in pending:
        reduction.wait()
    COUNTER.release("grad", accumulated)
    return reduced[: w_local.shape[0]].to(w_local.dtype)
