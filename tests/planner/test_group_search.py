"""The search groups k consecutive identical blocks into one FSDP2 unit (k in 2, 4) only where the cost model
predicts it faster within the budget: where per-unit costs dominate, not where memory binds."""

import pytest
import torch

from osdp import models
from osdp.cost.schedule import predict
from osdp.cost.terms import Calibration
from osdp.describe.analytic import describe_analytic
from osdp.machine.presets import device_preset
from osdp.planner import description_of, find_plan, least_budget

BATCH = 2
# per-unit costs that dominate the step: every FSDP2 unit (its hooks, its meetings) costs 50 ms
EXPENSIVE_UNITS = Calibration(unit_overhead_s={"replicate": 0.05, "zero2": 0.05, "zero3": 0.05})


@pytest.fixture(scope="module")
def gpt2_mini():
    """gpt2-mini described analytically per sub-block and per block, for 2 CPU ranks."""
    with torch.device("meta"):
        model = models.build("gpt2-mini")
    example = torch.zeros(BATCH, models.get_config("gpt2-mini").seq_len, dtype=torch.long, device="meta")
    device = device_preset("cpu-loopback", 2)
    return [describe_analytic(model, (example, example), device, batch_sizes=(BATCH,), granularity=g, progress=False)
            for g in ("sub-block", "block")], device


def _search(descriptions, device, budget, calibration, group_blocks=True):
    return find_plan(descriptions, device, (BATCH,), budget=budget, calibration=calibration,
                     group_blocks=group_blocks)


def test_groups_are_searched_only_when_asked(gpt2_mini):
    """Off by default: the pricing of a group does not agree with measurement on CPU yet (find_plan)."""
    descriptions, device = gpt2_mini
    budget = 4 * least_budget(descriptions, device, (BATCH,))
    assert not _search(descriptions, device, budget, EXPENSIVE_UNITS, group_blocks=False).plan.groups()
    assert _search(descriptions, device, budget, EXPENSIVE_UNITS).plan.groups()


def test_the_search_groups_blocks_where_per_unit_costs_dominate(gpt2_mini):
    descriptions, device = gpt2_mini
    ddp_peak = least_budget(descriptions, device, (BATCH,))  # a budget where sharding is needed somewhere
    budget = 4 * ddp_peak
    result = _search(descriptions, device, budget, EXPENSIVE_UNITS)
    plan = result.plan
    assert plan.groups(), plan.summary()
    assert all(len(members) in (2, 4) for members in plan.groups().values())
    assert ", groups of " in plan.meta["granularity"]
    # the plan reports what the cost model predicts for it, priced again from the descriptions it was searched in
    again = predict(description_of(plan, descriptions), plan, device, calibration=EXPENSIVE_UNITS)
    assert again.step_s == pytest.approx(plan.predicted_step_s, rel=1e-9)
    assert again.peak_bytes == plan.predicted_peak_bytes <= budget
    speeds = plan.meta["samples_per_s_by_granularity"]
    assert plan.meta["predicted_samples_per_s"] > max(v for g, v in speeds.items() if ", groups of " not in g)


def test_the_search_does_not_group_where_per_unit_costs_are_small(gpt2_mini):
    descriptions, device = gpt2_mini
    budget = 4 * least_budget(descriptions, device, (BATCH,))
    plan = _search(descriptions, device, budget, Calibration()).plan  # the ideal FSDP2 runtime: no fixed costs
    assert not plan.groups(), plan.summary()


def test_the_search_does_not_group_where_memory_binds(gpt2_mini):
    descriptions, device = gpt2_mini
    budget = least_budget(descriptions, device, (BATCH,), calibration=EXPENSIVE_UNITS)
    plan = _search(descriptions, device, budget, EXPENSIVE_UNITS).plan
    assert not plan.groups(), plan.summary()  # a group gathers k blocks at once: more than the least there is
    assert plan.predicted_peak_bytes <= budget
