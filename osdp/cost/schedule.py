"""A plan's step time and its peak over the step's schedule: ``predict``.

The true peak is a maximum over the schedule; the search's decomposition adds each
unit's worst phase and the one largest transient, so it over-estimates, most where a
unit's neighbours are not what the bound assumes and where the largest working set
runs while few units hold their activations (a unit's backward after those after it
have let theirs go); it leaves out the all-gather output FSDP2 keeps in forward.
``schedule_peak`` walks the schedule instead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np

from osdp.cost.context import _base, _context, _options_of, _uniform, uniform_mode_of
from osdp.cost.neighbours import plan_neighbours, sequence_order
from osdp.cost.terms import Calibration, OptionCost, Prediction
from osdp.cost.unit import unit_cost
from osdp.describe.granularity import grouped
from osdp.machine.device_info import DeviceInfo
from osdp.schema.description import ModelDescription
from osdp.schema.plan import (
    ROOT,
    Plan,
    PlanError,
    display_path,
)


def predict(
    description: ModelDescription,
    plan_or_choices: Plan | Sequence[Any],
    device_info: DeviceInfo,
    *,
    batch_size: int | None = None,
    precision: str | None = None,
    optimizer: str = "adamw",
    calibration: Calibration | None = None,
) -> Prediction:
    """Step time and peak memory per rank of a plan (or one option per unit, in description order).

    ``batch_size`` and ``precision`` default to the plan's. The peak is the schedule's
    (``schedule_peak``, with the plan's neighbours); for a plan whose options are all in
    ``options_for(device_info)`` the step time and ``breakdown["bound_peak_bytes"]`` are exactly
    ``build_problem(...)``'s ``step_time`` and ``peak`` for the same choice, with ``uniform_mode=``
    the plan's mode where all its units take one of ``UNIFORM_MODES``. A plan's groups are priced as one unit
    each (``osdp.describe.granularity.grouped``: the description may have them merged already, or not).
    """
    if isinstance(plan_or_choices, Plan) and plan_or_choices.groups():
        description, plan_or_choices = _grouped(description, plan_or_choices)
    if isinstance(plan_or_choices, Plan):
        batch_size = batch_size or plan_or_choices.batch_size
        precision = precision or plan_or_choices.mixed_precision
        if plan_or_choices.world_size not in (None, device_info.world_size):
            raise PlanError(
                f"the plan is for {plan_or_choices.world_size} ranks, the device for {device_info.world_size}"
            )
        per_node = device_info.world_size // device_info.nodes
        if plan_or_choices.ranks_per_node not in (None, per_node):
            raise PlanError(
                f"the plan is for nodes of {plan_or_choices.ranks_per_node} ranks, the device "
                f"'{device_info.name}' has {device_info.nodes} node(s) of {per_node}; price it on a device of "
                f"that layout (a multi-node preset with ranks_per_node={plan_or_choices.ranks_per_node})"
            )
    if batch_size is None:
        raise ValueError("give batch_size= (the plan has none)")
    ctx = _context(description, device_info, batch_size, precision or "fp32", optimizer, calibration)
    options = _options_of(description, plan_or_choices, device_info)
    mode = uniform_mode_of(options)
    if mode is not None:
        ctx = _uniform(ctx, mode)
    bounding = [unit_cost(u, o, ctx) for u, o in zip(description.units, options)]  # as the search prices them
    mem = np.array([c.mem_bytes for c in bounding], dtype=np.int64)
    transient = np.array([c.transient_bytes for c in bounding], dtype=np.int64)
    bound_neighbours = ctx.neighbours
    ctx = replace(ctx, neighbours=plan_neighbours(description, bounding))
    # a unit's price depends on the context only through its neighbours: where the plan's are the bound's,
    # the bounding price is the price
    costs = [c if ctx.neighbours.get(u.path) == bound_neighbours.get(u.path) else unit_cost(u, o, ctx)
             for u, o, c in zip(description.units, options, bounding)]
    times = np.array([c.time_s for c in costs], dtype=np.float64)
    base = _base(ctx)
    step_s = float(times.sum())
    peak, moment = schedule_peak(description, costs, base)
    totals = {k: float(sum(c.parts[k] for c in costs)) for k in costs[0].parts}
    breakdown = {
        "base_bytes": base,
        "peak_moment": moment,
        # the search's additive bound on the peak (``build_problem``): base + mem + transient
        "bound_peak_bytes": base + int(mem.sum()) + int(transient.max()),
        "mem_bytes": int(mem.sum()),
        "transient_bytes": int(transient.max()),
        "largest_transient_unit": description.units[int(transient.argmax())].path,
        "totals": totals,
        "units": {
            u.path: {"option": list(o), "time_s": c.time_s, "mem_bytes": c.mem_bytes,
                     "transient_bytes": c.transient_bytes, **c.parts}
            for u, o, c in zip(description.units, options, costs)
        },
    }
    return Prediction(step_s, peak, breakdown)


def _grouped(description: ModelDescription, plan: Plan) -> tuple[ModelDescription, Plan]:
    """The description with the plan's groups merged, and the plan with one decision per group (its first
    unit's, for the group's merged unit)."""
    groups = plan.groups()
    inside = {p for first, members in groups.items() for p in members if p != first}
    return grouped(description, groups), replace(plan, units=[u for u in plan.units if u.path not in inside],
                                                 meta=dict(plan.meta))


def schedule_peak(description: ModelDescription, costs: Sequence[OptionCost], base: int) -> tuple[int, str]:
    """The peak per rank over the step's schedule of units costing ``costs`` (one per unit, in description
    order), and the moment it is reached.

    The units that run one after another (``sequence_order``) run their forwards in order and their
    backwards in reverse: while unit v runs, each unit before it holds what it keeps until its backward
    (``before_backward_bytes``), each unit after it (in backward) what it keeps from its backward on
    (``after_backward_bytes``; ``until_backward_ends_bytes`` instead until the whole backward ends, for a unit
    FSDP2 reduces only then); v works on what it holds until its backward (its transients on top), and
    as its backward ends reduces into what it keeps after; the optimizer step finds every unit after its
    backward, with the foreach optimizer's temporaries (``optimizer_step_bytes``). The root is counted at the
    larger of its two holdings all step, a unit enclosing others below it where it runs (``_EnclosedHoldings``);
    their working sets meet the moments inside them (``_enclosing_moments``). In forward, what the unit that
    gathered last left lingers, beside the next gather's output (``_gather_moments``), or to the root's end."""
    by_path = dict(zip(description.paths, costs))
    order = sequence_order(description)

    def part(path: str, name: str) -> int:
        return int(by_path[path].parts[name])

    def own(path: str) -> int:
        return max(part(path, "before_backward_bytes"), part(path, "after_backward_bytes"),
                   part(path, "until_backward_ends_bytes"))

    sequence = set(order)
    enclosing = [p for p in description.paths if p not in sequence]
    # the root (enclosing every unit) at the larger of its two holdings all step; a unit enclosing others (a block
    # with its sub-blocks as units) where it runs: by the moments of the units inside it and around it
    always = base + sum(part(p, "always_bytes") for p in description.paths)
    fixed = always + sum(own(p) for p in enclosing if not _spans(p, order))
    enclosed = _EnclosedHoldings(order, {p: (part(p, "before_backward_bytes"), own(p), part(p, "after_backward_bytes"))
                                         for p in enclosing if _spans(p, order)})
    before = np.array([part(p, "before_backward_bytes") for p in order], dtype=np.int64)
    after = np.array([part(p, "after_backward_bytes") for p in order], dtype=np.int64)
    # in backward: a unit reduced only as the backward ends holds its unsharded parameters and gradients till then
    after_in_backward = np.maximum(after, [part(p, "until_backward_ends_bytes") for p in order])
    held_before = np.cumsum(before) - before  # by the units earlier in forward order
    held_after = int(after_in_backward.sum()) - np.cumsum(after_in_backward)  # by the units later in forward order
    gathers = [part(p, "gather_output_bytes") for p in order]
    linger_forward, left = _lingering_gathers(gathers)
    # with the unit's own activations (no gradients yet)
    forward = fixed + enclosed.in_forward + held_before + before
    backward = (fixed + enclosed.in_backward + held_before + np.array([own(p) for p in order], dtype=np.int64)
                + held_after)
    # every backward done: the enclosing units hold what they keep after theirs (no activations); the foreach
    # optimizer's temporaries are every unit's at once, in its step alone
    optimizer = (always + sum(part(p, "after_backward_bytes") for p in enclosing) + int(after.sum())
                 + sum(part(p, "optimizer_step_bytes") for p in description.paths))
    backward_ended = fixed + enclosed.after_backward + int(after_in_backward.sum())
    moments = [(optimizer, "the optimizer step")]
    final_reduce = max((part(p, "final_reduce_bytes") for p in order if part(p, "until_backward_ends_bytes")),
                       default=None)
    if final_reduce is not None:  # FSDP2's final callback reduces them one by one, every backward done
        moments.append((backward_ended + final_reduce, "the end of the backward"))
    moments += _gather_moments(order, gathers, forward - before)
    for i, path in enumerate(order):
        moments += [
            (int(forward[i]) + int(linger_forward[i]) + part(path, "fwd_transient_bytes"),
             f"forward of {display_path(path)}"),
            # its backward works on what it held until then; as it ends it reduces into what it keeps after
            (int(backward[i]) - own(path) + int(before[i]) + part(path, "bwd_transient_bytes"),
             f"backward of {display_path(path)}"),
            (int(backward[i]) + part(path, "post_backward_bytes"), f"the end of the backward of {display_path(path)}"),
            (optimizer + max(int(before[i]) - int(after[i]), 0) + part(path, "optimizer_temp_bytes"),
             "the optimizer step"),
        ]
    # between unit i's backward and the next one's (the previous unit in forward order): i holds what it keeps
    # after, FSDP2 keeps its reduce-scatter input and has prefetched the next unit's parameters
    kept_input = np.array([part(p, "kept_reduce_input_bytes") for p in order], dtype=np.int64)
    prefetch = np.array([part(p, "backward_gather_bytes") for p in order], dtype=np.int64)
    between = (fixed + enclosed.in_backward + held_before + after_in_backward + held_after + kept_input
               + np.concatenate([[0], prefetch[:-1]]).astype(np.int64))
    backward_started = fixed + enclosed.activations + int(before.sum())
    timeline = _Timeline(order, fixed, before, forward + linger_forward, backward, between, backward_started,
                         backward_ended, optimizer, left, enclosed.activations)
    for path in enclosing:
        moments += _enclosing_moments(path, part, lambda p, name: name in by_path[p].parts, timeline)
    peak, moment = max(moments, key=lambda m: m[0])
    return int(peak), moment


def _gather_moments(order: list[str], gathers: list[int], held: np.ndarray) -> list[tuple[int, str]]:
    """As each unit gathers (``held``: what is alive as its forward begins): its all-gather output and its
    parameters copied out of it, beside the output the last unit to gather left, which FSDP2 frees only then."""
    moments, last = [], 0
    for i, path in enumerate(order):
        if gathers[i]:
            moments.append((int(held[i]) + 2 * gathers[i] + last, f"the gather of {display_path(path)}"))
            last = gathers[i]
    return moments


def _lingering_gathers(gathered: list[int]) -> tuple[np.ndarray, int]:
    """Per unit in forward order (each gathering ``gathered`` bytes), the all-gather output another unit left as
    it runs, and what the last one to gather leaves: FSDP2 keeps a unit's all-gather output until the next
    unit's all-gather is waited for, or the root's forward ends, so it lingers while units that gather nothing
    run (and beside the next one's output until that unit's parameters are copied out of it: ``schedule_peak``'s
    moment of each gather)."""
    left, lingering = 0, []
    for nbytes in gathered:
        lingering.append(0 if nbytes else left)
        left = nbytes or left
    return np.array(lingering, dtype=np.int64), left


@dataclass(frozen=True)
class _Timeline:
    """What the units that run one after another hold at the moments of the step (``schedule_peak``)."""

    order: list[str]  # the units in forward order
    fixed: int  # held all step: the base, every unit's always-held bytes, the enclosing units' larger holding
    before: np.ndarray  # per unit, what it holds from its forward to its backward
    forward: np.ndarray  # as each unit's forward runs, with what the last gather left
    backward: np.ndarray  # as each unit's backward runs
    between: np.ndarray  # as each unit's backward has ended, before the next one's begins
    backward_started: int  # every forward done, before any unit's backward
    backward_ended: int  # every backward done, before the final reduces
    optimizer: int  # in the optimizer step
    last_gathered: int  # the all-gather output the last unit to gather left in forward
    enclosed_activations: int  # what the units enclosing others, but the root, keep until their backward


def _spans(path: str, order: list[str]) -> bool:
    """Whether a unit enclosing others is placed by the units inside it (all but the root, which encloses all)."""
    return path != ROOT and any(p.startswith(path + ".") for p in order)


class _EnclosedHoldings:
    """What the units enclosing others but the root hold at each moment of the units in ``order``, from each one's
    (before backward, larger of the two, after backward) bytes: nothing in forward before its first unit inside,
    its activations from there (all of them already, at the latest) until the backward reaches its units, the
    larger of its two holdings while they run their backwards, what it keeps after its backward once they have."""

    def __init__(self, order: list[str], holdings: dict[str, tuple[int, int, int]]):
        n = len(order)
        self.in_forward = np.zeros(n, dtype=np.int64)
        self.in_backward = np.zeros(n, dtype=np.int64)
        self.after_backward = sum(after for _, _, after in holdings.values())
        self.activations = sum(before for before, _, _ in holdings.values())
        index = np.arange(n)
        for path, (before, larger, after) in holdings.items():
            inside = [i for i, p in enumerate(order) if p.startswith(path + ".")]
            first, last = min(inside), max(inside)
            self.in_forward += np.where(index >= first, before, 0)
            self.in_backward += np.where(index > last, before, np.where(index >= first, larger, after))


def _enclosing_moments(path: str, part: Callable[[str, str], int], has_part: Callable[[str, str], bool],
                       t: _Timeline) -> list[tuple[int, str]]:
    """The moments of a unit enclosing others (the root, a block at nested granularity): its working sets where
    they meet what the units inside it hold."""
    inside = [i for i, p in enumerate(t.order) if path == ROOT or p.startswith(path + ".")]
    running = max([*(int(t.backward[i]) for i in inside), *(int(t.between[i]) for i in inside)], default=0)
    name = f"the working set of {display_path(path)}"
    if has_part(path, "bwd_head_bytes"):
        # the root's backward where it runs: before the units' (every unit's activations held, no gradient yet),
        # between two of theirs, after them all; it reduces as the backward ends
        moments = [
            (t.backward_started + part(path, "bwd_head_bytes"), name),
            (running + part(path, "bwd_between_bytes") if inside else 0, name),
            (t.backward_ended + max(part(path, "bwd_tail_bytes"), part(path, "post_backward_bytes")), name),
        ]
    else:
        # its backward runs between its inner units' backwards, or before or after them all
        working = max(part(path, "bwd_transient_bytes"), part(path, "post_backward_bytes"))
        moments = [(max(t.backward_ended, running) + working, name)]
    moments.append((t.optimizer + part(path, "optimizer_temp_bytes"), "the optimizer step"))
    # its forward, at the latest with every unit inside holding its activations
    working = part(path, "fwd_transient_bytes")
    fullest_forward = max([t.fixed, *(int(t.forward[i]) for i in inside)]) + working
    if path == ROOT:  # the head, after the last unit's forward: what was gathered last is freed as it ends
        gathered = part(path, "gather_output_bytes")
        fullest_forward = max(fullest_forward, t.fixed + int(t.before.sum()) + t.enclosed_activations + working
                              - gathered + (t.last_gathered or gathered))
    moments.append((fullest_forward, f"the forward of {display_path(path)}"))
    return moments
