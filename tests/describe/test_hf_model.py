"""Hugging Face Transformers models as users bring them, built from small configs (no download,
defaults kept: caches on, tied heads), train under every mode, split, checkpointing and a searched
plan exactly as in one process."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers  # a test extra: pip install -e ".[test]"
from cases import every_mode_plans
from dist_harness import run_ranks
from hf_models import BATCH, FAMILIES, SEQ, VOCAB, hf_model
from training_check import STEPS, assert_matches_reference, full_state, reference, train, train_under_plans

import osdp
from osdp.describe.forward_caches import cached_modules


def batches(family: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches (every rank takes its slice); every token labelled, so that ranks' mean losses
    average to one process's."""
    g = torch.Generator().manual_seed(2)
    if family == "vit":
        return [(torch.randn(BATCH, 3, 16, 16, generator=g), torch.randint(0, 5, (BATCH,), generator=g))
                for _ in range(STEPS)]
    out = []
    for _ in range(STEPS):
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        labels = ids if family in ("gpt2", "llama", "qwen2", "mixtral") else torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        out.append((ids, labels))
    return out


def _train_searched(rank, world_size, family, global_batches):
    """``osdp.wrap(model, device_mem=...)`` at 5% above the least any plan needs (so that the search has
    to shard and checkpoint), then trained; losses, full state (rank 0) and the plan's modes."""
    n = BATCH // world_size
    example = tuple(t[rank * n:(rank + 1) * n] for t in global_batches[0])
    try:
        osdp.wrap(hf_model(family), device_mem="1KiB", example_input=example)
        raise AssertionError("1 KiB fits no plan")
    except osdp.BudgetTooSmall as e:
        budget = int(e.min_peak_bytes * 1.05)
    model = hf_model(family)
    osdp.wrap(model, device_mem=budget, example_input=example)
    plan = osdp.plan_of(model)
    losses = train(model, global_batches, rank, world_size)
    state = full_state(model)
    return [(losses, state if rank == 0 else None)], sorted({(u.mode, u.split, u.checkpoint_policy) for u in plan.units})


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_under_every_plan_kind_as_one_process(family):
    build = lambda: hf_model(family)  # noqa: E731
    plans = every_mode_plans(build())  # every mode, checkpointing on and off, split where a Linear qualifies
    assert ("split" in plans) == (family != "gpt2"), "GPT-2's Conv1D is no nn.Linear; every other family has some"
    data = batches(family)
    ref = reference(build, data)
    out = run_ranks(_train_planned, 2, family, data, [p.to_json() for p in plans.values()], timeout=240)
    assert_matches_reference(out, ref, list(plans))
    searched = run_ranks(_train_searched, 2, family, data, timeout=240)
    assert_matches_reference([r[0] for r in searched], ref, ["searched"])
    assert searched[0][1] == searched[1][1]  # one plan on every rank


def _train_planned(rank, world_size, family, data, plans_json):
    return train_under_plans(rank, world_size, lambda: hf_model(family), data, plans_json)


def test_caches_are_off_while_checkpointed_units_train_and_on_for_inference():
    """T5 keeps its key/value cache on by default; checkpointed, its recomputed forward would save other
    tensors. Training turns the cache off (with one warning); inference still returns it."""
    model = hf_model("t5")
    assert cached_modules(model) == ["hf"] and model.hf.config.use_cache
    ids, labels = batches("t5")[0]
    plan = every_mode_plans(model)["mixed_a"]
    assert any(u.checkpoint for u in plan.units)
    out = run_ranks(_cache_check, 2, plan.to_json(), ids, labels, timeout=120)
    for warned, cache_in_eval, config_use_cache in out:
        assert warned == 1 and cache_in_eval and config_use_cache  # the user's config untouched


def _cache_check(rank, world_size, plan_json, ids, labels):
    model = hf_model("t5")
    osdp.wrap(model, plan=plan_json)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(ids, labels).backward()  # would raise CheckpointError with the cache on
    warned = sum("use_cache=False while training" in str(w.message) for w in caught)
    model.eval()
    with torch.no_grad():
        out = model(ids, labels)
    return warned, out.past_key_values is not None, model.hf.config.use_cache


def test_checkpointed_recomputation_replays_dropout_exactly():
    """With GPT-2's default dropout on, a plan that checkpoints every unit trains exactly as the same plan
    without checkpointing on the same ranks: the recomputed forward draws the same masks."""
    paths = [u.path for u in osdp.discover_units(hf_model("gpt2", dropout=True))]
    plain = osdp.Plan.for_strategy(paths, "fsdp")
    ckpt = osdp.Plan([osdp.UnitPlan(p, "zero3", checkpoint=p != "") for p in paths])
    out = run_ranks(_train_with_dropout, 2, batches("gpt2"), [plain.to_json(), ckpt.to_json()], timeout=240)
    (plain_losses, plain_state), (ckpt_losses, ckpt_state) = out[0]
    assert plain_losses == ckpt_losses  # to the bit: other masks would differ by ~1e-2
    # gradients summed in another order under recomputation (the tied embedding's two uses): rounding only
    assert max((plain_state[k] - ckpt_state[k]).abs().max().item() for k in plain_state) <= 1e-6


def _train_with_dropout(rank, world_size, data, plans_json):
    results = []
    for plan_json in plans_json:
        model = hf_model("gpt2", dropout=True)
        osdp.wrap(model, plan=plan_json)
        torch.manual_seed(100 + rank)  # the same masks for both plans on a rank
        losses = train(model, data, rank, world_size)
        results.append((losses, full_state(model)))
    return results


def _train_and_save_pretrained(rank, world_size, data, plan_json, directory):
    from osdp.runtime.dcp import full_state_dict

    model = hf_model("gpt2")
    osdp.wrap(model, plan=plan_json)
    train(model, data, rank, world_size)
    state = full_state_dict(model)  # collective: the whole model on rank 0, on the CPU
    if rank == 0:  # the wrapped model itself saves, from the gathered state (keys without our wrapper's prefix)
        model.hf.save_pretrained(directory, state_dict={k.removeprefix("hf."): v for k, v in state.items()})


def test_a_wrapped_model_saves_with_save_pretrained_as_one_process_would(tmp_path):
    data = batches("gpt2")
    plan = every_mode_plans(hf_model("gpt2"))["mixed_a"]  # replicated, zero2 and zero3 units, checkpointing
    run_ranks(_train_and_save_pretrained, 2, data, plan.to_json(), str(tmp_path), timeout=240)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    ref = hf_model("gpt2")
    train(ref, data)
    expected = ref.hf.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, atol=1e-5, rtol=0, msg=key)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # still tied
    # the class name save_pretrained writes (FSDP2's prefix taken off): the user's, whatever the plan checkpoints
    assert loaded.config.architectures == ["GPT2LMHeadModel"]
