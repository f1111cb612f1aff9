"""Hugging Face Transformers models as users bring them, built from small configs (no download, defaults kept:
caches on, tied heads), each with its loss: what the equality, trainer and contract tests train."""

from __future__ import annotations

import torch
import torch.nn as nn
import transformers  # a test extra: pip install -e ".[test]"

VOCAB, SEQ, BATCH = 64, 8, 4


NO_DROPOUT = dict(  # ranks draw other dropout masks than one process: compared without it
    gpt2=dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    bert=dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    t5=dict(dropout_rate=0.0),
    bart=dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0),
    vit=dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
)


SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)  # 64 x 64: splittable


class WithLoss(nn.Module):
    """``model(inputs, targets) -> loss`` over a Transformers model that computes its loss from ``labels``."""

    def __init__(self, hf: nn.Module, input_name: str):
        super().__init__()
        self.hf, self.input_name = hf, input_name

    def forward(self, inputs, labels):
        out = self.hf(**{self.input_name: inputs}, labels=labels)
        return out.loss if self.training else out  # evaluation: the whole output (logits, caches)


def hf_model(family: str, dropout: bool = False) -> nn.Module:
    """A two-layer model of ``family`` with its loss; defaults kept except sizes (and dropout, unless asked)."""
    torch.manual_seed(0)
    t = transformers
    drop = {} if dropout else NO_DROPOUT.get(family, {})
    if family == "gpt2":  # Conv1D, tied head
        config = t.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, **drop)
        return WithLoss(t.GPT2LMHeadModel(config), "input_ids")
    if family == "llama":  # RoPE, grouped-query attention, gated MLP of Linears
        config = t.LlamaConfig(vocab_size=VOCAB, num_key_value_heads=2, max_position_embeddings=32, **SMALL)
        return WithLoss(t.LlamaForCausalLM(config), "input_ids")
    if family == "qwen2":
        config = t.Qwen2Config(vocab_size=VOCAB, num_key_value_heads=2, max_position_embeddings=32, **SMALL)
        return WithLoss(t.Qwen2ForCausalLM(config), "input_ids")
    if family == "mixtral":  # mixture of experts: top-2 of 4 experts inside each decoder layer's MoE block
        config = t.MixtralConfig(vocab_size=VOCAB, num_key_value_heads=2, max_position_embeddings=32,
                                 num_local_experts=4, num_experts_per_tok=2, **SMALL)
        return WithLoss(t.MixtralForCausalLM(config), "input_ids")
    if family == "bert":  # masked LM, tied decoder
        config = t.BertConfig(vocab_size=VOCAB, max_position_embeddings=32, **SMALL, **drop)
        return WithLoss(t.BertForMaskedLM(config), "input_ids")
    if family == "t5":  # encoder-decoder, cross-attention, relative position bias, use_cache on
        config = t.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                            decoder_start_token_id=0, pad_token_id=0, **drop)
        return WithLoss(t.T5ForConditionalGeneration(config), "input_ids")
    if family == "bart":  # encoder-decoder, learned positions, use_cache on
        config = t.BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                              encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                              decoder_ffn_dim=128, max_position_embeddings=32, **drop)
        return WithLoss(t.BartForConditionalGeneration(config), "input_ids")
    if family == "vit":  # pixels in, a class out
        config = t.ViTConfig(image_size=16, patch_size=4, num_labels=5, **SMALL, **drop)
        return WithLoss(t.ViTForImageClassification(config), "pixel_values")
    raise ValueError(family)


FAMILIES = ["gpt2", "llama", "qwen2", "mixtral", "bert", "t5", "bart", "vit"]
