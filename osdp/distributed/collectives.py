"""The collectives OSDP's units make: a reduce-scatter and an all-gather at NCCL's traffic on gloo, and, on
gloo, collectives that have let go of their tensors when they return.

Reduce-scatter. A reduce-scatter on NCCL (a ring) sends and receives (N-1)/N
of the message per rank, as an all-gather does. Gloo's reduce-scatter costs
about an all-reduce (its fitted per-byte cost is 1.5-1.9x the all-gather's on
a shaped link, 2-3x on loopback: experiments/results/collectives.md), which
makes sharding look dearer on CPU ranks than it is on GPUs, and CPU training
slower than it needs to be. With the ``pairwise`` implementation every rank
sends chunk j of its input to rank j and sums the N-1 chunks it receives with
its own: (N-1)/N of the message out and in per rank, NCCL's traffic, on any
backend with point-to-point ops.

All-gather. Gloo's all-gather moves the right bytes but slowly through a
rate-limited link: on 2 ranks over a veth shaped to 718 Mbit/s, 147 ms for a
16 MiB message where a send of the own shard and a receive of the peer's take
98 ms (65% of the link against 93%; about 1.3x faster on the unshaped veth
too), so all-gathers were charged ~1.37x the (pairwise) reduce-scatters where
NCCL charges them alike. With the ``pairwise`` all-gather every rank sends its
shard to each peer and receives each peer's straight into its place in the
output.

Two settings, each ``native`` (default) or ``pairwise``:
``OSDP_REDUCE_SCATTER`` (or :func:`set_reduce_scatter`) and
``OSDP_ALL_GATHER`` (or :func:`set_all_gather`). Each is read where its
collective is made, and applies to all of them alike:

- FSDP2 units: :func:`install` puts :class:`FSDPReduceScatter` and
  :class:`FSDPAllGather` on every ``fully_shard``-ed module of a model
  (``FSDPModule.set_custom_reduce_scatter`` / ``set_custom_all_gather``);
  ``osdp.wrap`` calls it, so do the experiments' baselines;
- split Linears' slices (``osdp/split``, both the PyTorch loop and the C++ op);
- ``osdp.machine.measure.measure_collectives``, so that the cost model prices the
  collectives that run.

They are meant for gloo: NCCL's own collectives already move (N-1)/N, and the
split op's C++ path takes the pairwise ones on CPU tensors only.

Set it the same way on every rank, before ``osdp.wrap``. The pairwise exchange
keeps at most (N-2)/N of the message in extra buffers (none on 2 ranks: the
peer's chunk is received straight into the output), fewer than gloo's own,
which copies the whole input. Sums run in a fixed order on every rank, so the
result is the same on all of them; it may differ from the native
reduce-scatter's in the last bits, as any two reduction orders do.

Letting go. Gloo runs a collective on a worker thread that keeps the job, and
the tensors in it, until it has finished with it, which can be after the
caller saw the collective complete and went on (after a quarter of 130 KiB
all-gathers on 2 ranks here, after 70% of 16 KiB ones). The caller's last
reference is then not the last one: FSDP2 drops an all-gather's flat buffer
right after copying out of it, and that buffer's memory stayed alive
whenever the thread next ran, so a rank's peak held one more unit's gathered
parameters in some steps and not others, past a budget the plan had met.
:class:`Lent` hands a collective fresh aliases of its tensors and waits, once
it completed, until no one else holds them (a few yields of the CPU at most):
memory is then freed where the caller frees it, as under NCCL, and peaks are
the same every step. On CPU tensors, every
collective of this module, FSDP2's all-gathers and reduce-scatters
(:func:`install`) and the split loop's do so. Gloo's reduce-scatter also
copies its input and frees the copy on that thread, where no alias can
watch it: :func:`native_reduce_scatter` runs the same algorithm (an
all-reduce of a copy) with a copy of its own, lent and freed before it returns.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from osdp._torch_private import (
    FSDPAllGatherBase,
    FSDPReduceScatterBase,
    fsdp_device,
    storage_holders,
    tensor_holders,
)

IMPLEMENTATIONS = ("native", "pairwise")
ENV = "OSDP_REDUCE_SCATTER"
ALL_GATHER_ENV = "OSDP_ALL_GATHER"

# all_gather_single and reduce_scatter_single replace the *_tensor forms in recent torch.
native_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_group_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
LET_GO_TIMEOUT_S = 1.0  # past this, go on: the memory is freed when the worker thread runs
_let_go = {"collectives": 0, "waited": 0, "seconds": 0.0}  # this process's Lent collectives (let_go_stats)

# Point-to-point tags of pairwise collectives: one per call and group, the same on every rank
# because every rank makes the same calls in the same order. The C++ op (csrc/split_linear.cpp)
# counts its own from 1 << 25, so the two never meet; gloo tags must fit in 31 bits.
_TAG_BASE, _TAG_SPAN = 1 << 24, 1 << 20
_tags: dict[str, int] = {}


def _check(name: str, where: str) -> str:
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"{where}={name!r}: use one of {', '.join(IMPLEMENTATIONS)}")
    return name


class _Setting:
    """Which implementation one collective uses: set in this process, else its environment variable's."""

    def __init__(self, env: str):
        self.env, self.value = env, None  # None: from the environment

    def set(self, name: str | None, where: str) -> None:
        self.value = None if name is None else _check(name, where)

    def get(self) -> str:
        return self.value if self.value is not None else _check(os.environ.get(self.env, "native"), self.env)


_reduce_scatter_setting, _all_gather_setting = _Setting(ENV), _Setting(ALL_GATHER_ENV)


def set_reduce_scatter(name: str | None) -> None:
    """``native``, ``pairwise``, or None to follow ``OSDP_REDUCE_SCATTER`` again (this process only)."""
    _reduce_scatter_setting.set(name, "set_reduce_scatter")


def reduce_scatter_impl() -> str:
    """The reduce-scatter in use: ``native`` or ``pairwise``."""
    return _reduce_scatter_setting.get()


def set_all_gather(name: str | None) -> None:
    """``native``, ``pairwise``, or None to follow ``OSDP_ALL_GATHER`` again (this process only)."""
    _all_gather_setting.set(name, "set_all_gather")


def all_gather_impl() -> str:
    """The all-gather in use: ``native`` or ``pairwise``."""
    return _all_gather_setting.get()


def _next_tag(group: dist.ProcessGroup) -> int:
    key = group.group_name
    count = _tags.get(key, 0)
    _tags[key] = count + 1
    return _TAG_BASE + count % _TAG_SPAN


def _finish_sum(op: Any, n: int) -> Callable[[torch.Tensor], Any] | None:
    """What turns the sum over ``n`` ranks into ``op``'s result, for reductions that only sum: gloo has neither
    a mean nor the pre-multiplied sum FSDP2 asks for once a unit has a gradient divide factor."""
    if op == dist.ReduceOp.SUM:
        return None
    if op == dist.ReduceOp.AVG:
        return lambda t: t.div_(n)
    if getattr(op, "op", None) == dist.ReduceOp.PREMUL_SUM:
        factor = op.factor
        return lambda t: t.mul_(factor)
    raise ValueError(f"a reduce-scatter of CPU tensors sums, averages or sums pre-multiplied; got reduce op {op!r} "
                     "(use SUM, AVG or PREMUL_SUM)")


class Lent:
    """A collective run on fresh aliases of its tensors, so that its letting go of them can be seen.

    ``Lent(collective, tensors, **kwargs)`` calls ``collective(*aliases,
    **kwargs)`` and keeps what it returns (the ``Work`` of an async call):
    :meth:`wait` waits for it, drops it, and then waits until nothing but this
    object holds the aliases. Keep the ``Lent``, not the ``Work``: a handle
    held elsewhere would hold the tensors. Only CPU tensors are waited for: on
    CUDA the caching allocator frees by stream, whoever drops the last reference.
    """

    def __init__(self, collective: Any, tensors: tuple[torch.Tensor, ...], **kwargs: Any):
        aliases = [t.detach() for t in tensors]
        on_cpu = [a for a in aliases if a.device.type == "cpu"]
        if kwargs.get("async_op"):
            # the caller may make views of these tensors before it waits: count the aliases' holders
            self._held = [(tensor_holders, a, tensor_holders(a)) for a in on_cpu]
        else:
            # gloo's job can hold a view of its own (one more TensorImpl on the memory, freed a moment after
            # the aliases): count the memory's holders, which nothing else adds to before the wait
            self._held = [(storage_holders, a, storage_holders(a)) for a in on_cpu]
        self._work = collective(*aliases, **kwargs)

    def wait(self, timeout_s: float = LET_GO_TIMEOUT_S) -> None:
        work, self._work = self._work, None
        if work is not None:
            work.wait()
        del work
        held, self._held = self._held, []
        start = time.perf_counter()
        waited = False
        while any(holders(a) > n for holders, a, n in held) and time.perf_counter() - start < timeout_s:
            waited = True
            os.sched_yield()  # let the worker thread run
        if waited and held and held[0][0] is tensor_holders:
            # the job let go of the aliases a moment ago: give it as long again to drop the views it made
            _settle([a for _, a, _ in held], deadline=start + timeout_s)
        _let_go["collectives"] += 1
        if waited:
            _let_go["waited"] += 1
            _let_go["seconds"] += time.perf_counter() - start


def _settle(tensors: list[torch.Tensor], deadline: float) -> None:
    """Yield to other threads while the memory under ``tensors`` loses holders (until ``deadline``)."""
    counts = [storage_holders(t) for t in tensors]
    while time.perf_counter() < deadline:
        os.sched_yield()
        now = [storage_holders(t) for t in tensors]
        if now == counts:
            return
        counts = now


def let_go_stats(reset: bool = False) -> dict[str, float]:
    """This process's collectives run through :class:`Lent` since the last reset: how many, how many found
    the tensors still held when they completed, and the seconds spent waiting for those."""
    out = dict(_let_go)
    if reset:
        _let_go.update(collectives=0, waited=0, seconds=0.0)
    return out


class _Pending:
    """A pairwise collective in flight: ``wait()`` waits for its transfers, then (once) sums what a
    reduce-scatter received into its output."""

    def __init__(self, works: list, output: torch.Tensor | None = None, own: torch.Tensor | None = None,
                 received: list[torch.Tensor] | None = None, finish: Callable[[torch.Tensor], Any] | None = None):
        self._works, self._output, self._own, self._received = works, output, own, received or []
        self._finish = finish
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        if self._done:
            return True
        for work in self._works:
            work.wait()
        if self._output is not None:
            out = self._output.view(-1)
            out.add_(self._own)
            for chunk in self._received:
                out.add_(chunk)
            if self._finish is not None:
                self._finish(out)
        self._done = True
        self._works, self._output, self._own, self._received = [], None, None, []
        return True

    def is_completed(self) -> bool:
        return self._done


def _check_pairwise(name: str, output: torch.Tensor, input: torch.Tensor, world_size: int) -> None:
    """A pairwise collective's tensors: contiguous, one dtype, the full one (an all-gather's output, a
    reduce-scatter's input) world size x the other's elements."""
    full, shard, whole, part = ((output, input, "output", "input") if name == "all-gather"
                                else (input, output, "input", "output"))
    if not full.is_contiguous() or not shard.is_contiguous():
        raise ValueError(f"the pairwise {name} needs contiguous input and output tensors")
    if full.numel() != world_size * shard.numel() or full.dtype != shard.dtype:
        raise ValueError(
            f"{name} of {input.numel()} {input.dtype} elements over {world_size} ranks into {output.numel()} "
            f"{output.dtype} elements: the {whole} must hold world size x the {part}'s elements, of the same dtype"
        )


def pairwise_all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
                        async_op: bool = False) -> _Pending | None:
    """``all_gather_single(output, input, group)`` as N-1 point-to-point exchanges per rank.

    Rank r copies ``input`` into chunk r of ``output`` (nothing to copy when
    ``input`` is that chunk, as FSDP2 lays it out), sends it to every peer and
    receives peer j's into chunk j. ``async_op``: returns an object whose
    ``wait()`` finishes it.
    """
    group = group or dist.group.WORLD
    n, rank = group.size(), group.rank()
    _check_pairwise("all-gather", output, input, n)
    chunks = output.view(n, -1)
    own = chunks[rank]
    if own.data_ptr() != input.data_ptr():
        own.copy_(input.view(-1))
    works = []
    if n > 1:
        tag = _next_tag(group)
        for step in range(1, n):
            to, frm = (rank + step) % n, (rank - step) % n
            works.append(dist.irecv(chunks[frm], group=group, group_src=frm, tag=tag))
            works.append(dist.isend(own, group=group, group_dst=to, tag=tag))
    pending = _Pending(works)
    if async_op:
        return pending
    pending.wait()
    return None


def all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
               async_op: bool = False, impl: str | None = None):
    """The all-gather of ``impl`` (default: the current setting, see the module docstring); arguments as
    ``torch.distributed.all_gather_single``. Synchronous calls return once it has let go (:class:`Lent`)."""
    gather = pairwise_all_gather if (impl or all_gather_impl()) == "pairwise" else native_all_gather
    if async_op:
        return gather(output, input, group=group, async_op=True)
    Lent(gather, (output, input), group=group).wait()
    return None


def native_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                          group: dist.ProcessGroup | None = None, async_op: bool = False) -> Any:
    """The process group's reduce-scatter (arguments as ``torch.distributed.reduce_scatter_tensor``).

    On CPU tensors it runs as gloo's does, an all-reduce of a copy of the
    input of which each rank keeps its chunk, but with a copy made and freed
    here: gloo's own copy is freed by its worker thread whenever that next
    runs, after the call returned, and so was still live at a unit's peak in
    some steps and not others (one more copy of a unit's gradients, over a
    budget the plan met by PyTorch's ``FSDPMemTracker``). ``async_op``:
    returns an object whose ``wait()`` finishes it.
    """
    if input.device.type != "cpu":
        return _group_reduce_scatter(output, input, op=op, group=group, async_op=async_op)
    pending = _ReducedCopy(output, input, op, group or dist.group.WORLD)
    if async_op:
        return pending
    pending.wait()
    return None


class _ReducedCopy:
    """A reduce-scatter in flight as an all-reduce of a copy of its input: ``wait()`` copies this rank's chunk
    of the sum (or mean) into the output and frees the copy."""

    def __init__(self, output: torch.Tensor, input: torch.Tensor, op: Any, group: dist.ProcessGroup):
        n = group.size()
        if input.numel() != n * output.numel() or input.dtype != output.dtype:
            raise ValueError(
                f"reduce-scatter of {input.numel()} {input.dtype} elements over {n} ranks into {output.numel()} "
                f"{output.dtype} elements: the input must hold world size x the output's elements, of the same dtype"
            )
        self._finish = _finish_sum(op, n)  # gloo's all-reduce sums: the mean or the scaled sum after it
        self._copy = input.detach().clone(memory_format=torch.contiguous_format).view(n, -1)
        self._reduction = Lent(dist.all_reduce, (self._copy,), op=dist.ReduceOp.SUM, group=group, async_op=True)
        self._output, self._rank = output, group.rank()

    def wait(self, timeout: Any = None) -> bool:
        if self._reduction is not None:
            self._reduction.wait()
            chunk = self._copy[self._rank]
            if self._finish is not None:
                self._finish(chunk)
            self._output.copy_(chunk.view_as(self._output))
            self._reduction = self._copy = self._output = None
        return True

    def is_completed(self) -> bool:
        return self._reduction is None


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
    _check_pairwise("reduce-scatter", output, input, n)
    if output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr():
        raise ValueError("the pairwise reduce-scatter needs an output that does not share memory with its input")
    finish = _finish_sum(op, n)
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
    pending = _Pending(works, output, chunks[rank], received, finish)
    if async_op:
        return pending
    pending.wait()
    return None


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                   group: dist.ProcessGroup | None = None, async_op: bool = False, impl: str | None = None):
    """The reduce-scatter of ``impl`` (default: the current setting, see the module docstring); arguments as
    ``torch.distributed.reduce_scatter_tensor``. Synchronous calls return once it has let go (:class:`Lent`)."""
    reduce = pairwise_reduce_scatter if (impl or reduce_scatter_impl()) == "pairwise" else native_reduce_scatter
    if async_op:
        return reduce(output, input, op=op, group=group, async_op=True)
    Lent(reduce, (output, input), op=op, group=group).wait()
    return None


class _FreshBuffers:
    """FSDP2's default allocation of a custom collective's buffers (``torch.empty``)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class FSDPAllGather(_FreshBuffers, FSDPAllGatherBase):
    """FSDP2's all-gather as :func:`all_gather` of ``impl`` (``FSDPModule.set_custom_all_gather``), returning
    once gloo has let go of the flat buffer FSDP2 frees next. Asynchronous unshards (an explicit
    ``FSDPModule.unshard(async_op=True)``) take the group's own: FSDP2 waits only on a ``Work`` it returns."""

    def __init__(self, impl: str = "native"):
        self.impl = _check(impl, "FSDPAllGather")

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        if async_op:
            return native_all_gather(output_tensor, input_tensor, group=group, async_op=True)
        all_gather(output_tensor, input_tensor, group=group, impl=self.impl)
        return None


class FSDPReduceScatter(_FreshBuffers, FSDPReduceScatterBase):
    """FSDP2's reduce-scatter as :func:`reduce_scatter` of ``impl`` (``FSDPModule.set_custom_reduce_scatter``)."""

    def __init__(self, impl: str):
        self.impl = _check(impl, "FSDPReduceScatter")

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False):
        return reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op, impl=self.impl)


def install(model: nn.Module) -> int:
    """Give every ``fully_shard``-ed module of ``model`` the collectives of this module: on CPU, the all-gather
    and the reduce-scatter of the current settings, both letting go when they return; on CUDA, each one whose
    setting is pairwise (else FSDP2's own). Returns how many modules got the pairwise reduce-scatter. Call it
    after the last ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    reduce_impl, gather_impl, pairwise = reduce_scatter_impl(), all_gather_impl(), 0
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        on_cpu = fsdp_device(m).type == "cpu"
        if on_cpu or gather_impl == "pairwise":
            m.set_custom_all_gather(FSDPAllGather(gather_impl))
        if on_cpu or reduce_impl == "pairwise":
            m.set_custom_reduce_scatter(FSDPReduceScatter(reduce_impl))
            pairwise += reduce_impl == "pairwise"
    return pairwise


def uses_pairwise(model: nn.Module, collective: str = "reduce_scatter") -> bool:
    """Whether any ``fully_shard``-ed module of ``model`` runs the pairwise ``collective`` (``reduce_scatter``:
    :class:`FSDPReduceScatter`, ``all_gather``: :class:`FSDPAllGather`)."""
    from osdp._torch_private import fsdp_collective_comm

    return any(getattr(fsdp_collective_comm(m, collective), "impl", None) == "pairwise" for m in model.modules())
