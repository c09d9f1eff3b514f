"""Shape operations: reshape/view, permute, squeeze, expand, cat/stack, split/chunk/unbind, narrow, select,
flip, roll, repeat, tril/triu, diff; the ``*_copy`` forms of views, ``atleast_*``, ``[hvd]split``,
pixel/channel shuffles, ``meshgrid``, ``repeat_interleave``.

Indexing (``t[...]``, gather, index_select, scatter forms) is in indexing.py."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import clang, context, dtypes, prims
from ..proxies import is_int
from .convert import size_args
from .helpers import as_eager_allocates
from .autocast import PROMOTE  # autocast policies: see autocast.py
from ..grad_rules import register_vjp
from .registry import composed, torchsymbol
from .value_shaped import repeat_positions


@torchsymbol(torch.reshape, methods=("reshape",), torch_impl=torch.Tensor.reshape, tags=("view",))
def reshape(input, *shape):
    """torch.reshape / Tensor.reshape (one size may be -1)."""
    return clang.reshape(input, size_args(shape))


@torchsymbol(methods=("view",), tags=("view",))
def view(input, *shape):
    """Tensor.view; a dtype argument (bit reinterpretation) is not supported."""
    if len(shape) == 1 and isinstance(shape[0], torch.dtype):
        raise NotImplementedError("Tensor.view(dtype) (bit reinterpretation) is not supported")
    return clang.reshape(input, size_args(shape))


@torchsymbol(methods=("view_as",), tags=("view",))
def view_as(input, other):
    return clang.reshape(input, other._tt_shape)


@torchsymbol(methods=("reshape_as",), tags=("view",))
def reshape_as(input, other):
    return clang.reshape(input, other._tt_shape)


@torchsymbol(torch.flatten, methods=("flatten",), tags=("view",))
def flatten(input, start_dim=0, end_dim=-1):
    return clang.flatten(input, start_dim, end_dim)


@torchsymbol(torch.unflatten, methods=("unflatten",), tags=("view",))
def unflatten(input, dim, sizes):
    dim = clang.canonicalize_dim(input.ndim_, dim)
    sizes = tuple(sizes)
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if known == 0:  # (eager's error; the division below would raise ZeroDivisionError)
            raise RuntimeError(f"unflatten: cannot reshape a dim of {input._tt_shape[dim]} elements into {list(sizes)}: "
                               "with another size 0 the -1 can be any value and is ambiguous")
        sizes = tuple(input._tt_shape[dim] // known if s == -1 else s for s in sizes)
    return clang.reshape(input, input._tt_shape[:dim] + sizes + input._tt_shape[dim + 1 :])


@torchsymbol(torch.squeeze, methods=("squeeze",), tags=("view",))
def squeeze(input, dim=None):
    return clang.squeeze(input, dim)


@torchsymbol(torch.unsqueeze, methods=("unsqueeze",), tags=("view",))
def unsqueeze(input, dim):
    return clang.unsqueeze(input, dim)


@torchsymbol(torch.permute, methods=("permute",), torch_impl=torch.Tensor.permute, tags=("view",))
def permute(input, *dims):
    return clang.permute(input, size_args(dims))


@torchsymbol(torch.transpose, torch.swapaxes, torch.swapdims, methods=("transpose", "swapaxes", "swapdims"), tags=("view",))
def transpose(input, dim0, dim1):
    return clang.transpose(input, dim0, dim1)


@torchsymbol(torch.t, methods=("t",), tags=("view",))
def t(input):
    if input.ndim_ > 2:
        raise ValueError(f"t() expects a tensor with <= 2 dimensions, but self is {input.ndim_}D")
    return clang.transpose(input, 0, 1) if input.ndim_ == 2 else input


@torchsymbol(torch.movedim, torch.moveaxis, methods=("movedim", "moveaxis"), tags=("view",))
def movedim(input, source, destination):
    nd = input.ndim_
    src = [source] if is_int(source) else list(source)
    dst = [destination] if is_int(destination) else list(destination)
    if len(src) != len(dst):
        raise RuntimeError(f"movedim: Invalid source or destination dims: source ({src} dims) should contain the same number of dims as destination ({dst} dims)")
    src = [clang.canonicalize_dim(nd, d) for d in src]
    dst = [clang.canonicalize_dim(nd, d) for d in dst]
    if nd == 0:  # dims 0 and -1 name the scalar itself: nothing moves (eager returns a view)
        return clang.permute(input, [])
    perm = [-1] * nd
    for s, d in zip(src, dst):
        perm[d] = s
    rest = iter(i for i in range(nd) if i not in src)
    perm = [p if p != -1 else next(rest) for p in perm]
    return clang.permute(input, perm)


@torchsymbol(methods=("expand",), tags=("view",))
def expand(input, *sizes):
    return clang.expand(input, size_args(sizes))


@torchsymbol(methods=("expand_as",), tags=("view",))
def expand_as(input, other):
    return clang.expand(input, other._tt_shape)


@torchsymbol(torch.broadcast_to, methods=("broadcast_to",), tags=("view",))
def broadcast_to(input, size):
    return clang.expand(input, tuple(size))


@torchsymbol(torch.broadcast_tensors)
def broadcast_tensors(*tensors):
    return tuple(clang.maybe_broadcast(*tensors))


# "fusible": a kernel writes the pieces where they go (rotary embedding's rotate_half joins its region).
@torchsymbol(torch.cat, torch.concat, torch.concatenate, tags=("layout_on_meta", "fusible"), autocast={"cpu": PROMOTE})
def cat(tensors, dim=0):
    return clang.cat(list(tensors), dim)


@torchsymbol(torch.stack, autocast={"cpu": PROMOTE})
def stack(tensors, dim=0):
    return clang.stack(list(tensors), dim)


@torchsymbol(torch.hstack, autocast={"cpu": PROMOTE})
def hstack(tensors):
    tensors = [clang.reshape(x, (1,)) if x.ndim_ == 0 else x for x in tensors]
    return clang.cat(tensors, 0 if tensors[0].ndim_ == 1 else 1)


@torchsymbol(torch.vstack, autocast={"cpu": PROMOTE})
def vstack(tensors):
    tensors = [clang.reshape(x, (1, -1)) if x.ndim_ < 2 else x for x in tensors]
    return clang.cat(tensors, 0)


@torchsymbol(torch.split, methods=("split",), tags=("view",))
def split(tensor, split_size_or_sections, dim=0):
    dim = clang.canonicalize_dim(tensor.ndim_, dim)
    n = tensor._tt_shape[dim]
    if is_int(split_size_or_sections):
        s = split_size_or_sections
        sizes = [min(s, n - i) for i in range(0, n, s)] if n else [0]
    else:
        sizes = list(split_size_or_sections)
        if sum(sizes) != n:
            raise ValueError(f"split_with_sizes expects split_sizes to sum exactly to {n} (input tensor's size at dimension {dim}), but got split_sizes={sizes}")
    out, start = [], 0
    for s in sizes:
        out.append(clang.slice_in_dim(tensor, start, start + s, 1, dim))
        start += s
    return tuple(out)


@torchsymbol(torch.chunk, methods=("chunk",), tags=("view",))
def chunk(input, chunks, dim=0):
    dim = clang.canonicalize_dim(input.ndim_, dim)
    n = input._tt_shape[dim]
    size = -(-n // chunks) if n else 0
    return split(input, size, dim) if size else (input,)


@torchsymbol(torch.tensor_split, methods=("tensor_split",), tags=("view",))
def tensor_split(input, indices_or_sections, dim=0):
    dim = clang.canonicalize_dim(input.ndim_, dim)
    n = input._tt_shape[dim]
    if is_int(indices_or_sections):
        k = indices_or_sections
        sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
    else:
        idx = [0] + [min(max(i, 0), n) for i in indices_or_sections] + [n]
        sizes = [max(b - a, 0) for a, b in zip(idx[:-1], idx[1:])]
    out, start = [], 0
    for s in sizes:
        out.append(clang.slice_in_dim(input, start, start + s, 1, dim))
        start += s
    return tuple(out)


# ---------------------------------------------------------------------------
# split-like composites: one cat of the pieces' gradients (not a padded sum per piece)
# ---------------------------------------------------------------------------
def _cat_piece_grads(g, out, dim):
    pieces = [gi if gi is not None else prims.full(o._tt_shape, 0, device=o._tt_device, dtype=o._tt_dtype) for gi, o in zip(g, out)]
    return pieces[0] if len(pieces) == 1 else prims.cat(tuple(pieces), dim)


@register_vjp(split)
def _split_vjp(g, out, /, tensor, split_size_or_sections, dim=0):
    return {"tensor": _cat_piece_grads(g, out, clang.canonicalize_dim(tensor.ndim_, dim))}


@register_vjp(tensor_split)
def _tensor_split_vjp(g, out, /, input, indices_or_sections, dim=0):
    return {"input": _cat_piece_grads(g, out, clang.canonicalize_dim(input.ndim_, dim))}


@torchsymbol(torch.unbind, methods=("unbind",), tags=("view",))
def unbind(input, dim=0):
    dim = clang.canonicalize_dim(input.ndim_, dim)
    return tuple(clang.squeeze(clang.slice_in_dim(input, i, i + 1, 1, dim), (dim,)) for i in range(input._tt_shape[dim]))


@torchsymbol(torch.narrow, methods=("narrow",), tags=("view",))
def narrow(input, dim, start, length):
    dim = clang.canonicalize_dim(input.ndim_, dim)
    if start < 0:
        start += input._tt_shape[dim]
    return clang.slice_in_dim(input, start, start + length, 1, dim)


@torchsymbol(torch.select, methods=("select",), tags=("view",))
def select(input, dim, index):
    dim = clang.canonicalize_dim(input.ndim_, dim)
    n = input._tt_shape[dim]
    if not -n <= index < n:
        raise IndexError(f"select(): index {index} out of range for tensor of size {input._tt_shape} at dimension {dim}")
    index %= n
    return clang.squeeze(clang.slice_in_dim(input, index, index + 1, 1, dim), (dim,))


@torchsymbol(torch.flip, methods=("flip",))
def flip(input, dims):
    dims = clang.canonicalize_dims(input.ndim_, dims)
    return prims.flip(input, dims) if dims else input


@torchsymbol(torch.roll, methods=("roll",))
def roll(input, shifts, dims=None):
    if dims is None:
        return clang.reshape(roll(clang.flatten(input), shifts, 0), input._tt_shape)
    shifts = (shifts,) if is_int(shifts) else tuple(shifts)
    dims = (dims,) if is_int(dims) else tuple(dims)
    out = input
    for s, d in zip(shifts, dims):
        d = clang.canonicalize_dim(input.ndim_, d)
        n = input._tt_shape[d]
        if n == 0:
            continue
        s %= n
        if s:
            out = clang.cat([clang.slice_in_dim(out, n - s, n, 1, d), clang.slice_in_dim(out, 0, n - s, 1, d)], d)
    # nothing rolled: eager's kernel still writes a new tensor, row-major whatever the input's layout
    return prims.clone(input, torch.contiguous_format) if out is input else out


@torchsymbol(methods=("repeat",))
def repeat(input, *sizes):
    sizes = size_args(sizes)
    x = clang.reshape(input, (1,) * (len(sizes) - input.ndim_) + input._tt_shape)
    # Interleave a broadcast dim before each dim, then merge: [r0, s0, r1, s1, ...].
    inter = []
    for r, s in zip(sizes, x._tt_shape):
        inter += [1, s]
    x = clang.reshape(x, tuple(inter))
    target = []
    for r, s in zip(sizes, x._tt_shape[1::2]):
        target += [r, s]
    x = clang.expand(x, tuple(target))
    return clang.reshape(x, tuple(r * s for r, s in zip(sizes, target[1::2])))


@torchsymbol(torch.tile, methods=("tile",))
def tile(input, dims):
    dims = tuple(dims)
    if len(dims) < input.ndim_:
        dims = (1,) * (input.ndim_ - len(dims)) + dims
    return repeat(input, dims)


def _tri_mask(input, diagonal, upper):
    rows, cols = input._tt_shape[-2], input._tt_shape[-1]
    r = prims.iota(rows, start=0, step=1, device=input._tt_device, dtype=dtypes.int64)
    c = prims.iota(cols, start=0, step=1, device=input._tt_device, dtype=dtypes.int64)
    r = prims.broadcast_in_dim(r, (rows, cols), (0,))
    c = prims.broadcast_in_dim(c, (rows, cols), (1,))
    d = prims.sub(c, r)
    return prims.ge(d, prims.full((rows, cols), diagonal, device=input._tt_device, dtype=dtypes.int64)) if upper else prims.le(d, prims.full((rows, cols), diagonal, device=input._tt_device, dtype=dtypes.int64))


@torchsymbol(torch.tril, methods=("tril",))
def tril(input, diagonal=0):
    mask = clang.expand(_tri_mask(input, diagonal, upper=False), input._tt_shape)
    return prims.where(mask, input, prims.full(input._tt_shape, 0 if not input._tt_dtype.is_bool else False, device=input._tt_device, dtype=input._tt_dtype))


@torchsymbol(torch.triu, methods=("triu",))
def triu(input, diagonal=0):
    mask = clang.expand(_tri_mask(input, diagonal, upper=True), input._tt_shape)
    return prims.where(mask, input, prims.full(input._tt_shape, 0 if not input._tt_dtype.is_bool else False, device=input._tt_device, dtype=input._tt_dtype))


@torchsymbol(torch.diff, methods=("diff",))
def diff(input, n=1, dim=-1, prepend=None, append=None):
    """n-th forward difference along ``dim``."""
    if n < 0:
        raise RuntimeError(f"order must be non-negative but got {n}")  # (eager's error)
    dim = clang.canonicalize_dim(input.ndim_, dim)
    if n == 0:  # eager: a copy of the input, prepend and append left out
        return prims.clone(input)
    x = clang.cat([t for t in (prepend, input, append) if t is not None], dim)
    for _ in range(n):
        size = x._tt_shape[dim]
        if size == 0:  # an order above the size: eager's result is empty along dim
            break
        hi, lo = clang.slice_in_dim(x, 1, size, 1, dim), clang.slice_in_dim(x, 0, size - 1, 1, dim)
        x = clang.ne(hi, lo) if x._tt_dtype.is_bool else clang.sub(hi, lo)
    return x


# ---------------------------------------------------------------------------
# Written as torch calls the torch language knows (registry.composed: traced as the user's own calls)
# ---------------------------------------------------------------------------
def ravel(input):
    return input.reshape(-1)


composed("ravel", ravel, (torch.ravel,), ("ravel",))


def fliplr(input):
    return torch.flip(input, (1,))


composed("fliplr", fliplr, (torch.fliplr,), ("fliplr",))


def flipud(input):
    return torch.flip(input, (0,))


composed("flipud", flipud, (torch.flipud,), ("flipud",))


def _atleast(n):
    def fn(*tensors):
        one = len(tensors) == 1 and isinstance(tensors[0], torch.Tensor)
        ts = tensors if not (len(tensors) == 1 and isinstance(tensors[0], (list, tuple))) else tensors[0]
        out = []
        for t in ts:
            if t.ndim == 0:
                t = t.reshape((1,) * n)
            elif n >= 2 and t.ndim == 1:
                t = t.unsqueeze(0)
                if n == 3:
                    t = t.unsqueeze(-1)
            elif n == 3 and t.ndim == 2:
                t = t.unsqueeze(-1)
            out.append(t)
        return out[0] if one else tuple(out)

    return fn


composed("atleast_1d", _atleast(1), (torch.atleast_1d,))
composed("atleast_2d", _atleast(2), (torch.atleast_2d,))
composed("atleast_3d", _atleast(3), (torch.atleast_3d,))


def column_stack(tensors):
    return torch.hstack([t.reshape(t.numel(), 1) if t.ndim <= 1 else t for t in tensors])


composed("column_stack", column_stack, (torch.column_stack,))


def dstack(tensors):
    return torch.cat(_atleast(3)(*tensors) if len(tensors) > 1 else [_atleast(3)(tensors[0])], 2)


composed("dstack", dstack, (torch.dstack,))


def _split_dim(name, dim, min_ndim):
    def fn(input, indices_or_sections):
        if input.ndim < min_ndim:
            raise RuntimeError(f"torch.{name} requires a tensor with at least {min_ndim} dimension, but got a tensor with "
                               f"{input.ndim} dimensions!")
        d = 0 if (name == "hsplit" and input.ndim == 1) else dim
        if is_int(indices_or_sections) and input.shape[d] % indices_or_sections:
            raise RuntimeError(f"torch.{name} attempted to split along dimension {d}, but the size of the dimension "
                               f"{input.shape[d]} is not divisible by the split_size {indices_or_sections}!")
        return torch.tensor_split(input, indices_or_sections, d)

    return fn


composed("hsplit", _split_dim("hsplit", 1, 1), (torch.hsplit,), ("hsplit",))
composed("vsplit", _split_dim("vsplit", 0, 2), (torch.vsplit,), ("vsplit",))
composed("dsplit", _split_dim("dsplit", 2, 3), (torch.dsplit,), ("dsplit",))


def split_with_sizes(input, split_sizes, dim=0):
    return torch.split(input, list(split_sizes), dim)


composed("split_with_sizes", split_with_sizes, (torch.split_with_sizes,), ("split_with_sizes",))


def _unsafe(pieces, func):
    """The pieces of ``unsafe_split``/``unsafe_chunk``: ``split``'s, made by ``func`` in eager (whose autograd marks no
    view: a write into a piece is allowed; acquisition/returned_graph.py makes returned pieces again by it)."""
    st = context.tracer_state()
    if st is not None and st.buffers is not None:
        for p in pieces:
            st.buffers.call_was(p, func)
            st.view_creation.pop(id(p), None)  # (writable in place: acquisition/view_creation.py)
    return pieces


def unsafe_split(input, split_size, dim=0):
    return _unsafe(torch.split(input, split_size, dim), torch.Tensor.unsafe_split)


composed("unsafe_split", unsafe_split, (torch.unsafe_split,), ("unsafe_split",))


def unsafe_chunk(input, chunks, dim=0):
    return _unsafe(torch.chunk(input, chunks, dim), torch.Tensor.unsafe_chunk)


composed("unsafe_chunk", unsafe_chunk, (torch.unsafe_chunk,), ("unsafe_chunk",))


def pixel_shuffle(input, upscale_factor):
    r = upscale_factor
    *b, c, h, w = input.shape
    x = input.reshape(*b, c // (r * r), r, r, h, w)
    n = len(b)
    x = x.permute(*range(n), n, n + 3, n + 1, n + 4, n + 2)
    return x.reshape(*b, c // (r * r), h * r, w * r)


composed("pixel_shuffle", pixel_shuffle, (F.pixel_shuffle, torch.pixel_shuffle))


def pixel_unshuffle(input, downscale_factor):
    r = downscale_factor
    *b, c, h, w = input.shape
    x = input.reshape(*b, c, h // r, r, w // r, r)
    n = len(b)
    x = x.permute(*range(n), n, n + 2, n + 4, n + 1, n + 3)
    return x.reshape(*b, c * r * r, h // r, w // r)


composed("pixel_unshuffle", pixel_unshuffle, (F.pixel_unshuffle, torch.pixel_unshuffle))


def channel_shuffle(input, groups):
    b, c, *rest = input.shape
    return as_eager_allocates(input.reshape(b, groups, c // groups, *rest).transpose(1, 2).reshape(input.shape), input)


composed("channel_shuffle", channel_shuffle, (F.channel_shuffle, torch.channel_shuffle))


def fftshift(input, dim=None):
    dims = tuple(range(input.ndim)) if dim is None else ((dim,) if is_int(dim) else tuple(dim))
    return torch.roll(input, [input.shape[d] // 2 for d in dims], dims)


composed("fftshift", fftshift, (torch.fft.fftshift,))


def ifftshift(input, dim=None):
    dims = tuple(range(input.ndim)) if dim is None else ((dim,) if is_int(dim) else tuple(dim))
    return torch.roll(input, [-(input.shape[d] // 2) for d in dims], dims)


composed("ifftshift", ifftshift, (torch.fft.ifftshift,))


def _fresh(t):
    """A contiguous copy (what the ``*_copy`` ops return: never a view of their input)."""
    return t.clone(memory_format=torch.contiguous_format)


def _copy_of(view_fn):
    def fn(input, *args, **kwargs):
        out = view_fn(input, *args, **kwargs)
        if isinstance(out, (tuple, list)):
            return type(out)(_fresh(o) for o in out)
        return _fresh(out)

    return fn


_COPIES = [
    ("expand_copy", lambda x, size, *, implicit=False: x.expand(size), torch.expand_copy),
    ("alias_copy", lambda x: x, torch.alias_copy),
    ("view_copy", lambda x, size: x.view(size), torch.view_copy),
    ("permute_copy", lambda x, dims: x.permute(dims), torch.permute_copy),
    ("squeeze_copy", lambda x, *dim: x.squeeze(*dim), torch.squeeze_copy),
    ("unsqueeze_copy", lambda x, dim: x.unsqueeze(dim), torch.unsqueeze_copy),
    ("t_copy", lambda x: x.t(), torch.t_copy),
    ("transpose_copy", lambda x, d0, d1: x.transpose(d0, d1), torch.transpose_copy),
    ("narrow_copy", lambda x, dim, start, length: torch.narrow(x, dim, start, length), torch.narrow_copy),
    ("split_with_sizes_copy", lambda x, sizes, dim=0: torch.split(x, list(sizes), dim), torch.split_with_sizes_copy),
    ("unbind_copy", lambda x, dim=0: torch.unbind(x, dim), torch.unbind_copy),
]
for _name, _view, _fn in _COPIES:
    composed(_name, _copy_of(_view), (_fn,), ("narrow_copy",) if _name == "narrow_copy" else ())


def meshgrid(*tensors, indexing=None):
    ts = list(tensors[0]) if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)) else list(tensors)
    if any(t.ndim > 1 for t in ts):
        raise RuntimeError("torch.meshgrid: Expected 0D or 1D tensor in the tensor list")
    ts = [t.reshape(-1) for t in ts]
    xy = indexing == "xy" and len(ts) >= 2
    if xy:
        ts[0], ts[1] = ts[1], ts[0]
    shape = [t.shape[0] for t in ts]
    out = [t.reshape([-1 if i == k else 1 for i in range(len(ts))]).expand(shape) for k, t in enumerate(ts)]
    if xy:  # as eager: the "ij" grids of the swapped inputs, swapped back (no transpose)
        out[0], out[1] = out[1], out[0]
    return tuple(out)


composed("meshgrid", meshgrid, (torch.meshgrid,))


def cartesian_prod(*tensors):
    if len(tensors) == 1:
        return tensors[0]
    grids = meshgrid(*tensors, indexing="ij")
    return torch.stack([g.reshape(-1) for g in grids], 1)


composed("cartesian_prod", cartesian_prod, (torch.cartesian_prod,))


def rot90(input, k=1, dims=(0, 1)):
    d0, d1 = dims
    k %= 4
    if k == 1:
        return input.flip(d1).transpose(d0, d1)
    if k == 2:
        return input.flip((d0, d1))
    if k == 3:
        return input.flip(d0).transpose(d0, d1)
    return input.clone()


composed("rot90", rot90, (torch.rot90,), ("rot90",))


def sum_to_size(input, *size):
    size = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else tuple(size)
    if not size and input.ndim == 0:
        return input.sum()  # eager sums a 0-d tensor (bool -> int64)
    if tuple(input.shape) == size:
        return input  # eager returns the tensor itself (x.sum_to_size(x.shape) is x)
    lead = input.ndim - len(size)
    dims = list(range(lead)) + [lead + i for i, s in enumerate(size) if s == 1 and input.shape[lead + i] != 1]
    out = input.sum(dims, keepdim=True) if dims else input
    return out.reshape(size)


composed("sum_to_size", sum_to_size, (), ("sum_to_size",))


def repeat_interleave(input, repeats=None, dim=None, *, output_size=None):
    if repeats is None:  # torch.repeat_interleave(repeats): the indices
        return repeat_interleave(torch.arange(input.shape[0]), input, 0, output_size=output_size)
    if dim is None:
        input, dim = input.reshape(-1), 0
    d = dim % max(input.ndim, 1)
    if is_int(repeats):
        x = input.reshape(1) if input.ndim == 0 else input
        shape = list(x.shape)
        out = x.unsqueeze(d + 1).expand(shape[:d + 1] + [repeats] + shape[d + 1:])
        return out.reshape(shape[:d] + [shape[d] * repeats] + shape[d + 1:])
    if repeats.ndim == 0 or repeats.numel() == 1:
        repeats = repeats.reshape(1).expand(input.shape[d] if input.ndim else 1)
    if output_size is None:  # the total is a data-dependent size (prims.repeat_index)
        return torch.index_select(input, d, repeat_positions(repeats))
    ends = torch.cumsum(repeats, 0)
    idx = torch.bucketize(torch.arange(output_size), ends, right=True)
    return torch.index_select(input, d, idx)


composed("repeat_interleave", repeat_interleave, (torch.repeat_interleave,), ("repeat_interleave",))
