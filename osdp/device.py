"""The machine side of the cost model: memory sizes, collective costs, compute rate.

A plan is only as good as the numbers it is made from, so every number here is
either measured on the live process group (``measure_collectives``,
``measure_flops``, ``measure_device``) or comes from a named preset whose
sources are written next to it (``DEVICE_PRESETS``). All of it is plain data
(``DeviceInfo.to_dict``) so a plan can be made offline and reproduced.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
from scipy.optimize import nnls

from osdp import comm, distributed
from osdp.sizes import format_bytes, parse_size  # noqa: F401 - part of this module's API
from osdp.timing import StepTimer

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")

# --------------------------------------------------------------------------- sizes

# --------------------------------------------------------------------------- collectives

def ring_factor(collective: str, world_size: int) -> float:
    """Fraction of the full message each rank sends in a ring: (N-1)/N, or 2(N-1)/N for all-reduce.

    This is nccl-tests' "bus bandwidth" factor: busbw = factor * bytes / time.
    """
    _check_collective(collective)
    f = (world_size - 1) / world_size
    return 2 * f if collective == "all_reduce" else f


def _check_collective(collective: str) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; expected one of {COLLECTIVES}")


@dataclass(frozen=True)
class AlphaBeta:
    """time(bytes) = alpha_s + bytes * beta_s_per_byte, bytes being the full (unsharded) message."""

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self) -> None:
        for v in (self.alpha_s, self.beta_s_per_byte):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"alpha and beta must be finite and >= 0, got {self}")

    def time(self, nbytes: float) -> float:
        return self.alpha_s + nbytes * self.beta_s_per_byte

    @classmethod
    def fit(cls, nbytes: Sequence[float], seconds: Sequence[float]) -> "AlphaBeta":
        """Non-negative least squares on relative error.

        Weighting each point by 1/time makes a 4 KiB message (alpha-bound) count
        as much as a 16 MiB one (beta-bound); plain least squares would fit
        only the largest messages and leave alpha to noise.
        """
        x, t = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
        if x.shape != t.shape or x.size < 2 or len(set(x.tolist())) < 2:
            raise ValueError("fitting alpha and beta needs timings at two or more message sizes")
        if not (np.all(np.isfinite(t)) and np.all(t > 0)):
            raise ValueError(f"timings must be positive and finite, got {t.tolist()}")
        scale = x.max()  # condition the system: beta is ~1e-10, alpha ~1e-5
        a = np.stack([np.ones_like(x), x / scale], axis=1) / t[:, None]
        (alpha, beta_scaled), _ = nnls(a, np.ones_like(t))
        return cls(float(alpha), float(beta_scaled / scale))


@dataclass(frozen=True)
class CollectiveModel:
    """Alpha-beta cost of each FSDP collective on one process group (world_size ranks).

    ``samples`` holds, when the model was measured, the (bytes, seconds)
    medians it was fitted to, per collective. The largest message's bandwidth
    is the link's steady rate, which the fitted beta need not be: on a shaped
    link small messages pass within the shaper's burst and pull the fit under
    the rate, by a different amount each measurement.
    """

    world_size: int
    costs: Mapping[str, AlphaBeta]
    source: str = ""
    samples: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if set(self.costs) != set(COLLECTIVES):
            raise ValueError(f"costs must cover exactly {COLLECTIVES}, got {sorted(self.costs)}")

    def time(self, collective: str, nbytes: float) -> float:
        """Seconds for one collective whose full (unsharded) message is ``nbytes``."""
        _check_collective(collective)
        return self.costs[collective].time(nbytes)

    def bus_bandwidth(self, collective: str) -> float:
        """Bytes/s in nccl-tests' bus-bandwidth convention (inf when free, e.g. world size 1)."""
        beta = self.costs[collective].beta_s_per_byte
        return math.inf if beta == 0 else ring_factor(collective, self.world_size) / beta

    def largest_message_bus_bandwidth(self, collective: str) -> float:
        """Bus bandwidth (bytes/s) of the largest message measured: the link's steady rate. Falls back to the
        fitted ``bus_bandwidth`` for a model that was not measured."""
        _check_collective(collective)
        if collective not in self.samples:
            return self.bus_bandwidth(collective)
        nbytes, seconds = max(self.samples[collective])
        return ring_factor(collective, self.world_size) * nbytes / seconds

    @classmethod
    def zero(cls, source: str = "world size 1: no communication") -> "CollectiveModel":
        return cls(1, {c: AlphaBeta(0.0, 0.0) for c in COLLECTIVES}, source)

    @classmethod
    def ring(
        cls,
        world_size: int,
        bus_bandwidth: Mapping[str, float],
        latency_s: Mapping[str, float],
        source: str = "",
    ) -> "CollectiveModel":
        """Costs of ring collectives from bus bandwidth (bytes/s) and latency (s) per collective."""
        if world_size == 1:
            return cls.zero()
        return cls(world_size, {
            c: AlphaBeta(latency_s[c], ring_factor(c, world_size) / bus_bandwidth[c]) for c in COLLECTIVES
        }, source)

    @classmethod
    def fit(
        cls, world_size: int, samples: Mapping[str, Sequence[tuple[float, float]]], source: str = ""
    ) -> "CollectiveModel":
        """Fit each collective from (full message bytes, seconds) samples."""
        costs = {}
        for c in COLLECTIVES:
            nbytes, seconds = zip(*samples[c])
            costs[c] = AlphaBeta.fit(nbytes, seconds)
        return cls(world_size, costs, source, {c: tuple(sorted(samples[c])) for c in COLLECTIVES})

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "source": self.source,
            **{c: {"alpha_s": ab.alpha_s, "beta_s_per_byte": ab.beta_s_per_byte} for c, ab in self.costs.items()},
            **({"samples": {c: [list(p) for p in v] for c, v in self.samples.items()}} if self.samples else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CollectiveModel":
        missing = [k for k in ("world_size", *COLLECTIVES) if k not in d]
        if missing:
            raise ValueError(f"collective model is missing {missing}")
        return cls(
            int(d["world_size"]),
            {c: AlphaBeta(float(d[c]["alpha_s"]), float(d[c]["beta_s_per_byte"])) for c in COLLECTIVES},
            str(d.get("source", "")),
            {c: tuple((float(b), float(t)) for b, t in v) for c, v in d.get("samples", {}).items()},
        )


@dataclass(frozen=True)
class Topology:
    """Two levels of links: ``nodes`` nodes of ``ranks_per_node`` ranks each (torchrun's numbering: node i
    holds ranks i * ranks_per_node ... (i + 1) * ranks_per_node - 1).

    ``intra`` is the cost model of one node's group (its ranks_per_node ranks, on the node's own links);
    ``inter`` that of one cross-node group (the ``nodes`` ranks with the same local rank, one per node),
    priced as in a job where every local rank's cross-node group runs at once, so they share the node's
    network links. A unit sharded within its node pays ``intra`` for its gathers and reduce-scatters and
    ``inter`` for the all-reduce of its shard; the whole world group stays ``DeviceInfo.collectives``.
    """

    nodes: int
    ranks_per_node: int
    intra: CollectiveModel
    inter: CollectiveModel

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"topology: {name} must be a positive integer, got {value!r}")
        if self.intra.world_size != self.ranks_per_node:
            raise ValueError(f"topology: the intra-node model is for {self.intra.world_size} ranks, but a node "
                             f"holds {self.ranks_per_node}; measure or describe one node's group")
        if self.inter.world_size != self.nodes:
            raise ValueError(f"topology: the inter-node model is for {self.inter.world_size} ranks, but there are "
                             f"{self.nodes} nodes; measure or describe a group of one rank per node")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
                "intra": self.intra.to_dict(), "inter": self.inter.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Topology":
        missing = [k for k in ("nodes", "ranks_per_node", "intra", "inter") if k not in d]
        if missing:
            raise ValueError(f"topology is missing {missing}")
        return cls(int(d["nodes"]), int(d["ranks_per_node"]), CollectiveModel.from_dict(d["intra"]),
                   CollectiveModel.from_dict(d["inter"]))


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the group's tensors live: CUDA for NCCL, else CPU (no group: CUDA if there is one)."""
    if dist.is_available() and dist.is_initialized():
        nccl = "nccl" in str(dist.get_backend(group))
    else:
        nccl = torch.cuda.is_available()
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


# The all-gather and the reduce-scatter are osdp.comm's: the ones every unit of a run uses (the native
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
    (the all-gather and the reduce-scatter, with ReduceOp.AVG, of ``osdp.comm``'s settings,
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


# --------------------------------------------------------------------------- device

def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class DeviceInfo:
    """What the search needs to know about the machine: per-rank memory, communication, compute."""

    name: str
    # the device's memory per rank where known (a preset's capacity; a size string is parsed), else None;
    # the budget a plan must fit is the search's argument, not this
    memory_bytes: int | None
    world_size: int
    device_type: str  # "cpu" or "cuda"
    collectives: CollectiveModel
    flops: Mapping[str, float] = field(default_factory=dict)  # dtype name -> achievable FLOP/s
    notes: str = ""
    # nodes x ranks per node and the links of each level, for a job spanning several nodes; None: one
    # level (every group of the job priced as ``collectives``)
    topology: Topology | None = None

    def __post_init__(self) -> None:
        if self.memory_bytes is not None:
            object.__setattr__(self, "memory_bytes", parse_size(self.memory_bytes))
        if self.device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type must be 'cpu' or 'cuda', got {self.device_type!r}")
        if self.collectives.world_size != self.world_size:
            raise ValueError(
                f"collective model is for {self.collectives.world_size} ranks, device for {self.world_size}"
            )
        if self.topology is not None and self.topology.world_size != self.world_size:
            raise ValueError(
                f"topology of {self.topology.nodes} nodes x {self.topology.ranks_per_node} ranks is "
                f"{self.topology.world_size} ranks, device for {self.world_size}"
            )

    @property
    def nodes(self) -> int:
        return 1 if self.topology is None else self.topology.nodes

    def flops_for(self, dtype: torch.dtype | str) -> float:
        key = _dtype_name(dtype)
        if key not in self.flops:
            raise KeyError(f"{self.name} has no FLOP/s figure for {key}; known: {sorted(self.flops)}")
        return self.flops[key]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "world_size": self.world_size,
            "device_type": self.device_type,
            "collectives": self.collectives.to_dict(),
            "flops": dict(self.flops),
            "notes": self.notes,
            # only when there is one: descriptions of one level keep the dict (and the cache files) they had
            **({"topology": self.topology.to_dict()} if self.topology is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DeviceInfo":
        missing = [k for k in ("name", "memory_bytes", "world_size", "device_type", "collectives") if k not in d]
        if missing:
            raise ValueError(f"device info is missing {missing}")
        return cls(
            name=str(d["name"]),
            memory_bytes=None if d["memory_bytes"] is None else int(d["memory_bytes"]),
            world_size=int(d["world_size"]),
            device_type=str(d["device_type"]),
            collectives=CollectiveModel.from_dict(d["collectives"]),
            flops={str(k): float(v) for k, v in d.get("flops", {}).items()},
            notes=str(d.get("notes", "")),
            topology=Topology.from_dict(d["topology"]) if d.get("topology") is not None else None,
        )


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
    )


def _device_memory(device: torch.device) -> int | None:
    """A GPU's memory; None on CPU, where ranks share the host's."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


# --------------------------------------------------------------------------- presets

@dataclass(frozen=True)
class DevicePreset:
    """A machine described from published numbers, for planning without the hardware."""

    description: str
    device_type: str
    memory_bytes: int
    flops: Mapping[str, float]
    bus_bandwidth: Mapping[str, float]  # bytes/s, nccl-tests busbw convention
    latency_s: Mapping[str, float]
    max_world_size: int | None = None  # ranks one interconnect domain holds

    def device_info(self, name: str, world_size: int, memory: int | str | None = None) -> DeviceInfo:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if self.max_world_size is not None and world_size > self.max_world_size:
            raise ValueError(
                f"preset {name!r} describes at most {self.max_world_size} ranks ({self.description}); "
                f"for more ranks use a multi-node preset ({', '.join(multi_node_presets())}; or 'h100-ib', "
                "where every ring hop crosses the network)"
            )
        return DeviceInfo(
            name=name,
            memory_bytes=self.memory_bytes if memory is None else parse_size(memory),
            world_size=world_size,
            device_type=self.device_type,
            collectives=CollectiveModel.ring(world_size, self.bus_bandwidth, self.latency_s, f"preset {name}"),
            flops=dict(self.flops),
            notes=self.description,
        )


@dataclass(frozen=True)
class MultiNodePreset:
    """Nodes of one NVLink domain (``node``: its memory, FLOP/s and intra-node figures) joined by a network.

    The network is ``nics_per_node`` NICs each carrying ``nic_bus_bandwidth``
    (bytes/s, nccl-tests' busbw of one NIC). From these:

    * a node's group: the node preset's ring figures at ranks_per_node ranks;
    * a cross-node group (one rank per node): in a job that shards within
      nodes, all ranks_per_node such groups run at once and share the node's
      NICs, so each gets ``nics_per_node * nic_bus_bandwidth / ranks_per_node``
      (one NIC each on a rail-optimised node with a NIC per GPU);
    * the world group: NCCL lays its rings node by node, one channel per NIC,
      and every ring leaves each node once, so each node sends (N-1)/N of the
      message through its NICs, as much as each rank sends: the world's busbw
      is the node's whole NIC bandwidth, capped by the node's own links
      (``min(node busbw, nics_per_node * nic_bus_bandwidth)``); its latency
      is the node's plus the network's. (NVIDIA measures 192 GB/s all-reduce
      busbw on DGX A100 with 8x 200 Gb/s: 8 x 24, below NVLink's ~230;
      NVIDIA/nccl#812.)
    """

    description: str
    node: DevicePreset
    nic_bus_bandwidth: float
    nics_per_node: int
    network_latency_s: float

    @property
    def gpus_per_node(self) -> int:
        assert self.node.max_world_size is not None
        return self.node.max_world_size

    def device_info(
        self, name: str, world_size: int, memory: int | str | None = None, ranks_per_node: int | None = None,
    ) -> DeviceInfo:
        """``world_size`` ranks as nodes of ``ranks_per_node`` (default: full nodes, or one node if fewer)."""
        per_node = self.gpus_per_node
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if ranks_per_node is None:
            ranks_per_node = min(world_size, per_node)
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) \
                or not 1 <= ranks_per_node <= per_node:
            raise ValueError(f"preset {name!r} has {per_node} GPUs per node: ranks_per_node must be 1 to "
                             f"{per_node}, got {ranks_per_node!r}")
        if world_size % ranks_per_node:
            raise ValueError(
                f"preset {name!r}: {world_size} ranks are not whole nodes of {ranks_per_node} ranks; give a "
                f"multiple of {ranks_per_node} (e.g. {(world_size // ranks_per_node + 1) * ranks_per_node}) "
                "or the ranks per node that divide it"
            )
        nodes = world_size // ranks_per_node
        one_node = self.node.device_info(name, ranks_per_node, memory)
        if nodes == 1:
            return replace(one_node, notes=f"one node of: {self.description}")
        network = self.nics_per_node * self.nic_bus_bandwidth
        inter = CollectiveModel.ring(nodes, _same(network / ranks_per_node), _same(self.network_latency_s),
                                     f"preset {name}, across nodes")
        world = CollectiveModel.ring(
            world_size, {c: min(self.node.bus_bandwidth[c], network) for c in COLLECTIVES},
            {c: self.node.latency_s[c] + self.network_latency_s for c in COLLECTIVES}, f"preset {name}",
        )
        return replace(one_node, world_size=world_size, collectives=world, notes=self.description,
                       topology=Topology(nodes, ranks_per_node, one_node.collectives, inter))


def _same(value: float) -> dict[str, float]:
    return dict.fromkeys(COLLECTIVES, value)


GB, GiB, TFLOPS = 10**9, 2**30, 1e12

# Dense peak FLOP/s from NVIDIA's data sheets (they print BF16 "with sparsity": half
# that is the dense figure). Keyed by a part of torch.cuda.get_device_name(); the first
# key found in the name wins, so the variants come before the plain names.
DATASHEET_PEAK_FLOPS: dict[str, dict[str, float]] = {
    # H100 PCIe data sheet: BF16 1,513 TFLOP/s with sparsity, FP32 51.
    "H100 PCIe": {"bfloat16": 756 * TFLOPS, "float32": 51 * TFLOPS},
    # H100 NVL and H200 NVL data sheets: BF16 1,671 with sparsity, FP32 60.
    "H100 NVL": {"bfloat16": 835 * TFLOPS, "float32": 60 * TFLOPS},
    "H200 NVL": {"bfloat16": 835 * TFLOPS, "float32": 60 * TFLOPS},
    # H100 SXM5 ("NVIDIA H100 80GB HBM3") and H200 SXM data sheets: BF16 1,979 with sparsity, FP32 67.
    "H100": {"bfloat16": 989 * TFLOPS, "float32": 67 * TFLOPS},
    "H200": {"bfloat16": 989 * TFLOPS, "float32": 67 * TFLOPS},
    # A100 data sheet (SXM4 and PCIe, 40 and 80 GB): BF16 312 dense, FP32 19.5.
    "A100": {"bfloat16": 312 * TFLOPS, "float32": 19.5 * TFLOPS},
    # V100 SXM2 data sheet: FP16 tensor cores 125, FP32 15.7; no bf16 hardware.
    "V100": {"float16": 125 * TFLOPS, "float32": 15.7 * TFLOPS},
}


def datasheet_peak_flops(device_name: str) -> dict[str, float] | None:
    """Dense peak FLOP/s by dtype name for a GPU named like ``torch.cuda.get_device_name()``, or None."""
    for key, peaks in DATASHEET_PEAK_FLOPS.items():
        if key in device_name:
            return dict(peaks)
    return None


def _achievable(device_name: str) -> dict[str, float]:
    return {k: MFU_FRACTION * v for k, v in DATASHEET_PEAK_FLOPS[device_name].items()}


# Achievable compute = MFU_FRACTION x dense peak from NVIDIA's data sheets: 45% is
# a typical model FLOP utilisation of well-tuned transformer training, not a
# matmul benchmark. fp32 uses the non-tensor-core FP32 peak because PyTorch does
# not use TF32 for fp32 matmuls by default (torch.backends.cuda.matmul.allow_tf32).
MFU_FRACTION = 0.45
# Memory: the data-sheet capacity (HBM is built in binary units, "80 GB" = 80 GiB);
# the CUDA context and allocator fragmentation take 1-2 GiB of it, so pass an
# explicit budget when it matters.
DEVICE_PRESETS: dict[str, DevicePreset | MultiNodePreset] = {
    "h100-nvlink": DevicePreset(
        "8x H100 SXM5 80GB, NVLink 4 + NVSwitch (900 GB/s bidirectional per GPU)",
        "cuda", 80 * GiB,
        _achievable("H100"),
        # NCCL maintainer: "360 GB/s is exactly what we'd expect on H100" for all_gather and
        # all_reduce busbw (NVIDIA/nccl-tests#326); all-reduce reaches ~470 GB/s with
        # NVLink SHARP (NVLS, NVIDIA/nccl-tests#290), which NCCL picks by default on H100.
        {"all_gather": 360 * GB, "reduce_scatter": 360 * GB, "all_reduce": 470 * GB},
        # Small-message time of nccl-tests inside one NVLink node: ~10-30 us.
        _same(20e-6),
        max_world_size=8,
    ),
    "a100-80gb-nvlink": DevicePreset(
        "8x A100 SXM4 80GB, NVLink 3 + NVSwitch (600 GB/s bidirectional per GPU)",
        "cuda", 80 * GiB,
        _achievable("A100"),
        # nccl-tests busbw on 8x A100 SXM4: ~200-250 GB/s (NVIDIA/nccl-tests#149 reports ~200
        # on an HPE Apollo; ~230 is the usual DGX A100 figure). No NVLS on A100.
        _same(230 * GB),
        _same(20e-6),
        max_world_size=8,
    ),
    "a100-40gb-nvlink": DevicePreset(
        "8x A100 SXM4 40GB, NVLink 3 + NVSwitch (600 GB/s bidirectional per GPU)",
        "cuda", 40 * GiB,
        _achievable("A100"),
        _same(230 * GB),  # same fabric as a100-80gb-nvlink
        _same(20e-6),
        max_world_size=8,
    ),
    "v100-32gb-nvlink": DevicePreset(
        "8x V100 SXM2 32GB, NVLink 2 hybrid cube mesh (DGX-1V: 6 links x 25 GB/s per direction)",
        "cuda", 32 * GiB,
        _achievable("V100"),  # no bf16 hardware, so no bfloat16 figure
        # Estimate, not a cited measurement: 150 GB/s per direction x ~0.85, the
        # busbw/link-rate ratio seen on H100 and A100 above.
        _same(130 * GB),
        _same(25e-6),
        max_world_size=8,
    ),
    "h100-ib": DevicePreset(
        "H100 SXM5 80GB ranks talking over 400 Gb/s NDR InfiniBand, one NIC per GPU "
        "(every ring hop crosses the network: one rank per node, or a data-parallel "
        "group strided across nodes)",
        "cuda", 80 * GiB,
        _achievable("H100"),
        # "For NDR @ 400Gbps you should see 46-48GB/s per NIC" (NCCL maintainer,
        # NVIDIA/nccl-tests#290); 50 GB/s is the line rate.
        _same(46 * GB),
        # nccl-tests small-message all-reduce over 2 nodes of NDR: ~46 us (NVIDIA/nccl#1244).
        _same(50e-6),
    ),
    "cpu-loopback": DevicePreset(
        "CPU ranks on one host, gloo over loopback TCP, one thread per rank "
        "(measured 2026-11-22 on a 2-core AMD EPYC KVM guest with 23 GiB, torch 2.13.0+cpu, 2 ranks)",
        "cpu",
        8 * GiB,  # nominal per-rank budget for test-sized models on that host; pass memory=
        # measure_flops(dtype=...) on an otherwise idle core (median of 3 runs): bf16
        # matmuls run ~4.5x faster than fp32 on that CPU (AVX512-BF16).
        {"float32": 98e9, "bfloat16": 445e9},
        # measure_collectives() on 2 gloo ranks, 4 KiB..16 MiB, median of 5 runs; the
        # fitted beta converted to busbw with the 2-rank ring factor. gloo's
        # reduce-scatter reduces a full copy of its input (hence slower than
        # all-reduce here); extrapolating to more ranks assumes ring algorithms,
        # which gloo only approximates.
        {"all_gather": 1.16e9, "reduce_scatter": 0.52e9, "all_reduce": 1.54e9},
        {"all_gather": 340e-6, "reduce_scatter": 600e-6, "all_reduce": 530e-6},
    ),
}


# Multi-node clusters: the NVLink nodes above joined by a network, one level each (see MultiNodePreset).
DEVICE_PRESETS.update({
    "h100-nvlink-ndr400": MultiNodePreset(
        "nodes of 8x H100 SXM5 80GB (NVLink 4 + NVSwitch) joined by 8x 400 Gb/s NDR InfiniBand per node, one "
        "ConnectX-7 NIC per GPU, rail-optimised (DGX H100 / SuperPOD layout)",
        DEVICE_PRESETS["h100-nvlink"],
        # "For NDR @ 400Gbps you should see 46-48GB/s per NIC" (NCCL maintainer, NVIDIA/nccl-tests#290)
        nic_bus_bandwidth=46 * GB,
        nics_per_node=8,
        # nccl-tests small-message all-reduce over 2 nodes of NDR: ~46 us (NVIDIA/nccl#1244)
        network_latency_s=50e-6,
    ),
    "a100-nvlink-hdr200": MultiNodePreset(
        "nodes of 8x A100 SXM4 80GB (NVLink 3 + NVSwitch) joined by 8x 200 Gb/s HDR InfiniBand per node, one "
        "ConnectX-6 NIC per GPU (DGX A100 / SuperPOD layout)",
        DEVICE_PRESETS["a100-80gb-nvlink"],
        # NCCL maintainer: "On an Nvidia DGX-A100 system we have 8x200Gbit/s IB cards and we measure 192GB/s
        # AllReduce BusBW" (NVIDIA/nccl#812): 24 GB/s per NIC, 96% of HDR's 25 GB/s line rate
        nic_bus_bandwidth=24 * GB,
        nics_per_node=8,
        # Estimate: taken as NDR's measured ~46 us (NVIDIA/nccl#1244); a switch hop (~100-200 ns) is small
        # against NCCL's own per-collective cost, which dominates both
        network_latency_s=50e-6,
    ),
    "h100-nvlink-100gbe": MultiNodePreset(
        "nodes of 8x H100 SXM5 80GB (NVLink 4 + NVSwitch) joined by one 100 Gb/s Ethernet NIC per node "
        "(NCCL over TCP sockets, no RDMA)",
        DEVICE_PRESETS["h100-nvlink"],
        # A 100 Gb/s network through NCCL's ring reached 60 Gb/s busbw (NVIDIA/nccl-tests#22, AWS's 100 Gb/s
        # network, NCCL_ALGO ring): 7.5 GB/s, 60% of the 12.5 GB/s line rate. RoCE would reach more (~11).
        nic_bus_bandwidth=7.5 * GB,
        nics_per_node=1,
        # Estimate: twice the 38-46 us of an 8-byte NCCL broadcast between two nodes over TCP sockets
        # (NVIDIA/nccl-tests#82), for an all-reduce's reduce and broadcast passes
        network_latency_s=100e-6,
    ),
})


def list_presets() -> list[str]:
    return sorted(DEVICE_PRESETS)


def multi_node_presets() -> list[str]:
    return sorted(n for n, p in DEVICE_PRESETS.items() if isinstance(p, MultiNodePreset))


def device_preset(
    name: str, world_size: int, memory: int | str | None = None, *, ranks_per_node: int | None = None,
) -> DeviceInfo:
    """DeviceInfo for a named preset at ``world_size`` ranks; ``memory`` overrides the capacity.

    A multi-node preset (``multi_node_presets()``) lays the ranks out as nodes of
    ``ranks_per_node`` (default: its GPUs per node, or one node when fewer ranks);
    the others describe one level of links and take no ``ranks_per_node``.
    """
    if name not in DEVICE_PRESETS:
        raise ValueError(f"unknown device preset {name!r}; known presets: {', '.join(list_presets())}")
    preset = DEVICE_PRESETS[name]
    if isinstance(preset, MultiNodePreset):
        return preset.device_info(name, world_size, memory, ranks_per_node)
    if ranks_per_node is not None:
        raise ValueError(f"preset {name!r} describes one level of links, without nodes: ranks_per_node applies to "
                         f"the multi-node presets ({', '.join(multi_node_presets())})")
    return preset.device_info(name, world_size, memory)
