"""Scans, scatter forms and adaptive pooling written as compositions of torch calls (see composites.py)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import inplace
from .composites import reduce_loss
from .decided import _register
from .registry import by_torch_fn
from .value_shaped import _selected_positions


# ---- scans: log-depth (Hillis-Steele) with an associative op, exact for cumprod of integers ----
def _scan(x, dim, op, fill):
    n = x.shape[dim]
    s = 1
    while s < n:
        shifted = torch.cat([torch.full_like(x.narrow(dim, 0, s), fill), x.narrow(dim, 0, n - s)], dim)
        x = op(x, shifted)
        s *= 2
    return x


def cumprod(input, dim, *, dtype=None):
    x = input.to(dtype) if dtype is not None else (input.to(torch.int64) if not (input.dtype.is_floating_point or input.dtype.is_complex) else input)
    if x.ndim == 0:
        return x.clone()
    return _scan(x, dim % x.ndim, torch.mul, 1)


def logcumsumexp(input, dim):
    if not input.dtype.is_floating_point:
        raise NotImplementedError("logcumsumexp of a non-float tensor is run by torch")
    if input.ndim == 0:
        return input.clone()
    return _scan(input, dim % input.ndim, torch.logaddexp, -math.inf)


# ---- scatter forms ----
def scatter_reduce(input, dim, index, src, reduce, *, include_self=True):
    if reduce != "sum":
        raise NotImplementedError(f"scatter_reduce(reduce={reduce!r}) is run by torch")
    base = input if include_self else _cleared(input, dim, index)
    return base.scatter_add(dim, index, src)


def _cleared(input, dim, index):
    """``input`` with the positions ``index`` scatters to set to zero."""
    hit = torch.zeros_like(input).scatter_add(dim, index, torch.ones_like(index, dtype=input.dtype))
    return torch.where(hit > 0, torch.zeros_like(input), input)


def put(input, index, source, accumulate=False):
    flat = input.reshape(-1)
    n = flat.shape[0]
    idx = torch.where(index < 0, index + n, index).reshape(-1)
    src = source.reshape(-1)
    if accumulate:
        out = flat.index_add(0, idx, src)
    else:
        out = flat.clone()
        out[idx] = src
    return out.reshape(input.shape)


def masked_scatter(input, mask, source):
    if mask.dtype is not torch.bool:
        raise RuntimeError(f"masked_scatter_ only supports boolean masks, but got mask with dtype {mask.dtype}")
    shape = torch.broadcast_shapes(input.shape, mask.shape)
    pos = _selected_positions(mask.expand(shape))
    n = pos.shape[0]
    if n > source.numel():
        raise RuntimeError("masked_scatter: expected source to have at least as many elements as ones in mask")
    out = input.expand(shape).reshape(-1).clone()
    out[pos] = source.reshape(-1)[:n]
    return out.reshape(shape)


# ---- losses ----
def multilabel_margin_loss(input, target, size_average=None, reduce=None, reduction="mean"):
    if size_average is not None or reduce is not None:
        raise NotImplementedError("deprecated reduction arguments are run by torch")
    x = input.reshape(1, -1) if input.ndim < 2 else input
    t = target.reshape(1, -1) if target.ndim < 2 else target
    c = x.shape[1]
    valid = torch.cumsum((t == -1).to(torch.int64), 1) == 0  # the targets before the first -1
    count = ((t.unsqueeze(-1) == torch.arange(c)) & valid.unsqueeze(-1)).sum(1)  # (B, C): times j is listed
    m = torch.clamp_min(1 - (x.unsqueeze(-1) - x.unsqueeze(-2)), 0)  # [b, j, i]: 1 - (x_j - x_i)
    # each listed target j (duplicates counted, as eager does) against every class i that is not a target
    m = torch.where((count == 0).unsqueeze(-2), m, torch.zeros_like(m)) * count.unsqueeze(-1).to(m.dtype)
    loss = m.sum((1, 2)) / c
    if input.ndim < 2:
        loss = loss.reshape(())
    return reduce_loss(loss, reduction)


# ---- adaptive average pooling: separable means over eager's windows ----
def _adaptive_avg(n):
    def fn(input, output_size):
        size = (output_size,) * n if isinstance(output_size, int) else tuple(output_size)
        out = input
        for k in range(n):
            d = input.ndim - n + k
            n_in = input.shape[d]
            n_out = n_in if size[k] is None else size[k]
            if n_out == n_in:
                continue
            parts = []
            for i in range(n_out):
                start, end = (i * n_in) // n_out, -((-(i + 1) * n_in) // n_out)
                parts.append(out.narrow(d, start, end - start).mean(d, keepdim=True))
            out = torch.cat(parts, d)
        return out if out is not input else input.clone()

    return fn


# ---- diagonals (diag returns a new tensor, not a view) ----
def diag(input, diagonal=0):
    if input.ndim == 1:
        n = input.shape[0] + abs(diagonal)
        out = input.new_zeros(n * n)
        if input.shape[0]:
            start = diagonal if diagonal >= 0 else -diagonal * n
            out[start: start + (input.shape[0] - 1) * (n + 1) + 1: n + 1] = input
        return out.reshape(n, n)
    if input.ndim != 2:
        raise RuntimeError("diag(): Supports 1D or 2D tensors. Got " + f"{input.ndim}D")
    r, c = input.shape
    start = diagonal if diagonal >= 0 else -diagonal * c
    length = max(0, min(r, c - diagonal) if diagonal >= 0 else min(r + diagonal, c))
    if length == 0:
        return input.reshape(-1)[:0]
    return input.reshape(-1)[start: start + (length - 1) * (c + 1) + 1: c + 1].clone()


def diagflat(input, offset=0):
    return diag(input.reshape(-1), offset)


def repeat_interleave(input, repeats=None, dim=None, *, output_size=None):
    if repeats is None:  # torch.repeat_interleave(repeats): the indices
        return repeat_interleave(torch.arange(input.shape[0]), input, 0, output_size=output_size)
    if dim is None:
        input, dim = input.reshape(-1), 0
    d = dim % max(input.ndim, 1)
    if isinstance(repeats, int):
        x = input.reshape(1) if input.ndim == 0 else input
        shape = list(x.shape)
        out = x.unsqueeze(d + 1).expand(shape[:d + 1] + [repeats] + shape[d + 1:])
        return out.reshape(shape[:d] + [shape[d] * repeats] + shape[d + 1:])
    if repeats.ndim == 0 or repeats.numel() == 1:
        repeats = repeats.reshape(1).expand(input.shape[d] if input.ndim else 1)
    total = int(repeats.sum()) if output_size is None else output_size  # a decision on per-call repeats
    ends = torch.cumsum(repeats, 0)
    idx = torch.bucketize(torch.arange(total), ends, right=True)
    return torch.index_select(input, d, idx)


def native_dropout_backward(grad_output, mask, scale):
    return grad_output * mask.to(grad_output.dtype) * scale


def _softmax_backward_data(grad_output, output, dim, input_dtype):
    g = grad_output * output
    return (g - output * g.sum(dim, keepdim=True)).to(input_dtype)


_ALL = [
    ("diag", diag, (torch.diag,), ("diag",)),
    ("diagflat", diagflat, (torch.diagflat,), ("diagflat",)),
    ("repeat_interleave", repeat_interleave, (torch.repeat_interleave,), ("repeat_interleave",)),
    ("native_dropout_backward", native_dropout_backward, (torch.ops.aten.native_dropout_backward.default,
                                                          torch.ops.aten.native_dropout_backward), ()),
    ("_softmax_backward_data", _softmax_backward_data, (torch.ops.aten._softmax_backward_data.default,
                                                        torch.ops.aten._softmax_backward_data), ()),
    ("cumprod", cumprod, (torch.cumprod,), ("cumprod",)),
    ("logcumsumexp", logcumsumexp, (torch.logcumsumexp,), ("logcumsumexp",)),
    ("scatter_reduce", scatter_reduce, (torch.scatter_reduce,), ("scatter_reduce",)),
    ("put", put, (torch.put,), ("put",)),
    ("masked_scatter", masked_scatter, (torch.masked_scatter,), ("masked_scatter",)),
    ("multilabel_margin_loss", multilabel_margin_loss, (F.multilabel_margin_loss,), ()),
    ("adaptive_avg_pool1d", _adaptive_avg(1), (F.adaptive_avg_pool1d, torch.adaptive_avg_pool1d), ()),
    ("adaptive_avg_pool2d", _adaptive_avg(2), (F.adaptive_avg_pool2d,), ()),
    ("adaptive_avg_pool3d", _adaptive_avg(3), (F.adaptive_avg_pool3d,), ()),
]
for _name, _fn, _fns, _methods in _ALL:
    _register(_name, _fn, _fns, _methods)
# torch.zero_(t) is the in-place method's symbol (functionalized like t.zero_())
by_torch_fn[torch.zero_] = inplace.zero_
