"""The models, batches and plans the equality tests train: a user-style toy GPT and the reference models,
their batches, and plans that use every mode (checkpointing, splitting, per-block units)."""

from __future__ import annotations

import torch
from toy_models import GPT
from training_check import STEPS

import osdp
from osdp.schema.plan import Plan, PlanError, UnitPlan
from osdp.split import splittable_linears


def plan_error_of(fn) -> str | None:
    """The message of the PlanError ``fn()`` raises (the tests compare every rank's), or None."""
    try:
        fn()
    except PlanError as e:
        return str(e)
    return None


def build_toy():
    torch.manual_seed(0)
    return GPT()


def toy_batches(global_batch=8):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, 64, (global_batch, 16), generator=g), torch.randint(0, 64, (global_batch, 16), generator=g))
        for _ in range(STEPS)
    ]


def every_mode_plans(model):
    """Baselines, two mixed plans that use every mode with checkpointing off, full and selective, and one that
    splits every unit that can be split (k = 2, 3, 4 in turn) next to replicated and zero2 units."""
    units = osdp.discover_units(model)
    paths = [u.path for u in units]
    modes = ["replicate", "zero2", "zero3"]
    mixed_a = Plan([UnitPlan(p, modes[i % 3], checkpoint=i % 2 == 0) for i, p in enumerate(paths)])
    # full and selective checkpointing in turn
    mixed_b = Plan([UnitPlan(p, modes[(i + 1) % 3], checkpoint=(False, True, False, "selective")[i % 4])
                    for i, p in enumerate(paths)])
    modules = dict(model.named_modules())
    split = []
    for i, u in enumerate(units):
        nested = {modules[p] for p in u.nested}
        if splittable_linears(modules[u.path], exclude=nested, root=model):
            split.append(UnitPlan(u.path, "zero3", split=(2, 3, 4)[i % 3], checkpoint=i % 2 == 0))
        else:
            split.append(UnitPlan(u.path, modes[i % 2]))
    plans = {s: Plan.for_strategy(paths, s) for s in ("ddp", "zero2", "fsdp")}
    plans.update(mixed_a=mixed_a, mixed_b=mixed_b)
    if any(u.nested and u.path for u in osdp.discover_units(model, granularity="nested")):
        plans["per_block"] = per_block_plan(model)
    if any(u.split > 1 for u in split):
        plans["split"] = Plan(split)
    if (grouped := grouped_plan(model)) is not None:
        plans["grouped"] = grouped
    return plans


def grouped_plan(model):
    """At block granularity, every two consecutive blocks one FSDP2 unit (zero3, then zero2 checkpointed, in turn),
    the other units zero3; None if the model has no two consecutive blocks."""
    units = [u for u in osdp.discover_units(model, granularity="block")]
    by_path = {u.path: u for u in units}
    group, pairs = {}, 0
    for u in units:
        parent, _, index = u.path.rpartition(".")
        if not index.isdigit() or u.path in group or int(index) % 2:
            continue
        nxt = f"{parent}.{int(index) + 1}"
        if nxt in by_path and not u.nested and by_path[nxt].signature == u.signature:
            group[u.path] = group[nxt] = (u.path, pairs % 2)
            pairs += 1
    if not group:
        return None
    return Plan([UnitPlan(u.path, "zero2" if u.path in group and group[u.path][1] else "zero3",
                          checkpoint=u.path in group and group[u.path][1] == 1,
                          group=group[u.path][0] if u.path in group else None) for u in units])


def per_block_plan(model):
    """The first block whole (zero3, checkpointed), every other block apart: its sub-blocks and the block
    itself (its norms) in every mode, the sub-blocks checkpointed in turn (osdp.describe.granularity's plans)."""
    modes = ["replicate", "zero2", "zero3"]
    blocks = [u.path for u in osdp.discover_units(model, granularity="nested") if u.nested and u.path]
    units = []
    for i, u in enumerate(osdp.discover_units(model, granularity="nested")):
        if u.path == blocks[0]:
            units.append(UnitPlan(u.path, "zero3", checkpoint=True))
        elif not u.path.startswith(blocks[0] + "."):  # the first block's sub-blocks are in it
            units.append(UnitPlan(u.path, modes[i % 3], checkpoint=(not u.nested and i % 2 == 0) and
                                  ("selective" if i % 4 == 0 else True)))
    return Plan(units)


def build_reference(name):
    from osdp import models

    torch.manual_seed(0)
    return models.build(name, seq_len=16)


def reference_batches(name, global_batch=4):
    from osdp import models
    from osdp.models.data import synthetic_batch

    config = models.get_config(name, seq_len=16)
    return [synthetic_batch(config, global_batch, 16, generator=torch.Generator().manual_seed(s)) for s in range(STEPS)]
