"""Distances: ``cosine_similarity`` (a symbol); ``torch.dist``, ``pairwise_distance`` and ``pdist`` written as
torch calls."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import clang, prims
from .autocast import FP32  # autocast policies: see autocast.py
from ..grad_rules import register_vjp
from ..prims.core import sum_to
from ..proxies import TensorProxy
from .normalization import over_norm_grad
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


@register_vjp(cosine_similarity, supports=lambda x1, x2, dim=1, eps=1e-8: clang.result_dtype(x1, x2).is_float)
def _cosine_similarity_vjp(g, out, /, x1, x2, dim=1, eps=1e-8):
    """Eager's autograd through its formula: the sum's gradient spread over ``dim``, the product's, then each side's
    division by its clamped norm (``over_norm_grad``, the clamp without a gradient); each input gets the sum over
    its broadcast dims."""
    d = clang.result_dtype(x1, x2)
    shape = clang.broadcast_shapes(x1._tt_shape, x2._tt_shape)
    a, b = (clang.expand(clang.maybe_convert(x, d), shape) for x in (x1, x2))
    k = clang.canonicalize_dim(len(shape), dim)
    gm = clang.expand(clang.unsqueeze(g, k), shape) if shape else g  # (a 0-d sum over dim 0 keeps its shape: ())
    na, nb = vector_norm(a, 2, k, True), vector_norm(b, 2, k, True)
    ca, cb = clang.maximum(na, eps), clang.maximum(nb, eps)
    ua, ub = clang.true_divide(a, clang.expand(ca, shape)), clang.true_divide(b, clang.expand(cb, shape))
    grads = {}
    for name, x, gu, n, c in (("x1", x1, clang.mul(gm, ub), na, ca), ("x2", x2, clang.mul(gm, ua), nb, cb)):
        if type(x) is TensorProxy and x._tt_dtype.is_float:
            gx = over_norm_grad(gu, a if name == "x1" else b, n, c, (k,))
            grads[name] = clang.maybe_convert(sum_to(gx, x._tt_shape), x._tt_dtype)
    return grads


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
