"""``DeviceInfo``: what the search needs to know about the machine (per-rank memory, communication, compute),
measured (``machine.measure``) or from a named preset (``machine.presets``), as plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from osdp.machine.collective_model import CollectiveModel, Topology
from osdp.sizes import parse_size


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
    # bytes each rank's math libraries hold for the whole run, in every plan's peak (CUDA: the cuBLAS and
    # cuBLASLt workspaces, ``osdp.machine.workspace``; 0 on the CPU)
    workspace_bytes: int = 0
    # the reduce-scatter CPU ranks run (``osdp.distributed.collectives``): "native", gloo's all-reduce of a copy
    # of its input, or "pairwise", whose extra buffers are (N-2)/N of it: what it holds beside its input
    reduce_scatter: str = "native"

    def __post_init__(self) -> None:
        if self.memory_bytes is not None:
            object.__setattr__(self, "memory_bytes", parse_size(self.memory_bytes))
        if self.device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type must be 'cpu' or 'cuda', got {self.device_type!r}")
        if isinstance(self.workspace_bytes, bool) or not isinstance(self.workspace_bytes, int) \
                or self.workspace_bytes < 0:
            raise ValueError(f"workspace_bytes must be a non-negative integer, got {self.workspace_bytes!r}")
        if self.reduce_scatter not in ("native", "pairwise"):
            raise ValueError(f"reduce_scatter must be 'native' or 'pairwise', got {self.reduce_scatter!r}")
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
            **({"workspace_bytes": self.workspace_bytes} if self.workspace_bytes else {}),
            **({"reduce_scatter": self.reduce_scatter} if self.reduce_scatter != "native" else {}),
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
            workspace_bytes=int(d.get("workspace_bytes", 0)),
            reduce_scatter=str(d.get("reduce_scatter", "native")),
        )
