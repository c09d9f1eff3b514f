"""Reductions and scans: sum, mean, var, amax, argmax, softmax, cumsum, cumprod, nansum, trapezoid, ...

Sorting and top-k are in sorting.py."""
from __future__ import annotations

import math
import warnings

import torch

from .. import clang, dtypes, prims
from ..proxies import TensorProxy, is_int, is_number, number_type
from ..clang import Promotion
from .convert import to_dtype
from .autocast import FP32, FP32_UNLESS_DTYPE  # autocast policies: see autocast.py
from ..clang import downcast_like, upcast
from ..grad_rules import register_vjp
from ..prims import mul, sub
from ..prims.reductions import prod_vjp
from . import elementwise as ew
from .registry import composed, torchsymbol


def _dims(dim):
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return None
    return dim


@torchsymbol(torch.sum, methods=("sum",), tags=("fusible",), autocast={"cuda": FP32_UNLESS_DTYPE})
def sum(input, dim=None, keepdim=False, *, dtype=None):
    return clang.sum(input, _dims(dim), keepdim, dtype=to_dtype(dtype))


@torchsymbol(torch.mean, methods=("mean",), tags=("fusible", "layout_on_meta"))
def mean(input, dim=None, keepdim=False, *, dtype=None):
    return clang.mean(input, _dims(dim), keepdim, dtype=to_dtype(dtype))


@torchsymbol(torch.prod, methods=("prod",), autocast={"cpu": FP32, "cuda": FP32_UNLESS_DTYPE})
def prod(input, dim=None, keepdim=False, *, dtype=None):
    """Half and bfloat16 multiply in their own dtype, rounding at each step as eager's CPU kernel does (no float32
    accumulation), so its gradient rule (``out / a``, eager's ``prod_backward``) rounds per op as eager's too."""
    return clang.reduction(prims.prod, input, dim, keepdim, dtype=to_dtype(dtype), kind=Promotion.BOOL_TO_LONG, upcast=False)


def _over_all_elements(input, dim=None, keepdim=False, *, dtype=None):
    return dim is None and dtype is None and type(input) is TensorProxy and input._tt_dtype.is_float


@register_vjp(prod, supports=_over_all_elements)
def _prod_all_vjp(g, out, /, input, dim=None, keepdim=False, *, dtype=None):
    """Over all elements eager's ``prod_backward`` returns zeros when two or more entries are 0 (NaN-free even
    beside an infinity); otherwise prims.prod's rule (eager's exclusive products, as along a dim)."""
    x, every = input, tuple(range(input.ndim_))  # in the input's dtype, as the forward
    grad = prod_vjp(g, out, x, every)["a"]
    if every:
        zeros = prims.sum(prims.convert_element_type(prims.eq(x, 0.0), dtypes.int64), every)
        grad = prims.where(prims.broadcast_in_dim(prims.gt(zeros, 1), x._tt_shape, ()), 0.0, grad)
    return {"input": downcast_like(grad, input)}


def _amax_like(name, prim):
    def fn(input, dim=None, keepdim=False):
        return clang.reduction(prim, input, _dims(dim), keepdim, upcast=False)

    fn.__name__ = name
    return torchsymbol(getattr(torch, name), methods=(name,), name=name, tags=("fusible",))(fn)


amax = _amax_like("amax", prims.amax)
amin = _amax_like("amin", prims.amin)


def _max_min(name, prim, argprim):
    def fn(input, dim=None, keepdim=False):
        if dim is None:
            return clang.reduction(prim, input, None, False, upcast=False)
        if not is_int(dim):  # torch.max(a, b): elementwise
            return clang.elementwise_binary(prims.maximum if name == "max" else prims.minimum, input, dim, upcast=False)
        values = clang.reduction(prim, input, dim, keepdim, upcast=False)
        d = clang.canonicalize_dim(input.ndim_, dim)
        idx = argprim(input, d) if input.ndim_ else prims.full((), 0, device=input._tt_device, dtype=dtypes.int64)
        if keepdim and input.ndim_:
            idx = clang.unsqueeze(idx, d)
        return values, idx

    fn.__name__ = name
    return torchsymbol(getattr(torch, name), methods=(name,), name=name, returns=getattr(torch.return_types, name),
                       tags=("layout_on_meta",))(fn)


max = _max_min("max", prims.amax, prims.argmax)
min = _max_min("min", prims.amin, prims.argmin)


def _reducing(input, dim=None, keepdim=False):
    return dim is None or is_int(dim)  # torch.max(a, b) is elementwise: prims.maximum's rule


@register_vjp(max, min, supports=_reducing)
def _max_min_vjp(g, out, /, input, dim=None, keepdim=False):
    """As eager: over all elements the maxima share the gradient evenly, and a NaN result shares it among the
    NaNs (``evenly_distribute_backward``); along ``dim`` it goes to the position of the returned index only."""
    if dim is None:
        every = tuple(range(input.ndim_))
        value = prims.broadcast_in_dim(out, input._tt_shape, ())
        hit = prims.where(prims.isnan(value), prims.isnan(input), prims.eq(input, value))
        count = prims.sum(prims.convert_element_type(hit, input._tt_dtype), every)
        share = prims.broadcast_in_dim(prims.div(g, count), input._tt_shape, ())
        return {"input": prims.where(hit, share, 0.0)}
    gv, indices = g[0], out[1]
    if gv is None:
        return {}
    if input.ndim_ == 0:
        return {"input": gv}
    d = clang.canonicalize_dim(input.ndim_, dim)
    if not keepdim:
        gv, indices = clang.unsqueeze(gv, d), clang.unsqueeze(indices, d)
    zeros = prims.full(input._tt_shape, 0.0, device=input._tt_device, dtype=input._tt_dtype)
    return {"input": prims.scatter_add(zeros, indices, gv, d)}


def _arg(name, prim):
    def fn(input, dim=None, keepdim=False):
        if dim is None:
            out = prim(clang.flatten(input), 0)
            return clang.reshape(out, (1,) * input.ndim_) if keepdim else out
        d = clang.canonicalize_dim(input.ndim_, dim)
        if input.ndim_ == 0:
            return prims.full((), 0, device=input._tt_device, dtype=dtypes.int64)
        out = prim(input, d)
        return clang.unsqueeze(out, d) if keepdim else out

    fn.__name__ = name
    return torchsymbol(getattr(torch, name), methods=(name,), name=name)(fn)


argmax = _arg("argmax", prims.argmax)
argmin = _arg("argmin", prims.argmin)


def _correction(unbiased, correction):
    if correction is not None:
        return correction
    if unbiased is None:
        return 1
    return 1 if unbiased else 0


@torchsymbol(torch.var, methods=("var",))
def var(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    if number_type(dim) is bool:  # var(input, unbiased)
        dim, unbiased = None, dim
    return clang.var(input, _dims(dim), keepdim, correction=_correction(unbiased, correction))


@torchsymbol(torch.std, methods=("std",))
def std(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    if number_type(dim) is bool:
        dim, unbiased = None, dim
    v = clang.var(input, _dims(dim), keepdim, correction=_correction(unbiased, correction))
    return clang.sqrt(v)


def _std_vjp_parts(g, out, input, dim, unbiased, keepdim, correction):
    """As eager's ``std_backward``: ``g / std * (x - mean) / (N - correction)``, and 0 where the std is 0 (a
    constant slice; the square root's own rule would give 0 * inf = NaN there)."""
    if number_type(dim) is bool:
        dim, unbiased = None, dim
    c = _correction(unbiased, correction)
    x = upcast(input)
    dims = clang.canonicalize_dims(x.ndim_, _dims(dim))
    rest = tuple(d for d in range(x.ndim_) if d not in dims)

    def back(v):  # a reduced value broadcast back over the input
        v = upcast(v)
        if keepdim:
            v = clang.reshape(v, tuple(x._tt_shape[d] for d in rest))
        return prims.broadcast_in_dim(v, x._tt_shape, rest)

    n = 1
    for d in dims:
        n *= x._tt_shape[d]
    s = back(out)
    scale = prims.where(prims.eq(s, 0.0), 0.0, prims.div(back(g), s))
    centred = prims.sub(x, clang.expand(clang.mean(x, dims, keepdim=True), x._tt_shape))
    per = 1.0 / (n - c) if n != c else math.inf
    return prims.mul(prims.mul(scale, centred), per)


def _real_std(input, *args, **kwargs):
    return type(input) is TensorProxy and input._tt_dtype.is_float  # complex: the decomposition's rules


@register_vjp(std, supports=_real_std)
def _std_vjp(g, out, /, input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    return {"input": downcast_like(_std_vjp_parts(g, out, input, dim, unbiased, keepdim, correction), input)}


@torchsymbol(torch.var_mean)
def var_mean(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    if number_type(dim) is bool:
        dim, unbiased = None, dim
    return clang.var_mean(input, _dims(dim), keepdim, correction=_correction(unbiased, correction))


@torchsymbol(torch.std_mean)
def std_mean(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    v, m = var_mean(input, dim, unbiased, keepdim, correction=correction)
    return clang.sqrt(v), m


@register_vjp(std_mean, supports=_real_std)
def _std_mean_vjp(g, out, /, input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    grad = None
    if g[0] is not None:
        grad = _std_vjp_parts(g[0], out[0], input, dim, unbiased, keepdim, correction)
    if g[1] is not None:
        d = None if number_type(dim) is bool else _dims(dim)
        x = upcast(input)
        dims = clang.canonicalize_dims(x.ndim_, d)
        n = 1
        for k in dims:
            n *= x._tt_shape[k]
        gm = upcast(g[1])
        if not keepdim:
            gm = prims.broadcast_in_dim(gm, tuple(1 if k in dims else x._tt_shape[k] for k in range(x.ndim_)),
                                        tuple(k for k in range(x.ndim_) if k not in dims))
        gm = prims.div(clang.expand(gm, x._tt_shape), float(n) if n else math.inf)
        grad = gm if grad is None else prims.add(grad, gm)
    return {"input": downcast_like(grad, input)}


@torchsymbol(torch.logsumexp, methods=("logsumexp",), tags=("fusible",), autocast={"cuda": FP32})
def logsumexp(input, dim, keepdim=False):
    d = clang.canonicalize_dims(input.ndim_, dim)
    x = clang.maybe_convert(input, clang.compute_dtype(input._tt_dtype if input._tt_dtype.is_float else dtypes.default_float()))
    m = clang.amax(x, d, keepdim=True)
    m = clang.where(prims.isinf(m), 0.0, m)
    s = clang.sum(prims.exp(prims.sub(x, clang.expand(m, x._tt_shape))), d, keepdim=True)
    out = prims.add(prims.log(s), m)
    if not keepdim:
        out = clang.squeeze(out, d)
    return clang.maybe_convert(out, input._tt_dtype if input._tt_dtype.is_float else dtypes.default_float())


@register_vjp(logsumexp, supports=lambda input, dim, keepdim=False: input._tt_dtype.is_float)
def _logsumexp_vjp(g, out, /, input, dim, keepdim=False):
    """eager's logsumexp_backward: g * exp(x - result), op by op in the input's dtype (the decomposition's
    gradient, through its max-shifted sum, is an ulp off in 82 % of float32 elements)."""
    if not keepdim:
        for k in sorted(clang.canonicalize_dims(input.ndim_, dim)):
            g, out = clang.unsqueeze(g, k), clang.unsqueeze(out, k)
    shape = input._tt_shape
    return {"input": clang.mul(clang.expand(g, shape), clang.exp(clang.sub(input, clang.expand(out, shape))))}


def _softmax_dim(name, input, dim):
    """``dim``, or eager's deprecated implicit choice (``F._get_softmax_dim``) with its warning."""
    if dim is not None:
        return dim
    warnings.warn(f"Implicit dimension choice for {name} has been deprecated. Change the call to include dim=X as an argument.", stacklevel=3)
    return 0 if input.ndim_ in (0, 1, 3) else 1


@torchsymbol(torch.softmax, torch.nn.functional.softmax, torch.special.softmax, methods=("softmax",), torch_impl=torch.softmax,
             tags=("fusible", "fused_backward",),
             autocast={"cuda": FP32_UNLESS_DTYPE})
def softmax(input, dim=None, _stacklevel=3, dtype=None):
    """softmax along ``dim`` (computed in float32 for low-precision inputs)."""
    return clang.softmax(input, _softmax_dim("softmax", input, dim), to_dtype(dtype))


@torchsymbol(torch.log_softmax, torch.nn.functional.log_softmax, torch.special.log_softmax, methods=("log_softmax",), torch_impl=torch.log_softmax,
             tags=("fusible", "fused_backward",),
             autocast={"cuda": FP32_UNLESS_DTYPE})
def log_softmax(input, dim=None, _stacklevel=3, dtype=None):
    return clang.log_softmax(input, _softmax_dim("log_softmax", input, dim), to_dtype(dtype))


# Direct rules: the softmax output is all the gradient needs.
def _softmax_dims_ok(input, dim=None, _stacklevel=3, dtype=None):
    # dtype=: the same rule in the output's dtype, converted back to the input's (eager's softmax, then .to's)
    return dim is not None and input._tt_dtype.is_float and (dtype is None or to_dtype(dtype).is_float)


@register_vjp(softmax, supports=_softmax_dims_ok)
def _softmax_vjp(g, out, /, input, dim=None, _stacklevel=3, dtype=None):
    y, gu = upcast(out), upcast(g)
    d = clang.canonicalize_dim(input.ndim_, dim)
    inner = clang.sum(mul(gu, y), d, keepdim=True)
    return {"input": downcast_like(mul(y, sub(gu, clang.expand(inner, y._tt_shape))), input)}


@register_vjp(log_softmax, supports=_softmax_dims_ok)
def _log_softmax_vjp(g, out, /, input, dim=None, _stacklevel=3, dtype=None):
    y, gu = upcast(out), upcast(g)
    d = clang.canonicalize_dim(input.ndim_, dim)
    total = clang.expand(clang.sum(gu, d, keepdim=True), y._tt_shape)
    return {"input": downcast_like(sub(gu, mul(prims.exp(y), total)), input)}


@torchsymbol(torch.cumsum, methods=("cumsum",), autocast={"cuda": FP32_UNLESS_DTYPE})
def cumsum(input, dim, *, dtype=None):
    dt = to_dtype(dtype)
    x = input
    if dt is not None:
        x = clang.maybe_convert(x, dt)
    elif x._tt_dtype.category < dtypes.FLOAT:
        x = clang.maybe_convert(x, dtypes.int64)
    return prims.cumsum(x, clang.canonicalize_dim(x.ndim_, dim))


@torchsymbol(torch.all, methods=("all",))
def all(input, dim=None, keepdim=False):
    b = clang.to_bool(input)
    out = clang.reduction(prims.amin, clang.maybe_convert(b, dtypes.uint8), _dims(dim), keepdim, upcast=False)
    return prims.ne(out, 0)


@torchsymbol(torch.any, methods=("any",))
def any(input, dim=None, keepdim=False):
    b = clang.to_bool(input)
    out = clang.reduction(prims.amax, clang.maybe_convert(b, dtypes.uint8), _dims(dim), keepdim, upcast=False)
    return prims.ne(out, 0)


@torchsymbol(torch.count_nonzero, methods=("count_nonzero",))
def count_nonzero(input, dim=None):
    return clang.sum(clang.maybe_convert(clang.ne(input, 0), dtypes.int64), _dims(dim))


@torchsymbol(torch.norm, methods=("norm",), autocast={"cuda": FP32_UNLESS_DTYPE})
def norm(input, p=2, dim=None, keepdim=False, dtype=None):
    """Vector norms (p = 2, 1, inf, or any number)."""
    if p == "fro":
        p = 2
    if isinstance(p, str):
        raise NotImplementedError(f"torch.norm(p={p!r}) has no decomposition (the dispatcher runs it through torch)")
    if p is None:
        p = 2
    x = input if dtype is None else clang.maybe_convert(input, to_dtype(dtype))
    ax = clang.elementwise_unary(prims.abs, x, Promotion.COMPLEX_TO_FLOAT, upcast=False)
    if p == math.inf:
        return clang.amax(ax, _dims(dim), keepdim)
    if p == -math.inf:
        return clang.amin(ax, _dims(dim), keepdim)
    if p == 0:  # the number of nonzero entries
        return clang.sum(clang.maybe_convert(clang.ne(ax, 0), ax._tt_dtype), _dims(dim), keepdim)
    if p == 1:
        return clang.sum(ax, _dims(dim), keepdim)
    if p == 2:
        return clang.sqrt(clang.sum(clang.mul(ax, ax), _dims(dim), keepdim))
    return clang.elementwise_binary(prims.pow, clang.sum(clang.elementwise_binary(prims.pow, ax, p), _dims(dim), keepdim), 1.0 / p)


def _real_norm(input, p=2, dim=None, keepdim=False, dtype=None):
    return (p in ("fro", None) or number_type(p) in (int, float)) and type(input) is TensorProxy and input._tt_dtype.is_float


# Half and bfloat16 norms: eager's formula op by op, each rounding (as elementwise.py's low-precision rules); the
# reduced values broadcast back over the input as eager unsqueezes the reduced dims.
_lp_mul, _lp_div = clang.mul, clang.true_divide


def _reduced_dims(x, dim):
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return tuple(range(x.ndim_))
    return tuple(clang.canonicalize_dims(x.ndim_, dim if isinstance(dim, (tuple, list)) else (dim,)))


def _kept(v, x, dims):
    """``v`` (reduced over ``dims``, with or without kept dims) shaped to broadcast against ``x``."""
    return clang.reshape(v, tuple(1 if d in dims else s for d, s in enumerate(x._tt_shape)))


def _vector_norm_low(input, p=2, dim=None, keepdim=False, dtype=None):
    p = 2 if p in ("fro", None) else p
    return (dtype is None and isinstance(p, (int, float)) and not isinstance(p, bool) and p != 0 and p != 1
            and not math.isinf(p) and (type(input) is TensorProxy and input._tt_dtype.is_low_precision))


def _norm_low_precision_vjp(g, out, /, input, p=2, dim=None, keepdim=False, dtype=None):
    """eager's ``norm_backward`` (p = 0, 1 and inf round nowhere and keep their float32 rule): p = 2,
    ``g * (x / norm)``; p < 1, ``sgn(x) * |x| ** (p - 1) * g * norm ** (1 - p)``; otherwise ``x_scaled * (g / norm **
    (p - 1))`` with ``x_scaled`` ``x * |x| ** (p - 2)`` (p > 2) or ``sgn(x) * |x| ** (p - 1)``; 0 at a zero norm
    (and at zero entries for p < 1)."""
    p = 2 if p in ("fro", None) else p
    x, dims = input, _reduced_dims(input, dim)
    gk, n = _kept(g, x, dims), _kept(out, x, dims)
    if p == 2:
        return {"input": _lp_mul(gk, clang.where(clang.eq(n, 0.0), 0.0, _lp_div(x, n)))}
    ax = ew.abs(x)
    if p < 1:
        scaled = _lp_mul(ew.sign(x), clang.where(clang.eq(x, 0.0), 0.0, ew.pow(ax, p - 1)))
        return {"input": _lp_mul(_lp_mul(scaled, gk), ew.pow(n, 1 - p))}
    scaled = _lp_mul(x, ew.pow(ax, p - 2)) if p > 2 else _lp_mul(ew.sign(x), ew.pow(ax, p - 1))
    return {"input": _lp_mul(scaled, clang.where(clang.eq(n, 0.0), 0.0, _lp_div(gk, ew.pow(n, p - 1))))}


@register_vjp(norm, supports=_real_norm)
def _norm_vjp(g, out, /, input, p=2, dim=None, keepdim=False, dtype=None):
    """As eager's ``linalg_vector_norm_backward``: 0 at a zero norm (p = 2, p > 1), ``sgn(x)`` shares of the
    gradient among the maxima for p = inf (a NaN is a maximum, and ``sgn(nan)`` is 0), 0 at zero entries for p < 1."""
    if _vector_norm_low(input, p, dim, keepdim, dtype):
        return _norm_low_precision_vjp(g, out, input, p, dim, keepdim, dtype)
    p = 2 if p in ("fro", None) else p  # Tensor.norm() passes p='fro': the 2-norm
    x = upcast(input if dtype is None else clang.maybe_convert(input, to_dtype(dtype)))
    dims = tuple(range(x.ndim_)) if _dims(dim) is None else clang.canonicalize_dims(x.ndim_, dim if isinstance(dim, (tuple, list)) else (dim,))
    rest = tuple(d for d in range(x.ndim_) if d not in dims)

    def back(v):  # a reduced value broadcast back over the input
        v = upcast(v)
        if keepdim:
            v = clang.reshape(v, tuple(x._tt_shape[d] for d in rest))
        return prims.broadcast_in_dim(v, x._tt_shape, rest)

    if p == 0:
        return {"input": clang.maybe_convert(prims.full(input._tt_shape, 0.0, device=input._tt_device, dtype=x._tt_dtype), input._tt_dtype)}
    n, gb, sign = back(out), back(g), prims.sign(x)
    if p == 1:
        grad = prims.mul(sign, gb)
    elif p == 2:
        grad = prims.mul(gb, prims.where(prims.eq(n, 0.0), 0.0, prims.div(x, n)))
    elif math.isinf(p):
        ax = prims.abs(x)
        hit = prims.convert_element_type(prims.bitwise_or(prims.eq(ax, n), prims.isnan(ax)), x._tt_dtype)
        count = prims.broadcast_in_dim(prims.sum(hit, dims), x._tt_shape, rest)
        grad = prims.mul(sign, prims.mul(prims.div(gb, count), hit))
    elif p < 1:
        scaled = prims.where(prims.eq(x, 0.0), 0.0, prims.mul(sign, prims.pow(prims.abs(x), p - 1.0)))
        grad = prims.mul(prims.mul(scaled, gb), prims.pow(n, 1.0 - p))
    else:
        scale = prims.where(prims.eq(n, 0.0), 0.0, prims.div(gb, prims.pow(n, p - 1.0)))
        grad = prims.mul(prims.mul(sign, prims.pow(prims.abs(x), p - 1.0)), scale)
    return {"input": downcast_like(grad, input)}


@torchsymbol(torch.aminmax, methods=("aminmax",), returns=torch.return_types.aminmax)
def aminmax(input, *, dim=None, keepdim=False):
    """(amin, amax) over ``dim`` (all dims when None)."""
    return clang.amin(input, _dims(dim), keepdim), clang.amax(input, _dims(dim), keepdim)


@torchsymbol(torch.linalg.vector_norm, autocast={"cuda": FP32_UNLESS_DTYPE})
def vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None, out=None):
    """``torch.linalg.vector_norm``: ``norm`` with eager's ``ord`` keyword."""
    return norm(x, ord, dim, keepdim, dtype)


# ---------------------------------------------------------------------------
# Written as torch calls the torch language knows (registry.composed: traced as the user's own calls)
# ---------------------------------------------------------------------------
def nansum(input, dim=None, keepdim=False, *, dtype=None):
    if input.dtype.is_complex:
        raise NotImplementedError("nansum of a complex tensor is run by torch")
    x = torch.where(torch.isnan(input), torch.zeros_like(input), input) if input.dtype.is_floating_point else input
    return torch.sum(x, dim, keepdim, dtype=dtype) if dim is not None else torch.sum(x, dtype=dtype)


composed("nansum", nansum, (torch.nansum,), ("nansum",))


def nanmean(input, dim=None, keepdim=False, *, dtype=None):
    if not input.dtype.is_floating_point:
        raise NotImplementedError("nanmean of a non-float tensor is run by torch")
    keep = ~torch.isnan(input)
    n = torch.sum(keep, dim, keepdim) if dim is not None else torch.sum(keep)
    return nansum(input, dim, keepdim, dtype=dtype) / n


composed("nanmean", nanmean, (torch.nanmean,), ("nanmean",))


def contains(input, element):
    """``element in t`` (transformers' Reformer: ``if pad_token_id in input_ids[:, [-1, 0]]``): eager's
    ``(element == t).any()`` as a Python bool, a decision on the input's values that the program checks."""
    if not isinstance(element, (torch.Tensor, bool, int, float, complex)):
        raise RuntimeError(f"Tensor.__contains__ only supports Tensor or scalar, but you passed in a {type(element)}.")
    return bool((element == input).any())


composed("contains", contains, (), ("__contains__",))


def renorm(input, p, dim, maxnorm):
    d = dim % input.ndim
    others = [i for i in range(input.ndim) if i != d]
    norm = torch.linalg.vector_norm(input, p, others, keepdim=True)
    factor = torch.where(norm > maxnorm, maxnorm / (norm + 1e-7), torch.ones_like(norm))
    return (input * factor).contiguous()  # eager's kernel writes a new row-major tensor whatever the input's layout


composed("renorm", renorm, (torch.renorm,), ("renorm",))


def _trapz_parts(y, x, dx, dim):
    n = y.shape[dim]
    left, right = y.narrow(dim, 0, n - 1), y.narrow(dim, 1, n - 1)
    if x is None:
        return (left + right) * (dx / 2)
    if x.ndim == 1:
        shape = [1] * y.ndim
        shape[dim] = n - 1
        d = (x[1:] - x[:-1]).reshape(shape)
    else:
        d = x.narrow(dim, 1, n - 1) - x.narrow(dim, 0, n - 1)
    return (left + right) * d / 2


def trapezoid(y, x=None, *, dx=None, dim=-1):
    if is_number(x):
        x, dx = None, x
    dx = 1 if dx is None else dx
    if y.shape[dim] == 0:
        return y.sum(dim)
    return _trapz_parts(y, x, dx, dim).sum(dim)


composed("trapezoid", trapezoid, (torch.trapezoid,))


def trapz(y, x=None, *, dx=None, dim=-1):
    return trapezoid(y, x, dx=dx, dim=dim)


composed("trapz", trapz, (torch.trapz,))


def cumulative_trapezoid(y, x=None, *, dx=None, dim=-1):
    if is_number(x):
        x, dx = None, x
    dx = 1 if dx is None else dx
    if y.shape[dim] == 0:
        return y.clone()
    return torch.cumsum(_trapz_parts(y, x, dx, dim), dim)


composed("cumulative_trapezoid", cumulative_trapezoid, (torch.cumulative_trapezoid,))


# cumprod: a symbol the torch executor runs whole (eager multiplies in sequence, where the log-depth scan rounds
# in another order: an ulp off in 62 % of float32 elements), its gradient eager's cumprod_backward kernel.  The
# decompositions (the scan and its adjoint, exact at zeros) are not fused: neither symbol is "fusible".
def _shifted(x, dim, s, fill):
    """x moved s places along dim, the first s elements ``fill``."""
    n = x._tt_shape[dim]
    head = clang.full_like(clang.slice_in_dim(x, 0, s, 1, dim), fill)
    return clang.cat([head, clang.slice_in_dim(x, 0, n - s, 1, dim)], dim)


def _scan_stages(x, dim):
    """The log-depth (Hillis-Steele) product scan: the inputs of each stage and its shift."""
    stages, s = [], 1
    while s < x._tt_shape[dim]:
        stages.append((x, s))
        x = clang.mul(x, _shifted(x, dim, s, 1))
        s *= 2
    return stages, x


@torchsymbol(torch.cumprod, methods=("cumprod",))
def cumprod(input, dim, *, dtype=None):
    d = to_dtype(dtype) if dtype is not None else (input._tt_dtype if input._tt_dtype.is_float else dtypes.int64)
    if d.is_float and d is not input._tt_dtype:  # eager converts, then runs its kernel: so does the inner symbol
        return cumprod(clang.maybe_convert(input, d), dim)
    x = clang.maybe_convert(input, d)
    if x.ndim_ == 0:
        return clang.mul(x, 1)
    return _scan_stages(x, clang.canonicalize_dim(x.ndim_, dim))[1]


@torchsymbol(torch.ops.aten.cumprod_backward.default, name="cumprod_backward")
def cumprod_backward(grad, input, dim, output):
    """The adjoint of the scan: each stage y = x * shifted(x) gives x the gradient g * shifted(x) plus g * x moved
    back (exact where inputs are 0, as eager's kernel)."""
    g = clang.maybe_convert(grad, input._tt_dtype)
    if input.ndim_ == 0:
        return clang.mul(g, 1)
    dim = clang.canonicalize_dim(input.ndim_, dim)
    n = input._tt_shape[dim]
    for x, s in reversed(_scan_stages(input, dim)[0]):
        gx = clang.mul(g, x)
        back = clang.cat([clang.slice_in_dim(gx, s, n, 1, dim), clang.full_like(clang.slice_in_dim(gx, 0, s, 1, dim), 0)], dim)
        g = clang.add(clang.mul(g, _shifted(x, dim, s, 1)), back)
    return clang.mul(g, 1) if n <= 1 else g


def _cumprod_in_input_dtype(input, dim, *, dtype=None):
    return input._tt_dtype.is_float and (dtype is None or to_dtype(dtype) is input._tt_dtype)


@register_vjp(cumprod, supports=_cumprod_in_input_dtype)
def _cumprod_vjp(g, out, /, input, dim, *, dtype=None):
    return {"input": cumprod_backward(g, input, dim, out)}


@torchsymbol(torch.logcumsumexp, methods=("logcumsumexp",))
def logcumsumexp(input, dim):
    if not input._tt_dtype.is_float:
        raise NotImplementedError("logcumsumexp of a non-float tensor is run by torch")
    if input.ndim_ == 0:
        clang.canonicalize_dim(0, dim)
        return prims.clone(input)
    x = upcast(input)
    return downcast_like(_logcumsumexp_scan(x, clang.canonicalize_dim(x.ndim_, dim)), input)


def _logcumsumexp_scan(x, d):
    """Log-depth (Hillis-Steele) scan of a logaddexp that is exact at equal infinities (-inf, -inf: -inf)."""
    n, s = x._tt_shape[d], 1
    while s < n:
        head_shape = tuple(s if i == d else k for i, k in enumerate(x._tt_shape))
        head = prims.full(head_shape, -math.inf, device=x._tt_device, dtype=x._tt_dtype)
        b = clang.cat([head, clang.slice_in_dim(x, 0, n - s, dim=d)], d)
        same_inf = prims.bitwise_and(prims.eq(x, b), prims.isinf(x))
        gap = prims.where(same_inf, 0.0, prims.neg(prims.abs(prims.sub(x, b))))
        x = prims.add(prims.maximum(x, b), prims.log1p(prims.exp(gap)))
        s *= 2
    return x


@register_vjp(logcumsumexp)
def _logcumsumexp_vjp(g, out, /, input, dim):
    """Eager's ``logcumsumexp_backward``: reverse scans of ``log|g| - out`` for the positive and the negative
    parts of ``g``, shifted by the input and exponentiated (NaN where the output is -inf, as eager's)."""
    if input.ndim_ == 0:
        return {"input": g}
    x, y, gu = upcast(input), upcast(out), upcast(g)
    d = clang.canonicalize_dim(x.ndim_, dim)
    lowest = torch.finfo(x._tt_dtype.torch).min
    log_abs = prims.log(prims.abs(gu))
    # eager's CPU scan accumulates in double (acc_type) and rounds its result: so does this one, or the
    # positive and negative parts' cancellation shows the scan's float32 rounding
    acc = dtypes.float64 if input._tt_device.type == "cpu" else x._tt_dtype

    def part(mask):
        lg = clang.maybe_convert(prims.flip(prims.sub(prims.where(mask, log_abs, lowest), y), (d,)), acc)
        rev = prims.flip(clang.maybe_convert(_logcumsumexp_scan(lg, d), x._tt_dtype), (d,))
        return prims.exp(prims.add(rev, x))

    grad = prims.sub(part(prims.gt(gu, 0.0)), part(prims.lt(gu, 0.0)))
    return {"input": downcast_like(grad, input)}


def _softmax_backward_data(grad_output, output, dim, input_dtype):
    g = grad_output * output
    return (g - output * g.sum(dim, keepdim=True)).to(input_dtype)


composed("_softmax_backward_data", _softmax_backward_data, (torch.ops.aten._softmax_backward_data.default,
                                                        torch.ops.aten._softmax_backward_data))
