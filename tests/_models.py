"""Small models and helpers shared by several test files."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """A pre-norm transformer block: attention (causal SDPA) + MLP, layer norms, residuals."""

    def __init__(self, d=16, heads=2, hidden=32):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def leaves(x):
    """The tensors (and other leaves) of nested lists, tuples and dicts, in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [leaf for v in x for leaf in leaves(v)]
    if isinstance(x, dict):
        return [leaf for v in x.values() for leaf in leaves(v)]
    return [x]


def without_key_bias(name, t, model=None):
    """Drop the attention *key* bias (of a GPT's ``attn.qkv.bias``) for Adam-style comparisons.

    Its gradient is zero in exact arithmetic (softmax ignores a constant added to
    every key score), so it is pure float32 rounding noise — which Adam divides by
    its own magnitude and turns into full-size, run-dependent steps.
    """
    if name.endswith("attn.qkv.bias"):
        d = t.shape[0] // 3
        return torch.cat([t[:d], t[2 * d:]])
    return t


def train_step(model, opt, x, y):
    """The whole training step the tests compile: forward, cross-entropy (any leading dims), backward, step."""
    loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss
