"""``torch.cov`` and ``torch.corrcoef``, written with torch calls traced as the user's own.

Eager checks the frequency weights' values (integral, non-negative) with Python decisions on tensors; here
those checks are decisions too (``acquisition/decisions.py``: computed from per-call inputs by the prologue).
"""
from __future__ import annotations

import torch

from ..opaque import meta_rule
from .registry import composed


def cov(input, *, correction=1, fweights=None, aweights=None):
    if input.ndim > 2:
        raise ValueError(f"cov(): expected input to have two or fewer dimensions but got an input with {input.ndim} dimensions")
    x = input if input.ndim == 2 else input.reshape(1, -1)
    if not (x.dtype.is_floating_point or x.dtype.is_complex):
        x = x.to(torch.get_default_dtype())
    n = x.shape[1]
    w = None
    if fweights is not None:
        if fweights.dtype.is_floating_point or fweights.dtype.is_complex:
            raise RuntimeError("cov(): expected fweights to have integral dtype")
        if bool((fweights < 0).any()):
            raise RuntimeError("cov(): fweights cannot be negative")
        w = fweights
    if aweights is not None:
        if not aweights.dtype.is_floating_point:
            raise RuntimeError("cov(): expected aweights to have floating point dtype")
        if bool((aweights < 0).any()):
            raise RuntimeError("cov(): aweights cannot be negative")
        w = aweights if w is None else w * aweights
    if w is None:
        avg = x.mean(1)
        w_sum = n
        norm = n - correction
    else:
        w_sum = w.sum()
        avg = (x * w).sum(1) / w_sum
        if correction == 0:
            norm = w_sum
        elif aweights is None:
            norm = w_sum - correction
        else:
            norm = w_sum - correction * (w * aweights).sum() / w_sum
    if isinstance(norm, torch.Tensor):
        norm = norm.clamp(min=0)
    else:
        norm = max(norm, 0)
    xm = x - avg.unsqueeze(1)
    c = torch.mm(xm, (xm if w is None else xm * w).t().conj())
    return (c / norm).squeeze()


def corrcoef(input):
    c = cov(input)
    if c.ndim == 0:
        return c / c
    n = c.shape[0]
    std = torch.sqrt(c.reshape(-1)[:: n + 1])  # the diagonal
    c = c / std.unsqueeze(1)
    c = c / std.unsqueeze(0)
    return c.clamp(-1, 1)


composed("cov", cov, (torch.cov,), ("cov",))
composed("corrcoef", corrcoef, (torch.corrcoef,), ("corrcoef",))


# ``torch.histogram``/``histogramdd`` run through torch (opaquely); eager has no meta kernels for them. Their
# outputs' sizes follow from the bin arguments alone (the edges' values may depend on the data, their number
# does not), so these rules give the metadata.
def _bins_count(bins) -> tuple:
    """(number of bins, number of edges) for an int or a tensor of edges."""
    if isinstance(bins, torch.Tensor):
        return bins.shape[0] - 1, bins.shape[0]
    return int(bins), int(bins) + 1


@meta_rule(torch.histogram, torch.Tensor.histogram)
def _histogram_meta(input, bins=100, *, range=None, weight=None, density=False):
    hist, edges = _bins_count(bins)
    out = (torch.empty((hist,), dtype=input.dtype, device="meta"), torch.empty((edges,), dtype=input.dtype, device="meta"))
    return torch.return_types.histogram(out)


@meta_rule(torch.histogramdd)
def _histogramdd_meta(input, bins, *, range=None, weight=None, density=False):
    d = input.shape[-1]
    per_dim = [bins] * d if isinstance(bins, int) else list(bins)
    if len(per_dim) != d:
        raise RuntimeError(f"torch.histogramdd: expected {d} sequences of bin edges for each dimension, got {len(per_dim)}")
    counts = [_bins_count(b) for b in per_dim]
    hist = torch.empty(tuple(c[0] for c in counts), dtype=input.dtype, device="meta")
    edges = tuple(torch.empty((c[1],), dtype=input.dtype, device="meta") for c in counts)
    return torch.return_types.histogramdd((hist, edges))
