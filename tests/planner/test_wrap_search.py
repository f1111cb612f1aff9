"""osdp.wrap(model, device_mem=..., example_input=...) searches once, agrees on every rank, and fits."""

import torch
from dist_harness import run_ranks

import osdp
from osdp import models
from osdp.models.data import synthetic_batch


def _wrap_with_budget(rank, world_size, budget):
    torch.manual_seed(0)
    model = models.build("gpt2-tiny", seq_len=32)
    config = models.get_config("gpt2-tiny", seq_len=32)
    # each rank's example batch differs: the plan must still be rank 0's, everywhere
    batch = synthetic_batch(config, 4, 32, generator=torch.Generator().manual_seed(rank))
    try:
        osdp.wrap(model, device_mem=budget, example_input=batch)
    except osdp.BudgetTooSmall as e:
        return ("too small", e.min_peak_bytes, e.batch_size, str(e))
    plan = osdp.plan_of(model)
    loss = model(*batch)
    loss.backward()  # the plan runs
    return ("ok", plan.hash, plan.predicted_peak_bytes, [u.mode for u in plan.units], plan.meta["budget_bytes"],
            _uniform_plans_predicted(plan, batch))


def _uniform_plans_predicted(plan, batch):
    """Predicted step of every uniform plan over the searched plan's units, priced as the search priced it
    (the cached calibration, the description at the plan's granularity)."""
    from osdp.calibration.measured import calibrate
    from osdp.cost.schedule import predict
    from osdp.planner import description_of, planning_descriptions

    machine = calibrate()  # cached by the wrap above: no collective runs here
    description = description_of(plan, planning_descriptions(models.build("gpt2-tiny", seq_len=32), batch))
    out = {}
    for mode in ("replicate", "zero2", "zero3"):
        uniform = osdp.Plan([osdp.UnitPlan(path, mode) for path in description.paths],
                            batch_size=plan.batch_size)
        out[mode] = predict(description, uniform, machine.device_info,
                                 calibration=machine.calibration).step_s
    return plan.predicted_step_s, out


def test_wrap_searches_once_and_every_rank_applies_the_same_plan():
    tight = run_ranks(_wrap_with_budget, 2, "4GiB", timeout=240)
    assert tight[0][0] == "ok" and tight[0][1] == tight[1][1]
    # Nothing limits memory: the searched plan is at least as fast, under the model that searched, as every
    # uniform plan (which modes win per unit depends on the collectives and overheads measured here).
    searched, uniform = tight[0][5]
    assert all(searched <= step * (1 + 1e-9) for step in uniform.values()), (searched, uniform)
    tiny = run_ranks(_wrap_with_budget, 2, "64KiB", timeout=240)
    assert tiny[0][0] == tiny[1][0] == "too small"  # the same error on every rank
    minimum, batch_size = tiny[0][1], tiny[0][2]
    assert batch_size == 4 and minimum > 64 * 1024 and "at micro-batch 4" in tiny[0][3]
    # just above the minimum, a plan fits, and it cannot be all-replicate
    fits = run_ranks(_wrap_with_budget, 2, minimum + 1024, timeout=240)
    assert fits[0][0] == "ok" and fits[0][2] <= minimum + 1024 and fits[0][1] == fits[1][1]
    assert set(fits[0][3]) != {"replicate"}


def _peaks_under_searched_plans(rank, world_size):
    """Plans osdp.wrap searches at budgets from the least any plan needs to what the fastest needs, each
    trained: its measured peaks per rank (three steps after the optimizer's state exists)."""
    from osdp.optim import make_optimizer
    from osdp.runtime.step import peaks_per_step

    config = models.get_config("gpt2-tiny", seq_len=32)
    batch = synthetic_batch(config, 4, 32, generator=torch.Generator().manual_seed(rank))

    def wrapped(budget):
        torch.manual_seed(0)
        model = models.build("gpt2-tiny", seq_len=32)
        osdp.wrap(model, device_mem=budget, example_input=batch)
        return model

    try:
        wrapped(64 * 1024)
    except osdp.BudgetTooSmall as e:
        least = e.min_peak_bytes
    most = osdp.plan_of(wrapped("4GiB")).predicted_peak_bytes
    out = []
    for fraction in (0.0, 0.3, 0.6, 1.0):
        budget = int(least + fraction * (most - least))
        model = wrapped(budget)
        optimizer = make_optimizer("adamw", model.parameters())  # what the plan was priced with
        peaks = peaks_per_step(model, optimizer, batch, warmup=2, steps=3)
        plan = osdp.plan_of(model)
        out.append((budget, plan.predicted_peak_bytes, peaks, plan.summary()))
    return out


def test_a_searched_plan_measures_within_its_budget_on_two_ranks():
    ranks = run_ranks(_peaks_under_searched_plans, 2, timeout=300)
    assert [b for b, *_ in ranks[0]] == [b for b, *_ in ranks[1]]
    assert len({summary for *_, summary in ranks[0]}) >= 3  # the budgets give different plans
    for results in ranks:
        for budget, predicted, peaks, summary in results:
            assert predicted <= budget, (budget, predicted, summary)
            # every step the same: nothing (e.g. a collective's worker thread) frees memory when it likes
            assert len(set(peaks)) == 1 and peaks[0] <= budget, (budget, peaks, summary)
