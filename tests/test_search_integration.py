"""The search over the real cost model: the extremes of the budget and monotonicity in between."""


import numpy as np
import pytest
import torch

from osdp import models
from osdp.analytic import describe_analytic
from osdp.cost import build_problem
from osdp.device import device_preset
from osdp.planner import search
from osdp.plan import ROOT
from osdp.search import BudgetTooSmall, min_peak

BATCH = 2


@pytest.fixture(scope="module")
def gpt2_mini_on_4_gpus():
    with torch.device("meta"):
        model = models.build("gpt2-mini")
    example = torch.zeros(BATCH, 128, dtype=torch.long, device="meta")
    device = device_preset("a100-40gb-nvlink", 4)
    description = describe_analytic(model, (example, example), device, world_size=4, batch_sizes=(BATCH,), progress=False)
    minimum, _ = min_peak(build_problem(description, device, BATCH))
    return description, device, minimum


def _search(description, device, budget):
    return search(description, device, (BATCH,), budget=int(budget)).plan


def test_at_the_minimum_budget_every_unit_is_sharded_and_splits_are_used(gpt2_mini_on_4_gpus):
    description, device, minimum = gpt2_mini_on_4_gpus
    plan = _search(description, device, minimum)
    assert plan.predicted_peak_bytes <= minimum
    blocks = [u for u in plan.units if u.path != ROOT]
    assert all(u.mode == "zero3" for u in blocks), plan.summary()
    assert any(u.split > 1 for u in blocks) and any(u.checkpoint for u in blocks), plan.summary()
    with pytest.raises(BudgetTooSmall) as e:
        _search(description, device, minimum - 1)
    assert e.value.min_peak_bytes == minimum and e.value.batch_size == BATCH


def test_more_memory_never_predicts_a_slower_plan(gpt2_mini_on_4_gpus):
    description, device, minimum = gpt2_mini_on_4_gpus
    budgets = np.geomspace(minimum, 64 * minimum, 16)
    times = [_search(description, device, b).predicted_step_s for b in budgets]
    for (b1, t1), (b2, t2) in zip(zip(budgets, times), zip(budgets[1:], times[1:])):
        # the grid follows the budget, so allow what rounding can cost (far below any real difference)
        assert t2 <= t1 * (1 + 1e-3), f"budget {b2:.0f} predicts {t2} s, slower than {t1} s at {b1:.0f}"
    assert times[-1] < times[0] / 2  # and the budget matters


def test_with_memory_for_everything_each_unit_takes_its_fastest_option(gpt2_mini_on_4_gpus):
    description, device, _ = gpt2_mini_on_4_gpus
    problem = build_problem(description, device, BATCH)
    plan = _search(description, device, 2**40)
    uniform = {}
    for mode in ("replicate", "zero2", "zero3"):
        j = problem.options.index((mode, 1, False))
        uniform[mode] = problem.step_time(np.full(len(problem.units), j))
    assert plan.predicted_step_s <= min(uniform.values()) + 1e-12
    # with memory for everything, every unit takes its own fastest option (step time is additive)
    fastest = np.where(problem.allowed, problem.time, np.inf).min(axis=1).sum()
    assert plan.predicted_step_s == pytest.approx(fastest, rel=1e-12)
