"""Named machines to plan for without the hardware (``osdp plan --device h100-80gb``), each number with
its source written next to it: single devices (``DevicePreset``) and clusters of nodes (``MultiNodePreset``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from osdp.machine.collective_model import COLLECTIVES, CollectiveModel, Topology
from osdp.machine.device_info import DeviceInfo
from osdp.machine.workspace import training_workspace_bytes
from osdp.sizes import parse_size


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
    capability: tuple[int, int] | None = None  # a GPU's compute capability: its matmul workspaces' size

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
            # PyTorch's defaults: the environment of the machine planning is not the cluster's
            workspace_bytes=training_workspace_bytes(self.capability, env={}) if self.capability else 0,
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
        capability=(9, 0),
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
        capability=(8, 0),
    ),
    "a100-40gb-nvlink": DevicePreset(
        "8x A100 SXM4 40GB, NVLink 3 + NVSwitch (600 GB/s bidirectional per GPU)",
        "cuda", 40 * GiB,
        _achievable("A100"),
        _same(230 * GB),  # same fabric as a100-80gb-nvlink
        _same(20e-6),
        max_world_size=8,
        capability=(8, 0),
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
        capability=(7, 0),
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
        capability=(9, 0),
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
