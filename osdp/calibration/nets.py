"""What the calibration measures: its synthetic models (``CalibrationNet``, ``MeetingNet``), the profiles that
size the measurement (``PROFILES``: full, or tiny for tests), and the jobs they are trained as.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from osdp.cost.terms import DDP_FIRST_BUCKET_BYTES
from osdp.describe.measured import describe_once
from osdp.describe.units import discover_units
from osdp.fsdp_ext.apply import apply_plan
from osdp.runtime.jobs import Job
from osdp.schema.description import ModelDescription
from osdp.schema.plan import MODES, ROOT, Plan, UnitPlan

PROFILE_ENV = "OSDP_CALIBRATION_PROFILE"


class CalibrationError(RuntimeError):
    """No usable calibration for this job (the message says how to make one)."""


# --------------------------------------------------------------------------- the synthetic model


class _CalibrationBlock(nn.Module):
    def __init__(self, d: int, linears: int):
        super().__init__()
        self.n = linears
        for i in range(linears):  # direct children, so that the block is the unit (a ModuleList has no forward)
            self.add_module(f"fc{i}", nn.Linear(d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for i in range(self.n):
            y = torch.relu(getattr(self, f"fc{i}")(y))
        return x + y


class CalibrationNet(nn.Module):
    """The synthetic model FSDP2's overheads are measured on: ``blocks`` units of ``linears`` Linears each."""

    def __init__(self, blocks: int = 8, d: int = 64, linears: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(_CalibrationBlock(d, linears) for _ in range(blocks))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x).square().mean()


def can_split(device: torch.device) -> bool:
    """Collective: whether this build of osdp applies split plans (every rank finds the same)."""
    net = CalibrationNet().to(device)
    plan = Plan([UnitPlan(u.path, "zero3", split=1 if u.path == ROOT else 2) for u in discover_units(net)])
    try:
        apply_plan(net, plan, device=device)
        return True
    except (RuntimeError, ValueError):
        return False


# --------------------------------------------------------------------------- what is measured


@dataclass(frozen=True)
class NetSpec:
    """One calibration net and the jobs it runs."""

    linears: int  # per unit
    width: int
    batch: int
    modes: tuple[str, ...]  # trained under each
    overheads: bool  # little compute: its mode jobs are the rows per-unit and per-byte costs are fitted on
    checkpoint: bool = False  # also zero3 with every block checkpointed
    split: bool = True  # also zero3 with every block split in 2
    compute: bool = False  # the compute scale is measured on its plain model
    blocks: int = 8  # units besides the root
    # its replicated job is the one DDP's hidden all-reduce (Calibration.ddp_overlap) is fitted on: a job whose
    # model fits DDP's first bucket hides none, and a calibration for it can go without (``needs_ddp_overlap``)
    ddp_buckets: bool = False

    @property
    def name(self) -> str:
        return f"{self.blocks}x{self.linears}x{self.width}b{self.batch}"

    def build(self) -> "CalibrationNet":
        return CalibrationNet(blocks=self.blocks, d=self.width, linears=self.linears)


@dataclass(frozen=True)
class MeetingNet:
    """The transformer the ranks' meeting wait is measured on (``measure_meeting_wait``): the wait depends on
    what the ranks compute between meetings, and a transformer's attention, norms and activations are what
    the planned models compute. Its shape is none of the presets'."""

    n_layer: int
    n_embd: int
    n_head: int
    seq_len: int
    batch: int

    @property
    def name(self) -> str:
        return f"gpt-{self.n_layer}x{self.n_embd}s{self.seq_len}b{self.batch}"

    def build(self) -> nn.Module:
        from osdp.models import build

        return build("gpt2-tiny", n_layer=self.n_layer, n_embd=self.n_embd, n_head=self.n_head,
                     seq_len=self.seq_len)

    def batch_of(self, b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``b`` sequences and their targets (the model returns its loss)."""
        from osdp.models import get_config

        g = torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0)
        vocab = get_config("gpt2-tiny").vocab_size
        ids = torch.randint(0, vocab, (b, self.seq_len + 1), generator=g).to(device)
        return ids[:, :-1], ids[:, 1:]


@dataclass(frozen=True)
class CalibrationProfile:
    """How much to measure: the nets, and seconds per job and for the collectives."""

    name: str
    nets: tuple[NetSpec, ...]
    run_s: float  # timed seconds per job
    min_steps: int
    warmup: int
    collectives_s: float  # the first fit; each re-fit takes half
    refits: int
    describe_repeats: int
    compute_rounds: int
    meeting_net: MeetingNet
    # a calibration whose fixed step varied more than this (``spread``) was measured on a busy machine: it is
    # cached with that noise, and every job that uses it is told; None: not checked (the tiny nets' steps, ~1 ms, are too short to tell)
    busy_spread: float | None = None
    about: str = "a few seconds"  # how long it takes on 2 CPU ranks, as the first run tells the user
    # how long a describe of the model being planned times its steps (``osdp.describe.measured.describe``'s
    # time_budget_s; 0: one timed repeat)
    describe_s: float = 20.0


# 2 and 4 Linears per unit separate per-unit from per-parameter costs; 3 blocks against 8 separate what a
# step costs once from what each unit costs; the wide nets' units (2 MiB, like a small transformer's) are
# 64x larger, which separates per-unit from per-byte costs, of FSDP and of split slices; with a large batch
# the wide net computes ~100x more (the compute scale is measured on it), and its slices' gathers run while
# there is compute to compete with.
FULL = CalibrationProfile(
    "full",
    (
        NetSpec(2, 64, 4, MODES, overheads=True, checkpoint=True),
        NetSpec(4, 64, 4, MODES, overheads=True, checkpoint=True),
        NetSpec(2, 64, 4, MODES, overheads=True, split=False, blocks=3),
        NetSpec(2, 512, 4, MODES, overheads=True),
        NetSpec(2, 512, 64, ("zero3",), overheads=False, compute=True),
        # 8 MiB units, 64 MiB in all: DDP reduces three buckets while backward goes on (longer than their
        # all-reduce, as in a transformer), then the last
        NetSpec(2, 1024, 64, ("replicate",), overheads=False, split=False, ddp_buckets=True),
    ),
    run_s=1.2, min_steps=5, warmup=2, collectives_s=2.0, refits=3, describe_repeats=5, compute_rounds=15,
    meeting_net=MeetingNet(n_layer=2, n_embd=128, n_head=4, seq_len=64, batch=8), busy_spread=1.5,
    about="about a minute",
)

PROFILES = {
    "full": FULL,
    # what a job whose model fits DDP's first bucket needs (the first run of a small model: ``osdp train``'s
    # default): every term but DDP's hidden all-reduce, whose net is the slowest to train, over two rounds of
    # re-fitted collectives instead of three; ``osdp calibrate --full`` measures the rest
    "quick": dataclasses.replace(FULL, name="quick", nets=tuple(n for n in FULL.nets if not n.ddp_buckets),
                                 run_s=1.0, refits=2, about="about 40 s"),
    # for tests: every term measured, at toy sizes, in a few seconds; keyed apart from "full"
    "tiny": CalibrationProfile(
        "tiny",
        (
            NetSpec(2, 64, 2, MODES, overheads=True, checkpoint=True),  # 64 wide: splittable
            NetSpec(4, 64, 2, MODES, overheads=True, checkpoint=True),
            NetSpec(2, 64, 2, MODES, overheads=True, split=False, blocks=3),
            NetSpec(2, 128, 2, MODES, overheads=True),
            NetSpec(2, 128, 32, ("zero3",), overheads=False, compute=True),
        ),
        run_s=0.6, min_steps=5, warmup=1, collectives_s=0.3, refits=2, describe_repeats=3, compute_rounds=9,
        meeting_net=MeetingNet(n_layer=2, n_embd=32, n_head=2, seq_len=16, batch=2),
        # the tests check what a plan does; the plans' speed is judged under the quick profile
        # (tests/cli/test_validate.py), whose describes take their full time
        describe_s=0.0,
    ),
}


def profile_from_env() -> CalibrationProfile:
    name = os.environ.get(PROFILE_ENV) or "full"
    if name not in PROFILES:
        raise CalibrationError(f"{PROFILE_ENV}={name!r}: use one of {sorted(PROFILES)}")
    return PROFILES[name]


def describe_seconds() -> float:
    """How long a describe of the model being planned times its steps: ``OSDP_CALIBRATION_PROFILE``'s
    profile's, else the full profile's."""
    return profile_from_env().describe_s


def profiles_for_job(ddp_overlap: bool) -> tuple[CalibrationProfile, ...]:
    """The profiles whose calibration serves a job, the fullest first (the one measured when none is cached is
    the last): ``OSDP_CALIBRATION_PROFILE``'s when set; else "full", and "quick" where the job does not need
    DDP's hidden all-reduce (``ddp_overlap``: see ``needs_ddp_overlap``)."""
    if os.environ.get(PROFILE_ENV):
        return (profile_from_env(),)
    return (PROFILES["full"],) if ddp_overlap else (PROFILES["full"], PROFILES["quick"])


def needs_ddp_overlap(model: nn.Module) -> bool:
    """Whether a plan for ``model`` can hide DDP's all-reduce behind its backward: only where its replicated
    parameters fill more than DDP's first bucket (every bucket but the last reduces while backward goes on);
    the cost model prices the hidden fraction with ``Calibration.ddp_overlap``."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) > DDP_FIRST_BUCKET_BYTES


def _net_and_batch(spec: NetSpec, device: torch.device) -> tuple[Callable[[], nn.Module], tuple[torch.Tensor]]:
    build = spec.build
    g = torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0)
    return build, (torch.randn(spec.batch, spec.width, generator=g).to(device),)


def calibration_jobs(device: torch.device, profile: CalibrationProfile, *, splits: bool = True) -> dict[str, Job]:
    """The synthetic-model jobs ``fit_calibration`` needs: ``calibration-NET-KIND`` (KIND a mode, ``ckpt``
    or ``split``)."""
    jobs: dict[str, Job] = {}
    for spec in profile.nets:
        build, batch = _net_and_batch(spec, device)
        paths = [u.path for u in discover_units(build())]

        def plan(mode: str, split: int = 1, ckpt: bool = False, b: int = spec.batch) -> Plan:
            return Plan([UnitPlan(p, mode, 1 if p == ROOT else split, ckpt and p != ROOT) for p in paths],
                        batch_size=b)

        for mode in spec.modes:
            jobs[f"calibration-{spec.name}-{mode}"] = Job(build, plan(mode), batch)
        if spec.checkpoint:
            jobs[f"calibration-{spec.name}-ckpt"] = Job(build, plan("zero3", ckpt=True), batch)
        if spec.split and splits:
            jobs[f"calibration-{spec.name}-split"] = Job(build, plan("zero3", split=2), batch)
    return jobs


def describe_nets(device: torch.device, profile: CalibrationProfile, *, optimizer: str = "adamw") -> dict[str, ModelDescription]:
    """Collective: the calibration nets' descriptions, made as the planner makes them
    (``osdp.describe.measured.describe_once``: rank 0 alone)."""
    descriptions = {}
    for spec in profile.nets:
        build, batch = _net_and_batch(spec, device)
        torch.manual_seed(0)
        descriptions[spec.name] = describe_once(
            build().to(device), batch, cache=False, progress=False, optimizers=(optimizer,),
            repeats=profile.describe_repeats,
            checkpoint_policies=("full",),  # the calibration's jobs checkpoint in full only
        )
    return descriptions


def _described_compute_s(description: ModelDescription, b: int) -> float:
    return sum(c.fwd_s(b) + c.bwd_s(b) for c in description.costs("fp32"))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
