"""What a collective costs: alpha-beta per collective and message size, per group of ranks, and the
topology of a job over several nodes (the ranks of a node and the link between nodes).

Plain data (``to_dict``/``from_dict``), measured by ``machine.measure`` or taken from a preset
(``machine.presets``), so that a plan can be made offline and reproduced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
from scipy.optimize import nnls

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
