"""Distances: ``cosine_similarity`` (a symbol); ``torch.dist``, ``pairwise_distance`` and ``pdist`` written as
torch calls."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import clang
from .autocast import FP32  # autocast policies: see autocast.py
from .registry import composed, torchsymbol


@torchsymbol(F.cosine_similarity, torch.cosine_similarity, autocast={"cuda": FP32})
def cosine_similarity(x1, x2, dim=1, eps=1e-8):
    num = clang.sum(clang.mul(x1, x2), dim)
    n1 = clang.sqrt(clang.sum(clang.mul(x1, x1), dim))
    n2 = clang.sqrt(clang.sum(clang.mul(x2, x2), dim))
    return clang.true_divide(num, clang.maximum(clang.mul(n1, n2), eps))


# ---------------------------------------------------------------------------
# Written as torch calls the torch language knows (registry.composed: traced as the user's own calls)
# ---------------------------------------------------------------------------
def dist(input, other, p=2):
    return torch.linalg.vector_norm(input - other, p)


composed("dist", dist, (torch.dist,), ("dist",))


def pairwise_distance(x1, x2, p=2.0, eps=1e-6, keepdim=False):
    d = max(x1.ndim, x2.ndim) - 1
    if d < 0:
        raise NotImplementedError("pairwise_distance of 0-d tensors is run by torch")
    return torch.linalg.vector_norm(x1 - x2 + eps, p, d, keepdim)


composed("pairwise_distance", pairwise_distance, (F.pairwise_distance, torch.pairwise_distance))


def pdist(input, p=2):
    n = input.shape[0]
    i = [a for a in range(n) for b in range(a + 1, n)]
    j = [b for a in range(n) for b in range(a + 1, n)]
    if not i:
        return input.reshape(-1)[:0]
    return torch.linalg.vector_norm(input[torch.tensor(i)] - input[torch.tensor(j)], p, -1)


composed("pdist", pdist, (F.pdist, torch.pdist))
