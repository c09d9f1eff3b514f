"""``torch.cov`` and ``torch.corrcoef``, written with torch calls traced as the user's own.

Eager checks the frequency weights' values (integral, non-negative) with Python decisions on tensors; here
those checks are decisions too (``acquisition/decisions.py``: computed from per-call inputs by the prologue).
"""
from __future__ import annotations

import torch

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
