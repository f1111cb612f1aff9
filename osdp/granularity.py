"""Unit size per block: a whole transformer block as one unit, or its sub-blocks as units nested in it.

A unit's fixed costs (its hooks, its collectives' latency, the ranks meeting at
them) favour few large units where memory allows; gathering one sub-block at a
time needs less memory. The search chooses per block, from two descriptions
of the model: at ``"block"`` granularity (each block one unit) and at
``"nested"`` (the same units, and inside each block its sub-blocks; the block
keeps its norms). Both have the same root and the same units outside the
blocks, so a plan taking some blocks whole and others apart is described
exactly by putting the two together unit by unit (``compose``).

``build_problem`` has a row per unit of the ``"block"`` description. A block's
options are its own (taken whole) and, as ``SubUnits``, every combination of
its parts' options (taken apart: times and memory add up, the largest
transient counts). A part may have a whole block for a neighbour where the
``"nested"`` description has a sub-block, so the first and last part of each
block are priced with the larger of the two buffers (``neighbours``): the
search's peak for a plan is never below what the composed description predicts
for it (``osdp.cost.predict``), which is what a searched plan reports.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Iterable

import numpy as np

from osdp.cost import build_problem as build_unit_problem
from osdp.cost import options_for, sequence_order, unit_neighbours
from osdp.description import ModelDescription
from osdp.device import DeviceInfo
from osdp.plan import ROOT, Plan
from osdp.search.problem import Problem, SubUnits
from osdp.units import nesting

# A block whose parts have more option combinations than this is only taken whole (the search stays fast).
MAX_COMBINATIONS = 4096


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


def neighbours(coarse: ModelDescription, nested: ModelDescription, precision: str,
               world_size: int) -> dict[str, tuple[int, int]]:
    """``nested``'s neighbour buffers per unit (``osdp.cost.unit_neighbours``), where a block's first part
    also counts the whole block before it and its last part the whole block after it: what a part may
    meet in a plan that takes its neighbours whole."""
    blocks = blocks_apart(coarse, nested)
    whole = unit_neighbours(coarse, precision, world_size)
    out = dict(unit_neighbours(nested, precision, world_size))
    order = sequence_order(nested)
    for block, parts in blocks.items():
        running = [p for p in order if p in parts]
        if not running:
            continue
        first, last = running[0], running[-1]
        out[first] = (max(out[first][0], whole[block][0]), out[first][1])
        out[last] = (out[last][0], max(out[last][1], whole[block][1]))
        if block in parts:  # the block itself, its backward among its parts'
            out[block] = (max(out[p][0] for p in running), 0)
    return out


def build_problem(
    coarse: ModelDescription, nested: ModelDescription, device_info: DeviceInfo, batch_size: int, *,
    precision: str = "fp32", max_combinations: int = MAX_COMBINATIONS, **settings: Any,
) -> Problem:
    """The search problem where every block is taken whole or apart (see the module docstring); options as
    ``osdp.cost.build_problem`` (``settings``: optimizer, calibration, options)."""
    blocks = blocks_apart(coarse, nested)
    whole = build_unit_problem(coarse, device_info, batch_size, precision=precision, **settings)
    parts = build_unit_problem(nested, device_info, batch_size, precision=precision,
                               neighbours=neighbours(coarse, nested, precision, device_info.world_size),
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
        choices = [np.flatnonzero(parts.allowed[r]) for r in rows]
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


def apart_in(plan: Plan, coarse: ModelDescription, nested: ModelDescription) -> list[str]:
    """The blocks ``plan`` takes apart: those with a part of theirs among its units."""
    paths = set(plan.paths)
    return [block for block, parts in blocks_apart(coarse, nested).items()
            if any(p in paths for p in parts if p != block)]


def _relative(path: str, block: str) -> str:
    return "" if path == block else path[len(block) + 1:] if block else path


__all__ = ["MAX_COMBINATIONS", "apart_in", "blocks_apart", "build_problem", "compose", "neighbours"]
