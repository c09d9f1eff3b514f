"""A small GPT (token + position embeddings, pre-norm blocks, causal attention) and generated data.

Used by the recipes and the benchmarks.  The data is made here, not downloaded:
character-level lines of integer additions such as ``"37+48=85\n"``, which a
small model learns to complete.
"""
from __future__ import annotations

import dataclasses
import random

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass
class GPTConfig:
    vocab_size: int = 16
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx):
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ---------------------------------------------------------------------------
# Data: character-level additions
# ---------------------------------------------------------------------------
ALPHABET = "0123456789+=\n"
STOI = {c: i for i, c in enumerate(ALPHABET)}


class CheckpointedBlocks(nn.Module):
    """``GPT.forward`` with every block run under ``checkpoint(block, x, use_reentrant=False)`` (activation
    checkpointing as users write it; tests/test_memory.py and benchmarks/memory.py measure it)."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx):
        from torch.utils.checkpoint import checkpoint

        g = self.gpt
        x = g.tok(idx) + g.pos(torch.arange(idx.size(1), device=idx.device))
        for block in g.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return g.head(g.ln_f(x))


def make_corpus(n_lines: int = 20000, max_value: int = 99, seed: int = 0) -> torch.Tensor:
    rng = random.Random(seed)
    text = "".join(f"{a}+{b}={a + b}\n" for a, b in ((rng.randint(0, max_value), rng.randint(0, max_value)) for _ in range(n_lines)))
    return torch.tensor([STOI[c] for c in text], dtype=torch.long)


def batches(data: torch.Tensor, batch_size: int, block_size: int, device, seed: int = 0):
    """Endless random (input, target) windows from ``data``."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - block_size - 1, (batch_size,), generator=g)
        x = torch.stack([data[s : s + block_size] for s in starts])
        y = torch.stack([data[s + 1 : s + block_size + 1] for s in starts])
        yield x.to(device), y.to(device)


# ---------------------------------------------------------------------------
# Command line shared by the recipes
# ---------------------------------------------------------------------------
def add_common_args(p, default_compile: str, extra_compile: tuple = ()) -> None:
    """--compile, --device, the model and data sizes, --lr, --seed, --print-trace, --no-progress."""
    p.add_argument("--compile", choices=["eager", "thunder", "thunder-thin", *extra_compile], default=default_compile)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--print-trace", action="store_true", help="print the executed computation trace after training")
    p.add_argument("--no-progress", action="store_true")


def pick_device(name: str) -> torch.device:
    """``auto``: CUDA when present, else CPU; asking for CUDA without it is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for, but torch.cuda.is_available() is False")
    return torch.device(name)

