"""Unit size per block: a whole transformer block as one unit, or its sub-blocks as units nested in it.

A unit's fixed costs (its hooks, its collectives' latency, the ranks meeting at
them) favour few large units where memory allows; gathering one sub-block at a
time needs less memory. The search chooses per block, from two descriptions
of the model: at ``"block"`` granularity (each block one unit) and at
``"nested"`` (the same units, and inside each block its sub-blocks; the block
keeps its norms). Both have the same root and the same units outside the
blocks, so a plan taking some blocks whole and others apart is described
exactly by putting the two together unit by unit (``compose``).

How a plan is searched over both (each block whole or apart) is the cost model's: ``osdp.cost.problem.
build_block_problem``.

The other way, k consecutive identical blocks can be one unit (a group: ``UnitPlan.group``, one
``fully_shard`` over the k modules): fewer fixed per-unit costs, for k blocks' parameters gathered at
once. ``grouped`` describes a model so, merging each group's units into one (``UnitProfile.group``);
``group_runs`` finds the groups of k the search offers, and ``expand_groups`` turns a plan found in a
grouped description back into one that names every unit of each group.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence

from osdp.describe.units import nesting
from osdp.schema.description import ModelDescription, UnitProfile
from osdp.schema.plan import ROOT, Plan, PlanError, UnitPlan, display_path


def blocks_apart(coarse: ModelDescription, nested: ModelDescription) -> dict[str, tuple[str, ...]]:
    """Block path -> its parts in ``nested`` (the units inside it, then the block itself where it holds
    parameters of its own), for every unit of ``coarse`` that ``nested`` takes apart. ValueError unless the
    two describe one model the same way outside the blocks (the root and every other unit alike)."""
    if (coarse.signature, coarse.granularity, nested.granularity) != (nested.signature, "block", "nested"):
        raise ValueError(
            f"need the 'block' and 'nested' descriptions of one model, got {coarse.granularity!r} of "
            f"{coarse.model} and {nested.granularity!r} of {nested.model}"
        )
    inner = {u.path: u for u in nested.units}
    blocks = {}
    for unit in coarse.units:
        inside = [p for p in inner if unit.path != ROOT and p.startswith(unit.path + ".")]
        if unit.path != ROOT and any(p.startswith(unit.path + ".") for p in coarse.paths):
            continue  # it encloses units of its own (a wrapper with parameters): no block, priced as the root is
        if inside:
            blocks[unit.path] = (*inside, *([unit.path] if unit.path in inner else []))
        elif unit.path not in inner or inner[unit.path].param_shapes != unit.param_shapes:
            raise ValueError(f"unit '{unit.name}' differs between the 'block' and 'nested' descriptions")
    return blocks


def compose(coarse: ModelDescription, nested: ModelDescription, apart: Iterable[str]) -> ModelDescription:
    """The description of the model with the blocks in ``apart`` taken apart (their parts from ``nested``)
    and every other unit from ``coarse``."""
    blocks = blocks_apart(coarse, nested)
    apart = set(apart)
    unknown = sorted(apart - set(blocks))
    if unknown:
        raise ValueError(f"'{unknown[0]}' is not a block the 'nested' description takes apart")
    inner = {u.path: u for u in nested.units}
    units, order = [], []
    for unit in coarse.units:  # bottom-up: a block's parts before the block
        units += [inner[p] for p in blocks[unit.path]] if unit.path in apart else [unit]
    inside = nesting(u.path for u in units)
    units = [dataclasses.replace(u, nested=inside[u.path]) for u in units]
    for path in coarse.forward_order:
        order += [p for p in nested.forward_order if p in blocks[path]] if path in apart else [path]
    return dataclasses.replace(
        coarse, units=units, forward_order=tuple(order), granularity="per-block", checks={},
        source=f"{coarse.source}; blocks {sorted(apart)} as described at 'nested' granularity",
        profile_seconds=coarse.profile_seconds + nested.profile_seconds, cache_key=None, from_cache=False,
    )


def apart_in(plan: Plan, coarse: ModelDescription, nested: ModelDescription) -> list[str]:
    """The blocks ``plan`` takes apart: those with a part of theirs among its units."""
    paths = set(plan.paths)
    return [block for block, parts in blocks_apart(coarse, nested).items()
            if any(p in paths for p in parts if p != block)]


# -- groups: k consecutive identical blocks as one unit -----------------------------------------------------------

def _sibling_index(path: str) -> tuple[str, int] | None:
    """(parent path, index) of a module in a container (``blocks.3`` -> ("blocks", 3)), else None."""
    parent, _, name = path.rpartition(".")
    return (parent, int(name)) if name.isdigit() else None


def _identical(a: UnitProfile, b: UnitProfile) -> bool:
    return (a.module_type, a.param_shapes, a.split_shapes) == (b.module_type, b.param_shapes, b.split_shapes)


def grouped(description: ModelDescription, groups: Mapping[str, Sequence[str]]) -> ModelDescription:
    """``description`` with each group's units (first unit -> its units, as ``Plan.groups``) merged into one unit
    named by the first: all their parameters, one block's costs (the first's), ``group`` naming them. Groups the
    description already has merged are left as they are. PlanError naming the units unless each group is of
    consecutive identical units that enclose none."""
    by_path = {u.path: u for u in description.units}
    order = description.forward_order
    merged: dict[str, UnitProfile] = {}
    for first, members in groups.items():
        if first in by_path and set(by_path[first].group) == set(members):
            continue  # merged already
        members = sorted(members, key=lambda p: order.index(p) if p in order else -1)
        named = ", ".join(f"'{display_path(p)}'" for p in members)
        unknown = [p for p in members if p not in by_path]
        if unknown:
            raise PlanError(f"group '{display_path(first)}' ({named}): '{display_path(unknown[0])}' is not a unit of "
                            f"{description.model}")
        units = [by_path[p] for p in members]
        if any(u.nested or u.group for u in units):
            raise PlanError(f"group '{display_path(first)}' ({named}): a group is of units that enclose no other")
        if not all(_identical(units[0], u) for u in units):
            raise PlanError(f"group '{display_path(first)}' ({named}) is not of identical units (one type, the same "
                            "parameter shapes)")
        places = [order.index(p) for p in members if p in order]
        if len(places) != len(members) or places != list(range(places[0], places[0] + len(members))):
            raise PlanError(f"group '{display_path(first)}' ({named}) is not of consecutive units")
        merged[first] = dataclasses.replace(
            units[0], path=first, numel=sum(u.numel for u in units), param_bytes=sum(u.param_bytes for u in units),
            param_shapes=tuple(s for u in units for s in u.param_shapes),
            split_shapes=(), group=tuple(members),  # a group is never split
        )
    if not merged:
        return description
    inside = {p for unit in merged.values() for p in unit.group}
    units = [merged.get(u.path, u) for u in description.units if u.path in merged or u.path not in inside]
    nested = nesting(u.path for u in units)
    units = [dataclasses.replace(u, nested=nested[u.path]) for u in units]
    # a group's forward ends where its last unit's did; its first unit names it
    last = {unit.group[-1]: path for path, unit in merged.items()}
    forward = tuple(last.get(p, p) for p in order if p in last or p not in inside)
    return dataclasses.replace(description, units=units, forward_order=forward, checks={}, cache_key=None,
                               from_cache=False)


def group_runs(description: ModelDescription, k: int) -> dict[str, list[str]]:
    """Groups of ``k`` the search offers: in each run of consecutive identical units of one container (blocks.0,
    blocks.1, ...), enclosing none and with the same costs, every k from the run's start (a shorter rest stays
    apart)."""
    by_path = {u.path: u for u in description.units}
    runs: list[list[str]] = []
    previous = None
    for path in description.forward_order:
        unit, place = by_path.get(path), _sibling_index(path)
        if unit is None or unit.nested or unit.group or place is None or path == ROOT:
            previous = None
            continue
        prior = by_path[runs[-1][-1]] if previous is not None else None
        if (prior is not None and previous == (place[0], place[1] - 1) and _identical(prior, unit)
                and prior.costs == unit.costs):
            runs[-1].append(path)
        else:
            runs.append([path])
        previous = place
    return {run[i]: run[i:i + k] for run in runs for i in range(0, len(run) - k + 1, k)} if k > 1 else {}


GROUPED = ", groups of "  # how a description's granularity says it groups its blocks ("block, groups of 2")


def grouped_by(description: ModelDescription, k: int) -> ModelDescription | None:
    """``description`` with its blocks in groups of ``k`` (``group_runs``), its granularity saying so; None where
    it has no k consecutive identical blocks."""
    runs = group_runs(description, k)
    if not runs:
        return None
    return dataclasses.replace(grouped(description, runs), granularity=f"{description.granularity}{GROUPED}{k}")


def ungrouped_granularity(granularity: str) -> str:
    """The granularity a ``grouped_by`` description was made from."""
    return granularity.split(GROUPED)[0]


def expand_groups(plan: Plan, description: ModelDescription) -> Plan:
    """``plan`` (found in a ``grouped`` description: one decision per group) naming every unit of each group,
    each with the group's decision."""
    by_path = {u.path: u for u in description.units}
    units: list[UnitPlan] = []
    for u in plan.units:
        members = by_path[u.path].group if u.path in by_path else ()
        units += ([dataclasses.replace(u, path=p, group=u.path) for p in members] if len(members) > 1 else [u])
    return dataclasses.replace(plan, units=units, meta=dict(plan.meta))
