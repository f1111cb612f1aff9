"""Modules the model calls depending on the data (a mixture of experts' experts, a branch some ranks' rows take):
never units of their own, and their gradients, present on some ranks only, reduced as one process would have them
under every plan."""

from __future__ import annotations

import model_styles as styles
import pytest
import torch
import torch.nn as nn
from dist_harness import run_ranks
from training_check import assert_matches_reference, full_state, reference, train, train_under_plans

import osdp
from osdp.describe.units import discover_units, routed_containers, trace_calls, uneven_calls
from osdp.schema.plan import Plan, PlanError, UnitPlan

ROWS = 4  # per rank
STEPS = 4


def _traced(model, *inputs):
    return trace_calls(model, lambda: model(*inputs))


def _build():
    return styles.build("moe")


def _batches():
    return styles.batches("moe", 2 * ROWS, STEPS)


def _experts_used(batch) -> list[set[int]]:
    """Per rank, the experts its rows are routed to (the reference model's router: the same at the first step)."""
    model = styles.build("moe")
    with torch.no_grad():
        choice = model.router(model.emb(batch[0]).mean(1)).argmax(-1)
    return [set(choice[r * ROWS:(r + 1) * ROWS].tolist()) for r in range(2)]


def test_modules_called_depending_on_the_data_are_no_units():
    model = styles.build("moe")
    example = _batches()[0]
    calls = _traced(model, *example)
    assert routed_containers(model, calls) == ["experts"]
    for granularity in ("sub-block", "block", "nested"):
        paths = [u.path for u in discover_units(model, calls, granularity)]
        assert not any(p.startswith("experts") for p in paths), (granularity, paths)

    class TokenRouted(nn.Module):  # every expert called, each on the rows routed to it
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

        def forward(self, x):
            return sum(e(x[: 2 + i]).sum() for i, e in enumerate(self.experts))

    token_routed = TokenRouted()
    assert routed_containers(token_routed, _traced(token_routed, torch.randn(6, 8))) == ["experts"]

    gpt = styles.build("lambda_gpt")  # blocks in a ModuleList, each called once on the same shape: units
    gpt_calls = _traced(gpt, *styles.batches("lambda_gpt", 2, 1)[0])
    assert routed_containers(gpt, gpt_calls) == []
    assert {"transformer.h.0", "transformer.h.1"} <= {u.path for u in discover_units(gpt, gpt_calls)}


def _plans(model, example) -> dict[str, str]:
    paths = [u.path for u in discover_units(model, _traced(model, *example))]  # the root, which holds the experts, last
    modes = {
        "ddp": lambda p: "replicate", "zero2": lambda p: "zero2", "fsdp": lambda p: "zero3",
        "experts replicated": lambda p: "replicate" if p == "" else "zero3",
        "experts sharded": lambda p: "zero3" if p == "" else "replicate",
    }
    plans = {name: Plan([UnitPlan(p, mode(p), checkpoint=p != "" and i % 2 == 0) for i, p in enumerate(paths)],
                        routed=["experts"])
             for name, mode in modes.items()}
    return {name: plan.to_json() for name, plan in plans.items()}


def test_routed_experts_train_as_one_process_under_every_plan():
    batches = _batches()
    used = [_experts_used(b) for b in batches]
    # what makes the test: experts used on one rank only, and one used by no rank in a later step
    assert any(a ^ b for a, b in used), used
    assert any(set().union(*used[0]) - set().union(*u) for u in used[1:]), used
    plans = _plans(_build(), batches[0])
    ref = reference(_build, batches)
    results = run_ranks(train_under_plans, 2, _build, batches, list(plans.values()), timeout=300)
    assert_matches_reference(results, ref, list(plans))


def _refused(rank, world_size, plan_json):
    try:
        osdp.wrap(styles.build("moe"), plan=plan_json)
    except PlanError as e:
        return str(e)
    return None


@pytest.mark.parametrize("unit", ["experts.3", "experts.3.up"])
def test_a_plan_making_a_routed_module_a_unit_is_refused_on_every_rank(unit):
    plan = Plan([UnitPlan(unit, "zero3"), UnitPlan("", "zero3")], routed=["experts"]).to_json()
    for message in run_ranks(_refused, 2, plan, timeout=120):
        assert message is not None and f"unit '{unit}' is inside 'experts'" in message, message


def _given_plan_and_example(rank, world_size, plan_json, batches):
    model = _build()
    example = tuple(t[rank * ROWS:(rank + 1) * ROWS] for t in batches[0])
    try:
        osdp.wrap(model, plan=plan_json, example_input=example)
    except PlanError as e:
        return str(e)
    losses = train(model, batches, rank, world_size)
    state = full_state(model)  # collective: every rank takes part
    return osdp.plan_of(model).routed, losses, state if rank == 0 else None


def test_a_given_plan_lacking_the_routed_modules_gets_them_from_the_example():
    """A plan written by hand names no routed containers: with the example, wrap finds them on every rank (one
    that would make an expert a unit is refused, naming it) instead of ranks reducing different gradients."""
    batches = _batches()
    lacking = {name: Plan.from_json(plan) for name, plan in _plans(_build(), batches[0]).items()}
    for plan in lacking.values():
        plan.routed = []
    expert_units = Plan([UnitPlan("experts.1", "zero3"), UnitPlan("", "zero3")]).to_json()
    ref = reference(_build, batches)
    names = ["fsdp", "experts replicated"]
    for name in names:
        results = run_ranks(_given_plan_and_example, 2, lacking[name].to_json(), batches, timeout=300)
        assert all(r[0] == ["experts"] for r in results), results
        assert_matches_reference([[r[1:]] for r in results], ref, [name])
    for message in run_ranks(_given_plan_and_example, 2, expert_units, batches, timeout=120):
        assert "unit 'experts.1' is inside 'experts'" in message, message


def test_modules_the_ranks_examples_call_unevenly_are_named_outermost_first():
    model = styles.build("data_branch")
    batch = styles.batches("data_branch", 2 * ROWS, 1)[0]
    counts = [trace_calls(model, lambda r=r: model(*(t[r * ROWS:(r + 1) * ROWS] for t in batch))).counts
              for r in range(2)]  # only the first rank's rows take the branch
    assert uneven_calls(model, counts) == ("refine",)  # not its Linears as well
    assert uneven_calls(model, counts[:1] * 2) == ()
    calls = trace_calls(model, lambda: model(*(t[:ROWS] for t in batch)))
    calls.uneven = ("refine",)
    assert not any(u.path.startswith("refine") for u in discover_units(model, calls))


class Skipping(nn.Module):
    """Stochastic depth with its draw fixed: the forward runs the layers in ``ran`` only."""

    def __init__(self, ran, h=16):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
                                     for _ in range(4)])
        self.ran = ran

    def forward(self, x):
        for i in self.ran:
            x = x + self.layers[i](x)
        return x.square().mean()


def _saved_bytes(ran) -> tuple[dict[str, int], dict[str, int]]:
    """The saved bytes and forward working sets of all units, summed; the root's memory entry."""
    from osdp.describe.measure import memory_pass, resolve_units

    model, x = Skipping(ran), torch.randn(8, 16)
    units, routed, _ = resolve_units(model, x, None, None)
    memory, _ = memory_pass(model, units, x, None, routed=routed)
    return {key: sum(m[key] for m in memory.values()) for key in ("act", "fwd_peak")}, memory[""]


def test_members_a_routed_container_did_not_call_are_priced_as_those_that_ran():
    """A later step may run the layers this example's draw skipped: the unit holding them is priced with all
    of them run, as one measured running all of them (there each layer is a unit of its own)."""
    every, _ = _saved_bytes([0, 1, 2, 3])
    for ran in ([0, 2], [3]):
        some, root = _saved_bytes(ran)
        assert some["act"] == every["act"], (ran, some, every)
        assert root["fwd_peak"] >= every["act"], (ran, root, every)
