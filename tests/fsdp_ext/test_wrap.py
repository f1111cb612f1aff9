"""osdp.wrap under every mode: N-rank training equals single-process training of the global batch (a toy GPT, the
reference models, a self-distilling model with hook-computed weights, a Fourier operator with complex weights, gradient
hooks on parameters)."""

import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import prune
import model_styles
from cases import build_reference, build_toy, every_mode_plans, reference_batches, toy_batches
from dist_harness import run_ranks
from training_check import assert_matches_reference, reference, train_under_plans

from osdp.schema.plan import Plan, UnitPlan


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


class SelfDistillation(nn.Module):
    """A unit called twice per forward, first under no_grad for the target (SimSiam's, data2vec's), and Linears
    whose weights torch's own forward pre-hooks compute and return nothing: a pruned one (weight_orig *
    weight_mask) and one under the older hook-based weight_norm."""

    def __init__(self, h=32, vocab=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        fc = nn.Linear(h, 2 * h)
        prune.l1_unstructured(fc, "weight", amount=0.3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated for the parametrization, still in use
            normed = torch.nn.utils.weight_norm(nn.Linear(2 * h, h))
        self.encoder = nn.Sequential(nn.LayerNorm(h), fc, nn.GELU(), normed)
        self.predictor = nn.Sequential(nn.Linear(h, h), nn.GELU(), nn.Linear(h, h))

    def forward(self, tokens, targets):
        with torch.no_grad():
            target = self.encoder(self.emb(targets))
        return F.mse_loss(self.predictor(self.encoder(self.emb(tokens))), target)


def _self_distillation():
    torch.manual_seed(0)
    return SelfDistillation()


def test_a_unit_called_without_grad_then_with_and_hook_computed_weights_train_as_one_process():
    """Every mode, and the root selectively checkpointed around the encoder unit: its FSDP2 hooks gather twice in
    the forward and once in the recompute, which selective checkpointing must not see."""
    plans = every_mode_plans(_self_distillation())
    plans["root_selective"] = Plan([UnitPlan("emb", "zero2"), UnitPlan("encoder", "zero3"),
                                    UnitPlan("predictor", "replicate"), UnitPlan("", "zero2", checkpoint="selective")])
    batches = toy_batches()
    out = run_ranks(train_under_plans, 2, _self_distillation, batches, [p.to_json() for p in plans.values()])
    assert_matches_reference(out, reference(_self_distillation, batches), list(plans))


def _fourier_operator():
    return model_styles.build("fourier")


def _training_warnings(rank, world_size, build, batches, plans_json):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = train_under_plans(rank, world_size, build, batches, plans_json)
    return out, sorted({str(w.message) for w in seen if "complex" in str(w.message).lower()})


def test_complex_parameters_train_as_one_process_without_warnings():
    # a parameter's check for writes through .data reads both parts of a complex one (casting it to real warned at
    # every gather and missed writes to the imaginary part)
    plans = every_mode_plans(_fourier_operator())
    batches = model_styles.batches("fourier", 8, 3)
    out = run_ranks(_training_warnings, 2, _fourier_operator, batches, [p.to_json() for p in plans.values()])
    assert all(not messages for _, messages in out), out[0][1]
    assert_matches_reference([r for r, _ in out], reference(_fourier_operator, batches), list(plans))


class NewTokenRows(nn.Module):
    """Only the new tokens' embedding rows trained (a gradient hook masks the old rows'), and a Linear whose
    gradient a hook halves: hooks registered on the parameters in ``__init__``, before any wrapping."""

    def __init__(self, h=64, vocab=64, old=48):
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.body = nn.Sequential(nn.Linear(h, 2 * h), nn.GELU(), nn.Linear(2 * h, h))
        self.head = nn.Linear(h, vocab)
        self.register_buffer("new_rows", (torch.arange(vocab) >= old).float()[:, None])
        self.emb.weight.register_hook(lambda g: g * self.new_rows)
        self.body[0].weight.register_hook(lambda g: g * 0.5)

    def forward(self, tokens, targets):
        return F.cross_entropy(self.head(self.body(self.emb(tokens))).flatten(0, 1), targets.flatten())


def _new_token_rows():
    torch.manual_seed(0)
    return NewTokenRows()


def test_gradient_hooks_on_parameters_run_under_every_plan():
    # FSDP2 computes with new gathered parameters: the hooks are carried onto them (and a hooked Linear is never
    # split, its hook expecting the whole gradient); without, sharded plans trained the masked rows
    plans = every_mode_plans(_new_token_rows())
    assert "split" in plans
    batches = toy_batches()
    out = run_ranks(train_under_plans, 2, _new_token_rows, batches, [p.to_json() for p in plans.values()])
    assert_matches_reference(out, reference(_new_token_rows, batches), list(plans))
