"""Batches for the reference models: synthetic tokens for any of them, and a
small English corpus shipped in the package (``osdp/models/corpus.txt``) with a
byte-level tokenizer (vocabulary 256) for training runs whose loss should go
down (gpt2-tiny, gpt2-mini, llama-tiny, bert-tiny with ``mask_tokens``).

Every batch is an ``(input_ids, targets)`` pair of int64 tensors [B, T], made
on the CPU from a seeded generator, so it is the same on every machine and
rank: ``model(input_ids, targets)`` gives the loss.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Iterator

import numpy as np
import torch

from osdp.models import BertConfig, ModelConfig

MASK_PROB = 0.15  # fraction of positions a masked-LM batch masks, as in BERT


def synthetic_batch(
    config: ModelConfig,
    batch_size: int,
    seq_len: int | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniformly random tokens for ``config``'s model.

    Decoders: the targets are the inputs shifted by one. BERT: ``MASK_PROB`` of
    each row's positions are replaced by ``config.mask_token_id`` and are the
    only targets (others are -100). ``generator`` must be a CPU generator.
    """
    T = seq_len or config.seq_len
    if isinstance(config, BertConfig):
        tokens = torch.randint(0, config.vocab_size, (batch_size, T), generator=generator)
        input_ids, targets = mask_tokens(tokens, config.mask_token_id, generator=generator)
    else:
        tokens = torch.randint(0, config.vocab_size, (batch_size, T + 1), generator=generator)
        input_ids, targets = tokens[:, :-1], tokens[:, 1:]
    return input_ids.to(device), targets.to(device)


def mask_tokens(
    tokens: torch.Tensor, mask_token_id: int, prob: float = MASK_PROB, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked-LM inputs and labels: round(prob * T) positions per row (at least one) become
    ``mask_token_id`` in the inputs and keep their token in the labels; other labels are -100.

    A fixed count per row (rather than a coin per position) means no row, and so no loss, is empty.
    """
    B, T = tokens.shape
    n = max(1, round(prob * T))
    picked = torch.rand(B, T, generator=generator).topk(n, dim=1).indices
    masked = torch.zeros(B, T, dtype=torch.bool).scatter_(1, picked, True)
    return tokens.masked_fill(masked, mask_token_id), tokens.masked_fill(~masked, -100)


def encode(text: str) -> torch.Tensor:
    """Byte-level tokens (UTF-8 bytes, vocabulary 256) as int64."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode(tokens: torch.Tensor) -> str:
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


@functools.cache
def corpus_tokens() -> torch.Tensor:
    """The shipped corpus, byte-tokenised (read once per process; do not modify in place)."""
    return encode(resources.files("osdp.models").joinpath("corpus.txt").read_text(encoding="utf-8"))


class CorpusLoader:
    """Batches of random windows of the shipped corpus, nanoGPT style.

    Step s's global batch is ``batch_size * world_size`` windows of
    ``seq_len + 1`` bytes at random offsets drawn from a stream seeded with
    (seed, s); rank r gets rows ``[r * batch_size, (r + 1) * batch_size)``. So
    the ranks' batches are disjoint slices of one global batch, every batch is
    reproducible from (seed, step) alone, and a single process with
    ``batch_size * world_size`` rows sees exactly what N ranks see together.
    Iterating yields steps 0, 1, 2, ... without end.
    """

    def __init__(self, seq_len: int, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.tokens = corpus_tokens()
        if seq_len + 1 > len(self.tokens):
            raise ValueError(f"seq_len={seq_len} is longer than the corpus ({len(self.tokens)} tokens)")
        self.seq_len, self.batch_size = seq_len, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All ranks' batches for ``step``, concatenated in rank order."""
        rng = np.random.default_rng((self.seed, step))  # an independent stream per (seed, step)
        starts = torch.from_numpy(rng.integers(0, len(self.tokens) - self.seq_len, self.batch_size * self.world_size))
        windows = self.tokens[starts[:, None] + torch.arange(self.seq_len + 1)]
        return windows[:, :-1], windows[:, 1:]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of ``global_batch(step)``."""
        rows = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        input_ids, targets = self.global_batch(step)
        return input_ids[rows], targets[rows]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        step = 0
        while True:
            yield self.batch(step)
            step += 1
