"""A small user-style model (not one of ours): tied embeddings, sub-blocks, LayerNorms."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Attn(nn.Module):
    def __init__(s, h): super().__init__(); s.qkv = nn.Linear(h, 3*h); s.proj = nn.Linear(h, h)
    def forward(s, x):
        B,T,C = x.shape; q,k,v = s.qkv(x).split(C, 2)
        return s.proj(F.scaled_dot_product_attention(q,k,v,is_causal=True))
class MLP(nn.Module):
    def __init__(s, h): super().__init__(); s.fc = nn.Linear(h, 4*h); s.proj = nn.Linear(4*h, h)
    def forward(s, x): return s.proj(F.gelu(s.fc(x)))
class Block(nn.Module):
    def __init__(s, h): super().__init__(); s.ln1=nn.LayerNorm(h); s.attn=Attn(h); s.ln2=nn.LayerNorm(h); s.mlp=MLP(h)
    def forward(s, x): x = x + s.attn(s.ln1(x)); return x + s.mlp(s.ln2(x))
class GPT(nn.Module):
    def __init__(s, V=64, h=32, L=2, T=16):
        super().__init__(); s.wte=nn.Embedding(V,h); s.wpe=nn.Embedding(T,h); s.blocks=nn.ModuleList([Block(h) for _ in range(L)]); s.ln_f=nn.LayerNorm(h); s.head=nn.Linear(h,V,bias=False); s.head.weight = s.wte.weight
    def forward(s, idx, targets=None):
        x = s.wte(idx) + s.wpe(torch.arange(idx.shape[1]))
        for b in s.blocks: x = b(x)
        logits = s.head(s.ln_f(x))
        return logits if targets is None else F.cross_entropy(logits.flatten(0,1), targets.flatten())
