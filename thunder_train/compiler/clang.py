"""The core language: usable operations built from prims.

clang adds what prims leave out — PyTorch type promotion, broadcasting,
``-1`` in reshape, dim normalisation, low-precision upcasting — and knows
nothing about torch objects (dtypes and devices here are compiler ones).
Functions here are plain Python; the prims they call are what gets recorded.
"""
from __future__ import annotations

import builtins
import math
from enum import Enum

from . import dtypes, prims
from .dtypes import DType
from .proxies import (TensorProxy, NumberProxy, SizeProxy, as_divisor, is_int, is_number, number_type, same_shape, same_size,
                      size_arg, is_unbacked)


def is_tensor(x) -> bool:
    return type(x) is TensorProxy


class ClangError(ValueError):
    pass


def check(cond, msg):
    if not cond:
        raise ClangError(msg() if callable(msg) else msg)


# ---------------------------------------------------------------------------
# Dims and shapes
# ---------------------------------------------------------------------------
def canonicalize_dim(rank: int, dim: int, *, wrap_scalar=True) -> int:
    r = rank if rank > 0 or not wrap_scalar else 1
    check(-r <= dim < r, lambda: f"dimension {dim} out of range for a tensor of rank {rank}")
    return dim % r if r else 0


def canonicalize_dims(rank: int, dims) -> tuple:
    if dims is None:
        return tuple(range(rank))
    if is_int(dims):
        dims = (dims,)
    out = tuple(sorted({canonicalize_dim(rank, d) for d in dims}))
    return tuple(d for d in out if d < rank) if rank else ()


def settle_size(x, v: int) -> None:
    """A data-dependent size the trace decided equals the int ``v`` (a check of the program right after the op that
    computes it): every later line runs with ``v``, so later questions and layout probes use it, not the stand-in
    (the largest count possible, which would not broadcast against ``v``)."""
    if is_unbacked(x):
        x.decided = x.value = v


def broadcast_shapes(*shapes) -> tuple:
    n = max((len(s) for s in shapes), default=0)
    out = [1] * n
    for s in shapes:
        s = (1,) * (n - len(s)) + tuple(s)
        for i, x in enumerate(s):
            o = out[i]
            if x is o or (type(x) is int and x == 1):
                continue
            if type(o) is int and o == 1:
                out[i] = x  # whatever x is (a data-dependent size too): no decision needed
                continue
            if (is_unbacked(x) or is_unbacked(o)) and same_size(x, o):
                continue  # certainly equal (a data-dependent size is never asked ``== 1`` here)
            if x == 1:
                continue
            check(o == 1 or o == x, lambda: f"shapes {', '.join(str(tuple(t)) for t in shapes)} cannot be broadcast together")
            if type(o) is int and o != 1:  # a data-dependent x decided equal to o: the size is o
                settle_size(x, o)
                continue
            if type(x) is int:
                settle_size(o, x)
            out[i] = x
    return tuple(out)


def expand(a, shape):
    """Broadcast ``a`` to ``shape`` (``-1`` keeps a size), like ``Tensor.expand``."""
    shape = tuple(shape)
    nd = len(shape)
    check(nd >= a.ndim_, lambda: f"expand: target {shape} has fewer dims than input {a._tt_shape}")
    offset = nd - a.ndim_
    resolved = list(shape)
    for i, s in enumerate(a._tt_shape):
        t = shape[offset + i]
        if t == -1:
            resolved[offset + i] = s
        else:
            check(same_size(s, t) or s == 1 or s == t, lambda: f"expand: size {s} at dim {i} cannot expand to {t} (target {shape})")
    check(all(s >= 0 for s in resolved), lambda: f"expand: invalid target {shape}")
    resolved = tuple(resolved)
    if same_shape(resolved, a._tt_shape):
        return a
    return prims.broadcast_in_dim(a, resolved, tuple(range(offset, nd)))


def maybe_broadcast(*args):
    shapes = [a._tt_shape for a in args if is_tensor(a)]
    if not shapes:
        return args
    target = broadcast_shapes(*shapes)
    return tuple(expand(a, target) if is_tensor(a) and not same_shape(a._tt_shape, target) else a for a in args)


def _prod(sizes):
    n = 1
    for s in sizes:
        n = s if type(n) is int and n == 1 else n * s
    return n


def reshape(a, shape):
    shape = tuple(size_arg(s) for s in shape)
    n = a.numel_()
    if any(type(s) is int and s == -1 for s in shape):
        check(builtins.sum(1 for s in shape if type(s) is int and s == -1) == 1, "reshape: only one dimension can be -1")
        known = 1
        for s in shape:
            if not (type(s) is int and s == -1):
                known = s if type(known) is int and known == 1 else known * s
        check(known != 0 and n % known == 0 or (known == 0 and n == 0), lambda: f"shape {shape} is invalid for input of size {n}")
        minus_one = [type(s) is int and s == -1 for s in shape]
        shape = tuple(n // known if m else s for s, m in zip(shape, minus_one)) if known else tuple(0 if m else s for s, m in zip(shape, minus_one))
    check(_prod(shape) == n, lambda: f"shape {shape} is invalid for input of size {n}")
    if same_shape(shape, a._tt_shape):
        return a
    return prims.reshape(a, shape)


def unsqueeze(a, dim):
    nd = a.ndim_ + 1
    dim = canonicalize_dim(nd, dim)
    shape = list(a._tt_shape)
    shape.insert(dim, 1)
    return prims.broadcast_in_dim(a, tuple(shape), tuple(i for i in range(nd) if i != dim))


def squeeze(a, dims=None):
    if dims is None:
        dims = tuple(i for i, s in enumerate(a._tt_shape) if s == 1)
    else:
        dims = tuple(d for d in canonicalize_dims(a.ndim_, dims) if a._tt_shape[d] == 1)
    return prims.squeeze(a, dims) if dims else a


def permute(a, dims):
    dims = tuple(canonicalize_dim(a.ndim_, d) for d in dims)
    check(sorted(dims) == list(range(a.ndim_)), lambda: f"permute: {dims} is not a permutation of {a.ndim_} dims")
    if dims == tuple(range(a.ndim_)):
        return a
    return prims.transpose(a, dims)


def transpose(a, d0, d1):
    if a.ndim_ == 0:
        return a
    d0, d1 = canonicalize_dim(a.ndim_, d0), canonicalize_dim(a.ndim_, d1)
    perm = list(range(a.ndim_))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return permute(a, perm)


def slice_in_dim(a, start, stop, step=1, dim=0):
    dim = canonicalize_dim(a.ndim_, dim)
    lo = [0] * a.ndim_
    hi = list(a._tt_shape)
    st = [1] * a.ndim_
    lo[dim], hi[dim], st[dim] = start, stop, step
    if start == 0 and stop == a._tt_shape[dim] and step == 1:
        return a
    return prims.slice(a, tuple(lo), tuple(hi), tuple(st))


def cat(tensors, dim=0):
    tensors = [t for t in tensors if not (t.ndim_ == 1 and t._tt_shape[0] == 0)] or list(tensors[:1])
    check(len(tensors) > 0, "cat: expected a non-empty list of tensors")
    dtype = tensors[0]._tt_dtype
    for t in tensors[1:]:
        dtype = dtypes.promote(dtype, t._tt_dtype)
    dim = canonicalize_dim(tensors[0].ndim_, dim)
    tensors = [maybe_convert(t, dtype) for t in tensors]
    if len(tensors) == 1:
        return tensors[0]
    return prims.cat(tuple(tensors), dim)


def with_band(a, value, dim, start, stop):
    """``a`` with its band ``start:stop`` of ``dim`` replaced by ``value`` (that band's shape, ``a``'s dtype): a ``cat``
    of the parts around it.  How a write to a band (``a[..., :8] = v``, a copy into such a view) is traced: an
    index_put over int64 positions would compute them in the forward and keep them for its backward."""
    parts = [slice_in_dim(a, 0, start, 1, dim), value, slice_in_dim(a, stop, a._tt_shape[dim], 1, dim)]
    return prims.cat(tuple(p for p in parts if p._tt_shape[dim] != 0), dim)


def stack(tensors, dim=0):
    check(len(tensors) > 0, "stack: expected a non-empty list of tensors")
    dim = canonicalize_dim(tensors[0].ndim_ + 1, dim)
    for t in tensors:
        check(t._tt_shape == tensors[0]._tt_shape, lambda: f"stack expects each tensor to be equal size, got {tensors[0]._tt_shape} and {t._tt_shape}")
    return cat([unsqueeze(t, dim) for t in tensors], dim)


def flatten(a, start_dim=0, end_dim=-1):
    if a.ndim_ == 0:
        return reshape(a, (1,))
    s = canonicalize_dim(a.ndim_, start_dim)
    e = canonicalize_dim(a.ndim_, end_dim)
    check(s <= e, "flatten: start_dim cannot come after end_dim")
    shape = a._tt_shape[:s] + (math.prod(a._tt_shape[s : e + 1]),) + a._tt_shape[e + 1 :]
    return reshape(a, shape)


# ---------------------------------------------------------------------------
# Type promotion (PyTorch's rules)
# ---------------------------------------------------------------------------
class Promotion(Enum):
    DEFAULT = 0  # result dtype = promoted dtype
    INT_TO_FLOAT = 1  # bool/int → default float (true division, exp, sin, ...)
    ALWAYS_BOOL = 2  # comparisons
    COMPLEX_TO_FLOAT = 3  # abs
    BOOL_TO_LONG = 4  # sum of bools, cumsum


def result_dtype(*args) -> DType:
    """torch.result_type over tensors and Python numbers.

    Dimensioned tensors outrank zero-dim tensors, which outrank numbers; a
    lower-ranked operand only matters when its category (bool < int < float <
    complex) is higher.
    """
    dim_t = [a._tt_dtype for a in args if is_tensor(a) and a.ndim_ > 0]
    zero_t = [a._tt_dtype for a in args if is_tensor(a) and a.ndim_ == 0]
    nums = [a for a in args if is_number(a)]

    def fold(ds):
        r = None
        for d in ds:
            r = d if r is None else dtypes.promote(r, d)
        return r

    r = fold(dim_t)
    z = fold(zero_t)
    if r is None or (z is not None and z.category > r.category):
        r = z if r is None else z
    cat_num = max((dtypes.python_type_category(number_type(n)) for n in nums), default=-1)
    if r is None:
        return _category_default(cat_num)
    if cat_num > r.category:
        if cat_num == dtypes.COMPLEX:
            return dtypes.to_complex(r if r.is_float else dtypes.default_float())
        return _category_default(cat_num)
    return r


def _category_default(category) -> DType:
    if category == dtypes.BOOL:
        return dtypes.bool8
    if category == dtypes.INT:
        return dtypes.int64
    if category == dtypes.FLOAT:
        return dtypes.default_float()
    return dtypes.to_complex(dtypes.default_float())


def promote_for(kind: Promotion, *args) -> tuple[DType, DType]:
    """(computation dtype for the inputs, result dtype)."""
    d = result_dtype(*args)
    if kind is Promotion.INT_TO_FLOAT and d.category < dtypes.FLOAT:
        d = dtypes.default_float()
    if kind is Promotion.ALWAYS_BOOL:
        return d, dtypes.bool8
    if kind is Promotion.COMPLEX_TO_FLOAT:
        return d, dtypes.to_real(d)
    if kind is Promotion.BOOL_TO_LONG and d.category < dtypes.FLOAT:
        return d, dtypes.int64
    return d, d


def compute_dtype(d: DType) -> DType:
    """Low-precision floats are computed in float32, like torch's opmath."""
    return dtypes.float32 if d.is_low_precision else d


def maybe_convert(a, dtype: DType):
    if is_tensor(a):
        return a if a._tt_dtype is dtype else prims.convert_element_type(a, dtype)
    if isinstance(a, NumberProxy):
        return a
    if is_number(a):
        if dtype.is_bool:
            return bool(a)
        if dtype.is_int:
            return int(a) if number_type(a) is not complex else a
        if dtype.is_float:
            return float(a) if number_type(a) is not complex else a
    return a


def convert_element_type(a, dtype: DType):
    return maybe_convert(a, dtype)


def upcast(x):
    """Low-precision floats in their compute dtype (float32): gradient rules compute there, like the forwards."""
    return maybe_convert(x, compute_dtype(x._tt_dtype))


def downcast_like(grad, like):
    """A gradient computed in the compute dtype, converted back to its input's dtype (None stays None)."""
    return maybe_convert(grad, like._tt_dtype) if grad is not None else None


# ---------------------------------------------------------------------------
# Elementwise
# ---------------------------------------------------------------------------
def elementwise_unary(prim, a, kind=Promotion.DEFAULT, *, upcast=True):
    if not is_tensor(a):
        return prim(a)
    comp, res = promote_for(kind, a)
    cd = compute_dtype(comp) if upcast else comp
    out = prim(maybe_convert(a, cd))
    return maybe_convert(out, res if kind is not Promotion.ALWAYS_BOOL else dtypes.bool8)


def elementwise_binary(prim, a, b, kind=Promotion.DEFAULT, *, upcast=True):
    if not is_tensor(a) and not is_tensor(b):
        return prim(a, b)
    comp, res = promote_for(kind, a, b)
    cd = compute_dtype(comp) if upcast else comp
    a, b = maybe_broadcast(a, b)
    out = prim(maybe_convert(a, cd), maybe_convert(b, cd))
    return out if kind is Promotion.ALWAYS_BOOL else maybe_convert(out, res)


def where(pred, a, b):
    check(is_tensor(pred) or number_type(pred) is bool, "where: condition must be a bool tensor")
    if is_tensor(pred) and pred._tt_dtype is not dtypes.bool8:
        pred = prims.ne(pred, 0)
    d = result_dtype(a, b)
    if not is_tensor(a) and not is_tensor(b):
        a = full_like(pred, a, dtype=d)
    pred, a, b = maybe_broadcast(pred, a, b)
    a, b = maybe_convert(a, d), maybe_convert(b, d)
    if not is_tensor(a):
        a = full(b._tt_shape, a, device=b._tt_device, dtype=d)
    return prims.where(pred, a, b)


def add(a, b):
    return elementwise_binary(prims.add, a, b)


def sub(a, b):
    return elementwise_binary(prims.sub, a, b)


def mul(a, b):
    return elementwise_binary(prims.mul, a, b)


def true_divide(a, b):
    return elementwise_binary(prims.div, a, b, Promotion.INT_TO_FLOAT)


def neg(a):
    return elementwise_unary(prims.neg, a)


def exp(a):
    return elementwise_unary(prims.exp, a, Promotion.INT_TO_FLOAT)


def log(a):
    return elementwise_unary(prims.log, a, Promotion.INT_TO_FLOAT)


def sqrt(a):
    return elementwise_unary(prims.sqrt, a, Promotion.INT_TO_FLOAT)


def rsqrt(a):
    return elementwise_unary(prims.rsqrt, a, Promotion.INT_TO_FLOAT)


def tanh(a):
    return elementwise_unary(prims.tanh, a, Promotion.INT_TO_FLOAT)


def erf(a):
    return elementwise_unary(prims.erf, a, Promotion.INT_TO_FLOAT)


def maximum(a, b):
    return elementwise_binary(prims.maximum, a, b)


def minimum(a, b):
    return elementwise_binary(prims.minimum, a, b)


def eq(a, b):
    return elementwise_binary(prims.eq, a, b, Promotion.ALWAYS_BOOL, upcast=False)


def ne(a, b):
    return elementwise_binary(prims.ne, a, b, Promotion.ALWAYS_BOOL, upcast=False)


def lt(a, b):
    return elementwise_binary(prims.lt, a, b, Promotion.ALWAYS_BOOL, upcast=False)


def ge(a, b):
    return elementwise_binary(prims.ge, a, b, Promotion.ALWAYS_BOOL, upcast=False)


def logical_and(a, b):
    return prims.bitwise_and(*maybe_broadcast(to_bool(a), to_bool(b)))


def to_bool(a):
    if is_tensor(a):
        return a if a._tt_dtype is dtypes.bool8 else prims.ne(a, 0 if not a._tt_dtype.is_bool else False)
    return bool(a)


# ---------------------------------------------------------------------------
# Factories
# ---------------------------------------------------------------------------
def full(shape, fill_value, *, device, dtype):
    return prims.full(tuple(shape), fill_value, device=device, dtype=dtype)


def full_like(a, fill_value, *, dtype=None, device=None):
    return prims.full(a._tt_shape, fill_value, device=device or a._tt_device, dtype=dtype or a._tt_dtype)


def empty(shape, *, device, dtype):
    return prims.empty(tuple(shape), device=device, dtype=dtype)


def zeros(shape, *, device, dtype):
    return full(shape, False if dtype.is_bool else 0, device=device, dtype=dtype)


def ones(shape, *, device, dtype):
    return full(shape, True if dtype.is_bool else 1, device=device, dtype=dtype)


def uniform(shape, minval=0.0, maxval=1.0, *, device, dtype):
    return prims.uniform(tuple(shape), minval, maxval, device=device, dtype=dtype)


def randn(shape, *, device, dtype):
    return prims.randn(tuple(shape), device=device, dtype=dtype)


def linspace(start, end, steps, *, device, dtype):
    """``steps`` points from ``start`` to ``end``, computed in float32 (float64 for float64) like eager."""
    if steps == 1:
        return full((1,), start, device=device, dtype=dtype)
    idx = prims.iota(steps, start=0, step=1, device=device, dtype=dtypes.float64 if dtype is dtypes.float64 else dtypes.float32)
    step = (end - start) / (steps - 1)
    return maybe_convert(prims.add(prims.mul(idx, step), float(start)), dtype)


def arange(start, end, step, *, device, dtype):
    check(step != 0, "arange: step must be nonzero")
    if any(type(v) is SizeProxy for v in (start, end, step)) and all(is_int(v) for v in (start, end, step)):
        # Symbolic bounds (dynamic=True): integer ceil-division keeps the length symbolic.
        length = (end - start + step - 1) // step if step > 0 else (start - end - step - 1) // (-step)
        return prims.iota(builtins.max(0, length), start=start, step=step, device=device, dtype=dtype)
    length = builtins.max(0, math.ceil((end - start) / step))
    return prims.iota(length, start=start, step=step, device=device, dtype=dtype)


# ---------------------------------------------------------------------------
# Reductions
# ---------------------------------------------------------------------------
def _restore_dims(out, in_shape, dims):
    shape = tuple(1 if i in dims else s for i, s in enumerate(in_shape))
    return prims.broadcast_in_dim(out, shape, tuple(i for i in range(len(in_shape)) if i not in dims))


def reduction(prim, a, dims=None, keepdim=False, *, dtype=None, kind=Promotion.DEFAULT, upcast=True):
    dims = canonicalize_dims(a.ndim_, dims)
    if dtype is not None:
        a = maybe_convert(a, dtype)
    _, res = promote_for(kind, a)
    cd = compute_dtype(a._tt_dtype) if upcast else a._tt_dtype
    if kind is Promotion.BOOL_TO_LONG and a._tt_dtype.category < dtypes.FLOAT:
        cd = res
    out = prim(maybe_convert(a, cd), dims)
    if keepdim:
        out = _restore_dims(out, a._tt_shape, dims)
    return maybe_convert(out, res if dtype is None else dtype)


def sum(a, dims=None, keepdim=False, *, dtype=None):
    return reduction(prims.sum, a, dims, keepdim, dtype=dtype, kind=Promotion.BOOL_TO_LONG)


def amax(a, dims=None, keepdim=False):
    return reduction(prims.amax, a, dims, keepdim, upcast=False)


def amin(a, dims=None, keepdim=False):
    return reduction(prims.amin, a, dims, keepdim, upcast=False)


def mean(a, dims=None, keepdim=False, *, dtype=None):
    d = dtype or a._tt_dtype
    check(d.category >= dtypes.FLOAT, lambda: f"mean(): could not infer output dtype. Input dtype must be floating point or complex, got {d}. Pass dtype=")
    cdims = canonicalize_dims(a.ndim_, dims)
    n = math.prod(a._tt_shape[i] for i in cdims)
    x = maybe_convert(a, compute_dtype(d))
    s = prims.sum(x, cdims)
    s = prims.div(s, as_divisor(n))
    if keepdim:
        s = _restore_dims(s, a._tt_shape, cdims)
    return maybe_convert(s, d)


def var(a, dims=None, keepdim=False, *, correction=1):
    cdims = canonicalize_dims(a.ndim_, dims)
    check(a._tt_dtype.category >= dtypes.FLOAT, "var: input must be floating point")
    x = maybe_convert(a, compute_dtype(a._tt_dtype))
    out = prims.var(x, cdims, correction)
    if keepdim:
        out = _restore_dims(out, a._tt_shape, cdims)
    return maybe_convert(out, dtypes.to_real(a._tt_dtype))


def var_mean(a, dims=None, keepdim=False, *, correction=1):
    return var(a, dims, keepdim, correction=correction), mean(a, dims, keepdim)


# ---------------------------------------------------------------------------
# Normalisations used by several torch ops
# ---------------------------------------------------------------------------
def softmax(a, dim, dtype=None):
    out_dtype = dtype or a._tt_dtype
    x = maybe_convert(a, compute_dtype(out_dtype if out_dtype.is_float else dtypes.default_float()))
    dims = canonicalize_dims(a.ndim_, dim)  # () for a 0-d tensor: dim 0 and -1 name the scalar itself
    m = amax(x, dims, keepdim=True)
    e = prims.exp(prims.sub(x, expand(m, x._tt_shape)))
    s = prims.sum(e, dims)
    s = _restore_dims(s, x._tt_shape, dims)
    return maybe_convert(prims.div(e, expand(s, x._tt_shape)), out_dtype)


def log_softmax(a, dim, dtype=None):
    out_dtype = dtype or a._tt_dtype
    x = maybe_convert(a, compute_dtype(out_dtype))
    dims = canonicalize_dims(a.ndim_, dim)
    m = amax(x, dims, keepdim=True)
    shifted = prims.sub(x, expand(m, x._tt_shape))
    lse = prims.log(prims.sum(prims.exp(shifted), dims))
    lse = _restore_dims(lse, x._tt_shape, dims)
    return maybe_convert(prims.sub(shifted, expand(lse, x._tt_shape)), out_dtype)
