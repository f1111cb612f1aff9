"""The FSDP2 buffers of its neighbours that a unit's backward meets: a bound for the search
(``unit_neighbours``: every neighbour zero3), the exact ones of a plan (``plan_neighbours``), the order
the units run in (``sequence_order``), and the bound where each block may be taken whole or apart
(``nested_neighbours``).
"""

from __future__ import annotations

from typing import Sequence

from osdp.cost.terms import _DTYPE_BYTES, _REDUCE_BYTES, OptionCost, _padded_numel
from osdp.describe.granularity import blocks_apart
from osdp.schema.description import ModelDescription
from osdp.schema.plan import (
    ROOT,
)


def sequence_order(description: ModelDescription) -> list[str]:
    """The units that run one after another, in forward order: all but those enclosing others (the root)."""
    enclosing = {u.path for u in description.units if u.nested or u.path == ROOT}
    return [p for p in description.forward_order if p not in enclosing]


def unit_neighbours(description: ModelDescription, precision: str, world_size: int) -> dict[str, tuple[int, int]]:
    """Per unit, the bytes of its neighbours' FSDP buffers that exist during its backward (``_Context.neighbours``):
    the previous unit's all-gather output and the next unit's reduce-scatter input, were both zero3. A unit
    enclosing others (a block with its sub-blocks nested in it) takes the largest prefetch among them."""
    padded = {u.path: sum(_padded_numel(s, world_size) for s in u.param_shapes) for u in description.units}
    order = sequence_order(description)
    neighbours = {}
    for i, path in enumerate(order):
        before = _DTYPE_BYTES[precision] * padded[order[i - 1]] if i > 0 else 0
        after = _REDUCE_BYTES * padded[order[i + 1]] if i + 1 < len(order) else 0
        neighbours[path] = (before, after)
    if order:  # the root's backward may run between any two units': one's input kept, the next one prefetched
        neighbours[ROOT] = (max(_DTYPE_BYTES[precision] * padded[p] for p in order),
                            max(_REDUCE_BYTES * padded[p] for p in order))
    within = _within(order)
    for unit in description.units:  # another enclosing unit's backward runs between those of the units inside it
        inside = [neighbours[p] for p in within.get(unit.path, [])] if unit.path != ROOT else []
        if inside:
            neighbours[unit.path] = (max(b for b, _ in inside), max(a for _, a in inside))
    return neighbours


def _within(paths: Sequence[str]) -> dict[str, list[str]]:
    """Path -> the ``paths`` inside it (those starting with it and a dot), in their order: one pass over each
    path's dots, where testing every pair took a planner's search 10% of its time."""
    within: dict[str, list[str]] = {}
    for path in paths:
        for i, c in enumerate(path):
            if c == ".":
                within.setdefault(path[:i], []).append(path)
    return within


def plan_neighbours(description: ModelDescription, costs: Sequence[OptionCost]) -> dict[str, tuple[int, int]]:
    """Per unit, the neighbours' FSDP buffers that exist during its backward in a plan whose units cost
    ``costs`` (``_Context.neighbours``; what the search bounds by ``unit_neighbours``): the all-gather output of
    the FSDP2 unit whose forward ended just before its own (FSDP2 prefetches it; none unless that unit reshards
    after forward) and the reduce-scatter input of the one whose backward ended just before its own began (the
    unit whose forward began next). DDP's units are no FSDP2 units: the FSDP2 units around them are their
    neighbours, whose buffers exist during their backward as well (a DDP unit between two FSDP2 units
    recomputed beside the earlier one's prefetched gather and the later one's reduce-scatter input)."""
    by_path = dict(zip(description.paths, costs))
    ends = [p for p in description.forward_order if p in by_path] or [*sequence_order(description), ROOT]
    # forwards begin in the order they end, but a unit enclosing others begins before them (the root first)
    first_end = {q: i for i, q in reversed(list(enumerate(ends)))}
    first_inside = {p: first_end[inside[0]] for p, inside in _within(ends).items()}
    span = {p: 0 if p == ROOT else min(first_end[p], first_inside.get(p, first_end[p])) for p in ends}
    begins = sorted(ends, key=lambda p: (span[p], -len(ends) if p == ROOT else p.count(".")))
    fsdp = {p for p in ends if not by_path[p].parts["ddp"]}
    enclosing = {ROOT, *_within(ends)}
    neighbours = dict.fromkeys(description.paths, (0, 0))
    for path in ends:
        i, j = ends.index(path), begins.index(path)
        earlier = next((q for q in reversed(ends[:i]) if q in fsdp), None)
        later = next((q for q in begins[j + 1:] if q in fsdp), None)
        # an FSDP2 unit prefetches the earlier one at its own backward; a DDP unit meets that gather only if an
        # FSDP2 unit whose backward came before its own prefetched it
        prefetched = path in fsdp or any(q in fsdp for q in ends[i + 1:])
        before = int(by_path[earlier].parts["backward_gather_bytes"]) if earlier and prefetched else 0
        after = int(by_path[later].parts["kept_reduce_input_bytes"]) if later else 0
        # a unit enclosing others meets the inner units' buffers where the schedule places its working set
        neighbours[path] = (before, 0 if path in enclosing else after)
    return neighbours


def nested_neighbours(coarse: ModelDescription, nested: ModelDescription, precision: str,
               world_size: int) -> dict[str, tuple[int, int]]:
    """``nested``'s neighbour buffers per unit (``unit_neighbours``), where a block's first part
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
            out[block] = (max(out[p][0] for p in running), max(out[p][1] for p in running))
    return out
