"""Ops whose output shape depends on tensor values: ``nonzero``, ``argwhere``, ``masked_select``,
``bincount``; and ``combinations`` and ``linalg.lstsq``, whose eager kernels have no meta form.

The count that fixes the shape (``int(mask.sum())``) is a decision (``acquisition/decisions.py``):
computed by the prologue from the per-call inputs on every call, a retrace when it changes, and a
``DataDependentError`` naming the line when it depends on anything else (an activation).  The values
are then computed natively: a stable sort brings the selected positions first.
"""
from __future__ import annotations

import itertools

import torch

from .registry import composed


def _selected_positions(mask):
    """Flat positions where ``mask`` is true, in order; their count is a decision."""
    flat = mask.reshape(-1)
    n = int(flat.sum())
    _, order = torch.sort((~flat).to(torch.int32), stable=True)
    return order[:n]


def nonzero(input, *, as_tuple=False):
    x = input.reshape(1) if input.ndim == 0 else input
    pos = _selected_positions(x != 0 if x.dtype is not torch.bool else x)
    coords, stride = [], 1
    for size in reversed(x.shape):
        coords.append((pos // stride) % size)
        stride *= size
    coords.reverse()
    if as_tuple:
        return tuple(coords)
    if input.ndim == 0:
        return torch.zeros((pos.shape[0], 0), dtype=torch.int64)
    return torch.stack(coords, 1)


def argwhere(input):
    return nonzero(input)


def masked_select(input, mask):
    if mask.dtype is not torch.bool:
        raise RuntimeError(f"masked_select: expected BoolTensor for mask, got {mask.dtype}")
    shape = torch.broadcast_shapes(input.shape, mask.shape)
    pos = _selected_positions(mask.expand(shape))
    return input.expand(shape).reshape(-1)[pos]


def bincount(input, weights=None, minlength=0):
    if input.ndim != 1 or input.dtype.is_floating_point or input.dtype.is_complex or input.dtype is torch.bool:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    if minlength < 0:
        raise RuntimeError("minlength should be >= 0")
    if input.numel() and bool((input < 0).any()):
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    n = max(int(input.max()) + 1 if input.numel() else 0, minlength)
    if weights is None:
        return torch.zeros(n, dtype=torch.int64).scatter_add(0, input, torch.ones_like(input, dtype=torch.int64))
    if weights.shape != input.shape:
        raise RuntimeError("weights should be 1-d and have the same length as input")
    dt = weights.dtype if weights.dtype.is_floating_point else torch.float64
    return torch.zeros(n, dtype=dt).scatter_add(0, input, weights.to(dt))


def combinations(input, r=2, with_replacement=False):
    if input.ndim != 1:
        raise RuntimeError(f"Expect a 1D vector, but got shape {list(input.shape)}")
    if r < 0:
        raise RuntimeError(f"Expect a non-negative number, but got {r}")
    if r == 0:
        return input[:0]  # empty, and derived from input (requires grad like eager's)
    pick = itertools.combinations_with_replacement if with_replacement else itertools.combinations
    combos = list(pick(range(input.shape[0]), r))  # the positions are a function of the shape only
    if not combos:
        return input[:0].reshape(0, r)
    return input[torch.tensor([i for c in combos for i in c])].reshape(len(combos), r)


def lstsq(A, B, rcond=None, *, driver=None):
    """Least squares through the pseudo-inverse: the minimum-norm solution LAPACK's gelsy, gelsd and gelss
    drivers return (gels too, for full-rank problems); the auxiliary outputs follow the driver, as eager's do.
    gelsd/gelss treat singular values up to ``rcond * s_max`` as zero (``pinv``'s ``rtol``; eager's gradient
    is the untruncated one's all the same); gelsy's own pivoted-QR truncation with an explicit ``rcond`` is left
    to torch."""
    if driver not in ("gels", "gelsy", "gelsd", "gelss", None):
        raise NotImplementedError(f"linalg.lstsq with driver={driver!r} is run by torch (eager checks it)")
    svd_driver = driver in ("gelsd", "gelss")
    if rcond is not None and (driver in ("gelsy", None) or rcond < 0):
        raise NotImplementedError("linalg.lstsq with driver gelsy and rcond=, or a negative rcond, is run by torch")
    if A.dtype.is_complex or A.ndim < 2:
        raise NotImplementedError("complex or 1-d linalg.lstsq is run by torch")
    m, n = A.shape[-2], A.shape[-1]
    vector = B.ndim == A.ndim - 1
    Bm = B.unsqueeze(-1) if vector else B
    rtol = rcond if rcond is not None else torch.finfo(A.dtype).eps * max(m, n)
    X = torch.matmul(torch.linalg.pinv(A), Bm)
    if svd_driver and rcond is not None:
        # the truncated solution's value with eager's gradient, which is the untruncated pinv's
        X = X + (torch.matmul(torch.linalg.pinv(A, rtol=rtol), Bm) - X).detach()
    empty = A.reshape(-1)[:0]  # derived from A: requires grad like eager's empty outputs
    singular_values = A.new_empty(0)  # eager's: no gradient
    if driver == "gels":
        rank = torch.zeros(0, dtype=torch.int64)
        with_residuals = m > n
    elif svd_driver:
        singular_values = torch.linalg.svdvals(A.detach())
        rank = (singular_values > rtol * singular_values.amax(-1, keepdim=True)).sum(-1)
        # eager computes them only when every matrix has full column rank: a decision on A's values
        with_residuals = m > n and bool((rank == n).all())
    else:
        rank = torch.linalg.matrix_rank(A)
        with_residuals = False
    residuals = ((torch.matmul(A, X) - Bm) ** 2).sum(-2) if with_residuals else empty
    if vector:
        X = X.squeeze(-1)  # eager keeps the residuals' last dim (size 1)
    return torch.return_types.linalg_lstsq((X, residuals, rank, singular_values))


composed("nonzero", nonzero, (torch.nonzero,), ("nonzero",))
composed("argwhere", argwhere, (torch.argwhere,), ("argwhere",))
composed("masked_select", masked_select, (torch.masked_select,), ("masked_select",))
composed("bincount", bincount, (torch.bincount,), ("bincount",))
composed("combinations", combinations, (torch.combinations,), ())
composed("lstsq", lstsq, (torch.linalg.lstsq, torch._C._linalg.linalg_lstsq), ())
