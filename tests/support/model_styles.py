"""Models written the way they come in the wild, not by this project: the contract tests wrap them as they are.

Each style: ``build()`` (seeded), ``batch(rows, generator)`` (the example input: a tuple of positional
arguments), ``loss(output, batch, step)`` (what the user's loop computes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ = 128, 16
TARGET_VOCAB, TARGET_SEQ = 1024, 6  # a translation model's target language


class LambdaMLPBlock(nn.Module):
    """A small research GPT's block: the MLP's Linears kept in a ModuleDict that is never called itself, its
    forward a lambda stored on the block."""

    def __init__(self, h):
        super().__init__()
        self.ln_1 = nn.LayerNorm(h)
        self.attn = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln_2 = nn.LayerNorm(h)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(h, 4 * h), c_proj=nn.Linear(4 * h, h)))
        m = self.mlp
        self.mlpf = lambda x: m.c_proj(F.gelu(m.c_fc(x)))

    def forward(self, x):
        q, k, v = self.attn(self.ln_1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlpf(self.ln_2(x))


class LambdaGPT(nn.Module):
    """Returns ``(logits, loss)``; the head is tied to the embedding and applied as a functional call."""

    def __init__(self, h=32, layers=2):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, h), wpe=nn.Embedding(SEQ, h),
            h=nn.ModuleList([LambdaMLPBlock(h) for _ in range(layers)]), ln_f=nn.LayerNorm(h)))

    def forward(self, idx, targets):
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in t.h:
            x = block(x)
        logits = F.linear(t.ln_f(x), t.wte.weight)  # the embedding's weight, used outside its module
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Seq2Seq(nn.Module):
    """An encoder-decoder built from PyTorch's own layers (MultiheadAttention uses its out_proj's weight
    without calling it)."""

    def __init__(self, h=32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, h)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(h, 4, 64, dropout=0.0, batch_first=True), 2)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(h, 4, 64, dropout=0.0, batch_first=True), 2)
        self.out = nn.Linear(h, VOCAB)

    def forward(self, src, tgt):
        memory = self.encoder(self.embed(src))
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.out(self.decoder(self.embed(tgt), memory, tgt_mask=mask, tgt_is_causal=True))


class SmallCNN(nn.Module):
    """Convolutions with GroupNorm, a classifier, an auxiliary head a step may leave unused, and a buffer that
    counts the training forwards."""

    def __init__(self, classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.GroupNorm(4, 32), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1, stride=2), nn.GroupNorm(4, 32), nn.ReLU(),
        )
        self.classifier = nn.Linear(32 * 4 * 4, classes)
        self.aux = nn.Linear(32 * 4 * 4, classes)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        if self.training and torch.is_grad_enabled():
            self.seen += 1
        f = self.features(x).flatten(1)
        return self.classifier(f), self.aux(f)


class RecurrentLM(nn.Module):
    """A recurrent language model: nn.LSTM and nn.GRU (their weights used by one fused op that saves its own
    outputs), a decoder tied to the embedding; returns the loss."""

    def __init__(self, h=32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, h)
        self.rnn = nn.LSTM(h, h, num_layers=2, batch_first=True)
        self.gru = nn.GRU(h, h, batch_first=True)
        self.dec = nn.Linear(h, VOCAB)
        self.dec.weight = self.emb.weight

    def forward(self, tokens, targets):
        out, _ = self.rnn(self.emb(tokens))
        out, _ = self.gru(out)
        return F.cross_entropy(self.dec(out).flatten(0, 1), targets.flatten())


class SharedLayerEncoder(nn.Module):
    """ALBERT's cross-layer sharing: one encoder layer applied three times per forward, after a factorised
    embedding; returns the loss."""

    def __init__(self, h=32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.proj = nn.Linear(16, h)
        self.layer = nn.TransformerEncoderLayer(h, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.head = nn.Linear(h, VOCAB)

    def forward(self, tokens, targets):
        x = self.proj(self.emb(tokens))
        for _ in range(3):
            x = self.layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class ViTBlock(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(h), nn.MultiheadAttention(h, 4, batch_first=True)
        self.norm2 = nn.LayerNorm(h)
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))

    def forward(self, x):
        y = self.norm1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """A vision transformer as tutorials write it: a class token and position embedding as the root's own
    parameters, a frozen convolutional patch embedding, MultiheadAttention blocks in an nn.Sequential."""

    def __init__(self, h=32, classes=10):
        super().__init__()
        self.patch = nn.Conv2d(3, h, 4, 4)
        self.cls = nn.Parameter(torch.zeros(1, 1, h))
        self.pos = nn.Parameter(torch.randn(1, 17, h) * 0.02)
        self.blocks = nn.Sequential(ViTBlock(h), ViTBlock(h))
        self.norm = nn.LayerNorm(h)
        self.head = nn.Linear(h, classes)
        self.patch.requires_grad_(False)

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


class DictInOut(nn.Module):
    """Takes a dict and returns one; a Linear shared by two parents (the encoder's first, the decoder's last)."""

    def __init__(self, h=32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, h)
        shared = nn.Linear(h, h)
        self.enc = nn.Sequential(shared, nn.Tanh(), nn.Linear(h, h))
        self.dec = nn.Sequential(nn.Linear(h, h), nn.Tanh(), shared)
        self.out = nn.Linear(h, VOCAB)

    def forward(self, batch):
        logits = self.out(self.dec(self.enc(self.emb(batch["ids"]))))
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())}


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update, as LoRA adapters are written."""

    def __init__(self, base: nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.A = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.B = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.A.t()) @ self.B.t()


class LoRAGPT(nn.Module):
    """LambdaGPT's blocks fine-tuned with LoRA: embedding, norms and MLP frozen, the attention's projections
    adapted, the head trained; returns the loss."""

    def __init__(self, h=32):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, h).requires_grad_(False)
        self.blocks = nn.ModuleList([LambdaMLPBlock(h) for _ in range(2)])
        for b in self.blocks:
            for frozen in (b.ln_1, b.ln_2, b.mlp):
                frozen.requires_grad_(False)
            b.attn, b.proj = LoRALinear(b.attn), LoRALinear(b.proj)
        self.head = nn.Linear(h, VOCAB)

    def forward(self, tokens, targets):
        x = self.wte(tokens)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class PaddedClassifier(nn.Module):
    """A padding-aware encoder: Embedding(padding_idx), MultiheadAttention with a bool key_padding_mask,
    nn.RMSNorm, keyword arguments with defaults and a Python float among the inputs; mean-pools the tokens."""

    def __init__(self, h=32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, h, padding_idx=0)
        self.attn = nn.MultiheadAttention(h, 4, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(h, 64), nn.SiLU(), nn.Linear(64, h))
        self.norm = nn.RMSNorm(h)
        self.cls = nn.Linear(h, 5)

    def forward(self, ids, mask=None, temperature=1.0):
        x = self.emb(ids)
        a, _ = self.attn(x, x, x, key_padding_mask=mask, need_weights=False)
        x = self.norm(x + a)
        x = x + self.ff(x)
        keep = (~mask).unsqueeze(-1)
        return self.cls((x * keep).sum(1) / keep.sum(1)) / temperature


class UserCheckpointedGPT(LambdaGPT):
    """LambdaGPT with the user's own activation checkpointing of every block, as Hugging Face's
    ``gradient_checkpointing_enable()`` applies it by default: the block's ``__call__`` (its hooks inside)
    under reentrant ``torch.utils.checkpoint``."""

    def __init__(self, reentrant: bool = True):
        super().__init__()
        self.reentrant = reentrant

    def forward(self, idx, targets):
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in t.h:
            x = torch.utils.checkpoint.checkpoint(block.__call__, x, use_reentrant=self.reentrant)
        logits = F.linear(t.ln_f(x), t.wte.weight)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class WeightNormConv(nn.Module):
    """An audio-style encoder: convolutions under ``weight_norm`` parametrizations (wav2vec2's positional
    convolution, HiFi-GAN), a custom autograd Function, a no-grad statistic of a weight, a dataclass output."""

    def __init__(self, h=16):
        super().__init__()
        from torch.nn.utils.parametrizations import weight_norm

        self.conv1 = weight_norm(nn.Conv1d(4, h, 3, padding=1))
        self.conv2 = weight_norm(nn.Conv1d(h, h, 3, padding=1), dim=2)
        self.proj = nn.Linear(h, 10)

    def forward(self, x, y):
        h = _Swish.apply(self.conv1(x))
        h = F.gelu(self.conv2(h)).mean(-1)
        with torch.no_grad():
            scale = self.proj.weight.norm()
        logits = self.proj(h) / (1 + 0 * scale)
        return _Out(logits=logits, loss=F.cross_entropy(logits, y))


class _Swish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s + x * s * (1 - s))


@dataclass
class _Out:
    logits: torch.Tensor
    loss: torch.Tensor


def _signals(rows, g):
    return torch.randn(rows, 4, SEQ, generator=g), torch.randint(0, 10, (rows,), generator=g)


class InplaceMLP(nn.Module):
    """An MLP as older code writes it to save memory: ``nn.ReLU(inplace=True)`` on a Linear's output, and its
    result returned as a view (``.view``) that the caller adds the residual to in place."""

    def __init__(self, h):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.up = nn.Linear(h, 4 * h)
        self.act = nn.ReLU(inplace=True)
        self.down = nn.Linear(4 * h, h)

    def forward(self, x):
        b, t, h = x.shape
        y = self.down(self.act(self.up(self.norm(x))).view(b * t, 4 * h))
        return y.view(b, t, h)


class InplaceResidualNet(nn.Module):
    """Residuals added in place to a block's output (``h += x``), a head whose first op rectifies its input in
    place, an in-place scale of the head's output."""

    def __init__(self, h=32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, h)
        self.blocks = nn.ModuleList([InplaceMLP(h) for _ in range(3)])
        self.head = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(h, VOCAB))

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        for block in self.blocks:
            y = block(x)
            y += x
            x = y
        logits = self.head(x)
        logits.mul_(0.5)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Expert(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.up, self.down = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class RoutedMoE(nn.Module):
    """A mixture of experts looped over as Mixtral's reference code does: top-1 routing (of each sequence, so
    that few experts are hit), and only the experts something was routed to are called: which experts run (and
    get gradients) differs by batch and by rank."""

    def __init__(self, h=32, experts=8):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, h)
        self.router = nn.Linear(h, experts, bias=False)
        self.experts = nn.ModuleList([Expert(h) for _ in range(experts)])
        self.head = nn.Linear(h, VOCAB)

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        weight, choice = self.router(x.mean(1)).softmax(-1).max(-1)
        out = torch.zeros_like(x)
        for e in choice.unique().tolist():
            rows = (choice == e).nonzero().squeeze(1)
            out = out.index_add(0, rows, self.experts[e](x[rows]) * weight[rows, None, None])
        x = x + out
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class LayerDropEncoder(nn.Module):
    """Stochastic depth (LayerDrop) as fairseq writes it: a layer skipped in training when ``torch.rand`` says so;
    every rank seeded alike skips the same layers."""

    def __init__(self, h=32, layers=4, p=0.5):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, h)
        self.layers = nn.ModuleList([nn.Sequential(nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.GELU(),
                                                   nn.Linear(4 * h, h)) for _ in range(layers)])
        self.head = nn.Linear(h, VOCAB)
        self.p = p

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        for layer in self.layers:
            if self.training and torch.rand(()) < self.p:
                continue
            x = x + layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class GatedBlock(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
        self.alpha = nn.Parameter(torch.full((), 0.5))  # ReZero's residual gate: a 0-d parameter

    def forward(self, x):
        return x + self.alpha * self.ff(x)


class CalibratedHead(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.proj = nn.Linear(h, VOCAB)
        self.temperature = nn.Parameter(torch.ones(()))  # 0-d
        self.log_scale = nn.Parameter(torch.zeros(1, dtype=torch.float64))  # kept in double, as calibration code does

    def forward(self, x):
        return self.proj(x) / self.temperature * self.log_scale.exp().float()


class ScalarParams(nn.Module):
    """Parameters outside the modules a forward calls, or that FSDP2 cannot shard with their unit's others: ReZero's
    0-d gates in every block, per-block scales in a ParameterList the root reads, a head with a 0-d temperature and
    a float64 scale beside its float32 Linear, and an auxiliary head this configuration never calls."""

    def __init__(self, h=32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, h)
        self.blocks = nn.ModuleList([GatedBlock(h) for _ in range(2)])
        self.block_scales = nn.ParameterList([nn.Parameter(torch.ones(h)) for _ in range(2)])
        self.head = CalibratedHead(h)
        self.aux_head = nn.Linear(h, 7)

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        for block, scale in zip(self.blocks, self.block_scales):
            x = block(x) * scale
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class DataBranch(nn.Module):
    """A Python branch on the data: rows whose first token is below 8 also go through a refinement block, which a
    rank whose rows have none never calls."""

    def __init__(self, h=32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, h)
        self.pre = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
        self.refine = nn.Sequential(nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
        self.head = nn.Linear(h, VOCAB)

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        x = x + self.pre(x)
        special = tokens[:, 0] < 8
        if special.any():
            rows = special.nonzero().squeeze(1)
            x = x.index_add(0, rows, self.refine(x[rows]))
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class DecoderLoopSeq2Seq(nn.Module):
    """Sequence to sequence with the decoder's loop in the model's own forward: residual MLP blocks encode the
    source; each target step embeds the previous token (teacher forcing), attends over the encoder's output and
    updates a state through a cell; the head reads every state. The target embedding takes token ids only, after
    the encoder has run: FSDP2 reduces its gradients only as the whole backward ends."""

    class Block(nn.Module):
        def __init__(self, h):
            super().__init__()
            self.norm, self.fc1, self.fc2 = nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(self.norm(x))))

    class Cell(nn.Module):
        def __init__(self, h):
            super().__init__()
            self.inp, self.out, self.norm = nn.Linear(2 * h, 4 * h), nn.Linear(4 * h, h), nn.LayerNorm(h)

        def forward(self, token, state, context):
            return self.norm(state + self.out(torch.tanh(self.inp(torch.cat([token, context], -1)))))

    def __init__(self, h=32):
        super().__init__()
        self.source_embedding = nn.Embedding(VOCAB, h)
        self.encoder = nn.ModuleList([self.Block(h) for _ in range(2)])
        self.target_embedding = nn.Embedding(VOCAB, h)
        self.query = nn.Linear(h, h)
        self.cell = self.Cell(h)
        self.head = nn.Linear(h, VOCAB)

    def forward(self, src, tgt):
        memory = self.source_embedding(src)
        for block in self.encoder:
            memory = block(memory)
        state, tokens, logits = memory.mean(1), self.target_embedding(tgt), []
        for t in range(tgt.shape[1]):
            weights = torch.softmax(torch.einsum("bh,bth->bt", self.query(state), memory) / state.shape[-1] ** 0.5, -1)
            state = self.cell(tokens[:, t], state, torch.einsum("bt,bth->bh", weights, memory))
            logits.append(self.head(state))
        return torch.stack(logits, 1)


class AttentionGRUSeq2Seq(nn.Module):
    """The recurrent translation model of the tutorials: a GRU encoder; a decoder that steps through the target
    one token at a time (teacher forcing), each step embedding the token, attending over the encoder's outputs
    (additive attention) and advancing a GRU; returns log-probabilities. The attention and the GRU take two
    inputs each, whose gradients arrive at different times."""

    class Encoder(nn.Module):
        def __init__(self, h):
            super().__init__()
            self.embedding = nn.Embedding(VOCAB, h)
            self.gru = nn.GRU(h, h, batch_first=True)

        def forward(self, src):
            return self.gru(self.embedding(src))

    class AdditiveAttention(nn.Module):
        def __init__(self, h):
            super().__init__()
            self.query, self.key, self.score = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, 1)

        def forward(self, query, keys):
            weights = F.softmax(self.score(torch.tanh(self.query(query) + self.key(keys))).transpose(1, 2), -1)
            return torch.bmm(weights, keys)

    class Decoder(nn.Module):
        def __init__(self, h):
            super().__init__()
            self.embedding = nn.Embedding(TARGET_VOCAB, h)
            self.attention = AttentionGRUSeq2Seq.AdditiveAttention(h)
            self.gru = nn.GRU(2 * h, h, batch_first=True)
            self.out = nn.Linear(h, TARGET_VOCAB)

        def forward(self, keys, hidden, targets):
            token = torch.zeros(keys.shape[0], 1, dtype=torch.long)  # start of sentence
            outputs = []
            for i in range(targets.shape[1]):
                context = self.attention(hidden.permute(1, 0, 2), keys)
                output, hidden = self.gru(torch.cat((self.embedding(token), context), dim=2), hidden)
                outputs.append(self.out(output))
                token = targets[:, i:i + 1]
            return F.log_softmax(torch.cat(outputs, dim=1), dim=-1)

    def __init__(self, h=32):
        super().__init__()
        self.encoder = self.Encoder(h)
        self.decoder = self.Decoder(h)

    def forward(self, src, targets):
        keys, hidden = self.encoder(src)
        return self.decoder(keys, hidden, targets)


class MomentumEncoder(nn.Module):
    """MoCo's key encoder: a copy of the query encoder, frozen, moved towards it under ``no_grad`` at the start of
    every training forward (the momentum update is in the model's own forward): the weights given new memory, as
    MoCo writes it (``k.data = k.data * m + q.data * (1 - m)``), the biases in place; returns the loss."""

    def __init__(self, h=32, m=0.9):
        super().__init__()
        self.m = m
        self.emb = nn.Embedding(VOCAB, h)
        self.query = nn.Sequential(nn.Linear(h, 2 * h), nn.GELU(), nn.Linear(2 * h, h))
        self.key = nn.Sequential(nn.Linear(h, 2 * h), nn.GELU(), nn.Linear(2 * h, h))
        self.key.load_state_dict(self.query.state_dict())
        self.key.requires_grad_(False)
        self.head = nn.Linear(h, VOCAB)

    def forward(self, tokens, targets):
        if self.training:
            with torch.no_grad():
                for (name, k), q in zip(self.key.named_parameters(), self.query.parameters()):
                    if name.endswith("weight"):
                        k.data = k.data * self.m + q.data * (1 - self.m)
                    else:
                        k.mul_(self.m).add_(q, alpha=1 - self.m)
        x = self.emb(tokens)
        logits = self.head(self.query(x) + self.key(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class DecayedBlock(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)

    def forward(self, x):
        if self.training:
            self.decay()  # a weight shrunk in place each training forward
        return x + self.fc2(torch.tanh(self.fc1(x)))

    def decay(self):
        with torch.no_grad():
            self.fc1.weight.mul_(0.98)


class SharedModuleEncoderDecoder(nn.Module):
    """A Linear registered in both the encoder's and the decoder's ModuleList (one module object at two paths),
    and blocks that write their own weights in place in a training forward; returns the loss."""

    def __init__(self, h=32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, h)
        shared = nn.Linear(h, h)
        self.enc = nn.ModuleList([shared, DecayedBlock(h)])
        self.dec = nn.ModuleList([DecayedBlock(h), shared])
        self.head = nn.Linear(h, VOCAB)

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        for layer in [*self.enc, *self.dec]:
            x = torch.tanh(layer(x))
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class DataDecayedBlock(DecayedBlock):
    def decay(self):
        self.fc1.weight.data.mul_(0.98)  # through .data: no version bump, as older code writes it


class DataEMA(nn.Module):
    """BYOL's target network: a copy of the online encoder, frozen, moved towards it through ``.data`` at the
    start of each training forward (``t.data.mul_(m).add_(o.data, ...)``, no version bump); an online block that
    decays its own weight through ``.data``; returns the loss."""

    def __init__(self, h=32, m=0.9):
        super().__init__()
        self.m = m
        self.emb = nn.Embedding(VOCAB, h)
        self.online = nn.Sequential(nn.Linear(h, 2 * h), nn.GELU(), nn.Linear(2 * h, h))
        self.target = nn.Sequential(nn.Linear(h, 2 * h), nn.GELU(), nn.Linear(2 * h, h))
        self.target.load_state_dict(self.online.state_dict())
        self.target.requires_grad_(False)
        self.block = DataDecayedBlock(h)
        self.head = nn.Linear(h, VOCAB)

    def forward(self, tokens, targets):
        if self.training:
            for t, o in zip(self.target.parameters(), self.online.parameters()):
                t.data.mul_(self.m).add_(o.data, alpha=1 - self.m)  # BYOL's momentum update, written as theirs is
        x = self.emb(tokens)
        logits = self.head(self.block(self.online(x) + self.target(x)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class SinusoidalPositions(nn.Module):
    """The Annotated Transformer's PositionalEncoding: a buffer (and a dropout), no parameter."""

    def __init__(self, h, max_len=64):
        super().__init__()
        self.dropout = nn.Dropout(0.0)
        pe = torch.zeros(max_len, h)
        position = torch.arange(0, max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, h, 2) * -(math.log(10000.0) / h))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x):
        return self.dropout(x + self.pe[:, : x.size(1)].requires_grad_(False))


class FixedSmoothing(nn.Module):
    """A fixed smoothing over the sequence: a depthwise convolution's kernel kept in a buffer."""

    def __init__(self, h):
        super().__init__()
        self.register_buffer("kernel", torch.tensor([0.25, 0.5, 0.25]).repeat(h, 1, 1))
        self.h = h

    def forward(self, x):
        return F.conv1d(x.transpose(1, 2), self.kernel, padding=1, groups=self.h).transpose(1, 2)


class ResidualMLP(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.fc = nn.Linear(h, h)

    def forward(self, x):
        return x + F.gelu(self.fc(self.norm(x)))


class BufferBlocks(nn.Module):
    """Modules holding only buffers (positions, a smoothing kernel the forward saves for backward) between blocks:
    every rank holds the buffers all step, whatever the plan."""

    def __init__(self, h=32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, h)
        self.pos = SinusoidalPositions(h)
        self.blocks = nn.Sequential(ResidualMLP(h), FixedSmoothing(h), ResidualMLP(h), FixedSmoothing(h))
        self.head = nn.Linear(h, VOCAB)

    def forward(self, tokens, targets):
        logits = self.head(self.blocks(self.pos(self.emb(tokens))))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class PrunedWeightNormed(nn.Module):
    """torch's hook-based utilities as older code uses them: a pruned Linear (weight_orig, a weight_mask buffer,
    ``weight`` computed by a forward pre-hook) and the older hook-based ``weight_norm`` (HiFi-GAN's)."""

    def __init__(self, h=32):
        super().__init__()
        import warnings

        from torch.nn.utils import prune

        self.emb = nn.Embedding(VOCAB, h)
        self.fc1 = nn.Linear(h, 2 * h)
        prune.l1_unstructured(self.fc1, "weight", amount=0.3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated for the parametrization
            self.fc2 = torch.nn.utils.weight_norm(nn.Linear(2 * h, h))
        self.head = nn.Linear(h, VOCAB)

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        logits = self.head(x + self.fc2(F.gelu(self.fc1(x))))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class DisplayedAttention(nn.Module):
    """Self-attention that keeps its map for display as a plain attribute, not detached (explainability code)."""

    def __init__(self, h):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.attn_map = None

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        self.attn_map = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).softmax(-1)
        return x + self.proj(self.attn_map @ v)


class AttentionMaps(nn.Module):
    def __init__(self, h=32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, h)
        self.blocks = nn.ModuleList([DisplayedAttention(h) for _ in range(2)])
        self.head = nn.Linear(h, VOCAB)

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class SpectralConv(nn.Module):
    """A Fourier neural operator's layer: complex weights on the lowest modes of the signal."""

    def __init__(self, channels=8, modes=5):
        super().__init__()
        self.modes = modes
        self.weight = nn.Parameter(torch.randn(channels, channels, modes, dtype=torch.cfloat) / channels**2)

    def forward(self, x):
        xf = torch.fft.rfft(x)
        out = torch.zeros_like(xf)
        out[:, :, :self.modes] = torch.einsum("bix,iox->box", xf[:, :, :self.modes], self.weight)
        return torch.fft.irfft(out, n=x.shape[-1])


class FourierOperator(nn.Module):
    """A Fourier neural operator (complex spectral weights) with a float64 gain per channel on the root: parameters
    of 8 bytes an element in an fp32 model; returns the loss."""

    def __init__(self, channels=8):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(channels, 1, dtype=torch.float64))
        self.lift = nn.Linear(2, channels)
        self.spectral = nn.ModuleList(SpectralConv(channels) for _ in range(2))
        self.pointwise = nn.ModuleList(nn.Conv1d(channels, channels, 1) for _ in range(2))
        self.project = nn.Linear(channels, 1)

    def forward(self, x, y):
        h = self.lift(x).transpose(1, 2) * self.gain.float()
        for spectral, pointwise in zip(self.spectral, self.pointwise):
            h = F.gelu(spectral(h) + pointwise(h))
        return F.mse_loss(self.project(h.transpose(1, 2)).squeeze(-1), y)


def _signal_pairs(rows, g):
    return torch.randn(rows, 16, 2, generator=g), torch.randn(rows, 16, generator=g)


def _translation(rows, g):
    return (torch.randint(0, VOCAB, (rows, SEQ), generator=g),
            torch.randint(0, TARGET_VOCAB, (rows, TARGET_SEQ), generator=g))


def _source_and_target(rows, g):
    return torch.randint(0, VOCAB, (rows, SEQ), generator=g), torch.randint(0, VOCAB, (rows, SEQ // 2), generator=g)


def _one_special_row(rows, g):
    tokens, targets = _tokens(rows, g)
    tokens[:, 0] = 64
    tokens[1, 0] = 3  # in the first rank's rows only
    return tokens, targets


def t5():
    """Hugging Face T5 as its users build it (small sizes): a relative position bias computed in the first
    layer and passed to the others, embeddings shared by encoder and decoder and tied to the head."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)  # dropout: no two runs agree
    return T5ForConditionalGeneration(config)


def _tokens(rows, g):
    return (torch.randint(0, VOCAB, (rows, SEQ), generator=g), torch.randint(0, VOCAB, (rows, SEQ), generator=g))


def _images(rows, g):
    return torch.randn(rows, 3, 16, 16, generator=g), torch.randint(0, 10, (rows,), generator=g)


class PackedText(nn.Module):
    """A text classifier whose memory depends on the lengths in its batch, not only its shapes: nn.TransformerEncoder
    with a padding mask, an EmbeddingBag over the tokens that are not padding, a packed LSTM; a zero-size
    parameter kept to read the device from."""

    def __init__(self, h=32):
        super().__init__()
        self._device_anchor = nn.Parameter(torch.empty(0))
        self.emb = nn.Embedding(VOCAB, h, padding_idx=0)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(h, 4, 64, dropout=0.0, batch_first=True), 2)
        self.bag = nn.EmbeddingBag(VOCAB, h, mode="mean")
        self.lstm = nn.LSTM(h, h, batch_first=True)
        self.head = nn.Linear(3 * h, 5)

    def forward(self, ids, labels):
        pad = ids == 0
        lengths = (~pad).sum(1)
        x = self.enc(self.emb(ids), src_key_padding_mask=pad)
        pooled = x.masked_fill(pad[..., None], 0).sum(1) / lengths[:, None]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long, device=self._device_anchor.device),
                             lengths.cumsum(0)[:-1]])
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(ids), lengths.cpu(), batch_first=True,
                                                   enforce_sorted=False)
        _, (last, _) = self.lstm(packed)
        logits = self.head(torch.cat([pooled, self.bag(ids[~pad], offsets), last[-1]], -1))
        return F.cross_entropy(logits, labels)


def _bucketed_by_length(rows, g):
    """Padded token batches as a length-bucketing sampler makes them, lengths sorted: each rank's share of a batch
    keeps other lengths, so other bytes for backward, than the next rank's."""
    lengths = torch.randint(2, SEQ + 1, (rows,), generator=g).sort().values
    ids = torch.randint(1, VOCAB, (rows, SEQ), generator=g)
    return ids.masked_fill(torch.arange(SEQ)[None, :] >= lengths[:, None], 0), torch.randint(0, 5, (rows,), generator=g)


def _padded(rows, g):
    ids = torch.randint(1, VOCAB, (rows, SEQ), generator=g)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (rows,), generator=g)
    mask = torch.arange(SEQ)[None, :] >= lengths[:, None]
    return ids.masked_fill(mask, 0), mask, torch.randint(0, 5, (rows,), generator=g)


def _seq2seq_loss(out, batch, step):
    return F.cross_entropy(out.flatten(0, 1), batch[1].flatten())


def _cnn_loss(out, batch, step):
    logits, aux = out
    loss = F.cross_entropy(logits, batch[1])
    return loss + 0.3 * F.cross_entropy(aux, batch[1]) if step % 2 == 0 else loss  # aux unused on odd steps


class ChannelsLastNet(nn.Module):
    """A small ResNet trained in channels_last, as performance guides write it (its 4-D convolution weights are then
    not contiguous, which FSDP2 cannot shard): a stem whose ReLU saves its output, the next stage's convolution
    its input (one storage saved by two units), residual stages, global pooling, a classifier."""

    def __init__(self, memory_format: torch.memory_format = torch.channels_last):
        super().__init__()
        self.memory_format = memory_format
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU())
        self.stages = nn.ModuleList(
            nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.GroupNorm(4, 16), nn.SiLU()) for _ in range(3))
        self.head = nn.Linear(16, 2)
        self.to(memory_format=memory_format)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.stem(images.contiguous(memory_format=self.memory_format))
        for stage in self.stages:
            x = x + stage(x)
        return F.cross_entropy(self.head(x.mean((2, 3))), labels)


class TaskHeads(nn.Module):
    """Multi-task heads as a ParameterDict the forward picks from (no module of their own: the root holds them),
    over a trunk of raw features (its input needs no gradient, so FSDP2 reduces it only as the backward ends) and a
    middle Linear large enough to split."""

    def __init__(self, h: int = 256):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU())
        self.mid = nn.Sequential(nn.Linear(h, h), nn.Tanh())
        self.heads = nn.ParameterDict({"a": nn.Parameter(torch.randn(h, 5) * 0.1),
                                       "b": nn.Parameter(torch.randn(h, 3) * 0.1)})

    def forward(self, features: torch.Tensor, labels_a: torch.Tensor, labels_b: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.trunk(features))
        return F.cross_entropy(h @ self.heads["a"], labels_a) + F.cross_entropy(h @ self.heads["b"], labels_b)


def _two_tasks(rows, g):
    return (torch.randn(rows, 16, generator=g), torch.randint(0, 5, (rows,), generator=g),
            torch.randint(0, 3, (rows,), generator=g))


def _labelled_images(rows, g):
    return torch.randn(rows, 3, 16, 16, generator=g), torch.randint(0, 2, (rows,), generator=g)


STYLES = {
    # name: (model class, batch maker, loss(output, batch, step), the example's inputs from a batch)
    "lambda_gpt": (LambdaGPT, _tokens, lambda out, batch, step: out[1], lambda b: b),
    "seq2seq": (Seq2Seq, _tokens, _seq2seq_loss, lambda b: b),
    "cnn": (SmallCNN, _images, _cnn_loss, lambda b: b[:1]),
    "t5": (t5, _tokens, lambda out, batch, step: out.loss, lambda b: {"input_ids": b[0], "labels": b[1]}),
    "recurrent": (RecurrentLM, _tokens, lambda out, batch, step: out, lambda b: b),
    "shared_layer": (SharedLayerEncoder, _tokens, lambda out, batch, step: out, lambda b: b),
    "vit": (TinyViT, _images, lambda out, batch, step: F.cross_entropy(out, batch[1]), lambda b: b[:1]),
    "lora": (LoRAGPT, _tokens, lambda out, batch, step: out, lambda b: b),
    "padded": (PaddedClassifier, _padded, lambda out, batch, step: F.cross_entropy(out, batch[2]),
               lambda b: {"ids": b[0], "mask": b[1], "temperature": 0.5}),
    "packed": (PackedText, _bucketed_by_length, lambda out, batch, step: out, lambda b: b),
    "user_ckpt": (UserCheckpointedGPT, _tokens, lambda out, batch, step: out[1], lambda b: b),
    "weight_norm": (WeightNormConv, _signals, lambda out, batch, step: out.loss, lambda b: b),
    "inplace": (InplaceResidualNet, _tokens, lambda out, batch, step: out, lambda b: b),
    "dict_io": (DictInOut, _tokens, lambda out, batch, step: out["loss"],
                lambda b: ({"ids": b[0], "labels": b[1]},)),
    "moe": (RoutedMoE, _tokens, lambda out, batch, step: out, lambda b: b),
    "layerdrop": (LayerDropEncoder, _tokens, lambda out, batch, step: out, lambda b: b),
    "scalar_params": (ScalarParams, _tokens, lambda out, batch, step: out, lambda b: b),
    "data_branch": (DataBranch, _one_special_row, lambda out, batch, step: out, lambda b: b),
    "channels_last": (ChannelsLastNet, _labelled_images, lambda out, batch, step: out, lambda b: b),
    "task_heads": (TaskHeads, _two_tasks, lambda out, batch, step: out, lambda b: b),
    "momentum_encoder": (MomentumEncoder, _tokens, lambda out, batch, step: out, lambda b: b),
    "shared_module": (SharedModuleEncoderDecoder, _tokens, lambda out, batch, step: out, lambda b: b),
    "data_ema": (DataEMA, _tokens, lambda out, batch, step: out, lambda b: b),
    "buffer_blocks": (BufferBlocks, _tokens, lambda out, batch, step: out, lambda b: b),
    "pruned_weight_norm": (PrunedWeightNormed, _tokens, lambda out, batch, step: out, lambda b: b),
    "attention_maps": (AttentionMaps, _tokens, lambda out, batch, step: out, lambda b: b),
    "fourier": (FourierOperator, _signal_pairs, lambda out, batch, step: out, lambda b: b),
    "gru_attention": (AttentionGRUSeq2Seq, _translation,
                      lambda out, batch, step: F.nll_loss(out.flatten(0, 1), batch[1].flatten()), lambda b: b),
}


def build(style: str) -> nn.Module:
    torch.manual_seed(0)
    return STYLES[style][0]()


def batches(style: str, rows: int, steps: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    return [STYLES[style][1](rows, g) for _ in range(steps)]


def loss_of(style: str, out, batch, step: int) -> torch.Tensor:
    return STYLES[style][2](out, batch, step)


def inputs_of(style: str, batch):
    """The model's inputs from a batch: a tuple of positional arguments or a dict of keyword arguments."""
    return STYLES[style][3](batch)


def call(model: nn.Module, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)
