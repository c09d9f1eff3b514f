"""Indexing: ``t[...]`` (getitem), index_select, gather, take_along_dim, scatter, scatter_add, index_add, masked_fill
(symbols), and take, put, index_fill, index_copy, select_scatter, slice_scatter, scatter_reduce (sum),
masked_scatter and unravel_index written as torch calls (``registry.composed``).  Writes through an index
(``t[k] = v``) are ``inplace.setitem``."""
from __future__ import annotations

import builtins
import math
import operator

import torch

from .. import clang, dtypes, prims
from ..clang import is_tensor
from ..errors import TracingError
from ..grad_rules import register_vjp
from ..proxies import NumberProxy, SizeProxy, is_int, number_type
from .autocast import PROMOTE  # autocast policies: see autocast.py
from .registry import composed, torchsymbol
from .shapes import select


@torchsymbol(torch.index_select, methods=("index_select",), tags=("fallible",))
def index_select(input, dim, index):
    if input.ndim_ == 0:  # eager treats a 0-d input as one element along dim 0 and returns 0-d
        return clang.reshape(index_select(clang.reshape(input, (1,)), dim, index), ())
    dim = clang.canonicalize_dim(input.ndim_, dim)
    return prims.take(input, index if index.ndim_ == 1 else clang.reshape(index, (1,)), dim)


@torchsymbol(torch.gather, methods=("gather",), tags=("fallible",))
def gather(input, dim, index, *, sparse_grad=False):
    if sparse_grad and input._tt_requires_grad and torch.is_grad_enabled():
        # eager's gradient is a sparse COO tensor; a dense one in its place would differ in type (sparse.py)
        raise TracingError("gather(sparse_grad=True) on an input that requires grad: sparse gradients are not supported "
                           "by thunder_train; use sparse_grad=False (a dense gradient, the same values)")
    if 0 in index._tt_shape:  # eager returns an empty result of the index's shape before checking ranks or dtype
        return clang.reshape(clang.slice_in_dim(clang.flatten(input), 0, 0), index._tt_shape)
    if input.ndim_ == 0:  # eager treats a 0-d input as one element along dim 0 (an index of at most 1 dimension)
        clang.canonicalize_dim(1, dim)
        out = prims.gather(clang.reshape(input, (1,)), clang.reshape(index, (-1,)), 0)
        return clang.reshape(out, index._tt_shape)
    return prims.gather(input, index, clang.canonicalize_dim(input.ndim_, dim))


@torchsymbol(torch.take_along_dim, methods=("take_along_dim",), tags=("fallible",))
def take_along_dim(input, indices, dim=None):
    if dim is None:  # a gather of the flattened input: an index out of range raises, as eager's
        return prims.gather(clang.flatten(input), clang.flatten(indices), 0)
    # along a dim, eager's CPU kernel takes every index modulo the size (-1 is the last entry, and so is
    # size - 1 + k * size), in the forward and its gradient alike
    dim = clang.canonicalize_dim(input.ndim_, dim)
    indices = clang.elementwise_binary(prims.remainder, indices, input._tt_shape[dim])
    # Every dim but ``dim`` broadcasts; along ``dim`` each keeps its own size.
    rest_in = input._tt_shape[:dim] + (1,) + input._tt_shape[dim + 1 :]
    rest_idx = indices._tt_shape[:dim] + (1,) + indices._tt_shape[dim + 1 :]
    shape = list(clang.broadcast_shapes(rest_in, rest_idx))
    shape_in = list(shape)
    shape_in[dim] = input._tt_shape[dim]
    shape_idx = list(shape)
    shape_idx[dim] = indices._tt_shape[dim]
    return prims.gather(clang.expand(input, tuple(shape_in)), clang.expand(indices, tuple(shape_idx)), dim)


@torchsymbol(torch.scatter_add, methods=("scatter_add",), tags=("fallible",), autocast={"cuda": PROMOTE})
def scatter_add(input, dim, index, src):
    return prims.scatter_add(input, index, src, clang.canonicalize_dim(input.ndim_, dim))


@torchsymbol(torch.scatter, methods=("scatter",), tags=("fallible",))
def scatter(input, dim, index, src=None, *, value=None, reduce=None):
    """``input.scatter(dim, index, src)`` or ``(dim, index, value)``: each position ``index`` names takes ``src``'s
    element (the same kernel as eager's, so where two write one position the same one wins) or the number."""
    src = value if src is None else src
    if reduce is not None or src is None or input.ndim_ == 0 or not all(type(n) is int for n in index._tt_shape) \
            or math.prod(index._tt_shape) == 0:
        raise NotImplementedError("scatter with reduce, of a 0-d input or an empty or symbolic index is run by torch")
    if index._tt_dtype is not dtypes.int64:
        raise NotImplementedError("scatter with an index of another dtype than int64 is run by torch")
    # eager's checks, with its messages
    if is_tensor(src) and src._tt_dtype is not input._tt_dtype:
        raise RuntimeError("scatter(): Expected self.dtype to be equal to src.dtype")
    if index.ndim_ != input.ndim_ or (is_tensor(src) and src.ndim_ != index.ndim_):
        raise RuntimeError(f"Index tensor must have the same number of dimensions as {'self' if index.ndim_ != input.ndim_ else 'src'} tensor")
    dim = clang.canonicalize_dim(input.ndim_, dim)
    over = [type(n) is int and k > n and d != dim for d, (n, k) in enumerate(zip(input._tt_shape, index._tt_shape))]
    if is_tensor(src):
        over += [type(n) is int and k > n for n, k in zip(src._tt_shape, index._tt_shape)]
    if any(over):
        raise RuntimeError(f"Expected index {list(index._tt_shape)} to be no larger than self {list(input._tt_shape)} apart "
                           f"from dimension {dim}" + (f" and to be no larger size than src {list(src._tt_shape)}" if is_tensor(src) else ""))
    if is_tensor(src) and tuple(src._tt_shape) != tuple(index._tt_shape):
        raise NotImplementedError("scatter from a src larger than index is run by torch")
    return prims.scatter(input, index, src, dim)


@torchsymbol(torch.index_add, methods=("index_add",), tags=("fallible",))
def index_add(input, dim, index, source, *, alpha=1):
    """``input.index_add(dim, index, source)`` via scatter_add with an expanded index."""
    if input.ndim_ == 0:  # 0-d: one element along dim 0
        one = index_add(clang.reshape(input, (1,)), dim, clang.reshape(index, (-1,)), clang.reshape(source, (-1,)), alpha=alpha)
        return clang.reshape(one, ())
    if index.ndim_ == 0:
        index = clang.reshape(index, (1,))
    dim = clang.canonicalize_dim(input.ndim_, dim)
    if alpha != 1:
        source = clang.mul(source, alpha)
    shape = [1] * source.ndim_
    shape[dim] = index._tt_shape[0]
    idx = clang.expand(clang.reshape(index, tuple(shape)), source._tt_shape)
    return prims.scatter_add(input, idx, clang.maybe_convert(source, input._tt_dtype), dim)


@torchsymbol(torch.masked_fill, methods=("masked_fill",), tags=("layout_on_meta",))
def masked_fill(input, mask, value):
    """Out of place, input and mask broadcast together (as eager); ``masked_fill_`` keeps the input's shape."""
    if is_tensor(value) and value.ndim_ != 0:
        raise RuntimeError(f"masked_fill_ only supports a 0-dimensional value tensor, but got tensor with {value.ndim_} dimension(s).")
    value = clang.maybe_convert(value, input._tt_dtype)
    target = clang.broadcast_shapes(input._tt_shape, mask._tt_shape)
    return clang.where(clang.expand(mask, target), value, clang.expand(input, target))


def _list_index(k):
    """A list of ints indexes like an int64 tensor (``t[[0, 2]]``)."""
    from .factories import tensor

    if isinstance(k, list) and k and builtins.all(type(v) is int for v in k):
        return tensor(k)
    return k


def _normalize_index(input, key):
    if not isinstance(key, tuple):
        key = (key,)
    key = tuple(_list_index(k) for k in key)
    n_real = sum(1 for k in key if k is not None and k is not Ellipsis and number_type(k) is not bool)
    for k in key:
        if is_tensor(k) and k._tt_dtype.is_bool:
            raise NotImplementedError(
                "boolean-mask indexing (t[mask]) has a data-dependent shape and cannot be compiled; "
                "use torch.where(mask, t, other) or masked_fill"
            )
        if is_tensor(k) and k._tt_dtype.is_bool is False and k._tt_dtype.category != dtypes.INT:
            raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
    if any(k is Ellipsis for k in key):
        i = next(j for j, k in enumerate(key) if k is Ellipsis)  # not key.index: that compares tensors with ==
        fill = (slice(None),) * (input.ndim_ - n_real)
        key = key[:i] + fill + key[i + 1 :]
    else:
        key = key + (slice(None),) * (input.ndim_ - n_real)
    if n_real > input.ndim_:
        raise IndexError(f"too many indices for tensor of dimension {input.ndim_}")
    return key


@torchsymbol(methods=("__getitem__",), name="getitem", tags=("fallible", "view"))  # tensor indices out of range raise
def getitem(input, key):
    """Basic indexing (ints, slices, None, ...) and integer-tensor indexing (one or several tensors)."""
    key = _normalize_index(input, key)
    x = input
    out_dim = 0  # current dim of x being processed
    tensor_dims = []
    for k in key:
        if k is None:
            x = clang.unsqueeze(x, out_dim)
            out_dim += 1
        elif number_type(k) is bool:
            raise NotImplementedError("indexing with a Python bool is not supported")
        elif is_int(k):
            x = select(x, out_dim, operator.index(k))
        elif isinstance(k, slice):
            n = x._tt_shape[out_dim]
            start, stop, step = _slice_indices(k, n)
            if step <= 0:
                raise ValueError("step must be greater than zero")
            stop = max(stop, start)
            x = clang.slice_in_dim(x, start, stop, step, out_dim)
            out_dim += 1
        elif is_tensor(k):
            tensor_dims.append((out_dim, k))
            out_dim += 1
        else:
            raise TypeError(f"unsupported index {k!r}")
    if not tensor_dims:
        return x
    if len(tensor_dims) > 1:
        return _multi_tensor_index(x, tensor_dims)
    dim, idx = tensor_dims[0]
    n = x._tt_shape[dim]
    flat = _wrap_negative(clang.reshape(idx, (-1,)), n)  # negative indices wrap, like eager
    taken = prims.take(x, flat, dim)
    return clang.reshape(taken, x._tt_shape[:dim] + idx._tt_shape + x._tt_shape[dim + 1 :])


def _selects_at_a_tensor(input, key):
    """``x[i]`` or ``x[i, :, ...]`` with ``i`` a 0-d integer tensor and ``x`` row-major: eager reads ``int(i)`` and
    returns a select, a view of ``x`` with the row-major strides the decomposition's copy has."""
    key = key if isinstance(key, tuple) else (key,)
    i, rest = key[0], key[1:]
    return (is_tensor(i) and i.ndim_ == 0 and i._tt_dtype.category == dtypes.INT and i._tt_dtype.torch is not torch.uint8
            and input.ndim_ >= 1 and input._tt_rowmajor
            and builtins.all(k is Ellipsis or (isinstance(k, slice) and k == slice(None)) for k in rest))


@register_vjp(getitem, supports=_selects_at_a_tensor)
def _select_at_a_tensor_vjp(g, out, /, input, key):
    """A direct rule so that the forward stays one ``__getitem__`` call, which eager runs as a select (a view of the
    input: a mixture-of-experts layer's ``experts.weight[expert_idx]`` copies no weight and saves none for the
    backward).  Its gradient is the decomposition's: ``g`` scattered into zeros at the (wrapped) index."""
    i = key[0] if isinstance(key, tuple) else key
    index = _wrap_negative(clang.reshape(i, (1,)), input._tt_shape[0])
    g = prims.broadcast_in_dim(g, (1, *g._tt_shape), tuple(range(1, g.ndim_ + 1)))
    full_index = prims.broadcast_in_dim(index, g._tt_shape, (0,))
    zeros = prims.full(input._tt_shape, 0.0, device=input._tt_device, dtype=input._tt_dtype)
    return {"input": prims.scatter_add(zeros, full_index, g, 0)}


def _slice_indices(k, n):
    """``slice.indices(n)``, keeping a symbolic size (dynamic=True) symbolic: ``x[1:]`` and ``x[:-1]`` stay one
    program for every length (the comparisons that clamp the bounds record checks, as any decision on a size)."""
    if type(n) is not SizeProxy and not builtins.any(isinstance(v, NumberProxy) for v in (k.start, k.stop, k.step)):
        return k.indices(n)
    step = 1 if k.step is None else operator.index(k.step)

    def bound(v, default):
        if v is None:
            return default
        v = v if type(v) is SizeProxy else operator.index(v)  # an item() bound is decided, as eager uses its value
        if v < 0:
            v = v + n
            return 0 if v < 0 else v
        return n if v > n else v

    return bound(k.start, 0), bound(k.stop, n), step


def _wrap_negative(idx, n):
    return clang.where(clang.lt(idx, 0), clang.add(idx, n), idx)


def _multi_tensor_index(x, tensor_dims):
    """``x[i, j]`` with several integer tensors (after ints and None are applied), as eager.

    The index tensors broadcast to one shape ``S``. Their result dims replace the indexed dims in place
    when those were adjacent, and go first otherwise. Each index is applied by its own take/gather, so
    an out-of-range entry raises at run time as in eager (a combined linear index would not).
    """
    dims = [d for d, _ in tensor_dims]
    idxs = [k for _, k in tensor_dims]
    s = clang.broadcast_shapes(*(k._tt_shape for k in idxs))
    rest = [i for i in range(x.ndim_) if i not in dims]
    x = clang.permute(x, dims + rest)  # indexed dims first, in order
    rest_shape = tuple(x._tt_shape[len(dims):])
    p = math.prod(s)
    flat = [_wrap_negative(clang.reshape(clang.expand(k, s), (p,)), x._tt_shape[i]) for i, k in enumerate(idxs)]
    x = prims.take(x, flat[0], 0)  # (p, n1, ..., rest)
    for k in flat[1:]:
        # Row r keeps entry k[r] of the next dim: a gather with the index broadcast over the other dims.
        shape = (p, 1) + tuple(x._tt_shape[2:])
        index = prims.broadcast_in_dim(k, shape, (0,))
        x = clang.squeeze(prims.gather(x, index, 1), (1,))
    x = clang.reshape(x, tuple(s) + rest_shape)
    adjacent = dims == list(range(dims[0], dims[0] + len(dims)))
    if adjacent and dims[0] > 0:  # S goes where the indexed dims were
        n_s, before = len(s), dims[0]
        order = list(range(n_s, n_s + before)) + list(range(n_s)) + list(range(n_s + before, x.ndim_))
        x = clang.permute(x, order)
    return x


# ---------------------------------------------------------------------------
# Written as torch calls the torch language knows (registry.composed: traced as the user's own calls)
# ---------------------------------------------------------------------------
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
    if isinstance(value, torch.Tensor):
        # A where() over a mask of the filled positions: ``value`` gets each position's gradient once, as in
        # eager (a duplicated index fills one position), which an index_put of ``value`` would count twice.
        d = dim % input.ndim
        mask = torch.zeros(input.shape[d], dtype=torch.bool, device=input.device)
        mask[index] = True
        mask = mask.reshape([-1 if i == d else 1 for i in range(input.ndim)])
        return torch.where(mask, value.to(input.dtype), input)
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
    base = input if include_self else input.scatter(dim, index, 0)  # (the positions ``index`` names cleared)
    return base.scatter_add(dim, index, src)


composed("scatter_reduce", scatter_reduce, (torch.scatter_reduce,), ("scatter_reduce",))


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
    """Each true position takes the next element of ``source``: its index is the count of true positions before it
    (a cumulative sum), so every shape is static and one program serves every count."""
    if mask.dtype is not torch.bool:
        raise RuntimeError(f"masked_scatter_ only supports boolean masks, but got mask with dtype {mask.dtype}")
    if source.dtype is not input.dtype:
        raise RuntimeError(f"masked_scatter: expected self and source to have same dtypes but got {input.dtype} and "
                           f"{source.dtype}")
    shape = torch.broadcast_shapes(input.shape, mask.shape)
    flat_mask = mask.expand(shape).reshape(-1)
    flat_src = source.reshape(-1)
    # A decision that holds on every valid call (eager raises otherwise): checked by the program, never a retrace.
    if flat_mask.numel() and bool(flat_mask.sum() > flat_src.numel()):
        raise RuntimeError("masked_scatter: expected source to have at least as many elements as ones in mask")
    flat_in = input.expand(shape).reshape(-1)
    if flat_src.numel() == 0:  # then no position is true (checked above)
        return flat_in.clone().reshape(shape)
    index = (torch.cumsum(flat_mask, 0) - 1).clamp(min=0)
    return torch.where(flat_mask, flat_src.index_select(0, index), flat_in).reshape(shape)


composed("masked_scatter", masked_scatter, (torch.masked_scatter,), ("masked_scatter",))
