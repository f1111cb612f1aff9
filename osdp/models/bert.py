"""BERT style encoder for masked-LM training: word + position + token-type
embeddings, post-LN blocks with bidirectional attention and a GELU MLP, and
the MLM head (dense, GELU, LayerNorm, decoder tied to the word embeddings).

The MLM head is laid out flat on the root (``head_dense``, ``head_ln``,
``lm_head``) so that ``lm_head`` is the vocabulary Linear in every reference
model. The parameter count equals Hugging Face's ``BertForMaskedLM``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from osdp.models.base import MLP, Attention, ModelConfig, init_weights_, lm_loss


@dataclass
class BertConfig(ModelConfig):
    type_vocab_size: int = 2
    mask_token_id: int = 103  # [MASK] in the bert-base-uncased vocabulary
    layer_norm_eps: float = 1e-12


class Block(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.attn = Attention(config, causal=False)
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = MLP(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_1(x + self.attn(x))
        return self.ln_2(x + self.mlp(x))


class Bert(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        d = config.n_embd
        self.wte = nn.Embedding(config.vocab_size, d)
        self.wpe = nn.Embedding(config.seq_len, d)
        self.wtt = nn.Embedding(config.type_vocab_size, d)
        self.ln_emb = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.head_dense = nn.Linear(d, d)
        self.head_ln = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(d, config.vocab_size)
        self.init_weights()  # also ties lm_head.weight to wte.weight: one Parameter, owned by the root

    def init_weights(self) -> None:
        """(Re)draw every parameter, e.g. after ``to_empty`` on a model built on meta.

        ``to_empty`` gives each reference to a tied weight its own copy, so tie them again first.
        """
        self.lm_head.weight = self.wte.weight
        init_weights_(self, self.config.init_std)

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``targets`` are the MLM labels: the original token at masked positions, -100 elsewhere."""
        T = input_ids.size(1)
        if T > self.config.seq_len:
            raise ValueError(f"sequence of length {T} is longer than seq_len={self.config.seq_len}")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        pos = torch.arange(T, device=input_ids.device)
        x = self.ln_emb(self.wte(input_ids) + self.wpe(pos) + self.wtt(token_type_ids))
        x = F.dropout(x, self.config.dropout, self.training)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.head_ln(F.gelu(self.head_dense(x))))
        return logits if targets is None else lm_loss(logits, targets)
