"""Distances written as torch calls (``registry.composed``): ``torch.dist``, ``pairwise_distance``, ``pdist``.
``cosine_similarity`` is a symbol in nn.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import composed


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
