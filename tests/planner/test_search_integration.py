"""The search over the real cost model: the extremes of the budget and monotonicity in between."""


import dataclasses

import numpy as np
import pytest
import torch

from osdp import models
from osdp.cost.problem import build_problem
from osdp.describe.analytic import describe_analytic
from osdp.machine.presets import device_preset
from osdp.planner import find_plan
from osdp.schema.plan import ROOT
from osdp.search import BudgetTooSmall, Option, Problem, min_peak, solve
from osdp.search.reference import brute_force, brute_force_min_peak, solve_milp

BATCH = 2


def _gpt2_mini_on_4_gpus(granularity="sub-block"):
    with torch.device("meta"):
        model = models.build("gpt2-mini")
    example = torch.zeros(BATCH, 128, dtype=torch.long, device="meta")
    device = device_preset("a100-40gb-nvlink", 4)
    return describe_analytic(model, (example, example), device, world_size=4, batch_sizes=(BATCH,),
                             granularity=granularity, progress=False), device


@pytest.fixture(scope="module")
def gpt2_mini_on_4_gpus():
    description, device = _gpt2_mini_on_4_gpus()
    minimum, _ = min_peak(build_problem(description, device, BATCH))
    return description, device, minimum


def _search(description, device, budget):
    return find_plan(description, device, (BATCH,), budget=int(budget)).plan


def _least_budget(description, device):
    """The least budget the search plans in, as its error names it."""
    with pytest.raises(BudgetTooSmall) as e:
        _search(description, device, 1)
    return e.value.min_peak_bytes


def test_at_the_minimum_budget_every_unit_is_sharded_and_splits_are_used(gpt2_mini_on_4_gpus):
    description, device, minimum = gpt2_mini_on_4_gpus
    assert _search(description, device, minimum).predicted_peak_bytes <= minimum  # the least additive bound
    # the least budget the error names: a plan's schedule peak, at most the least additive bound, and it fits
    with pytest.raises(BudgetTooSmall) as e:
        _search(description, device, minimum // 2)
    named = e.value.min_peak_bytes
    assert named <= minimum and e.value.batch_size == BATCH
    assert named == _least_budget(description, device)  # whatever the budget below it
    plan = _search(description, device, named)
    assert plan.predicted_peak_bytes <= named
    blocks = [u for u in plan.units if u.path != ROOT]
    assert all(u.mode == "zero3" for u in blocks), plan.summary()
    assert any(u.split > 1 for u in blocks) and any(u.checkpoint for u in blocks), plan.summary()


def test_more_memory_never_predicts_a_slower_plan(gpt2_mini_on_4_gpus):
    description, device, _ = gpt2_mini_on_4_gpus
    least = _least_budget(description, device)
    budgets = np.geomspace(least, 64 * least, 16)
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
        j = problem.options.index(Option(mode))
        uniform[mode] = problem.step_time(np.full(len(problem.units), j))
    assert plan.predicted_step_s <= min(uniform.values()) + 1e-12
    # with memory for everything, every unit takes its own fastest option (step time is additive)
    fastest = np.where(problem.allowed, problem.time, np.inf).min(axis=1).sum()
    assert plan.predicted_step_s == pytest.approx(fastest, rel=1e-12)


@pytest.fixture(scope="module")
def gpt2_mini_on_2_nodes_of_2():
    """Two nodes of two H100s on one 100 GbE NIC each: the links where sharding within the node pays off."""
    with torch.device("meta"):
        model = models.build("gpt2-mini")
    example = torch.zeros(BATCH, 128, dtype=torch.long, device="meta")
    device = device_preset("h100-nvlink-100gbe", 4, ranks_per_node=2)
    description = describe_analytic(model, (example, example), device, world_size=4, batch_sizes=(BATCH,),
                                    progress=False)
    return description, device


def test_the_search_over_shard_scopes_is_exact(gpt2_mini_on_2_nodes_of_2):
    """Against brute force on four units with every unsplit option (world and node scope), and against the MILP
    on the whole model with all 21 options (checkpointing none, selective, full): the DP's plan is no slower than the optimum at its budget less the
    rounding slack it reports, and never faster than the optimum at its budget."""
    description, device = gpt2_mini_on_2_nodes_of_2
    full = build_problem(description, device, BATCH)
    assert len(full.options) == 21 and sum(o.scope == "node" for o in full.options) == 6
    rows = [0, 1, 2, full.units.index(ROOT)]
    cols = [j for j, o in enumerate(full.options) if o.split == 1]
    ix = np.ix_(rows, cols)
    small = Problem(full.time[ix], full.mem[ix], full.transient[ix], full.allowed[ix], base=full.base,
                    batch_size=BATCH, units=[full.units[u] for u in rows], options=[full.options[j] for j in cols])
    fastest = np.argmin(np.where(small.allowed, small.time, np.inf), axis=1)
    scopes = set()
    for budget in np.linspace(brute_force_min_peak(small), small.peak(fastest), 10).astype(int):
        s = solve(small, int(budget))
        best, choice = brute_force(small, int(budget))
        tighter = brute_force(small, int(budget) - s.slack_bytes)  # None where nothing fits there
        assert best - 1e-15 <= s.step_time <= (tighter[0] if tighter else np.inf) + 1e-15
        assert s.peak_bytes == small.peak(s.choice) <= budget
        scopes |= {small.options[c].scope for c in choice}
    assert scopes == {"world", "node"}  # between the extremes the optimum shards some units within the node
    lowest, _ = min_peak(full)
    for budget in np.linspace(lowest, 2 * lowest, 4).astype(int):
        s = solve(full, int(budget))
        assert solve_milp(full, int(budget))[0] - 1e-12 <= s.step_time
        tighter = solve_milp(full, int(budget) - s.slack_bytes)
        assert s.step_time <= (tighter[0] if tighter else np.inf) + 1e-12


def test_a_searched_plan_shards_over_one_scope(gpt2_mini_on_2_nodes_of_2):
    """Every plan the search gives on two nodes shards its units over every rank or within the node, never
    both (its parameters then sit on one device mesh, as ``torch.nn.utils.clip_grad_norm_`` needs); each kind
    is taken at some budget, and no plan is slower than the faster of the two searched apart."""
    description, device = gpt2_mini_on_2_nodes_of_2
    full = build_problem(description, device, BATCH)
    lowest, _ = min_peak(full)
    kinds = set()
    for budget in np.geomspace(lowest, 8 * lowest, 8).astype(int):
        try:
            plan = find_plan(description, device, (BATCH,), budget=int(budget)).plan
        except BudgetTooSmall:
            continue
        scopes = {u.shard_scope for u in plan.units if u.mode != "replicate"}
        assert len(scopes) <= 1, (budget, [u.label for u in plan.units])
        kinds |= scopes
    assert kinds == {"world", "node"}


@pytest.fixture(scope="module")
def gpt2_mini_both_granularities():
    (fine, device), (coarse, _) = (_gpt2_mini_on_4_gpus(g) for g in ("sub-block", "block"))
    return [fine, coarse], device


def test_the_search_takes_the_fewest_sharded_units_within_the_tolerance_of_the_fastest(gpt2_mini_both_granularities):
    from osdp.planner import GRANULARITY_TOLERANCE, sharded_units

    # the unit sizes alone (find_plan searches groups of blocks only when asked: tests/planner/test_group_search.py)
    descriptions, device = gpt2_mini_both_granularities
    fine, coarse = descriptions
    assert len(coarse.units) < len(fine.units)
    minimum = min(min_peak(build_problem(d, device, BATCH))[0] for d in descriptions)
    chosen = set()
    for budget in np.geomspace(minimum, 64 * minimum, 12):
        # the reference: each granularity searched alone
        alone = {}
        for d in descriptions:
            try:
                alone[d.granularity] = find_plan(d, device, (BATCH,), budget=int(budget)).plan
            except BudgetTooSmall:
                pass
        fastest = max(p.meta["predicted_samples_per_s"] for p in alone.values())
        close = [g for g in ("block", "sub-block")
                 if g in alone and alone[g].meta["predicted_samples_per_s"] >= (1 - GRANULARITY_TOLERANCE) * fastest]
        # of those, the fewest sharded units, then units; the faster at a tie
        expected = min(close, key=lambda g: (sharded_units(alone[g]), len(alone[g].units),
                                             -alone[g].meta["predicted_samples_per_s"]))
        plan = find_plan(descriptions, device, (BATCH,), budget=int(budget)).plan
        speeds = {g: p.meta["predicted_samples_per_s"] for g, p in alone.items()}
        assert plan.meta["granularity"] == expected, (budget, speeds)
        assert plan.predicted_step_s == alone[expected].predicted_step_s
        assert plan.meta["samples_per_s_by_granularity"] == pytest.approx(
            {g: p.meta["predicted_samples_per_s"] for g, p in alone.items()})
        chosen.add(plan.meta["granularity"])
    assert chosen == {"block", "sub-block"}  # tight budgets take attention and MLP apart, loose ones whole blocks


def test_more_sharded_units_are_taken_only_when_predicted_faster_by_more_than_the_tolerance(
        gpt2_mini_both_granularities):
    from osdp.planner import GRANULARITY_TOLERANCE, choose_granularity
    from osdp.schema.plan import Plan

    fine, coarse = (Plan.for_strategy(d.paths, "fsdp") for d in gpt2_mini_both_granularities[0])
    within, beyond = 1 / (1 - GRANULARITY_TOLERANCE) - 1e-3, 1 / (1 - GRANULARITY_TOLERANCE) + 1e-3
    assert choose_granularity([(fine, 1.0), (coarse, 1.0)]) == 1
    assert choose_granularity([(fine, within), (coarse, 1.0)]) == 1  # fine a little faster: whole blocks
    assert choose_granularity([(fine, beyond), (coarse, 1.0)]) == 0
    assert choose_granularity([(coarse, 1.0), (fine, beyond)]) == 1  # whatever the order
    assert choose_granularity([(fine, 1.0), (coarse, 0.5)]) == 0
    # all replicated: the fewer units, as DDP over whole blocks ran faster than over their halves
    fine_ddp, coarse_ddp = (Plan.for_strategy(p.paths, "ddp") for p in (fine, coarse))
    assert choose_granularity([(fine_ddp, within), (coarse_ddp, 1.0)]) == 1
    # sharded units count first: the 109.6 MiB plans of gpt2-mini on loopback, sub-blocks all replicated against
    # three sharded blocks
    mixed = Plan([dataclasses.replace(u, mode="zero2") if u.path.startswith("blocks.") and u.path < "blocks.3"
                  else u for u in coarse_ddp.units])
    assert choose_granularity([(fine_ddp, 1.0), (mixed, 1.02)]) == 0


class _ReturnsLogits(torch.nn.Module):
    """Returns ``(logits, loss)``, as nanoGPT's model does."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64)

    def forward(self, ids, targets):
        logits = self.head(torch.tanh(self.emb(ids)))
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_what_the_model_returns_is_priced_as_held_through_the_step_unless_the_loop_keeps_only_the_loss():
    """``logits, loss = model(x, y)`` keeps the logits through backward (FSDPMemTracker measured them over the
    budget before they were priced); ``holds_output=False`` is for loops that keep only the loss."""
    import osdp

    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    held, dropped = (osdp.plan(_ReturnsLogits(), device_mem="1GiB", example_input=(ids, ids),
                               loss_fn=lambda out: out[1], device="cpu-loopback", holds_output=holds)
                     for holds in (True, False))
    assert held.summary() == dropped.summary()
    logits_bytes = 4 * 16 * 64 * 4
    assert logits_bytes <= held.predicted_peak_bytes - dropped.predicted_peak_bytes <= logits_bytes + 16
