"""Reference models, built into the package (no downloads).

``build(name, **overrides)`` makes a model from a named preset; overrides
change config fields (``build("gpt2-small", n_layer=2, seq_len=128)``).
Every model takes ``model(input_ids, targets=None)`` and returns logits
[B, T, vocab] without targets, the mean cross-entropy with them (-100
ignored), and keeps its config in ``model.config``. Initialisation is
deterministic given ``torch.manual_seed``; dropout is 0 unless asked for.

Build under ``with torch.device("meta"):`` to describe a large model without
allocating it; ``model.to_empty(device=...)`` then ``model.init_weights()``
materialises it.

Presets (parameters counted with tied weights once):

=================  ======  ======  =====  ======  =====  ================
name               layers  hidden  heads  vocab   seq    parameters
=================  ======  ======  =====  ======  =====  ================
gpt2-tiny          2       64      4      256     64     120,576
gpt2-mini          4       256     4      256     128    3,257,856
gpt2-cpu-medium    8       512     8      256     256    25,482,240
gpt2-small         12      768     12     50257   1024   124,439,808
gpt2-medium        24      1024    16     50257   1024   354,823,168
gpt2-large         36      1280    20     50257   1024   774,030,080
gpt2-xl            48      1600    25     50257   1024   1,557,611,200
gpt-48l-h1536      48      1536    16     50257   1024   1,438,683,648
bert-tiny          2       128     2      512     64     488,064
bert-base          12      768     12     30522   512    109,514,298
bert-large         24      1024    16     30522   512    335,174,458
llama-tiny         2       64      4/2kv  256     64     125,248
llama-1b           16      2048    32/8kv 128256  2048   1,235,814,400
=================  ======  ======  =====  ======  =====  ================

The tiny models and gpt2-mini train on the byte-level corpus of
``osdp.models.data`` in seconds on a CPU; gpt2-cpu-medium is the largest that is
still practical for multi-rank CPU experiments; gpt-48l-h1536 is the OSDP
paper's 48-layer GPT; bert-* match Hugging Face ``BertForMaskedLM``; llama-1b
matches Llama-3.2-1B's shapes (grouped-query attention, tied embeddings;
without its long-context RoPE scaling).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn

from osdp.models.base import ModelConfig
from osdp.models.bert import Bert, BertConfig
from osdp.models.gpt import GPT, GPTConfig
from osdp.models.llama import Llama, LlamaConfig

__all__ = [
    "Bert",
    "BertConfig",
    "GPT",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "ModelConfig",
    "build",
    "flops_per_token",
    "get_config",
    "names",
    "num_params",
]

_GPT2 = dict(vocab_size=50257, seq_len=1024)
_BERT = dict(vocab_size=30522, seq_len=512)

# name -> (config class, fields); configs are made fresh so that overrides see the class defaults
_PRESETS: dict[str, tuple[type[ModelConfig], dict]] = {
    "gpt2-tiny": (GPTConfig, dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, seq_len=64)),
    "gpt2-mini": (GPTConfig, dict(n_layer=4, n_embd=256, n_head=4, vocab_size=256, seq_len=128)),
    "gpt2-cpu-medium": (GPTConfig, dict(n_layer=8, n_embd=512, n_head=8, vocab_size=256, seq_len=256)),
    "gpt2-small": (GPTConfig, dict(n_layer=12, n_embd=768, n_head=12, **_GPT2)),
    "gpt2-medium": (GPTConfig, dict(n_layer=24, n_embd=1024, n_head=16, **_GPT2)),
    "gpt2-large": (GPTConfig, dict(n_layer=36, n_embd=1280, n_head=20, **_GPT2)),
    "gpt2-xl": (GPTConfig, dict(n_layer=48, n_embd=1600, n_head=25, **_GPT2)),
    "gpt-48l-h1536": (GPTConfig, dict(n_layer=48, n_embd=1536, n_head=16, **_GPT2)),
    # bert-tiny: the 256 byte values, then [MASK] = 256, so it can do MLM on the byte corpus
    "bert-tiny": (BertConfig, dict(n_layer=2, n_embd=128, n_head=2, vocab_size=512, seq_len=64, mask_token_id=256)),
    "bert-base": (BertConfig, dict(n_layer=12, n_embd=768, n_head=12, **_BERT)),
    "bert-large": (BertConfig, dict(n_layer=24, n_embd=1024, n_head=16, **_BERT)),
    "llama-tiny": (
        LlamaConfig,
        dict(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, intermediate_size=176, vocab_size=256, seq_len=64),
    ),
    "llama-1b": (
        LlamaConfig,
        dict(
            n_layer=16,
            n_embd=2048,
            n_head=32,
            n_kv_head=8,
            intermediate_size=8192,
            vocab_size=128256,
            seq_len=2048,
            rope_theta=500000.0,
            tie_embeddings=True,
        ),
    ),
}

_MODEL_FOR = {GPTConfig: GPT, BertConfig: Bert, LlamaConfig: Llama}


def quiet_view_warning() -> None:
    """Silence FSDP2's warning that a wrapped module returned a view: it warns of an in-place op on that view,
    which the reference models never apply to a unit's output (the CLIs train them; a user's model keeps it)."""
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def names() -> list[str]:
    """The preset names, by family and size."""
    return list(_PRESETS)


def get_config(name: str, **overrides) -> ModelConfig:
    """The config of preset ``name`` with ``overrides`` applied (unknown fields raise TypeError)."""
    if name not in _PRESETS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(_PRESETS)}")
    cls, fields = _PRESETS[name]
    return cls(**{"name": name, **fields, **overrides})


def build(name_or_config: str | ModelConfig, **overrides) -> nn.Module:
    """A freshly initialised model, on the current default device (``torch.device`` context)."""
    if isinstance(name_or_config, str):
        config = get_config(name_or_config, **overrides)
    else:
        config = dataclasses.replace(name_or_config, **overrides)
    return _MODEL_FOR[type(config)](config)


def num_params(model_or_config: nn.Module | ModelConfig | str) -> int:
    """Number of parameters, a shared (tied) Parameter counted once. Configs are built on meta."""
    model = model_or_config if isinstance(model_or_config, nn.Module) else _meta_model(model_or_config)
    return sum(p.numel() for p in model.parameters())


def flops_per_token(config: ModelConfig | str, seq_len: int | None = None) -> int:
    """Training FLOPs (forward + backward) per token: ``6 * N + 12 * n_layer * n_embd * seq_len``.

    N is the number of parameters that take part in matmuls: every parameter
    except embedding tables that are only looked up (positions, token types,
    and the token table when the head is untied); a tied head counts once. Each
    such parameter costs 2 FLOPs per token forward and 4 backward. The second
    term is attention's two T x T matmuls (QK^T and scores @ V), 4 * n_embd *
    seq_len FLOPs per layer and token forward, three times that with backward,
    counting the full score matrix as in PaLM (appendix B) and nanoGPT's MFU.
    Bias and norm parameters are in N though they do no matmul: that
    overestimates by under 2% for the tiny models and far less for real ones.
    """
    model = _meta_model(config)
    config = model.config
    matmul_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    lookup_only = sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, nn.Embedding) and id(m.weight) not in matmul_weights
    )
    n = num_params(model) - lookup_only
    return 6 * n + 12 * config.n_layer * config.n_embd * (seq_len or config.seq_len)


def _meta_model(name_or_config: ModelConfig | str) -> nn.Module:
    with torch.device("meta"):
        return build(name_or_config)
