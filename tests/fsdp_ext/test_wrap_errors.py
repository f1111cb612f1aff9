"""Plans that cannot be applied fail on every rank with a clear error, and leave the model untouched."""

import pytest
import torch
from cases import plan_error_of
from dist_harness import run_ranks
from torch.distributed.tensor import DTensor
from toy_models import GPT

import osdp
from osdp.schema.plan import Plan, UnitPlan


def _bad_plans_on_every_rank(rank, world_size):
    torch.manual_seed(0)
    model = GPT()
    paths = [u.path for u in osdp.discover_units(model)]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    errors = {
        "unknown": plan_error_of(lambda: osdp.wrap(model, plan=Plan([UnitPlan("blocks.7.mlp")]))),
        "world": plan_error_of(lambda: osdp.wrap(model, plan=Plan.for_strategy(paths, "fsdp", world_size=8))),
        "mismatch": plan_error_of(lambda: osdp.wrap(model, strategy="fsdp" if rank == 0 else "ddp")),
        "one_rank_bad": plan_error_of(
            lambda: osdp.wrap(model, plan=Plan([UnitPlan("blocks.0.mlp" if rank == 0 else "blocks.0.nope")]))
        ),
        # an example the forward cannot take, on one rank (a float batch for an embedding)
        "bad_example": plan_error_of(lambda: osdp.wrap(
            model, strategy="fsdp", example_input=torch.randint(0, 64, (2, 8)) if rank == 0 else torch.randn(2, 8))),
    }
    untouched = all(not isinstance(p, DTensor) for p in model.parameters()) and all(
        torch.equal(before[k], v) for k, v in model.state_dict().items()
    )
    osdp.wrap(model, strategy="fsdp")  # still usable after the failures
    errors["twice"] = plan_error_of(lambda: osdp.wrap(model, strategy="fsdp"))
    return errors, untouched


def test_bad_and_mismatched_plans_fail_on_every_rank_without_hanging():
    results = run_ranks(_bad_plans_on_every_rank, 2, timeout=120)
    for rank, (errors, untouched) in enumerate(results):
        assert untouched, f"rank {rank}: a failed wrap changed the model"
        assert "unit 'blocks.7.mlp': no such module in the model" in errors["unknown"]
        assert "the plan was made for world size 8 but this job has 2 ranks" in errors["world"]
        assert "ranks hold different plans" in errors["mismatch"]
        assert "ranks [0] hold plan" in errors["mismatch"] and "ranks [1] hold plan" in errors["mismatch"]
        assert "already wrapped" in errors["twice"]
        assert "the model's forward failed on the example_input of some rank" in errors["bad_example"]
    assert "unit 'blocks.0.nope': no such module in the model" in results[1][0]["one_rank_bad"]
    assert "rank 1 rejected the plan: unit 'blocks.0.nope': no such module" in results[0][0]["one_rank_bad"]


def test_single_process_without_process_group_wraps_and_matches_plain_training():
    import torch.distributed as dist
    from training_check import reference, train

    batches = [(torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))) for _ in range(2)]

    def build():
        torch.manual_seed(0)
        return GPT()

    ref_losses, _ = reference(build, batches)
    model = osdp.wrap(build(), strategy="zero2")
    try:
        assert train(model, batches) == pytest.approx(ref_losses, abs=1e-6)
    finally:
        dist.destroy_process_group()
