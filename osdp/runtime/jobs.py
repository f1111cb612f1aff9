"""Train several jobs side by side, one step of each in turn: ``run_jobs``.

On a shared machine the load changes within seconds, and gloo's blocking
collectives suffer from it far more than compute. Timing plans one after
another lets each see a different machine; here every job's model exists at
once and the jobs take one step each in turn, so that all of them see the
same load. Not too many at once, though: a model that allocates large
buffers finds less of the memory it freed ready to reuse when others live
in the process, and pays page faults each step. On gpt2-cpu-medium (2 CPU
ranks) the plan gathering blocks two at a time took 1.31-1.44 s a step
with all sixteen validated plans alive, 1.20-1.26 s among four, 1.03 s
alone, the others within about 10%: ``at_once`` bounds the models alive,
group after group. The calibration (``osdp.calibration``), the validation
(``osdp.cli.validate``) and the experiments measure with it.

A ``Job`` is a model builder, a plan (``None``: the plain model, not wrapped)
and this rank's batch. Per job ``run_jobs`` reports the median over steps of
the slowest rank's step time (and of its forward and backward), and the
largest peak over ranks of one step under ``osdp.machine.memory.PeakMemory``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from osdp.describe.units import discover_units
from osdp.distributed import all_gather_objects
from osdp.fsdp_ext.apply import apply_plan
from osdp.machine.memory import PeakMemory, iter_tensors
from osdp.optim import make_optimizer
from osdp.runtime.step import train_step
from osdp.schema.plan import ROOT, Plan


@dataclasses.dataclass
class Job:
    """A model to train: how to build it, how to make it data parallel, this rank's batch.

    ``plan``: applied with ``osdp.wrap``. ``parallelize``: any other way, a
    function of the built model returning the module to train (a baseline as
    users write it, say). Neither: the plain model, no communication; with
    ``lockstep`` the ranks meet (a one-element all-reduce) where every unit
    but the root starts its forward and its backward, as they do under any plan.
    """

    build: Callable[[], nn.Module]
    plan: Plan | None
    batch: Any
    lockstep: bool = False
    parallelize: Callable[[nn.Module], nn.Module] | None = None

    @property
    def parallel(self) -> bool:
        return self.plan is not None or self.parallelize is not None


class _Trainer:
    """One job's model, wrapped by its plan, and its optimizer: steps on demand."""

    def __init__(self, job: Job, device: torch.device, optimizer: str, loss_fn: Callable | None):
        self.job, self.device, self.loss_fn = job, device, loss_fn
        self.model = job.build().to(device)
        if job.plan is not None:  # what osdp.wrap(model, plan=...) does (the planner measures with this harness)
            apply_plan(self.model, job.plan, device=device)
        elif job.parallelize is not None:
            self.model = job.parallelize(self.model)
        elif job.lockstep:
            meet_at_every_unit(self.model)
        self.optimizer = make_optimizer(optimizer, self.model.parameters())

    def step(self) -> tuple[float, float]:
        """(step seconds, forward + backward seconds)."""
        with quiet_meetings():
            times = train_step(self.model, self.job.batch, self.optimizer, loss_fn=self.loss_fn, device=self.device)
        return times.seconds, times.fwd_bwd_seconds

    def peak(self) -> dict[str, Any]:
        """One step under ``PeakMemory`` (slower: not timed)."""
        with PeakMemory(self.device, self.model, self.optimizer, *iter_tensors(self.job.batch)) as meter:
            self.step()
        stats = meter.stats()
        return {"peak_bytes": stats.peak_bytes, "peak_breakdown": dict(stats.peak_breakdown)}


@contextlib.contextmanager
def quiet_meetings() -> Iterator[None]:
    """Silences the warning of the meetings' backward hooks on units whose inputs need no gradient."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        yield


def meet_at_every_unit(model: nn.Module) -> None:
    """Make the ranks meet (a one-element all-reduce) where every unit but the root starts its forward and
    its backward, as FSDP2's collectives make them meet under any plan."""
    token = torch.zeros(1, device=next(model.parameters()).device)

    def meet(*_: Any) -> None:
        dist.all_reduce(token)

    modules = dict(model.named_modules())
    for unit in discover_units(model):
        if unit.path != ROOT:
            modules[unit.path].register_forward_pre_hook(meet)
            modules[unit.path].register_full_backward_pre_hook(meet)


SETUP_SHARE = 0.2  # of run_jobs' time, building the jobs and their warm-up steps (measured on the calibration's)


def run_jobs(
    jobs: dict[str, Job],
    *,
    device: torch.device,
    optimizer: str = "adamw",
    time_budget_s: float = 4.0,
    warmup: int = 2,
    min_steps: int = 5,
    max_steps: int = 200,
    rounds: int = 4,
    each_round: Callable[[], None] | None = None,
    progress: Callable[[str, float], None] | None = None,
    loss_fn: Callable | None = None,
    measure_peak: bool = True,
    at_once: int | None = None,
    passes: int = 1,
) -> dict[str, dict[str, Any]]:
    """Collective: train every job side by side, one step of each in turn; times and peak memory.

    ``time_budget_s`` is the timed seconds per job (within ``min_steps`` ..
    ``max_steps`` steps each, agreed by all ranks); ``each_round()`` runs
    ``rounds`` times spread over them. Per job: the median over steps of the
    slowest rank's time (and that time for each step, in order: the jobs' i-th
    steps ran one after another, so they pair), and (``measure_peak``) the largest peak over ranks of
    one tracked step (CPU tracking slows a step, so it is not timed). ``progress(message, fraction)`` hears
    what is done, with the fraction of the whole. ``at_once``: at most this many models alive at a time: the jobs
    run in consecutive groups of that many, each group side by side, ``passes`` times over (each model built
    afresh, the time budget shared out), so that a machine whose speed drifts over minutes slows every group
    alike; the steps of all passes pooled, the peak from the first.
    """
    if at_once is not None and at_once < 1:
        raise ValueError(f"at_once={at_once}: at least one model must be alive at a time (None: all at once)")
    if passes < 1:
        raise ValueError(f"passes={passes}: the jobs must run at least once")
    names = list(jobs)
    at_once = at_once or max(1, len(names))  # all at once (none: no group to run)
    groups = [names[i:i + at_once] for i in range(0, len(names), at_once)] * passes
    parts: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for g, group in enumerate(groups):
        def part(message: str, fraction: float, g: int = g) -> None:
            progress(message if len(groups) == 1 else f"group {g + 1}/{len(groups)}: {message}",
                     (g + fraction) / len(groups))

        out = _side_by_side({n: jobs[n] for n in group}, device=device, optimizer=optimizer,
                            time_budget_s=time_budget_s / passes, warmup=warmup, min_steps=min_steps,
                            max_steps=max_steps, rounds=rounds, each_round=each_round,
                            progress=part if progress else None, loss_fn=loss_fn,
                            measure_peak=measure_peak and g < len(groups) // passes)
        for name, measured in out.items():
            parts[name].append(measured)
    return {name: _pooled(measured) for name, measured in parts.items()}


def _pooled(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """One job's measurements over its passes: medians over the steps of all, the peak of the first."""
    steps = [t for p in passes for t in p["step_s_each"]]
    fwd_bwd = [t for p in passes for t in p["fwd_bwd_s_each"]]
    return {**passes[0], "measured_step_s": statistics.median(steps), "measured_fwd_bwd_s": statistics.median(fwd_bwd),
            "step_s_each": steps, "fwd_bwd_s_each": fwd_bwd, "steps": len(steps)}


def _side_by_side(
    jobs: dict[str, Job],
    *,
    device: torch.device,
    optimizer: str,
    time_budget_s: float,
    warmup: int,
    min_steps: int,
    max_steps: int,
    rounds: int,
    each_round: Callable[[], None] | None,
    progress: Callable[[str, float], None] | None,
    loss_fn: Callable | None,
    measure_peak: bool,
) -> dict[str, dict[str, Any]]:
    """Collective: one group of ``run_jobs``, all alive at once: per job its slowest rank's time of each step."""
    trainers = {}
    for i, (name, job) in enumerate(jobs.items()):
        if progress:
            progress(f"setting up {i + 1}/{len(jobs)} {name}", SETUP_SHARE * i / len(jobs))
        trainers[name] = _Trainer(job, device, optimizer, loss_fn)
    warm = {name: [t.step()[0] for _ in range(warmup)][-1] for name, t in trainers.items()}
    wanted = int(time_budget_s * len(jobs) / max(sum(warm.values()), 1e-9))
    steps = max(min_steps, min(max_steps, max(all_gather_objects(wanted))))
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in jobs}
    for s in range(steps):
        if each_round is not None and s % max(1, steps // rounds) == 0:
            each_round()
        for name, trainer in trainers.items():
            times[name].append(trainer.step())
        if progress and (s + 1) % max(1, steps // 10) == 0:
            progress(f"step {s + 1}/{steps} of every job", SETUP_SHARE + (1 - SETUP_SHARE) * (s + 1) / steps)
    out = {}
    for name, trainer in trainers.items():
        tracked = measure_peak and trainer.job.parallel
        peak = trainer.peak() if tracked else {"peak_bytes": None, "peak_breakdown": None}
        ranks = all_gather_objects({"times": times[name], **peak})
        # the step of a synchronised job takes as long as its slowest rank's
        step_s, fwd_bwd_s = ([max(t[i] for t in ts) for ts in zip(*(r["times"] for r in ranks))] for i in (0, 1))
        out[name] = {
            "step_s_each": step_s,  # in step order
            "fwd_bwd_s_each": fwd_bwd_s,
            "measured_peak_bytes": max((r["peak_bytes"] or 0) for r in ranks),
            "per_rank": [{k: v for k, v in r.items() if k != "times"} for r in ranks],
        }
    del trainers
    gc.collect()  # FSDP state holds reference cycles
    return out


__all__ = ["Job", "meet_at_every_unit", "run_jobs"]
