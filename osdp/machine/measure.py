"""The machine measured on the live process group: collectives (``measure_collectives``,
``measure_topology``), matmul rate (``measure_flops``), and all of it as a ``DeviceInfo``
(``measure_device``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from osdp import distributed
from osdp.distributed import collectives as comm
from osdp.machine.collective_model import COLLECTIVES, AlphaBeta, CollectiveModel, Topology
from osdp.machine.device_info import DeviceInfo, _dtype_name
from osdp.machine.workspace import device_workspace_bytes
from osdp.machine.timing import StepTimer


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the group's tensors live: CUDA for NCCL, else CPU (no group: CUDA if there is one)."""
    if dist.is_available() and dist.is_initialized():
        nccl = "nccl" in str(dist.get_backend(group))
    else:
        nccl = torch.cuda.is_available()
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


# The all-gather and the reduce-scatter are osdp.distributed.collectives's: the ones every unit of a run uses (the native
# all-gather is the c10d op FSDP2's DefaultAllGather calls).

DEFAULT_MESSAGE_SIZES = tuple(4 * 2**10 * 8**i for i in range(5))  # 4 KiB .. 16 MiB
SMALL_MESSAGE_REPEATS = 8  # timings per round of a message 1/64 of the largest or smaller (fewer, down to 1, above)


def measure_collectives(
    group: dist.ProcessGroup | None = None,
    *,
    sizes: Sequence[int] = DEFAULT_MESSAGE_SIZES,
    repeats: int = 50,
    time_budget_s: float = 4.0,
    dtype: torch.dtype = torch.float32,
) -> CollectiveModel:
    """Measure and fit all-gather, reduce-scatter and all-reduce on the live process group.

    Collective call on every rank of ``group``. Uses the calls OSDP's units make
    (the all-gather and the reduce-scatter, with ReduceOp.AVG, of ``osdp.distributed.collectives``'s settings,
    all_reduce with ReduceOp.AVG for replicated units), on CUDA
    for NCCL groups and on CPU otherwise; about ``time_budget_s`` seconds (at least three rounds, at most
    ``repeats``). Each timing starts after a barrier and counts the slowest rank
    (a collective is done when every rank is). Sizes and collectives are
    interleaved round by round, so a burst of interference from elsewhere on
    the machine spreads over all points instead of bending the fit, and the
    median over rounds is fitted. Per-round maxima are all-reduced before
    fitting, so every rank computes the identical model and plans identically.
    Without a process group, or at world size 1, communication costs nothing.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return CollectiveModel.zero()
    world_size = dist.get_world_size(group)
    backend = str(dist.get_backend(group))
    device = _group_device(group)
    itemsize = torch.empty((), dtype=dtype).element_size()
    quantum = world_size * itemsize
    sizes = sorted({max(quantum, -(-int(s) // quantum) * quantum) for s in sizes})
    if len(sizes) < 2:
        raise ValueError("measure_collectives needs two or more distinct message sizes")
    full_buf = torch.zeros(sizes[-1] // itemsize, dtype=dtype, device=device)
    shard_buf = torch.zeros(sizes[-1] // itemsize // world_size, dtype=dtype, device=device)

    def make_op(collective: str, nbytes: int):
        full, shard = full_buf[: nbytes // itemsize], shard_buf[: nbytes // itemsize // world_size]
        if collective == "all_gather":
            return lambda: comm.all_gather(full, shard, group=group)
        if collective == "reduce_scatter":
            return lambda: comm.reduce_scatter(shard, full, op=dist.ReduceOp.AVG, group=group)
        return lambda: dist.all_reduce(full, op=dist.ReduceOp.AVG, group=group)

    # Small messages are timed several times a round: they cost little, and their
    # times scatter most (a TCP hiccup is many times a 4 KiB message's time), so a
    # median over a few rounds of them alone would bend the fit.
    cells = [(c, nbytes, make_op(c, nbytes))
             for c in COLLECTIVES for nbytes in sizes
             for _ in range(min(SMALL_MESSAGE_REPEATS, max(1, sizes[-1] // (8 * nbytes))))]

    def timed_round(since: float) -> tuple[list[float], float, float]:
        """Seconds per cell, seconds since ``since``, and the wall clock: each the max over ranks."""
        out = torch.empty(len(cells) + 2, dtype=torch.float64)
        for i, (_, _, op) in enumerate(cells):
            dist.barrier(group)
            with StepTimer(device) as timer:
                op()
            out[i] = timer.seconds
        out[-2] = time.perf_counter() - since
        out[-1] = time.time()
        out = out.to(device)
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
        *cell_times, elapsed, wall = out.cpu().tolist()
        return cell_times, elapsed, wall

    timed_round(time.perf_counter())  # first calls pay for connection setup (NCCL communicators)
    start, rounds = time.perf_counter(), []
    while len(rounds) < repeats:
        cell_times, elapsed, wall = timed_round(start)
        rounds.append(cell_times)
        if len(rounds) >= 3 and elapsed >= time_budget_s:
            break
    timings: dict[tuple[str, int], list[float]] = {}
    for i, (c, nbytes, _) in enumerate(cells):
        timings.setdefault((c, nbytes), []).extend(r[i] for r in rounds)
    samples = {c: [(nbytes, statistics.median(timings[c, nbytes])) for nbytes in sizes] for c in COLLECTIVES}
    date = time.strftime("%Y-%m-%d", time.gmtime(wall))  # from the reduced clock: the same string on every rank
    source = (f"measured {backend} {device.type} {world_size} ranks {date}, {comm.all_gather_impl()} all-gather, "
              f"{comm.reduce_scatter_impl()} reduce-scatter")
    return CollectiveModel.fit(world_size, samples, source)


def measure_topology(
    ranks_per_node: int,
    *,
    sizes: Sequence[int] = DEFAULT_MESSAGE_SIZES,
    time_budget_s: float = 4.0,
) -> Topology:
    """Measure the collectives of the node groups and of the cross-node groups of the default process group.

    Collective call on every rank. Every rank builds every subgroup, in the same
    order (``dist.new_group`` requires it): the node groups, then the groups of
    one rank per node. Each level is measured with all its groups at once, as a
    job sharding within nodes runs them, so groups sharing a node's links share
    them here too. Groups' fits differ a little; every rank takes, per
    collective, the largest alpha and the largest beta over the groups (the
    slowest group sets the step), so all ranks hold the identical topology.
    """
    world_size = dist.get_world_size()
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} does not divide the world size {world_size} "
                         "into whole nodes")
    nodes, rank = world_size // ranks_per_node, dist.get_rank()
    node_groups = [dist.new_group(list(range(i * ranks_per_node, (i + 1) * ranks_per_node)))
                   for i in range(nodes)]
    cross_groups = [dist.new_group(list(range(j, world_size, ranks_per_node))) for j in range(ranks_per_node)]
    intra = measure_collectives(node_groups[rank // ranks_per_node], sizes=sizes, time_budget_s=time_budget_s)
    dist.barrier()
    inter = measure_collectives(cross_groups[rank % ranks_per_node], sizes=sizes, time_budget_s=time_budget_s)
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, (intra.to_dict(), inter.to_dict()))
    for group in (*node_groups, *cross_groups):
        dist.destroy_process_group(group)
    # every rank of a group reports its group's model: one rank per group is enough
    intra_models = [CollectiveModel.from_dict(out[i * ranks_per_node][0]) for i in range(nodes)]
    inter_models = [CollectiveModel.from_dict(out[j][1]) for j in range(ranks_per_node)]
    return Topology(nodes, ranks_per_node, _slowest(intra_models), _slowest(inter_models))


def _slowest(models: Sequence[CollectiveModel]) -> CollectiveModel:
    """Per collective, the largest alpha and the largest beta of same-sized groups' models."""
    costs = {c: AlphaBeta(max(m.costs[c].alpha_s for m in models), max(m.costs[c].beta_s_per_byte for m in models))
             for c in COLLECTIVES}
    return CollectiveModel(models[0].world_size, costs, f"{models[0].source}, slowest of {len(models)} groups",
                           combine_samples(models, max))


def combine_samples(models: Sequence[CollectiveModel], combine: Callable[[list[float]], float]
                     ) -> dict[str, tuple[tuple[float, float], ...]]:
    """Per collective and message size, ``combine`` of the models' measured seconds (models measured at the
    same sizes; {} when none was measured)."""
    measured = [m.samples for m in models if m.samples]
    if not measured:
        return {}
    return {c: tuple((nbytes, combine([dict(m[c])[nbytes] for m in measured])) for nbytes, _ in measured[0][c])
            for c in COLLECTIVES}


# --------------------------------------------------------------------------- compute

def measure_flops(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    n: int | None = None,
    time_budget_s: float = 0.25,
) -> float:
    """FLOP/s of an n x n matmul (median over repeats): the rate the large Linears of a model reach.

    Smaller operators (norms, activations, attention softmax) run below it, so
    compute times derived from it are optimistic; measured per-unit times are
    preferred where a model can be profiled.
    """
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 512)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)

    torch.mm(a, b)  # warm-up: kernel selection, lazy init
    times: list[float] = []
    while len(times) < 3 or sum(times) < time_budget_s:
        with StepTimer(device) as timer:
            torch.mm(a, b)
        times.append(timer.seconds)
    return 2 * n**3 / statistics.median(times)


def measure_device(
    group: dist.ProcessGroup | None = None,
    *,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
    time_budget_s: float = 4.0,
    name: str | None = None,
    collectives: CollectiveModel | None = None,
    sizes: Sequence[int] = DEFAULT_MESSAGE_SIZES,
) -> DeviceInfo:
    """DeviceInfo for this machine, measured; collective call when a process group exists.

    Every rank measures its matmul rate and the slowest rank's figure is used
    (it sets the step time), so all ranks hold identical numbers. The
    collectives are measured too (``time_budget_s``, at ``sizes``) unless given; on the
    default group of a job spanning several nodes (torchrun's LOCAL_WORLD_SIZE
    below the world size), so are its node and cross-node groups (``topology``).
    """
    if collectives is None:
        collectives = measure_collectives(group, sizes=sizes, time_budget_s=time_budget_s)
    topology = None
    if group is None and collectives.world_size > 1:
        local = distributed.ranks_per_node()
        if local < collectives.world_size:
            topology = measure_topology(local, sizes=sizes, time_budget_s=time_budget_s)
    device = _group_device(group)
    flops = {_dtype_name(dt): measure_flops(device, dt) for dt in dtypes}
    if collectives.world_size > 1:
        out: list[Any] = [None] * collectives.world_size
        dist.all_gather_object(out, flops, group=group)
        flops = {k: min(f[k] for f in out) for k in flops}
    if name is None:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return DeviceInfo(
        name=name, memory_bytes=_device_memory(device), world_size=collectives.world_size,
        device_type=device.type, collectives=collectives, flops=flops,
        notes="measured: collectives on the live process group, FLOP/s of a large matmul",
        topology=topology,
        workspace_bytes=device_workspace_bytes(device),
        reduce_scatter=comm.reduce_scatter_impl(),
    )


def _device_memory(device: torch.device) -> int | None:
    """A GPU's memory; None on CPU, where ranks share the host's."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None
