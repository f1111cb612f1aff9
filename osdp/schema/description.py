"""What the cost model knows about a model: the description schema.

A ``ModelDescription`` lists a model's units (``osdp.describe.units``), bottom-up with
the root last; each ``UnitProfile`` holds the unit's parameter shapes and, per
precision, its ``UnitWorkload``: compute seconds and activation bytes as
``Affine`` functions of the micro-batch size. ``osdp.describe.measured.describe``
measures one, ``osdp.describe.analytic.describe_analytic`` derives one; ``osdp.cost``
prices plans from it. Plain data, JSON in and out (the describe cache).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from osdp.schema.plan import display_path

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
PHASES = ("fwd", "bwd")


@dataclass(frozen=True)
class Affine:
    """``intercept + slope * b``: a cost as a function of the micro-batch size b."""

    intercept: float
    slope: float

    def __call__(self, b: float) -> float:
        return self.intercept + self.slope * b

    def bytes(self, b: float) -> int:
        """As whole bytes, rounded up and never negative."""
        return max(0, self.signed_bytes(b))

    def signed_bytes(self, b: float) -> int:
        """As whole bytes, rounded up (for net amounts, which may be negative)."""
        return math.ceil(self(b) - 1e-6)

    @classmethod
    def fit(cls, xs: Sequence[float], ys: Sequence[float]) -> "Affine":
        """Least squares over the measured sizes; one size gives a line through the origin."""
        xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
        if len(set(xs.tolist())) < 2:
            return cls(0.0, float(ys.mean() / xs.mean()))
        dx = xs - xs.mean()  # centred: exact for points on a line (byte counts are)
        slope = float((dx * (ys - ys.mean())).sum() / (dx * dx).sum())
        return cls(float(ys.mean() - slope * xs.mean()), slope)


@dataclass(frozen=True)
class UnitWorkload:
    """One unit's compute and activation costs at one precision, per micro-batch size."""

    fwd_s: Affine
    bwd_s: Affine
    act_bytes: Affine  # saved for backward by this unit
    ckpt_bytes: Affine  # kept instead when the unit is checkpointed: its inputs nobody else saves
    # Peak working set (its own live saved bytes + all temporaries) while the unit's forward,
    # backward, or recomputed forward and backward (when checkpointed) run; for units other than
    # the root, net of the root's activations that do not exist at that moment (see _working_sets).
    fwd_peak_bytes: Affine
    bwd_peak_bytes: Affine
    recompute_peak_bytes: Affine
    bwd_end_bytes: Affine  # the working set (likewise net) when its backward ends
    # The root's backward working set by where it runs (bwd_peak_bytes is their largest): before any other unit's
    # backward (the loss, and the head after the last unit), between two of theirs, and after them all (the
    # embedding before the first unit). None: other units, and older descriptions (priced at bwd_peak_bytes
    # wherever the root's backward may run)
    bwd_head_bytes: Affine | None = None
    bwd_between_bytes: Affine | None = None
    bwd_tail_bytes: Affine | None = None
    # The most rows (tokens) one call of an nn.Linear of the unit took: a split Linear's loop makes each slice's
    # output and output gradient that tall (osdp.cost.unit prices them). None: older descriptions
    split_rows: Affine | None = None
    fwd_flops: Affine | None = None  # analytic descriptions only
    bwd_flops: Affine | None = None
    # What checkpointing adds to the unit's backward: its forward redone, measured (the recompute
    # stops once the last tensor backward needs is rebuilt, so it is cheaper than the forward);
    # None (analytic descriptions, units that cannot be checkpointed): the forward time.
    recompute_s: Affine | None = None
    # Selective checkpointing (osdp.describe.recompute: attention and every other matmul output kept, the rest
    # recomputed): what the unit keeps then (its inputs and those outputs), and what it adds to the backward.
    # None: not described (older descriptions; units that cannot be checkpointed), so not offered.
    sac_bytes: Affine | None = None
    sac_recompute_s: Affine | None = None
    # Of sac_bytes, what the unit's own backward does not save (its last matmul's output): the checkpoint's
    # cache holds it through the unit's backward, beside the backward's working set.
    sac_unsaved_bytes: Affine | None = None
    # False: the forward writes to one of the unit's inputs in place before its backward, or to a buffer of the
    # model (spectral_norm's power iteration), so a checkpoint's recompute would read what was written
    # (osdp.describe.attribution.InPlaceWrites): offered no checkpoint
    checkpointable: bool = True
    # True: the model's own reentrant checkpoint runs the unit's forward without autograd, then again in backward
    # (``torch.utils.checkpoint(..., use_reentrant=True)``, Hugging Face's ``gradient_checkpointing_enable()``)
    run_in_backward: bool = False
    # True: no forward of the unit takes an input that requires grad (token ids, a frozen part's output), so FSDP2
    # reduces its gradients only in the root's final callback: its unsharded parameters and gradients stay from its
    # backward to the end of the whole backward (FSDPParamGroup registers its post-backward on those inputs)
    reduced_at_end: bool = False

    def recompute_seconds(self, b: float, policy: str = "full") -> float:
        """What checkpointing under ``policy`` ("full" or "selective") adds to the unit's backward."""
        if policy == "selective":
            return self.sac_recompute_s(b)
        return (self.recompute_s or self.fwd_s)(b)

    def kept_bytes(self, b: float, policy: str) -> int:
        """Activation bytes the unit keeps from its forward to its backward under checkpoint ``policy``."""
        kept = {"none": self.act_bytes, "full": self.ckpt_bytes, "selective": self.sac_bytes}[policy]
        return kept.bytes(b)


@dataclass(frozen=True)
class UnitProfile:
    """A unit (``osdp.describe.units.Unit``) with its parameter shapes and its costs per precision."""

    path: str
    module_type: str
    signature: str
    numel: int
    param_bytes: int
    param_shapes: tuple[tuple[int, ...], ...]  # own parameters
    split_shapes: tuple[tuple[int, int], ...]  # weights a split plan turns into SplitLinear
    nested: tuple[str, ...]
    costs: Mapping[str, UnitWorkload]  # precision -> its workload (per block where the unit is a group)
    # The units of the group this unit stands for (k consecutive identical blocks as one FSDP2 unit: ``UnitPlan.
    # group``), the first (its path) first; () for a unit of its own. Its parameter shapes are all the blocks',
    # its costs one block's: the cost model prices the k blocks' compute and activations, and the group's
    # gathers and fixed costs once (``osdp.describe.granularity.grouped``).
    group: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return display_path(self.path)

    @property
    def blocks(self) -> int:
        """How many identical blocks the unit is: 1, or k for a group of k."""
        return max(1, len(self.group))


@dataclass
class ModelDescription:
    """What the cost model knows about a model: its units, bottom-up with the root last."""

    model: str
    signature: str  # osdp.describe.units.structure_signature of the model
    units: list[UnitProfile]
    batch_sizes: tuple[int, ...]  # the micro-batch sizes measured
    precisions: tuple[str, ...]
    optimizer_s_per_byte: Mapping[str, float]  # optimizer -> step seconds per fp32 parameter byte
    source: str  # "measured on ..." or "analytic: ..."
    device: str
    torch_version: str = torch.__version__
    input_spec: str = ""
    # bytes of the example input per sample (its storages): the batch is live through the step
    input_bytes_per_sample: float = 0.0
    # bytes of what the model returns per sample (its storages, but the parameters' and the input's): the training
    # loop holds the output through backward and into the next forward (osdp.describe.batch.held_output_bytes)
    output_bytes_per_sample: float = 0.0
    # bytes of the model's buffers (each storage once, but a parameter's): every rank holds all of them all step,
    # whatever the plan (FSDP2 shards parameters only), so they are priced apart from any unit's activations
    # (osdp.describe.batch.buffer_bytes); 0 in older descriptions
    buffer_bytes: int = 0
    forward_order: tuple[str, ...] = ()  # units in the order their forward ends (FSDP2 prefetches backward by it)
    checks: Mapping[str, Any] = field(default_factory=dict)  # whole step vs sum of units, per precision and size
    profile_seconds: float = 0.0
    cache_key: str | None = None
    granularity: str = "sub-block"  # of the default units (osdp.describe.units.GRANULARITIES), or "given"
    routed: tuple[str, ...] = ()  # containers whose members the forward calls depending on the data (Plan.routed)
    from_cache: bool = False

    def unit(self, path: str) -> UnitProfile:
        for u in self.units:
            if u.path == path:
                return u
        raise KeyError(f"no unit '{display_path(path)}' in the description of {self.model}")

    @property
    def paths(self) -> list[str]:
        return [u.path for u in self.units]

    def costs(self, precision: str) -> list[UnitWorkload]:
        if precision not in self.precisions:
            raise KeyError(
                f"the description of {self.model} was made for {list(self.precisions)}, not {precision}; "
                f"describe it with precisions=(..., '{precision}')"
            )
        return [u.costs[precision] for u in self.units]

    # -- JSON ---------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("from_cache")
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelDescription":
        def affine(x: Any) -> Affine | None:
            return None if x is None else Affine(**x)

        def costs(c: Mapping[str, Any]) -> UnitWorkload:
            return UnitWorkload(**{k: v if k in ("checkpointable", "run_in_backward", "reduced_at_end") else affine(v) for k, v in c.items()})

        units = [
            UnitProfile(
                **{
                    **u,
                    "param_shapes": tuple(tuple(s) for s in u["param_shapes"]),
                    "split_shapes": tuple(tuple(s) for s in u["split_shapes"]),
                    "nested": tuple(u["nested"]),
                    "group": tuple(u.get("group", ())),
                    "costs": {p: costs(c) for p, c in u["costs"].items()},
                }
            )
            for u in d["units"]
        ]
        rest = {k: v for k, v in d.items() if k != "units"}
        rest["batch_sizes"] = tuple(rest["batch_sizes"])
        rest["precisions"] = tuple(rest["precisions"])
        rest["forward_order"] = tuple(rest.get("forward_order", ()))
        rest["routed"] = tuple(rest.get("routed", ()))
        return cls(units=units, **rest)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "ModelDescription":
        return cls.from_dict(json.loads(text))


__all__ = ["PHASES", "PRECISIONS", "Affine", "ModelDescription", "UnitProfile", "UnitWorkload"]
