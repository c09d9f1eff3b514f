"""Index and scatter forms written as torch calls (``registry.composed``): take, put, index_fill, index_copy,
select_scatter, slice_scatter, scatter_reduce (sum), masked_scatter, unravel_index.  The indexing symbols
they are written with (getitem, index_select, gather, scatter_add, index_add) are in shapes.py."""
from __future__ import annotations

import torch

from ..proxies import is_int
from .registry import composed
from .value_shaped import _selected_positions


def take(input, index):
    return input.reshape(-1)[index]


composed("take", take, (torch.take,), ("take",))


def _index_key(dim, ndim, index):
    d = dim % ndim if ndim else 0
    return (slice(None),) * d + (index,)


def index_fill(input, dim, index, value):
    if input.ndim == 0:
        return index_fill(input.reshape(1), dim, index, value).reshape(())
    if isinstance(value, torch.Tensor) and value.ndim != 0:
        raise RuntimeError("index_fill_ only supports a 0-dimensional value tensor")
    out = input.clone()
    out[_index_key(dim, input.ndim, index)] = value
    return out


composed("index_fill", index_fill, (torch.index_fill,), ("index_fill",))


def index_copy(input, dim, index, source):
    if input.ndim == 0:
        return index_copy(input.reshape(1), dim, index, source.reshape(1)).reshape(())
    out = input.clone()
    out[_index_key(dim, input.ndim, index)] = source
    return out


composed("index_copy", index_copy, (torch.index_copy,), ("index_copy",))


def select_scatter(input, src, dim, index):
    out = input.clone()
    out[_index_key(dim, input.ndim, index)] = src
    return out


composed("select_scatter", select_scatter, (torch.select_scatter,), ("select_scatter",))


def slice_scatter(input, src, dim=0, start=None, end=None, step=1):
    out = input.clone()
    out[_index_key(dim, input.ndim, slice(start, end, step))] = src
    return out


composed("slice_scatter", slice_scatter, (torch.slice_scatter,), ("slice_scatter",))


def unravel_index(indices, shape):
    if indices.dtype.is_floating_point or indices.dtype is torch.bool:
        raise TypeError("expected 'indices' to be integer dtype")
    shape = (shape,) if is_int(shape) else tuple(shape)
    out, rest = [], indices
    for s in reversed(shape):
        out.append(torch.remainder(rest, s))
        rest = torch.div(rest, s, rounding_mode="floor")
    return tuple(reversed(out))


composed("unravel_index", unravel_index, (torch.unravel_index,))


def scatter_reduce(input, dim, index, src, reduce, *, include_self=True):
    if reduce != "sum":
        raise NotImplementedError(f"scatter_reduce(reduce={reduce!r}) is run by torch")
    base = input if include_self else _cleared(input, dim, index)
    return base.scatter_add(dim, index, src)


composed("scatter_reduce", scatter_reduce, (torch.scatter_reduce,), ("scatter_reduce",))


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


composed("put", put, (torch.put,), ("put",))


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


composed("masked_scatter", masked_scatter, (torch.masked_scatter,), ("masked_scatter",))
