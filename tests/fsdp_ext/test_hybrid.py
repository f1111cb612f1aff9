"""Units sharded within their node (shard_scope "node"): plan field, FSDP2's 2-D mesh, training, checkpoints.

Four gloo ranks laid out as 2 nodes x 2 ranks (LOCAL_WORLD_SIZE=2, as torchrun sets it per node).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from cases import build_toy, toy_batches
from dist_harness import run_ranks
from training_check import assert_matches_reference, full_state, reference, sgd, train

import osdp
from osdp.runtime import dcp as checkpoint
from osdp.schema.plan import Plan, PlanError, UnitPlan

# -- the plan field -------------------------------------------------------------------------------


def test_shard_scope_round_trips_and_plans_without_it_keep_their_hash():
    plan = Plan([UnitPlan("a", "zero3", shard_scope="node"), UnitPlan("b", "zero2", checkpoint=True)],
                ranks_per_node=8, world_size=64)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.hash == plan.hash
    assert json.loads(plan.to_json())["units"][0]["shard_scope"] == "node"
    assert "1 zero3@node" in plan.summary() and "1 zero2+ckpt" in plan.summary()
    # a plan written before shard scopes (no field, its hash) still loads, as world-scoped, same hash
    old = {"schema_version": 1, "units": [{"path": "a", "mode": "zero3", "split": 2, "checkpoint": False}]}
    old_hash = Plan.from_dict(old).hash
    world = Plan([UnitPlan("a", "zero3", split=2, shard_scope="world")])
    assert world.hash == old_hash and world.units[0].shard_scope == "world"
    assert Plan.from_dict({**old, "hash": old_hash}).units[0].shard_scope == "world"
    # the scope and the layout are decisions: they change the hash
    assert Plan([UnitPlan("a", "zero3", shard_scope="node")]).hash != Plan([UnitPlan("a", "zero3")]).hash
    assert Plan([UnitPlan("a")], ranks_per_node=4).hash != Plan([UnitPlan("a")]).hash


@pytest.mark.parametrize("unit, message", [
    (dict(mode="replicate", shard_scope="node"), "use it with mode 'zero2' or 'zero3'"),
    (dict(mode="zero3", split=2, shard_scope="node"), "use shard_scope 'world' for split units"),
    (dict(mode="zero3", shard_scope="rack"), "use one of world, node"),
])
def test_shard_scopes_that_cannot_work_are_refused(unit, message):
    with pytest.raises(PlanError, match=message):
        UnitPlan("blocks.0", **unit)


def test_a_layout_that_is_not_whole_nodes_is_refused():
    with pytest.raises(PlanError, match="not a whole number of nodes of 3 ranks"):
        Plan([UnitPlan("a")], world_size=8, ranks_per_node=3)


# -- two nodes of two ranks -----------------------------------------------------------------------


def mixed_plans(model) -> dict[str, Plan]:
    """Every unit node-scoped in turn with each mode, beside world-scoped, replicated and split units."""
    units = osdp.discover_units(model)
    paths = [u.path for u in units]
    node = dict(shard_scope="node")
    hsdp = Plan([UnitPlan(p, "zero3", **node) for p in paths])
    hsdp_zero2 = Plan([UnitPlan(p, "zero2", checkpoint=i % 2 == 0, **node) for i, p in enumerate(paths)])
    options = [UnitPlan("", "replicate"), UnitPlan("", "zero2", **node), UnitPlan("", "zero3", checkpoint=True),
               UnitPlan("", "zero3", checkpoint=True, **node), UnitPlan("", "zero2")]
    mixed = Plan([UnitPlan(**{**options[i % 5].to_dict(), "path": p}) for i, p in enumerate(paths)])
    # split units are world-scoped; their neighbours and the root node-scoped
    modules = dict(model.named_modules())
    from osdp.split import splittable_linears

    with_split = []
    for i, u in enumerate(units):
        nested = {modules[p] for p in u.nested}
        if u.path and splittable_linears(modules[u.path], exclude=nested, root=model) and i % 2:
            with_split.append(UnitPlan(u.path, "zero3", split=2, checkpoint=True))
        else:
            with_split.append(UnitPlan(u.path, ("zero3", "zero2")[i % 2], **node))
    return {"hsdp": hsdp, "hsdp_zero2_ckpt": hsdp_zero2, "mixed": mixed, "mixed_split": Plan(with_split)}


def _train_on_two_nodes(rank, world_size, plans_json):
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    batches = toy_batches()
    out = []
    for plan_json in plans_json:
        model = build_toy()
        osdp.wrap(model, plan=plan_json)
        meshes = {tuple(p.device_mesh.shape): tuple(str(x) for x in p.placements)
                  for p in model.parameters() if hasattr(p, "device_mesh")}
        losses = train(model, batches, rank, world_size)
        state = full_state(model)  # collective: every rank takes part
        out.append((losses, state if rank == 0 else None, meshes))
    return out


def test_node_scoped_plans_on_two_nodes_train_like_one_process():
    plans = mixed_plans(build_toy())
    assert sum(u.split > 1 for u in plans["mixed_split"].units) >= 1
    out = run_ranks(_train_on_two_nodes, 4, [p.to_json() for p in plans.values()], timeout=300)
    assert_matches_reference([[(losses, state) for losses, state, _ in r] for r in out],
                             reference(build_toy, toy_batches()), list(plans))
    # node-scoped units are FSDP2's hybrid sharding: replicated over 2 nodes, sharded over a node's 2 ranks
    assert out[0][0][2] == {(2, 2): ("R", "S(0)")}
    assert (2, 2) in out[0][2][2] and (4,) in out[0][2][2]


def _save_on_two_nodes(rank, world_size, directory, plan_json):
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    model = build_toy()
    osdp.wrap(model, plan=plan_json)
    opt = sgd(model)
    train(model, toy_batches()[:2], rank, world_size, optimizer=opt)
    checkpoint.save(directory, model, opt, extra={"step": 2})
    state = full_state(model)  # collective
    return state if rank == 0 else None


def _load_on_one_node(rank, world_size, directory, plan_json):
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    model = build_toy()
    osdp.wrap(model, plan=plan_json)
    opt = sgd(model)
    extra = checkpoint.load(directory, model, opt)
    loaded = full_state(model)  # collective
    train(model, toy_batches()[2:], rank, world_size, optimizer=opt)  # momentum came along: as uninterrupted
    resumed = full_state(model)
    return extra, loaded if rank == 0 else None, resumed if rank == 0 else None


def test_checkpoints_move_between_two_nodes_and_one(tmp_path):
    paths = [u.path for u in osdp.discover_units(build_toy())]
    saving = mixed_plans(build_toy())["mixed"]
    saved = run_ranks(_save_on_two_nodes, 4, str(tmp_path / "ckpt"), saving.to_json(), timeout=240)[0]
    _, uninterrupted = reference(build_toy, toy_batches())
    for world_size, plan in ((4, Plan.for_strategy(paths, "fsdp")), (2, mixed_plans(build_toy())["hsdp"])):
        extra, loaded, resumed = run_ranks(_load_on_one_node, world_size, str(tmp_path / "ckpt"), plan.to_json(),
                                           timeout=240)[0]
        assert extra == {"step": 2}
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)
        assert max((resumed[k] - uninterrupted[k]).abs().max().item() for k in uninterrupted) <= 1e-5


def _wrap_with_layout(rank, world_size, layouts, plan_json):
    os.environ["LOCAL_WORLD_SIZE"] = str(layouts[rank])
    try:
        osdp.wrap(build_toy(), plan=plan_json)
    except PlanError as e:
        return str(e)
    return None


def test_ranks_that_disagree_on_their_node_layout_all_fail_before_any_collective():
    plan = mixed_plans(build_toy())["hsdp"]
    errors = run_ranks(_wrap_with_layout, 4, [2, 2, 4, 4], plan.to_json(), timeout=120)
    assert all(e and "different numbers of ranks per node ([2, 4]" in e for e in errors), errors
    made_for_4 = Plan(plan.units, ranks_per_node=4)
    errors = run_ranks(_wrap_with_layout, 4, [2, 2, 2, 2], made_for_4.to_json(), timeout=120)
    assert all(e and "made for nodes of 4 ranks but this job runs 2 per node" in e for e in errors), errors
    errors = run_ranks(_wrap_with_layout, 4, [3, 3, 3, 3], plan.to_json(), timeout=120)
    assert all(e and "LOCAL_WORLD_SIZE=3 does not divide the world size 4" in e for e in errors), errors


def _search_on_two_nodes(rank, world_size, budgets_over_min):
    """osdp.wrap(device_mem=...) on 2 nodes x 2: the machine measured with its two levels of links, the
    plans searched over both shard scopes at budgets above the least any plan needs, then trained."""
    import dataclasses

    from osdp.calibration.nets import PROFILES

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    # what is checked is the search over both scopes and the training it picks, not the calibration's figures:
    # its jobs timed as short as they come (4 ranks on 2 cores took a minute at the tiny profile's lengths)
    PROFILES["tiny"] = dataclasses.replace(PROFILES["tiny"], run_s=0.05, min_steps=2, refits=1, compute_rounds=3,
                                           describe_repeats=1, collectives_s=0.1)
    batches = toy_batches()
    n = batches[0][0].shape[0] // world_size
    example = tuple(t[rank * n:(rank + 1) * n] for t in batches[0])
    try:
        osdp.wrap(build_toy(), device_mem="1KiB", example_input=example)
        raise AssertionError("1 KiB fits no plan")
    except osdp.BudgetTooSmall as e:
        least = e.min_peak_bytes
    out = []
    for over in budgets_over_min:
        model = build_toy()
        osdp.wrap(model, device_mem=int(least * over), example_input=example)
        plan = osdp.plan_of(model)
        losses = train(model, batches, rank, world_size)
        state = full_state(model)  # collective
        out.append((losses, state if rank == 0 else None, plan.to_json()))
    return out


def test_plans_searched_on_two_nodes_train_like_one_process():
    budgets = (1.05,)  # tight: the search has to weigh both scopes' memory
    out = run_ranks(_search_on_two_nodes, 4, budgets, timeout=420)
    assert_matches_reference([[(losses, state) for losses, state, _ in r] for r in out],
                             reference(build_toy, toy_batches()), [f"searched at {b}x the least" for b in budgets])
    for i in range(len(budgets)):
        plans = {r[i][2] for r in out}
        assert len(plans) == 1, "every rank applies the same plan"
        plan = Plan.from_json(plans.pop())
        assert plan.ranks_per_node == 2 and plan.world_size == 4  # searched for this job's node layout
