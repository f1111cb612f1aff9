"""The search problem: every unit under every option, priced by ``unit_cost`` (``build_problem``), and the way
back from the solver's choice to a Plan.

``build_block_problem`` has a row per unit of the ``"block"`` description. A block's
options are its own (taken whole) and, as ``SubUnits``, every combination of
its parts' options (taken apart: times and memory add up, the largest
transient counts). A part may have a whole block for a neighbour where the
``"nested"`` description has a sub-block, so the first and last part of each
block are priced with the larger of the two buffers (``neighbours.nested_neighbours``): the
search's peak for a plan is never below what the composed description predicts
for it (``osdp.cost.schedule.predict``), which is what a searched plan reports.

"""

from __future__ import annotations

import itertools
from typing import Any, Mapping, Sequence

import numpy as np

from osdp.cost.context import UNIFORM_MODES, _base, _context, _uniform, options_for
from osdp.cost.neighbours import nested_neighbours
from osdp.cost.terms import Calibration
from osdp.cost.unit import _as_option, _impossible, unit_cost
from osdp.describe.granularity import blocks_apart
from osdp.machine.device_info import DeviceInfo
from osdp.schema.description import ModelDescription
from osdp.schema.plan import (
    ROOT,
    Plan,
    PlanError,
    UnitPlan,
    display_path,
)
from osdp.search.problem import Option, Problem, SubUnits


def build_problem(
    description: ModelDescription,
    device_info: DeviceInfo,
    batch_size: int,
    *,
    precision: str = "fp32",
    optimizer: str = "adamw",
    calibration: Calibration | None = None,
    options: Sequence[Option] | None = None,
    uniform_mode: str | None = None,
    neighbours: Mapping[str, tuple[int, int]] | None = None,
) -> Problem:
    """The search problem at one micro-batch size: every unit under every option (default:
    ``options_for(device_info)``), costed by ``unit_cost``. ``uniform_mode`` (one of ``UNIFORM_MODES``):
    only that mode's options are allowed, and priced with the neighbours a plan all in that mode has.
    ``neighbours``: the neighbours' buffers each unit is priced with, instead of the description's own
    (``unit_neighbours``; ``osdp.describe.granularity`` prices units with the neighbours they may have in a plan
    that takes other blocks whole)."""
    ctx = _context(description, device_info, batch_size, precision, optimizer, calibration, neighbours)
    if uniform_mode is not None:
        ctx = _uniform(ctx, uniform_mode)
    options = options_for(device_info) if options is None else [_as_option(o) for o in options]
    U, O = len(description.units), len(options)
    time_ = np.zeros((U, O), dtype=np.float64)
    mem = np.zeros((U, O), dtype=np.int64)
    transient = np.zeros((U, O), dtype=np.int64)
    allowed = np.zeros((U, O), dtype=bool)
    for i, unit in enumerate(description.units):
        for j, option in enumerate(options):
            if _impossible(unit, option) or uniform_mode not in (None, option.mode):
                continue
            c = unit_cost(unit, option, ctx)
            time_[i, j], mem[i, j], transient[i, j], allowed[i, j] = c.time_s, c.mem_bytes, c.transient_bytes, True
    # No group ids: repeated blocks cost the same time, but their memory depends on their place in the
    # schedule (neighbours' buffers, what the root has freed by then); the solver merges identical rows.
    return Problem(
        time=time_, mem=mem, transient=transient, allowed=allowed, base=_base(ctx), batch_size=batch_size,
        units=description.paths, options=list(options),
    )


def build_problems(description: ModelDescription, device_info: DeviceInfo, batch_size: int,
                   **settings: Any) -> list[Problem]:
    """What the search solves at one micro-batch size: ``build_problem`` over every option, and one problem
    per mode of ``UNIFORM_MODES`` whose plans are priced with their true neighbours (the fastest plan that
    fits is the fastest over all of them)."""
    table = [_as_option(o) for o in settings.get("options") or options_for(device_info)]
    # all replicated is one plan whatever the shard scope: a table sharding only within the node leaves it to
    # the world's (osdp.cost.context.scope_option_sets)
    within_node = all(o.scope == "node" or o.mode == "replicate" for o in table)
    # a mode some unit cannot take has no plan all in it (a group is never replicated)
    modes = [m for m in UNIFORM_MODES if any(o.mode == m for o in table) and not (within_node and m == "replicate")
             and not any(_impossible(u, Option(m)) for u in description.units)]
    return [build_problem(description, device_info, batch_size, **settings),
            *(build_problem(description, device_info, batch_size, uniform_mode=m, **settings) for m in modes)]


def choice_of(problem: Problem, plan: Plan) -> np.ndarray:
    """The Problem's option index for each unit of ``plan`` (the root defaults to zero3)."""
    by_path = {u.path: u for u in plan.units}
    index = {_as_option(o): i for i, o in enumerate(problem.options)}
    choice = []
    for path in problem.units:
        key = _as_option(by_path.get(path, UnitPlan(ROOT, mode="zero3")))
        if key not in index:
            raise PlanError(f"unit '{display_path(path)}': option {key} is not in the problem's option table")
        choice.append(index[key])
    return np.array(choice, dtype=np.int64)


def plan_from_choice(problem: Problem, choice: Sequence[int], **settings: Any) -> Plan:
    """A Plan taking option ``choice[u]`` for every unit of ``problem``; a unit whose option is a ``SubUnits``
    becomes its parts, each with its option."""
    units = []
    for path, c in zip(problem.units, choice):
        option = problem.options[int(c)]
        if isinstance(option, SubUnits):
            units += [UnitPlan(_join(path, name), *part) for name, part in option.parts]
        else:
            units.append(UnitPlan(path, *_as_option(option)))
    return Plan(units=units, batch_size=problem.batch_size, **settings)


def _join(path: str, name: str) -> str:
    return ".".join(p for p in (path, name) if p)


# A block whose parts have more option combinations than this is only taken whole (the search stays fast).
MAX_COMBINATIONS = 4096



def build_block_problem(
    coarse: ModelDescription, nested: ModelDescription, device_info: DeviceInfo, batch_size: int, *,
    precision: str = "fp32", max_combinations: int = MAX_COMBINATIONS, **settings: Any,
) -> Problem:
    """The search problem where every block is taken whole or apart ; options as ``build_problem`` (``settings``: optimizer, calibration, options)."""
    blocks = blocks_apart(coarse, nested)
    whole = build_problem(coarse, device_info, batch_size, precision=precision, **settings)
    parts = build_problem(nested, device_info, batch_size, precision=precision,
                               neighbours=nested_neighbours(coarse, nested, precision, device_info.world_size),
                               **settings)
    row = {path: i for i, path in enumerate(nested.paths)}
    labels: list[Any] = list(whole.options)
    column: dict[SubUnits, int] = {}
    k = whole.num_options
    apart: list[tuple[int, list[int], tuple[np.ndarray, ...]]] = []  # (unit, its columns, its parts' costs)
    for u, path in enumerate(coarse.paths):
        if path not in blocks:
            continue
        rows = [row[p] for p in blocks[path]]
        choices = [_undominated(parts, r) for r in rows]
        if np.prod([len(c) for c in choices]) > max_combinations:
            continue
        columns = []
        for combo in itertools.product(*choices):
            label = SubUnits(tuple((_relative(p, path), parts.options[o]) for p, o in zip(blocks[path], combo)))
            columns.append(column.setdefault(label, len(labels)))
            if columns[-1] == len(labels):
                labels.append(label)
        grid = [g.reshape(-1) for g in np.meshgrid(*choices, indexing="ij")]  # itertools.product's order
        apart.append((u, columns, (
            sum(parts.time[r, g] for r, g in zip(rows, grid)),
            sum(parts.mem[r, g] for r, g in zip(rows, grid)),
            np.max([parts.transient[r, g] for r, g in zip(rows, grid)], axis=0),
        )))
    shape = (whole.num_units, len(labels))
    time_, mem, transient = np.zeros(shape), np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64)
    allowed = np.zeros(shape, dtype=bool)
    time_[:, :k], mem[:, :k], transient[:, :k], allowed[:, :k] = whole.time, whole.mem, whole.transient, whole.allowed
    for u, columns, (t, m, tr) in apart:
        time_[u, columns], mem[u, columns], transient[u, columns], allowed[u, columns] = t, m, tr, True
    return Problem(time=time_, mem=mem, transient=transient, allowed=allowed, base=whole.base,
                   batch_size=batch_size, units=coarse.paths, options=labels)



def _undominated(problem: Problem, row: int) -> np.ndarray:
    """The options of unit ``row`` that no other of its options beats in time, memory and transient alike (the
    first of equal ones). A block's parts combine by sum (time, memory) and max (transient), so a combination
    with a dominated part is itself dominated: only these need combining."""
    allowed = np.flatnonzero(problem.allowed[row])
    t, m, tr = problem.time[row, allowed], problem.mem[row, allowed], problem.transient[row, allowed]
    no_worse = (t[:, None] <= t[None, :]) & (m[:, None] <= m[None, :]) & (tr[:, None] <= tr[None, :])
    better = no_worse & ~(no_worse.T)  # i beats j: no worse anywhere, and j is worse somewhere
    equal_before = no_worse & no_worse.T & np.tri(len(allowed), k=-1, dtype=bool).T  # i equals j, i earlier
    return allowed[~(better | equal_before).any(axis=0)]


def _relative(path: str, block: str) -> str:
    return "" if path == block else path[len(block) + 1:] if block else path

