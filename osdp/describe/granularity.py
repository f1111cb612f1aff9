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
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from osdp.describe.units import nesting
from osdp.schema.description import ModelDescription
from osdp.schema.plan import ROOT, Plan


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
