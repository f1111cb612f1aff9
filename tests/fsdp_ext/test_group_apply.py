"""Grouped units: k consecutive identical blocks as one FSDP2 unit (``fully_shard([blocks.0, blocks.1])``).

A grouped plan trains as one process and as the same plan without groups (state dict keys and values), every
module of a group answers FSDP2's methods, and groups the model cannot run as one unit are refused on every rank,
naming the units, before anything changes.
"""

from __future__ import annotations

import torch
from cases import build_toy, plan_error_of, toy_batches
from dist_harness import run_ranks
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from training_check import assert_matches_reference, full_state, reference, train_under_plans

import osdp
from osdp.schema.plan import Plan, UnitPlan


def block_plan(model, grouped: bool, mode: str = "zero3", checkpoint=False) -> Plan:
    """The toy GPT at block granularity, its two blocks one group (``grouped``) or two units."""
    paths = [u.path for u in osdp.discover_units(model, granularity="block")]
    assert {"blocks.0", "blocks.1"} <= set(paths), paths
    return Plan([UnitPlan(p, mode, checkpoint=checkpoint if p.startswith("blocks.") else False,
                          group="blocks.0" if grouped and p.startswith("blocks.") else None) for p in paths])


def grouped_plans() -> dict[str, Plan]:
    model = build_toy()
    return {"group_zero3": block_plan(model, True), "group_zero2_ckpt": block_plan(model, True, "zero2", True),
            "group_zero3_sac": block_plan(model, True, checkpoint="selective"), "apart_zero3": block_plan(model, False)}


def test_grouped_plans_train_as_one_process_and_as_the_plan_without_groups():
    plans = grouped_plans()
    batches = toy_batches()
    out = run_ranks(train_under_plans, 2, build_toy, batches, [p.to_json() for p in plans.values()], timeout=240)
    assert_matches_reference(out, reference(build_toy, batches), list(plans))
    states = dict(zip(plans, (r[1] for r in out[0])))
    grouped, apart = states["group_zero3"], states["apart_zero3"]
    assert list(grouped) == list(apart)  # the same keys, in the same order
    assert all(torch.equal(grouped[k], apart[k]) for k in apart)  # FSDP2's group sums and shards the same


def _module_api(rank, world_size):
    model = build_toy()
    osdp.wrap(model, plan=block_plan(model, True))
    first, second = model.blocks[0], model.blocks[1]
    report = {
        "fsdp_modules": isinstance(first, FSDPModule) and isinstance(second, FSDPModule),
        "one_state": fully_shard.state(first) is fully_shard.state(second),
        "sharded": all(isinstance(p, DTensor) for p in [*first.parameters(), *second.parameters()]),
    }
    second.unshard()  # any module of the group gathers the whole group
    report["unsharded_together"] = not any(isinstance(p, DTensor) for p in first.parameters())
    second.reshard()
    report["resharded_together"] = all(isinstance(p, DTensor) for p in first.parameters())
    # gradient accumulation unit by unit, as torchtitan writes it, on every module of the group
    (x, y), *_ = toy_batches()
    n = x.shape[0] // world_size
    x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for last in (False, True):
        for unit in [m for m in model.modules() if isinstance(m, FSDPModule)]:
            unit.set_requires_gradient_sync(last, recurse=False)
        (model(x, y) / 2).backward()
    opt.step()
    state = full_state(model)  # collective: every rank takes part
    report["state"] = state if rank == 0 else None
    with torch.no_grad():  # evaluation: the group is resharded after its last module
        model.eval()
        model(x, y)
    report["resharded_after_eval"] = all(isinstance(p, DTensor) for p in [*first.parameters(), *second.parameters()])
    return report


def test_every_module_of_a_group_answers_fsdp2s_methods():
    reports = run_ranks(_module_api, 2, timeout=180)
    state = reports[0].pop("state")
    reports[1].pop("state")
    for rank, report in enumerate(reports):
        assert all(report.values()), f"rank {rank}: {report}"
    # the accumulated step equals one process's step on the global batch, accumulated the same way
    model = build_toy()
    (x, y), *_ = toy_batches()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for _ in range(2):
        (model(x, y) / 2).backward()
    opt.step()
    ref = model.state_dict()
    assert set(state) == set(ref)
    assert max((ref[k] - state[k]).abs().max().item() for k in ref) <= 1e-5


class Odd(torch.nn.Module):
    """Two identical blocks around a third of another width: groups that are not consecutive or not identical."""

    def __init__(self, h=8):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(h, h), torch.nn.Linear(h, 2 * h), torch.nn.Linear(2 * h, h),
                                           torch.nn.Linear(h, h)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _refusals(rank, world_size):
    torch.manual_seed(0)
    model = Odd()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def plan(*groups):
        group = {p: first for first, *rest in groups for p in [first, *rest]}
        return Plan([UnitPlan(f"layers.{i}", group=group.get(f"layers.{i}")) for i in range(4)])

    errors = {
        "not_identical": plan_error_of(lambda: osdp.wrap(model, plan=plan(("layers.0", "layers.1")))),
        "not_consecutive": plan_error_of(lambda: osdp.wrap(model, plan=plan(("layers.0", "layers.3")))),
    }
    gpt = build_toy()
    nested = Plan([UnitPlan(u.path, group="blocks.0" if u.path in ("blocks.0", "blocks.1") else None)
                   for u in osdp.discover_units(gpt, granularity="nested")])  # sub-blocks nested in each block
    errors["enclosing"] = plan_error_of(lambda: osdp.wrap(gpt, plan=nested))
    untouched = all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and not any(
        isinstance(p, DTensor) for p in model.parameters())
    return errors, untouched


def test_groups_the_model_cannot_run_as_one_unit_are_refused_on_every_rank():
    for errors, untouched in run_ranks(_refusals, 2, timeout=120):
        assert untouched
        assert errors["not_identical"].startswith(
            "group 'layers.0' ('layers.0', 'layers.1'): 'layers.1' (Linear) is not identical to 'layers.0' (Linear)")
        assert errors["not_consecutive"].startswith("group 'layers.0' ('layers.0', 'layers.3') is not consecutive")
        assert "group 'blocks.0' ('blocks.0', 'blocks.1'): unit 'blocks.0' encloses other units" in errors["enclosing"]
