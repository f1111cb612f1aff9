"""From a model and a budget to a Plan: describe, cost, search.

``osdp.plan(model, device_mem=..., example_input=...)`` measures the model
(``osdp.describe``), takes the machine's calibration (``osdp.calibration``:
collectives and FSDP2's runtime costs, cached per machine, backend, world size,
threads and torch), builds one search problem per candidate micro-batch size
with the cost model (``osdp.cost``), and returns the fastest plan (most
samples/s) whose predicted peak fits the budget. In a multi-rank job the model
is described and searched on rank 0 only, and the plan (or rank 0's error) is
broadcast, so every rank ends with the same plan or the same error.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Sequence

import numpy as np
import torch
import torch.nn as nn

from osdp._moved import old_names
from osdp.cost.context import scope_option_sets
from osdp.cost.problem import build_block_problem, build_problems, plan_from_choice
from osdp.cost.schedule import predict
from osdp.cost.terms import Calibration, Prediction
from osdp.describe import granularity
from osdp.describe.analytic import describe_analytic
from osdp.describe.batch import ProfileError, batch_size_of, call_model, kept_for_backward, without_grad
from osdp.describe.kept import quietly, rng_kept
from osdp.describe.measured import describe_once
from osdp.describe.units import (
    GRANULARITIES,
    CallTrace,
    enclosing,
    routed_containers,
    structure_signature,
    trace_calls,
    uneven_calls,
)
from osdp.distributed import all_gather_objects, broadcast_object, ensure_process_group, job_device, world
from osdp.fsdp_ext.meta import built_on_meta, check_built_alike
from osdp.log import Progress
from osdp.machine.device_info import DeviceInfo
from osdp.machine.memory import iter_tensors, map_tensors
from osdp.machine.presets import device_preset
from osdp.schema.description import ModelDescription
from osdp.schema.plan import GROUP_CHOICES, Plan
from osdp.search import BudgetTooSmall, FrontierPoint, Problem, min_peak, pareto_frontier
from osdp.search.relaxation import relaxation
from osdp.search.solver import Solution, best_of
from osdp.sizes import parse_size


@dataclass
class SearchResult:
    plan: Plan
    description: ModelDescription  # the description (unit granularity) the plan was found in
    problems: list[Problem]  # per candidate micro-batch size and description: osdp.cost.problem.build_problems
    search_seconds: float

    def frontier(self, max_peak: int | None = None) -> list[FrontierPoint]:
        """Throughput vs memory over every candidate batch size and granularity (Pareto-optimal points)."""
        return pareto_frontier(self.problems, max_peak=max_peak)


# The search adds up each unit's memory at its fullest (``osdp.cost``: a bound), which can be well over the peak
# of the plan's schedule (``osdp.cost.schedule.schedule_peak``: a unit holding its activations never meets one holding its
# gradients from the same moment of the step). Where memory binds, the solver runs at bounds on a fixed geometric
# grid (steps of RELAXED_STEP, the same for every budget, so that more memory never gives a slower plan), from
# RELAXED_BOUND times the budget down, each plan priced on the schedule: the first that fits the budget is taken,
# or the solver's plan at the budget itself where that is faster.
RELAXED_BOUND = 1.25
RELAXED_STEP = 1.05


@dataclass
class _Found:
    plan: Plan  # the units' decisions, batch size and precision; find_plan() adds the rest
    description: ModelDescription  # what prices it (osdp.cost.schedule.predict), as ``description_of`` gives
    prediction: Prediction

    @property
    def samples_per_s(self) -> float:
        return self.plan.batch_size / self.prediction.step_s


def find_plan(
    descriptions: ModelDescription | Sequence[ModelDescription],
    device_info: DeviceInfo,
    batch_sizes: Sequence[int],
    *,
    budget: int | str,
    calibration: Calibration | None = None,
    mixed_precision: str = "fp32",
    optimizer: str = "adamw",
    model_signature: str | None = None,
    group_blocks: bool = False,
) -> SearchResult:
    """The plan with the most samples/s on ``device_info`` whose predicted peak per rank fits ``budget``,
    priced with ``calibration`` (None: the ideal FSDP2 runtime, ``Calibration()``).

    ``group_blocks`` also searches plans gathering k consecutive identical blocks as one FSDP2 unit (k in
    GROUP_CHOICES), taken where predicted faster. Off by default: on 2 CPU ranks the pricing of a group does
    not agree with measurement yet (validation runs 29-31: grouped zero3 blocks of gpt2-cpu-medium predicted
    4-7% faster than per-sub-block FSDP and measured 12-16% slower).

    Several descriptions of one model, one per unit granularity
    (``planning_descriptions``), let the search choose the unit size too: for
    the whole model ("sub-block", "block"), and per block where the "block" and
    "nested" descriptions are both given (``osdp.cost.problem.build_block_problem``); the plan with
    the fewest sharded units, then units, among those within ``GRANULARITY_TOLERANCE`` of the
    fastest wins (``choose_granularity``). Each granularity's plan is the fastest plan memory does not
    constrain where its schedule peak (``osdp.cost.schedule.predict``) fits, else the
    faster of the solver's plan at the budget and at the largest additive bound
    on a fixed grid up to ``RELAXED_BOUND`` times the budget, where their
    schedule peaks fit: the plan
    reports exactly what ``predict`` gives for it. BudgetTooSmall only if none
    fits, naming a budget at which one does.
    """
    if isinstance(descriptions, ModelDescription):
        descriptions = [descriptions]
    budget = parse_size(budget)
    pricing = _Pricing(device_info, mixed_precision, optimizer, calibration, budget)
    settings = dict(precision=mixed_precision, optimizer=optimizer, calibration=calibration)
    candidates = _candidates(descriptions, device_info, batch_sizes, settings)
    grouped = _grouped_candidates(descriptions, device_info, batch_sizes, settings) if group_blocks else []
    start = time.perf_counter()  # the search's time: solving and pricing plans, not building the problems
    found = [f for problems, describe in candidates if (f := pricing.fastest_fitting(problems, describe))]
    best = found[choose_granularity([(f.plan, f.samples_per_s) for f in found])] if found else None
    # a grouped plan replaces the plan chosen without groups only where predicted faster: no other needs finding
    beat = best.samples_per_s if best else None
    found_grouped = [f for problems, describe in grouped if (f := pricing.fastest_fitting(problems, describe, beat))]
    fastest_grouped = max(found_grouped, key=lambda f: f.samples_per_s, default=None)
    if fastest_grouped is not None and (best is None or fastest_grouped.samples_per_s > best.samples_per_s):
        best = fastest_grouped
    found += found_grouped
    candidates += grouped
    seconds = time.perf_counter() - start
    if best is None:  # names a budget at which a plan is found: the least schedule peak of those plans
        least = min(pricing.least_bound_plans, key=lambda f: f.prediction.peak_bytes)
        raise BudgetTooSmall(budget, least.prediction.peak_bytes, least.plan.batch_size)
    speeds = [(f.description, f.samples_per_s) for f in found]
    plan = dataclasses.replace(
        granularity.expand_groups(best.plan, best.description),
        world_size=device_info.world_size,
        # the prediction is for this node layout (each level's links): the plan says so, and wrap checks it
        ranks_per_node=device_info.topology.ranks_per_node if device_info.topology is not None else None,
        model_signature=model_signature,
        routed=list(best.description.routed),
        predicted_step_s=best.prediction.step_s,
        predicted_peak_bytes=best.prediction.peak_bytes,
        search_seconds=seconds,
        meta={
            "budget_bytes": budget,
            "device": device_info.name,
            "calibration": (calibration or Calibration()).source,
            "optimizer": optimizer,
            **_why(best, speeds),
        },
    )
    return SearchResult(plan, best.description, [p for problems, _ in candidates for p in problems], seconds)


def _why(best: _Found, speeds: list[tuple[ModelDescription, float]]) -> dict[str, Any]:
    """What a plan's meta says of its prediction and of the granularities it was chosen among."""
    return {
        # the search's additive bound on the peak, and when in the step the predicted peak is reached
        "bound_peak_bytes": best.prediction.breakdown["bound_peak_bytes"],
        "peak_moment": best.prediction.breakdown["peak_moment"],
        "predicted_samples_per_s": best.samples_per_s,
        "granularity": best.description.granularity,
        # what each granularity's best plan was predicted to do: why this one was taken
        "samples_per_s_by_granularity": {d.granularity: speed for d, speed in speeds},
    }


Describer = Callable[[Plan], ModelDescription]  # the description that prices a plan of a candidate's problems


def _candidates(descriptions: Sequence[ModelDescription], device_info: DeviceInfo, batch_sizes: Sequence[int],
                settings: dict[str, Any]) -> list[tuple[list[Problem], Describer]]:
    """The problems to solve, per granularity over every batch size, each with what prices its plans: one
    description each, and (with the "block" and "nested" descriptions) each block whole or apart."""
    scopes = scope_option_sets(device_info, settings["precision"])  # one mesh a plan: their problems apart
    candidates: list[tuple[list[Problem], Describer]] = [
        ([p for b in batch_sizes for options in scopes
          for p in build_problems(d, device_info, b, options=options, **settings)], lambda _, d=d: d)
        for d in descriptions if d.granularity != "nested"  # priced per block, with the "block" description
    ]
    by_granularity = {d.granularity: d for d in descriptions}
    coarse, nested = by_granularity.get("block"), by_granularity.get("nested")
    if coarse is not None and nested is not None:
        def per_block(plan: Plan) -> ModelDescription:  # with every block whole, the "block" description's
            apart = granularity.apart_in(plan, coarse, nested)
            return granularity.compose(coarse, nested, apart) if apart else coarse

        candidates.append(
            ([build_block_problem(coarse, nested, device_info, b, options=options, **settings)
              for b in batch_sizes for options in scopes], per_block)
        )
    return candidates


def _grouped_candidates(descriptions: Sequence[ModelDescription], device_info: DeviceInfo,
                        batch_sizes: Sequence[int], settings: dict[str, Any]) -> list[tuple[list[Problem], Describer]]:
    """Like ``_candidates``, with k consecutive identical blocks as one unit (k in GROUP_CHOICES), where a
    description has them."""
    scopes = scope_option_sets(device_info, settings["precision"])
    return [
        ([p for b in batch_sizes for options in scopes
          for p in build_problems(g, device_info, b, options=options, **settings)], lambda _, g=g: g)
        for d in descriptions if d.granularity != "nested" for k in GROUP_CHOICES[1:]
        if (g := granularity.grouped_by(d, k)) is not None
    ]


@dataclass
class _Pricing:
    """Solves a candidate's problems and prices their plans on the step's schedule (``predict``)."""

    device_info: DeviceInfo
    precision: str
    optimizer: str
    calibration: Calibration | None
    budget: int
    least_bound_plans: list[_Found] = dataclasses.field(default_factory=list)  # where nothing else fits
    # (id of the problem, choice) -> its plan priced: the solver gives one plan at several bounds, priced once.
    # A problem belongs to one candidate, so it also says which description prices the plan.
    prices: dict[tuple[int, bytes], _Found] = dataclasses.field(default_factory=dict)

    def priced(self, problem: Problem, choice: np.ndarray, describe: Describer) -> _Found:
        key = (id(problem), np.asarray(choice, dtype=np.int64).tobytes())
        if key not in self.prices:
            plan = plan_from_choice(problem, choice, mixed_precision=self.precision)
            description = describe(plan)
            self.prices[key] = _Found(plan, description, predict(
                description, plan, self.device_info, optimizer=self.optimizer, calibration=self.calibration))
        return self.prices[key]

    @staticmethod
    def solved(problems: list[Problem], bound: int, beat: float | None = None) -> tuple[Problem, Solution] | None:
        """The solver's fastest plan within the additive ``bound`` over every problem (``sweep_batch_sizes``'s),
        unpriced; None where none fits, or none beats ``beat`` samples/s where that is given."""
        best = best_of(problems, bound, beat=beat)
        return None if best is None else (problems[best[0]], best[1])

    def fitting(self, solved: tuple[Problem, Solution] | None, describe: Describer) -> _Found | None:
        """``solved``'s plan priced on the schedule, if its peak fits the budget."""
        if solved is None:
            return None
        found = self.priced(solved[0], solved[1].choice, describe)
        return found if found.prediction.peak_bytes <= self.budget else None

    def fastest_fitting(self, problems: list[Problem], describe: Describer,
                        beat: float | None = None) -> _Found | None:
        """The candidate's plan (see ``find_plan``); None where none fits, or (given ``beat``) where none of the
        plans it could be is faster than ``beat`` samples/s."""
        # The fastest plan of all, where its schedule peak fits: nothing is faster. A problem's step time is the
        # plan's predicted one (osdp.cost.schedule.predict), so only that one plan needs pricing on the schedule.
        unconstrained = [(p, _fastest_choice(p)) for p in problems]
        problem, choice = max(unconstrained, key=lambda pc: pc[0].batch_size / pc[0].step_time(pc[1]))
        fastest = self.priced(problem, choice, describe)
        if fastest.prediction.peak_bytes <= self.budget:  # memory does not bind
            return fastest
        step = math.floor(math.log(self.budget * RELAXED_BOUND) / math.log(RELAXED_STEP))
        # every plan below is the solver's within a bound of at most RELAXED_STEP ** step, or a least-bound one
        if beat is not None and max(relaxation(p).samples_per_s(int(RELAXED_STEP ** step)) for p in problems) <= beat:
            return None
        at_budget: dict[float | None, tuple[Problem, Solution] | None] = {}  # by the samples/s it must beat
        # down to the least bound any problem fits in: the first at which the solver finds no plan
        while (solved := self.solved(problems, int(bound := RELAXED_STEP ** step))) is not None:
            found = self.fitting(solved, describe)
            if found is not None or bound < self.budget:
                # the solver's own plan at the budget (between two grid bounds), where it would be the faster
                # (its step time is the one its pricing gives): only problems that can beat the grid's are solved
                beat = found.samples_per_s if found else None
                if beat not in at_budget:
                    at_budget[beat] = self.solved(problems, self.budget, beat)
                fitting = [f for f in (found, self.fitting(at_budget[beat], describe)) if f]
                if fitting:
                    return max(fitting, key=lambda f: f.samples_per_s)
            step -= 1
        # nothing on the grid: the solver's plan at the budget (the grid can end above it: the next bound down
        # fits nothing), and the plans of the least bound, if they fit (and what the error names); the lean
        # ones keep the least transient where it costs no memory, which the schedule's peak may need
        if None not in at_budget:
            at_budget[None] = self.solved(problems, self.budget)
        least_bound = [self.priced(p, min_peak(p, lean)[1], describe) for p in problems for lean in (False, True)]
        self.least_bound_plans.extend(least_bound)
        fitting = [f for f in (self.fitting(at_budget[None], describe), *least_bound)
                   if f is not None and f.prediction.peak_bytes <= self.budget]
        return max(fitting, key=lambda f: f.samples_per_s, default=None)


def _fastest_choice(problem: Problem) -> np.ndarray:
    """Each unit's fastest allowed option, the one needing least memory among equally fast ones: the plan
    memory does not constrain."""
    time_ = np.where(problem.allowed, problem.time, np.inf)
    fastest = time_ <= time_.min(axis=1, keepdims=True) * (1 + 1e-9)
    return np.where(fastest, problem.mem + problem.transient, np.iinfo(np.int64).max).argmin(axis=1)


def least_budget(descriptions: ModelDescription | Sequence[ModelDescription], device_info: DeviceInfo,
                 batch_sizes: Sequence[int], **settings: Any) -> int:
    """The least budget per rank ``find_plan`` (same arguments) finds a plan in: what its BudgetTooSmall names."""
    try:
        find_plan(descriptions, device_info, batch_sizes, budget=1, **settings)
    except BudgetTooSmall as e:
        return e.min_peak_bytes
    return 1


# A plan with more sharded units is taken only where it is predicted faster than one with fewer by more than
# this. The cost model prices them within a few percent on small transformers, and there its per-unit costs,
# fitted on the calibration nets, miss part of what a sharded unit costs: on gpt2-mini (2 CPU ranks, loopback
# and gpu-ratio links) attention and MLP apart, all sharded, ran 4-9% slower than whole blocks, predicted a
# little faster (experiments/results/bench_modes/bench_modes.md). Fewer sharded units is also what PyTorch's own
# per-block wrapping runs. Sharded units first: counting every unit took a block plan with three sharded blocks,
# predicted 2% slower, over a sub-block plan all replicated (gpt2-mini, 2 CPU ranks, loopback, 109.6 MiB: 4,132
# against the 4,259 tokens/s the latter measured at 99.0 MiB); then all units: replicated ones cost a little
# each too (ten all replicated, predicted faster, ran 0.95-0.97 of DDP's five at 120.1 MiB).
GRANULARITY_TOLERANCE = 0.05


def sharded_units(plan: Plan) -> int:
    """How many FSDP2 units of ``plan`` gather parameters: its units not replicated, a group counted once."""
    return len({u.group or u.path for u in plan.units if u.mode != "replicate"})


def fsdp_units(plan: Plan) -> int:
    """How many FSDP2 units ``plan`` makes: a group counted once."""
    return len({u.group or u.path for u in plan.units})


def choose_granularity(candidates: Sequence[tuple[Plan, float]]) -> int:
    """Which of ``(plan, predicted speed)`` (one per granularity, higher faster) to take: among those within
    ``GRANULARITY_TOLERANCE`` of the fastest, the one with the fewest sharded units (``sharded_units``), then
    the fewest units, then the faster."""
    fastest = max(speed for _, speed in candidates)
    close = [i for i, (_, speed) in enumerate(candidates) if speed >= (1 - GRANULARITY_TOLERANCE) * fastest]
    return min(close, key=lambda i: (sharded_units(candidates[i][0]), fsdp_units(candidates[i][0]), -candidates[i][1]))


def description_of(plan: Plan, descriptions: Sequence[ModelDescription]) -> ModelDescription:
    """The description whose units are ``plan``'s, among (or composed from) the ``descriptions`` it was searched
    in: what prices it (``osdp.cost.schedule.predict``, which merges the plan's groups) as the search did."""
    by_granularity = {d.granularity: d for d in descriptions}
    chosen = plan.meta.get("granularity")
    chosen = granularity.ungrouped_granularity(chosen) if chosen else chosen
    if chosen == "per-block":
        coarse, nested = by_granularity["block"], by_granularity["nested"]
        return granularity.compose(coarse, nested, granularity.apart_in(plan, coarse, nested))
    if chosen not in by_granularity:
        raise KeyError(f"the plan was searched at granularity {chosen!r}, none of {sorted(by_granularity)}")
    return by_granularity[chosen]


def planning_description(
    model: nn.Module, example_input: Any, *, loss_fn: Callable[[Any], torch.Tensor] | None = None,
    mixed_precision: str = "fp32", granularity: str = "sub-block", progress: bool = True, uneven: Sequence[str] = (),
    unless_units: Collection[frozenset[str]] = (), example_kept_bytes: int | None = None,
) -> ModelDescription | None:
    """Collective: a description ``osdp.plan`` searches over: rank 0 describes the model (or reads it
    from the describe cache) while the others wait, and every rank gets it (or rank 0's error; None where the
    units are among ``unless_units``, as ``osdp.describe.measured.describe`` says). The
    validation and the experiments take theirs from here, so that they predict what ``osdp.wrap`` would."""
    from osdp.calibration.nets import describe_seconds  # here: planning offline needs no calibration module

    return describe_once(model, example_input, loss_fn=loss_fn, precisions=(mixed_precision,),
                         granularity=granularity, progress=progress, uneven=tuple(uneven),
                         time_budget_s=describe_seconds(), unless_units=unless_units,
                         example_kept_bytes=example_kept_bytes)


def planning_descriptions(model: nn.Module, example_input: Any, **settings: Any) -> list[ModelDescription]:
    """Collective: ``planning_description`` at every unit granularity that gives other units than the finer,
    reported as one task (a line per unit size, not each description's own lines)."""
    name = getattr(getattr(model, "config", None), "name", None) or type(model).__name__
    show = Progress(f"describe {name}")

    def one(granularity: str, unless_units: Collection[frozenset[str]]) -> ModelDescription | None:
        index = GRANULARITIES.index(granularity)
        show(f"{granularity} units ({index + 1}/{len(GRANULARITIES)})", index / len(GRANULARITIES))
        return planning_description(model, example_input, granularity=granularity, progress=False,
                                    unless_units=unless_units, **settings)

    descriptions = describe_granularities(one)
    cached = sum(bool(getattr(d, "from_cache", False)) for d in descriptions)
    show.done(f"{len(descriptions)} unit sizes" + (f", {cached} from the cache" if cached else ""))
    return descriptions


def calls_on_every_rank(model: nn.Module, example_input: Any) -> CallTrace | None:
    """Collective: this rank's trace of its own example (run once without gradients, leaving the model as it
    was), whose ``uneven`` names the modules that some rank's example calls depending on the data: containers
    whose members some rank ran some of (``routed_containers``), and modules the ranks' examples called different
    numbers of times (``uneven_calls``). A describe on rank 0 alone sees its own example only. None where some
    rank's forward failed (rank 0's describe runs it again and names what fails)."""
    try:
        with without_grad():
            trace = quietly(model, lambda: trace_calls(model, lambda: call_model(model, example_input)))
        seen = (trace.counts, routed_containers(model, trace))
    except Exception:  # noqa: BLE001 - reported by the describe, on every rank
        trace, seen = None, None
    everyone = all_gather_objects(seen)
    if trace is None or any(s is None for s in everyone):
        return None
    routed = sorted({c for _, containers in everyone for c in containers})
    uneven = [m for m in uneven_calls(model, [counts for counts, _ in everyone]) if enclosing(m, routed) is None]
    trace.uneven = (*routed, *uneven)
    return trace


def heaviest_example(model: nn.Module, example_input: Any) -> tuple[Any, int | None]:
    """Collective: of every rank's example, the one whose forward keeps the most for backward (rank 0's where
    none keeps more), on rank 0's device, and those bytes (None on one rank). Rank 0 describes it, so that the
    plan fits every rank's example where sizes depend on the data (padded sequences packed, bags of varying
    size), not rank 0's alone."""
    rank, world_size = world()
    if world_size == 1:
        return example_input, None
    try:
        kept = quietly(model, lambda: kept_for_backward(model, example_input))
    except Exception:  # noqa: BLE001 - the describe runs it again and names what fails
        kept = -1
    everyone = all_gather_objects(kept)
    heaviest = max(range(world_size), key=lambda r: (everyone[r], -r))
    if heaviest == 0:
        return example_input, everyone[0]
    theirs = broadcast_object(map_tensors(lambda t: t.cpu(), example_input) if rank == heaviest else None,
                              src=heaviest)
    device = next(iter_tensors(example_input)).device
    return map_tensors(lambda t: t.to(device), theirs), everyone[heaviest]


def _called_depending_on_data(model: nn.Module, example_input: Any) -> tuple[str, ...]:
    if world()[1] == 1:
        return ()  # the describe finds the containers its own example routes
    calls = calls_on_every_rank(model, example_input)
    return calls.uneven if calls is not None else ()


def describe_granularities(describe_one: Callable[..., ModelDescription | None]) -> list[ModelDescription]:
    """``describe_one(granularity=g, unless_units=...)`` for every unit granularity, of those that give other
    units than the finer ones: a describe told the unit sets already described stops after its first forward
    where its units are one of them (half the granularities of small models: their blocks are their units)."""
    descriptions: list[ModelDescription] = []
    for unit_size in GRANULARITIES:
        description = describe_one(granularity=unit_size, unless_units={frozenset(d.paths) for d in descriptions})
        if description is not None:
            descriptions.append(description)
    return descriptions


def plan(
    model: nn.Module,
    *,
    device_mem: int | str,
    example_input: Any,
    batch_sizes: Sequence[int] | None = None,
    device: str | DeviceInfo | None = None,
    calibration: Calibration | None = None,
    mixed_precision: str = "fp32",
    optimizer: str = "adamw",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    group_blocks: bool = False,
    holds_output: bool = True,
) -> Plan:
    """The fastest plan for ``model`` under ``device_mem`` per rank, without applying it.

    ``example_input``: one micro-batch as the model takes it (a tensor, a tuple
    of positional arguments or a dict of keyword arguments; batch in dim 0).
    ``batch_sizes``: candidate micro-batch sizes (default: the example's).
    ``device``: None plans for this machine and job with its calibration
    (``osdp.calibration``: the collectives and FSDP2's runtime costs on this
    machine at this world size), cached, or measured now (once per machine, about
    a minute) if there is none; a preset name (``osdp.machine.presets.list_presets()``)
    or a DeviceInfo plans without the hardware, priced with ``calibration``
    (default: the ideal FSDP2 runtime, ``Calibration()``).
    ``group_blocks``: also search groups of identical blocks as one unit (``find_plan``; off by default).
    ``holds_output``: whether the training loop holds what the model returns through backward and into the
    next forward, as ``logits, loss = model(x, y)`` does (priced so by default); False for a loop that keeps only
    the loss (Hugging Face's Trainer), whose budget then has room for more.
    Collective when a process group exists: call it on every rank. Torch's random number generators are left
    as they were on every rank (the calibration and the describe draw numbers), so the user's next dropout
    masks are those of an unwrapped run.
    """
    with rng_kept([job_device()]):
        return _plan(model, device_mem=device_mem, example_input=example_input, batch_sizes=batch_sizes,
                     device=device, calibration=calibration, mixed_precision=mixed_precision, optimizer=optimizer,
                     loss_fn=loss_fn, group_blocks=group_blocks, holds_output=holds_output)


def _described_from_shapes(model: nn.Module, example_input: Any, device_info: DeviceInfo, world_size: int,
                           loss_fn, mixed_precision: str) -> list[ModelDescription]:
    """``osdp.describe.analytic`` of a model on the meta device, at every unit granularity."""
    try:
        return describe_granularities(lambda **g: describe_analytic(
            model, example_input, device_info, world_size=world_size, loss_fn=loss_fn,
            precisions=(mixed_precision,), progress=False, **g))
    except ProfileError as e:
        raise ProfileError(f"{e}. The model is on the meta device, with no values to run: build it on a real device "
                           "for osdp to measure it, or wrap it with a plan") from e


def _plan(model: nn.Module, *, device_mem, example_input, batch_sizes, device, calibration, mixed_precision,
          optimizer, loss_fn, group_blocks, holds_output) -> Plan:
    budget = parse_size(device_mem)
    _, world_size = world()
    if isinstance(device, DeviceInfo):
        device_info = device
    elif isinstance(device, str):
        device_info = device_preset(device, world_size)
    else:
        from osdp.calibration.measured import calibrate
        from osdp.calibration.nets import needs_ddp_overlap

        ensure_process_group()  # the calibration is for the group the plan runs on (one gloo rank if none)
        # collective: cached, or measured by every rank now, as much as this model needs
        machine = calibrate(ddp_overlap=needs_ddp_overlap(model))
        device_info, calibration = machine.device_info, calibration or machine.calibration
    # a model built on the meta device has no values to run: described from its shapes (rank 0's, in the try)
    on_meta = built_on_meta(model)
    check_built_alike(on_meta)
    descriptions: list[ModelDescription] = []
    if not on_meta:
        uneven = _called_depending_on_data(model, example_input)
        example_input, kept_bytes = heaviest_example(model, example_input)
        descriptions = planning_descriptions(model, example_input, loss_fn=loss_fn, mixed_precision=mixed_precision,
                                             uneven=uneven, example_kept_bytes=kept_bytes)
    rank, _ = world()
    outcome: tuple[str, Any]
    if rank == 0:
        try:
            if on_meta:
                descriptions = _described_from_shapes(model, example_input, device_info, world_size, loss_fn,
                                                      mixed_precision)
            if not holds_output:
                descriptions = [dataclasses.replace(d, output_bytes_per_sample=0.0) for d in descriptions]
            candidates = list(batch_sizes or [batch_size_of(example_input)])
            result = find_plan(
                descriptions, device_info, candidates, budget=budget, calibration=calibration,
                mixed_precision=mixed_precision, optimizer=optimizer, model_signature=structure_signature(model),
                group_blocks=group_blocks,
            )
            outcome = ("plan", result.plan.to_json())
        except Exception as e:  # noqa: BLE001 - every rank must raise it, not wait forever
            outcome = ("error", e)
    else:
        outcome = ("", None)
    outcome = broadcast_object(outcome)
    kind, payload = outcome
    if kind == "error":
        raise payload
    return Plan.from_json(payload)


__all__ = [
    "BudgetTooSmall", "SearchResult", "calls_on_every_rank", "describe_granularities", "description_of",
    "least_budget", "plan", "planning_description", "planning_descriptions", "find_plan",
]


__getattr__ = old_names(__name__)  # the previous release's names of this module (osdp._moved)
