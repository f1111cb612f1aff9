"""A Hugging Face transformers model built from a config (tied embeddings, no download) trains
under every mode exactly as in one process."""

import torch
import torch.nn as nn
import transformers  # a test extra: pip install -e ".[test]"

import osdp
from dist_harness import run_ranks
from test_wrap import every_mode_plans
from training_check import STEPS, assert_matches_reference, reference, train_under_plans


class CausalLMLoss(nn.Module):
    """``model(inputs, targets) -> loss`` over a Hugging Face causal LM (it shifts labels itself)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, labels):
        return self.lm(input_ids=input_ids, labels=labels).loss


def build_hf_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    lm = transformers.GPT2LMHeadModel(config)
    assert lm.lm_head.weight is lm.transformer.wte.weight
    return CausalLMLoss(lm)


def test_hf_gpt2_matches_single_process():
    paths = [u.path for u in osdp.discover_units(build_hf_gpt2())]
    assert "lm.transformer.h.0.attn" in paths and "lm.transformer.h.1.mlp" in paths
    plans = every_mode_plans(build_hf_gpt2())
    assert "split" not in plans  # GPT-2's Conv1D is not an nn.Linear: nothing to split
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 64, (4, 16), generator=g),) * 2 for _ in range(STEPS)]
    out = run_ranks(train_under_plans, 2, build_hf_gpt2, batches, [p.to_json() for p in plans.values()])
    assert_matches_reference(out, reference(build_hf_gpt2, batches), list(plans))
