"""Sorting and searching: the ``sort`` and ``topk`` symbols, and msort, argsort, bucketize, searchsorted and
isin written as torch calls (``registry.composed``)."""
from __future__ import annotations

import torch

from .. import clang, dtypes, prims
from .registry import composed, torchsymbol


@torchsymbol(torch.topk, methods=("topk",), returns=torch.return_types.topk)
def topk(input, k, dim=-1, largest=True, sorted=True):
    if input.ndim_ == 0:  # as eager: the scalar and index 0 (k may be 0 or 1)
        clang.canonicalize_dim(0, dim)
        if k not in (0, 1):
            raise RuntimeError(f"selected index k out of range (k={k} for a 0-d tensor)")
        return prims.clone(input), prims.full((), 0, device=input._tt_device, dtype=dtypes.int64)
    return prims.topk(input, k, clang.canonicalize_dim(input.ndim_, dim), largest, sorted)


@torchsymbol(torch.sort, methods=("sort",), returns=torch.return_types.sort)
def sort(input, dim=-1, descending=False, stable=False):
    return prims.sort(input, clang.canonicalize_dim(input.ndim_, dim), descending, stable)


def isin(elements, test_elements, *, assume_unique=False, invert=False):
    if not isinstance(elements, torch.Tensor) or not isinstance(test_elements, torch.Tensor):
        raise NotImplementedError("isin with a number argument is run by torch")
    hit = (elements.unsqueeze(-1) == test_elements.reshape(-1)).any(-1)
    return ~hit if invert else hit


composed("isin", isin, (torch.isin,))


def msort(input):
    return torch.sort(input, 0).values


composed("msort", msort, (torch.msort,), ("msort",))


def argsort(input, dim=-1, descending=False, stable=False):
    return torch.sort(input, dim=dim, descending=descending, stable=stable).indices


composed("argsort", argsort, (torch.argsort,), ("argsort",))


def _count_below(seq, x, right):
    hit = seq <= x.unsqueeze(-1) if right else seq < x.unsqueeze(-1)
    count = hit.sum(-1)
    return torch.where(torch.isnan(x), torch.full_like(count, seq.shape[-1]), count) if x.dtype.is_floating_point else count


def bucketize(input, boundaries, *, out_int32=False, right=False):
    if not isinstance(input, torch.Tensor) or boundaries.ndim != 1:
        raise NotImplementedError("bucketize of a number or with N-d boundaries is run by torch")
    out = _count_below(boundaries, input, right)
    return out.to(torch.int32 if out_int32 else torch.int64)


composed("bucketize", bucketize, (torch.bucketize,))


def searchsorted(sorted_sequence, input, *, out_int32=False, right=False, side=None, sorter=None):
    if not isinstance(input, torch.Tensor):
        raise NotImplementedError("searchsorted of a number is run by torch")
    if side is not None:
        if right and side == "left":
            raise RuntimeError("torch.searchsorted(): side and right can't be set to opposites")
        right = side == "right"
    seq = sorted_sequence if sorter is None else sorted_sequence.gather(-1, sorter)
    if seq.ndim > 1:
        if tuple(seq.shape[:-1]) != tuple(input.shape[:-1]):
            raise NotImplementedError("searchsorted with mismatched leading dimensions is run by torch (eager checks them)")
        out = _count_below(seq.unsqueeze(-2), input, right)
    else:
        out = _count_below(seq, input, right)
    return out.to(torch.int32 if out_int32 else torch.int64)


composed("searchsorted", searchsorted, (torch.searchsorted,))
