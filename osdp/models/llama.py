"""Llama style decoder: RMSNorm, rotary position embeddings, grouped-query
attention (separate ``q``, ``k``, ``v`` Linears), SwiGLU MLP, no biases.

Rotary angles are computed in each attention forward rather than kept as a
buffer: they cost O(seq_len * head_dim), and with no buffers a model built on
the meta device needs nothing but ``to_empty`` and ``init_weights``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from osdp.models.base import ModelConfig, init_weights_, lm_loss


@dataclass
class LlamaConfig(ModelConfig):
    n_kv_head: int | None = None  # None: as many as n_head (no grouping)
    intermediate_size: int = 176
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head


def apply_rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate channel pairs (i, i + D/2) of ``x`` [B, H, T, D] by position * theta^(-2i/D)."""
    T, D = x.shape[-2:]
    inv_freq = theta ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    angles = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        hd = config.head_dim
        self.q = nn.Linear(config.n_embd, config.n_head * hd, bias=False)
        self.k = nn.Linear(config.n_embd, config.kv_heads * hd, bias=False)
        self.v = nn.Linear(config.n_embd, config.kv_heads * hd, bias=False)
        self.proj = nn.Linear(config.n_head * hd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        B, T, _ = x.shape
        q = self.q(x).view(B, T, c.n_head, c.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, c.rope_theta), apply_rotary(k, c.rope_theta)
        p = c.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=c.kv_heads != c.n_head)
        y = self.proj(y.transpose(1, 2).reshape(B, T, c.n_head * c.head_dim))
        return F.dropout(y, p, self.training)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.dropout = config.dropout
        self.gate = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.up = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.down(F.silu(self.gate(x)) * self.up(x)), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.ln_1 = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attn = Attention(config)
        self.ln_2 = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.init_weights()  # also ties lm_head.weight to wte.weight if asked: one Parameter, owned by the root

    def init_weights(self) -> None:
        """(Re)draw every parameter, e.g. after ``to_empty`` on a model built on meta.

        ``to_empty`` gives each reference to a tied weight its own copy, so tie them again first.
        """
        if self.config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        init_weights_(self, self.config.init_std, ("attn.proj", "mlp.down"), self.config.n_layer)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = F.dropout(self.wte(input_ids), self.config.dropout, self.training)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits if targets is None else lm_loss(logits, targets)
