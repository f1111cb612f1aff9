"""Pieces shared by the reference models: the common config fields, GPT/BERT
attention and MLP sub-blocks, the loss, and GPT-2 style initialisation.

The module layout is part of the contract with OSDP's unit discovery: every
block has an ``attn`` and an ``mlp`` submodule holding plain ``nn.Linear``s,
its norms as direct children, and the model keeps its blocks in ``blocks``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelConfig:
    """Fields every reference model has; the cost model and ``flops_per_token`` read these."""

    name: str = ""
    vocab_size: int = 256
    seq_len: int = 64  # longest sequence (size of a learned position table where there is one)
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0  # 0 by default so multi-rank runs can be compared exactly with one process
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class Attention(nn.Module):
    """Multi-head self-attention with one fused ``qkv`` Linear and an output ``proj``."""

    def __init__(self, config: ModelConfig, causal: bool, bias: bool = True):
        super().__init__()
        self.n_head, self.causal, self.dropout = config.n_head, causal, config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        y = self.proj(y.transpose(1, 2).reshape(B, T, C))
        return F.dropout(y, p, self.training)


class MLP(nn.Module):
    """``fc`` (4x wider), GELU, ``proj`` back."""

    def __init__(self, config: ModelConfig, bias: bool = True, gelu: str = "none"):
        super().__init__()
        self.dropout = config.dropout
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=bias)
        self.act = nn.GELU(approximate=gelu)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(self.act(self.fc(x))), self.dropout, self.training)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over positions whose target is not -100 (in fp32, also under autocast)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


def init_weights_(model: nn.Module, std: float, residual_projs: tuple[str, ...] = (), n_layer: int = 1) -> None:
    """GPT-2 initialisation: Linear and Embedding weights N(0, std), zero biases, unit norms.

    Linears whose path ends with one of ``residual_projs`` (the projections that
    write into the residual stream) get std / sqrt(2 * n_layer), so that the
    residual stream's variance does not grow with depth. Shared (tied) weights
    are drawn once. Works on the meta device (no-op) and on DTensors, so it can
    re-initialise a model built on meta and materialised with ``to_empty``.
    """
    seen: set[int] = set()
    for path, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            if id(module.weight) not in seen:
                seen.add(id(module.weight))
                s = std / math.sqrt(2 * n_layer) if path.endswith(residual_projs) else std
                nn.init.normal_(module.weight, mean=0.0, std=s)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            module.reset_parameters()
