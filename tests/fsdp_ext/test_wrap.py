"""osdp.wrap under every mode: N-rank training equals single-process training of the global batch."""

import functools

import pytest
from cases import build_reference, build_toy, every_mode_plans, reference_batches, toy_batches
from dist_harness import run_ranks
from training_check import assert_matches_reference, reference, train_under_plans


@pytest.mark.parametrize("world_size", [2, 4])
def test_toy_model_matches_single_process(world_size):
    plans = every_mode_plans(build_toy())
    assert "split" in plans
    batches = toy_batches()
    out = run_ranks(train_under_plans, world_size, build_toy, batches, [p.to_json() for p in plans.values()])
    assert_matches_reference(out, reference(build_toy, batches), list(plans))


@pytest.mark.parametrize("name, world_size", [("gpt2-tiny", 2), ("gpt2-tiny", 4), ("bert-tiny", 2), ("llama-tiny", 2)])
def test_reference_models_match_single_process(name, world_size):
    build = functools.partial(build_reference, name)
    plans = every_mode_plans(build())
    assert "split" in plans, f"{name} has no unit that can be split"
    batches = reference_batches(name)
    out = run_ranks(train_under_plans, world_size, build, batches, [p.to_json() for p in plans.values()], timeout=240)
    assert_matches_reference(out, reference(build, batches), list(plans))
