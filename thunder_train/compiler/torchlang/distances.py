"""Distances: ``cosine_similarity`` (a symbol); ``torch.dist``, ``pairwise_distance`` and ``pdist`` written as
torch calls."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import clang, prims
from .autocast import FP32  # autocast policies: see autocast.py
from .reductions import vector_norm
from .registry import composed, torchsymbol


@torchsymbol(F.cosine_similarity, torch.cosine_similarity, autocast={"cuda": FP32})
def cosine_similarity(x1, x2, dim=1, eps=1e-8):
    """Eager's formula (ATen's cosine_similarity): each side divided by its 2-norm, the norm clamped at ``eps``
    without a gradient of the clamp (eager clamps in place under no_grad), then the product summed."""
    d = clang.result_dtype(x1, x2)
    if not d.is_float:
        raise NotImplementedError("cosine_similarity of integer tensors is run by torch")
    shape = clang.broadcast_shapes(x1._tt_shape, x2._tt_shape)
    x1, x2 = (clang.expand(clang.maybe_convert(x, d), shape) for x in (x1, x2))

    def unit(x):
        n = vector_norm(x, 2, dim, True)
        return clang.true_divide(x, clang.add(n, prims.stop_gradient(clang.sub(clang.maximum(n, eps), n))))

    return clang.sum(clang.mul(unit(x1), unit(x2)), dim)


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
