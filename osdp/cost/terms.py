"""What every price is made of: the optimizer's and reducer's constants, the calibration's parameters
(``Calibration``: FSDP2's runtime costs measured once per machine), a unit's price under one option
(``OptionCost``), a plan's (``Prediction``), and FSDP2's padded sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from osdp.machine.device_info import DeviceInfo
from osdp.schema.plan import (
    MODES,
)

# fp32 state tensors per parameter (momentum, Adam's two moments)
OPTIMIZER_STATES = {"sgd": 0, "sgd-momentum": 1, "adamw": 2}  # by osdp.optim.OPTIMIZERS
# bytes of temporaries per byte of parameter shard in a foreach (CUDA) step: Adam's sqrt(v) list
_FOREACH_TEMPS = {"sgd": 0, "sgd-momentum": 0, "adamw": 1}
_DTYPE_BYTES = {"fp32": 4, "bf16": 2}
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket_cap_mb
DDP_FIRST_BUCKET_BYTES = 2**20  # and its first bucket's (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
_REDUCE_BYTES = 4  # gradients are reduced in fp32 (MixedPrecisionPolicy(reduce_dtype=float32) for bf16)
# osdp's reducer (fsdp_ext.replicate) carries a used flag per replicated parameter in its bucket, fp32
USED_FLAG_BYTES = 4


def reduce_scatter_buffer_bytes(device: DeviceInfo, input_bytes: int, group_size: int) -> int:
    """What a reduce-scatter of ``input_bytes`` over ``group_size`` ranks holds beside its input and output while
    it runs on ``device`` (a ``DeviceInfo``): gloo has none, so on CPU osdp's native one all-reduces a copy of
    the input, and the pairwise one receives N-2 chunks into buffers of their own
    (``osdp.distributed.collectives``); NCCL's holds nothing of its own."""
    if device.device_type != "cpu" or group_size <= 1:
        return 0
    if device.reduce_scatter == "pairwise":
        return input_bytes * (group_size - 2) // group_size
    return input_bytes


@dataclass(frozen=True)
class Calibration:
    """Runtime costs of FSDP2 on one machine and world size, measured once (not per model).

    ``osdp.calibration.measured.measure_calibration`` measures them on the live process
    group with a synthetic model; ``Calibration()`` is the ideal runtime (no
    overheads, full overlap on CUDA, none on CPU), for planning offline.
    """

    # how much longer the job's compute (and optimizer step) takes than the description says: a model is
    # described on one rank with the others idle; in the job every rank computes at once
    compute_scale: float = 1.0

    unit_overhead_s: Mapping[str, float] = field(default_factory=lambda: dict.fromkeys(MODES, 0.0))
    # once per step, charged to the root unit by its mode: the work of a step, not of a unit (FSDP2's root
    # hooks and final callback, DDP's reducer, the ranks meeting); without it a model with fewer units than
    # the calibration nets would be charged too little
    root_overhead_s: Mapping[str, float] = field(default_factory=lambda: dict.fromkeys(MODES, 0.0))
    # per fp32 byte of a unit's FSDP-managed parameters, by mode: what grows with a unit's size beyond the
    # collectives' alpha-beta model (copies into and out of collective buffers, fresh buffers, gloo's
    # in-training behaviour)
    unit_s_per_byte: Mapping[str, float] = field(default_factory=lambda: dict.fromkeys(MODES, 0.0))
    param_overhead_s: float = 0.0  # per parameter tensor of a unit, per step (FSDP's per-parameter work)
    checkpoint_overhead_s: float = 0.0  # per checkpointed unit, per step (beyond the recomputed forward)
    optimizer_tensor_s: float = 0.0  # per parameter tensor, per optimizer step (DTensor dispatch)
    slice_overhead_s: float = 0.0  # per split slice gathered or reduced
    slice_s_per_byte: float = 0.0  # per byte split slices move, beyond the collectives' model
    # fraction of the time a split unit's asynchronous slice collectives run alongside its compute that
    # adds to the step (on CPU gloo's threads compete with compute for the cores; ~0 on CUDA)
    slice_contention: float = 0.0
    overlap: float | None = None  # fraction of a unit's compute that hides its collectives; None: by device
    # fraction of DDP's all-reduce of a bucket, up to the unit's backward time, that runs hidden while the
    # backward goes on (every bucket but the last reduced, which has nothing left to hide behind); beyond
    # ``overlap``, which on CPU is 0: FSDP2's gloo collectives block, DDP's run on gloo's own thread
    ddp_overlap: float = 0.0
    # seconds a rank waits, per square root of the seconds it computed since the ranks last met, at each
    # collective that makes the ranks meet (FSDP2's; DDP's run behind the backward): ranks computing the same
    # work drift apart like a random walk, and every meeting waits for the slowest
    meeting_wait_s_per_sqrt_s: float = 0.0
    margin_bytes: int = 0
    source: str = "ideal FSDP2 runtime (not measured: no overheads, compute as described)"

    def overlap_for(self, device: DeviceInfo) -> float:
        if self.overlap is not None:
            return self.overlap
        return 1.0 if device.device_type == "cuda" else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "compute_scale": self.compute_scale,
            "unit_overhead_s": dict(self.unit_overhead_s),
            "root_overhead_s": dict(self.root_overhead_s),
            "unit_s_per_byte": dict(self.unit_s_per_byte),
            "param_overhead_s": self.param_overhead_s,
            "checkpoint_overhead_s": self.checkpoint_overhead_s,
            "optimizer_tensor_s": self.optimizer_tensor_s,
            "slice_overhead_s": self.slice_overhead_s,
            "slice_s_per_byte": self.slice_s_per_byte,
            "slice_contention": self.slice_contention,
            "overlap": self.overlap,
            "ddp_overlap": self.ddp_overlap,
            "meeting_wait_s_per_sqrt_s": self.meeting_wait_s_per_sqrt_s,
            "margin_bytes": self.margin_bytes,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Calibration":
        return cls(**d)


@dataclass(frozen=True)
class OptionCost:
    """One unit under one option: the three numbers the search adds up, and their parts."""

    time_s: float
    mem_bytes: int
    transient_bytes: int
    parts: Mapping[str, float]


@dataclass
class Prediction:
    step_s: float
    peak_bytes: int
    breakdown: dict[str, Any]


# --------------------------------------------------------------------------- bytes


def _padded_numel(shape: Sequence[int], n: int) -> int:
    """Elements FSDP2 stores for a parameter sharded on n ranks: dim 0 padded to a multiple of n."""
    if not shape:
        return n
    rows = math.ceil(shape[0] / n) * n
    return rows * math.prod(shape[1:])


def _remove(shapes: Sequence[tuple[int, ...]], taken: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    rest = list(shapes)
    for s in taken:
        rest.remove(tuple(s))
    return rest
