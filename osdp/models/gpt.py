"""GPT-2 style decoder (nanoGPT layout): learned positions, pre-LN blocks,
GELU MLP 4x, causal attention, token embedding tied to the LM head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from osdp.models.base import MLP, Attention, ModelConfig, init_weights_, lm_loss


@dataclass
class GPTConfig(ModelConfig):
    bias: bool = True


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = Attention(config, causal=True, bias=config.bias)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config, bias=config.bias, gelu="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.seq_len, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.init_weights()  # also ties lm_head.weight to wte.weight: one Parameter, owned by the root

    def init_weights(self) -> None:
        """(Re)draw every parameter, e.g. after ``to_empty`` on a model built on meta.

        ``to_empty`` gives each reference to a tied weight its own copy, so tie them again first.
        """
        self.lm_head.weight = self.wte.weight
        init_weights_(self, self.config.init_std, ("attn.proj", "mlp.proj"), self.config.n_layer)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        T = input_ids.size(1)
        if T > self.config.seq_len:
            raise ValueError(f"sequence of length {T} is longer than seq_len={self.config.seq_len}")
        pos = torch.arange(T, device=input_ids.device)
        x = nn.functional.dropout(self.wte(input_ids) + self.wpe(pos), self.config.dropout, self.training)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits if targets is None else lm_loss(logits, targets)
