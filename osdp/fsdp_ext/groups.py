"""A plan's groups against the model: k consecutive identical modules, one FSDP2 unit (``fully_shard([m0, m1])``).

FSDP2 takes a list of modules as one parameter group: one all-gather before
the first module's forward, one reduce-scatter after the first module's
backward, for all of them. Each module keeps its own class swap and forward
hooks, all sharing one ``FSDPState`` (``fully_shard.state(m)`` is the same
object for every module of the group), so FSDP2's methods called on any of
them act on the whole group. The plan says which units are grouped
(``UnitPlan.group``); this module checks that the model can run them so:
siblings, consecutive among their parent's children, of one type and the same
parameters, none enclosing another unit.
"""

from __future__ import annotations

from typing import Sequence

import torch.nn as nn

from osdp.describe.units import Unit
from osdp.schema.plan import Plan, PlanError, display_path


def _parent_and_name(path: str) -> tuple[str, str]:
    parent, _, name = path.rpartition(".")
    return parent, name


def _identity(module: nn.Module, unit: Unit) -> tuple:
    """What identical modules share: type, parameter names, shapes and dtypes, and the parameters the unit owns
    (not whether they require gradients now: a user may freeze part of one block, before wrapping or after)."""
    return (type(module), unit.numel, [(n, p.shape, p.dtype) for n, p in module.named_parameters()])


def group_members(model: nn.Module, plan: Plan, units: Sequence[Unit]) -> dict[str, list[str]]:
    """First unit of each group of ``plan`` -> its units' paths in the model's order. PlanError naming the units
    unless they are consecutive siblings of one type with the same parameters, none enclosing another unit."""
    by_path = {u.path: u for u in units}
    modules = dict(model.named_modules())
    ordered = {}
    for first, members in plan.groups().items():
        named = ", ".join(f"'{display_path(p)}'" for p in members)
        enclosing = [p for p in members if by_path[p].nested]
        if enclosing:
            raise PlanError(f"group '{display_path(first)}' ({named}): unit '{display_path(enclosing[0])}' encloses "
                            f"other units ({', '.join(by_path[enclosing[0]].nested)}); group only units that do not")
        different = [p for p in members if _identity(modules[p], by_path[p]) != _identity(modules[first], by_path[first])]
        if different:
            raise PlanError(f"group '{display_path(first)}' ({named}): '{display_path(different[0])}' "
                            f"({by_path[different[0]].module_type}) is not identical to '{display_path(first)}' "
                            f"({by_path[first].module_type}): a group is of identical modules (one type, the same "
                            "parameter shapes)")
        parents = {_parent_and_name(p)[0] for p in members}
        siblings = list(dict(modules[parents.pop()].named_children())) if len(parents) == 1 else []
        places = sorted(siblings.index(_parent_and_name(p)[1]) for p in members) if siblings else []
        if not places or places != list(range(places[0], places[0] + len(members))):
            raise PlanError(f"group '{display_path(first)}' ({named}) is not consecutive: a group is of modules "
                            "next to each other in one parent (blocks.0 and blocks.1, not blocks.0 and blocks.2)")
        parent = _parent_and_name(first)[0]
        ordered[first] = [".".join(p for p in (parent, siblings[i]) if p) for i in places]
    return ordered
