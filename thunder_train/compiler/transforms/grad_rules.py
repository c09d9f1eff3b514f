"""Gradient rules (vector-Jacobian products).

A rule is registered for a symbol with ``@register_vjp(symbol)``.  It is called
while the backward trace is being recorded, so it is written with prims and
clang calls and the backward becomes an ordinary trace::

    @register_vjp(prims.mul)
    def _(g, out, /, a, b):
        return {"a": mul(g, b), "b": mul(g, a)}

``g`` is the cotangent of the output (for a symbol with several outputs, a
tuple shaped like its output with ``None`` where no gradient arrives),
``out`` is the output, and the symbol's arguments follow by name (bound to its
signature, defaults applied).  The rule returns a dict from argument name to
gradient; arguments it leaves out (or maps to ``None``) get no gradient.  A
gradient has exactly the shape and dtype of its input; for a list argument
(``prims.cat``) it is a list.

Prims all have rules (or are listed in ``NON_DIFFERENTIABLE``).  Composite
torch-language symbols get a *direct* rule where differentiating their
decomposition would be slow, imprecise or wrong (``embedding``'s
``padding_idx`` only affects the gradient); ``supports=`` restricts a direct
rule to the arguments it handles.  Any other composite is differentiated
through its decomposition (see ``transforms/autograd.py``).
"""
from __future__ import annotations

import inspect
import math

import torch

from .. import clang, dtypes, prims
from ..proxies import TensorProxy
from ..symbols import Symbol
from ..torchlang import nn as tnn
from ..torchlang import reductions as treductions
from ..torchlang import shapes as tshapes

_rules: dict = {}  # Symbol -> (rule, supports)
_signatures: dict = {}

# Prims whose outputs carry no gradient (random values, factories, integer-valued results).
NON_DIFFERENTIABLE = {
    prims.stop_gradient, prims.full, prims.empty, prims.iota, prims.uniform, prims.randn, prims.bernoulli,
    prims.floor, prims.ceil, prims.round, prims.trunc, prims.sign, prims.argmax, prims.argmin, prims.shape,
    prims.floor_divide,
}


class NoGradientRuleError(NotImplementedError):
    """Backward through an operation that has no gradient rule."""


def register_vjp(*syms, supports=None):
    """Register the decorated function as the gradient rule of ``syms``."""

    def deco(fn):
        for s in syms:
            _rules[s] = (fn, supports)
        return fn

    return deco


def bind_arguments(bsym) -> dict:
    """The arguments of a bound symbol by parameter name, defaults applied."""
    sym = bsym.sym
    sig = _signatures.get(sym)
    if sig is None:
        sig = _signatures[sym] = inspect.signature(sym.fn)
    bound = sig.bind(*bsym.args, **bsym.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def get_rule(bsym):
    """The gradient rule that applies to ``bsym``, or None."""
    own = getattr(bsym.sym, "vjp_rule", None)  # a symbol made for one call (a custom autograd.Function)
    if own is not None:
        return own
    entry = _rules.get(bsym.sym)
    if entry is None:
        return None
    fn, supports = entry
    if supports is not None and not supports(**bind_arguments(bsym)):
        return None
    return fn


def has_rule(sym) -> bool:
    return sym in _rules


# ---------------------------------------------------------------------------
# Helpers (all record prims)
# ---------------------------------------------------------------------------
mul, add, sub, div, neg = prims.mul, prims.add, prims.sub, prims.div, prims.neg


def _t(x) -> bool:
    return type(x) is TensorProxy


def _float(x) -> bool:
    return _t(x) and x._tt_dtype.is_float


def zeros_like(a):
    return prims.full(a._tt_shape, 0.0, device=a._tt_device, dtype=a._tt_dtype)


def restore_reduced(g, shape, dims):
    """Broadcast a reduction's result (``dims`` removed) back to ``shape``."""
    shape = tuple(shape)
    return prims.broadcast_in_dim(g, shape, tuple(i for i in range(len(shape)) if i not in dims))


def sum_to(x, shape):
    """Sum ``x`` down to ``shape`` (the inverse of broadcasting ``shape`` to x's shape)."""
    shape = tuple(shape)
    if x._tt_shape == shape:
        return x
    lead = x.ndim_ - len(shape)
    dims = list(range(lead)) + [lead + i for i, s in enumerate(shape) if s == 1 and x._tt_shape[lead + i] != 1]
    if dims:
        x = prims.sum(x, tuple(dims))
    return clang.reshape(x, shape)


def _square(x):
    return mul(x, x)


# ---------------------------------------------------------------------------
# Elementwise prims
# ---------------------------------------------------------------------------
_UNARY = {
    "neg": lambda a, out, g: neg(g),
    "abs": lambda a, out, g: mul(g, prims.sign(a)),
    "exp": lambda a, out, g: mul(g, out),
    "exp2": lambda a, out, g: mul(g, mul(out, math.log(2.0))),
    "expm1": lambda a, out, g: mul(g, add(out, 1.0)),
    "log": lambda a, out, g: div(g, a),
    "log1p": lambda a, out, g: div(g, add(a, 1.0)),
    "log2": lambda a, out, g: div(g, mul(a, math.log(2.0))),
    "log10": lambda a, out, g: div(g, mul(a, math.log(10.0))),
    "sqrt": lambda a, out, g: div(mul(g, 0.5), out),
    "rsqrt": lambda a, out, g: mul(g, mul(mul(out, _square(out)), -0.5)),
    "sin": lambda a, out, g: mul(g, prims.cos(a)),
    "cos": lambda a, out, g: neg(mul(g, prims.sin(a))),
    "tan": lambda a, out, g: mul(g, add(_square(out), 1.0)),
    "asin": lambda a, out, g: mul(g, prims.rsqrt(sub(1.0, _square(a)))),
    "acos": lambda a, out, g: neg(mul(g, prims.rsqrt(sub(1.0, _square(a))))),
    "atan": lambda a, out, g: div(g, add(_square(a), 1.0)),
    "sinh": lambda a, out, g: mul(g, prims.cosh(a)),
    "cosh": lambda a, out, g: mul(g, prims.sinh(a)),
    "tanh": lambda a, out, g: mul(g, sub(1.0, _square(out))),
    "asinh": lambda a, out, g: mul(g, prims.rsqrt(add(_square(a), 1.0))),
    "acosh": lambda a, out, g: mul(g, prims.rsqrt(sub(_square(a), 1.0))),
    "atanh": lambda a, out, g: div(g, sub(1.0, _square(a))),
    "erf": lambda a, out, g: mul(g, mul(prims.exp(neg(_square(a))), 2.0 / math.sqrt(math.pi))),
    "erfc": lambda a, out, g: mul(g, mul(prims.exp(neg(_square(a))), -2.0 / math.sqrt(math.pi))),
    "erfinv": lambda a, out, g: mul(g, mul(prims.exp(_square(out)), math.sqrt(math.pi) / 2.0)),
    "reciprocal": lambda a, out, g: neg(mul(g, _square(out))),
    "lgamma": lambda a, out, g: mul(g, prims.digamma(a)),
    "digamma": lambda a, out, g: mul(g, prims.polygamma(1, a)),
    "sigmoid": lambda a, out, g: mul(g, mul(out, sub(1.0, out))),
}


def _register_unary(name, grad_fn):
    @register_vjp(getattr(prims, name))
    def rule(g, out, /, a):
        return {"a": grad_fn(a, out, g)}

    rule.__name__ = f"{name}_vjp"


for _name, _fn in _UNARY.items():
    _register_unary(_name, _fn)


@register_vjp(prims.add)
def add_vjp(g, out, /, a, b):
    return {"a": g, "b": g}


@register_vjp(prims.sub)
def sub_vjp(g, out, /, a, b):
    return {"a": g, "b": neg(g)}


@register_vjp(prims.mul)
def mul_vjp(g, out, /, a, b):
    return {"a": mul(g, b) if _t(a) else None, "b": mul(g, a) if _t(b) else None}


@register_vjp(prims.div)
def div_vjp(g, out, /, a, b):
    ga = div(g, b) if _t(a) else None
    gb = neg(div(mul(g, out), b)) if _t(b) else None
    return {"a": ga, "b": gb}


@register_vjp(prims.pow)
def pow_vjp(g, out, /, a, b):
    grads = {}
    if _t(a):
        # b * a^(b-1); exactly 0 where b == 0 (torch's convention)
        if _t(b):
            grads["a"] = prims.where(prims.eq(b, 0.0), 0.0, mul(g, mul(b, prims.pow(a, sub(b, 1.0)))))
        else:
            grads["a"] = zeros_like(a) if b == 0 else mul(g, mul(prims.pow(a, b - 1.0), b))
    if _t(b):
        # out * log(a); 0 where a == 0 and b >= 0 (torch's convention)
        if _t(a):
            gb = mul(g, mul(out, prims.log(a)))
            grads["b"] = prims.where(prims.bitwise_and(prims.eq(a, 0.0), prims.ge(b, 0.0)), 0.0, gb)
        else:
            grads["b"] = mul(g, mul(out, math.log(a))) if a > 0 else zeros_like(b) if a == 0 else mul(g, float("nan"))
    return grads


def _minmax_vjp(pick_a):
    """maximum/minimum: the chosen side gets the gradient; ties split it evenly (torch)."""

    def rule(g, out, /, a, b):
        if not _t(b) or not _t(a):
            # clamp_min / clamp_max semantics: the tensor gets g where it is the result (ties included)
            t, s = (a, b) if _t(a) else (b, a)
            keep = prims.ge(t, s) if pick_a == "max" else prims.le(t, s)
            return {("a" if _t(a) else "b"): prims.where(keep, g, 0.0)}
        wins_a = prims.gt(a, b) if pick_a == "max" else prims.lt(a, b)
        tie = prims.eq(a, b)
        half = mul(g, 0.5)
        ga = prims.where(tie, half, prims.where(wins_a, g, 0.0))
        gb = prims.where(tie, half, prims.where(wins_a, 0.0, g))
        return {"a": ga, "b": gb}

    return rule


register_vjp(prims.maximum)(_minmax_vjp("max"))
register_vjp(prims.minimum)(_minmax_vjp("min"))


@register_vjp(prims.atan2)
def atan2_vjp(g, out, /, a, b):
    denom = add(_square(a), _square(b)) if _t(a) and _t(b) else None
    if denom is None:
        raise NoGradientRuleError("atan2 with a Python number argument has no gradient rule yet")
    return {"a": div(mul(g, b), denom), "b": neg(div(mul(g, a), denom))}


@register_vjp(prims.hypot)
def hypot_vjp(g, out, /, a, b):
    return {"a": mul(g, div(a, out)) if _t(a) else None, "b": mul(g, div(b, out)) if _t(b) else None}


@register_vjp(prims.fmod)
def fmod_vjp(g, out, /, a, b):
    return {"a": g, "b": neg(mul(g, prims.trunc(div(a, b)))) if _t(b) else None}


@register_vjp(prims.remainder)
def remainder_vjp(g, out, /, a, b):
    return {"a": g, "b": neg(mul(g, prims.floor(div(a, b)))) if _t(b) else None}


@register_vjp(prims.copysign)
def copysign_vjp(g, out, /, a, b):
    """|a| with b's sign: the gradient is ``g`` times ``out / a`` (±1), and 0 where ``a == 0`` (torch); none for ``b``."""
    if not _t(a):
        return {"b": zeros_like(b)}
    ratio = prims.where(prims.eq(a, 0.0), 0.0, div(out, a))
    return {"a": mul(g, ratio), "b": zeros_like(b) if _t(b) else None}


@register_vjp(prims.nextafter)
def nextafter_vjp(g, out, /, a, b):
    """As eager: the result moves by one ulp, so ``a`` gets ``g`` unchanged and ``b`` gets zeros."""
    return {"a": g if _t(a) else None, "b": zeros_like(b) if _t(b) else None}


@register_vjp(prims.polygamma)
def polygamma_vjp(g, out, /, n, a):
    return {"a": mul(g, prims.polygamma(n + 1, a))}


@register_vjp(prims.where)
def where_vjp(g, out, /, pred, a, b):
    if not _t(pred):
        return {"a": g if pred else None, "b": None if pred else g}
    return {"a": prims.where(pred, g, 0.0) if _t(a) else None, "b": prims.where(pred, 0.0, g) if _t(b) else None}


@register_vjp(prims.convert_element_type)
def convert_element_type_vjp(g, out, /, a, dtype):
    return {"a": prims.convert_element_type(g, a._tt_dtype) if _float(a) else None}


@register_vjp(prims.clone)
def clone_vjp(g, out, /, a):
    return {"a": g}


# ---------------------------------------------------------------------------
# Reductions and scans
# ---------------------------------------------------------------------------
@register_vjp(prims.sum)
def sum_vjp(g, out, /, a, dims):
    return {"a": restore_reduced(g, a._tt_shape, dims)}


def _extremum_vjp(g, out, /, a, dims):
    # Every position equal to the result shares the gradient evenly (torch's amax/amin).
    hit = prims.eq(a, restore_reduced(out, a._tt_shape, dims))
    count = prims.sum(prims.convert_element_type(hit, a._tt_dtype), dims)
    share = restore_reduced(div(g, count), a._tt_shape, dims)
    return {"a": prims.where(hit, share, 0.0)}


register_vjp(prims.amax, prims.amin)(_extremum_vjp)


@register_vjp(prims.var)
def var_vjp(g, out, /, a, dims, correction):
    n = math.prod(a._tt_shape[d] for d in dims)
    mean = restore_reduced(div(prims.sum(a, dims), float(n)), a._tt_shape, dims)
    centred = sub(a, mean)
    gb = restore_reduced(g, a._tt_shape, dims)
    return {"a": div(mul(mul(gb, centred), 2.0), float(n - correction))}


@register_vjp(prims.prod)
def prod_vjp(g, out, /, a, dims):
    """The product of the other elements, zeros included (torch's ``prod_backward``).

    Without a zero in the reduced slice it is ``out / a``.  With exactly one zero,
    only that position gets a gradient: the product of the others.  With two or
    more, every gradient is 0.
    """
    if not dims:
        return {"a": g}
    shape = a._tt_shape
    is_zero = prims.eq(a, 0.0)
    safe = prims.where(is_zero, 1.0, a)
    gb = restore_reduced(g, shape, dims)
    no_zero = mul(gb, div(restore_reduced(out, shape, dims), safe))
    zeros_in_slice = restore_reduced(prims.sum(prims.convert_element_type(is_zero, dtypes.int64), dims), shape, dims)
    one_zero = prims.where(is_zero, mul(gb, restore_reduced(prims.prod(safe, dims), shape, dims)), 0.0)
    grad = prims.where(prims.eq(zeros_in_slice, 0), no_zero, prims.where(prims.eq(zeros_in_slice, 1), one_zero, 0.0))
    return {"a": grad}


@register_vjp(prims.cumsum)
def cumsum_vjp(g, out, /, a, dim):
    return {"a": prims.flip(prims.cumsum(prims.flip(g, (dim,)), dim), (dim,))}


def _values_indices_vjp(g, out, a, dim):
    gv = g[0]
    return {"a": prims.scatter_add(zeros_like(a), out[1], gv, dim)}


@register_vjp(prims.topk)
def topk_vjp(g, out, /, a, k, dim, largest, sorted):
    return _values_indices_vjp(g, out, a, dim)


@register_vjp(prims.sort)
def sort_vjp(g, out, /, a, dim, descending, stable):
    return _values_indices_vjp(g, out, a, dim)


# ---------------------------------------------------------------------------
# Shapes and indexing
# ---------------------------------------------------------------------------
@register_vjp(prims.broadcast_in_dim)
def broadcast_in_dim_vjp(g, out, /, a, shape, broadcast_dimensions):
    bdims = tuple(broadcast_dimensions)
    reduce = [d for d in range(len(shape)) if d not in bdims]
    reduce += [d for i, d in enumerate(bdims) if a._tt_shape[i] == 1 and shape[d] != 1]
    if reduce:
        g = prims.sum(g, tuple(sorted(reduce)))
    return {"a": clang.reshape(g, a._tt_shape)}


@register_vjp(prims.reshape, prims.squeeze)
def reshape_vjp(g, out, /, a, *_, **__):
    return {"a": clang.reshape(g, a._tt_shape)}


@register_vjp(prims.transpose)
def transpose_vjp(g, out, /, a, permutation):
    inverse = [0] * len(permutation)
    for i, p in enumerate(permutation):
        inverse[p] = i
    return {"a": prims.transpose(g, tuple(inverse))}


@register_vjp(prims.slice)
def slice_vjp(g, out, /, a, start_indices, end_indices, strides):
    strides = strides if strides is not None else (1,) * a.ndim_
    if 0 in g._tt_shape:
        return {"a": zeros_like(a)}
    config = []
    for size, lo, n, st in zip(a._tt_shape, start_indices, g._tt_shape, strides):
        last = lo + st * (n - 1)
        config.append((lo, size - last - 1, st - 1))
    return {"a": prims.pad(g, 0.0, tuple(config))}


@register_vjp(prims.pad)
def pad_vjp(g, out, /, a, padding_value, padding_config):
    # Undo the outer padding (a negative pad crops), then step over the interior padding.
    cropped = prims.pad(g, 0.0, tuple((-lo, -hi, 0) for lo, hi, _ in padding_config))
    if all(it == 0 for _, _, it in padding_config):
        return {"a": cropped}
    return {"a": prims.slice(cropped, (0,) * a.ndim_, cropped._tt_shape, tuple(it + 1 for _, _, it in padding_config))}


@register_vjp(prims.cat)
def cat_vjp(g, out, /, tensors, dim):
    grads, offset = [], 0
    for t in tensors:
        n = t._tt_shape[dim]
        grads.append(clang.slice_in_dim(g, offset, offset + n, 1, dim))
        offset += n
    return {"tensors": grads}


@register_vjp(prims.flip)
def flip_vjp(g, out, /, a, dims):
    return {"a": prims.flip(g, dims)}


@register_vjp(prims.take)
def take_vjp(g, out, /, a, index, dim):
    if index.ndim_ == 0:
        g = clang.unsqueeze(g, dim)
        index = clang.reshape(index, (1,))
    full_index = prims.broadcast_in_dim(index, g._tt_shape, (dim,))
    return {"a": prims.scatter_add(zeros_like(a), full_index, g, dim)}


@register_vjp(prims.gather)
def gather_vjp(g, out, /, a, index, dim):
    return {"a": prims.scatter_add(zeros_like(a), index, g, dim)}


@register_vjp(prims.scatter_add)
def scatter_add_vjp(g, out, /, a, index, src, dim):
    return {"a": g, "src": prims.gather(g, index, dim)}


def _index(x, indices):
    """``x[indices]`` for a tuple of integer index tensors over x's leading dims (advanced indexing)."""
    k = len(indices)
    lead, rest = x._tt_shape[:k], x._tt_shape[k:]
    idx_shape = ()
    for i in indices:
        if not _t(i) or not i._tt_dtype.is_int:
            raise NoGradientRuleError("index_put: the gradient of values supports integer index tensors only")
        idx_shape = clang.broadcast_shapes(idx_shape, i._tt_shape)
    flat, stride = None, 1
    for i, size in reversed(list(zip(indices, lead))):
        i = clang.expand(clang.maybe_convert(i, dtypes.int64), idx_shape)
        i = clang.where(clang.lt(i, 0), clang.add(i, size), i)  # negative indices count from the end
        term = clang.mul(i, stride) if stride != 1 else i
        flat = term if flat is None else clang.add(flat, term)
        stride *= size
    rows = clang.reshape(x, (math.prod(lead),) + tuple(rest))
    taken = prims.take(rows, clang.reshape(flat, (-1,)), 0)
    return clang.reshape(taken, tuple(idx_shape) + tuple(rest))


@register_vjp(prims.index_put)
def index_put_vjp(g, out, /, a, indices, values, accumulate):
    """``a``: ``g``, minus the overwritten positions unless accumulating; ``values``: ``g[indices]`` (as eager)."""
    grads = {}
    if _t(a):
        if accumulate:
            grads["a"] = g
        else:
            written = _index(g, indices)
            grads["a"] = prims.index_put(g, tuple(indices), zeros_like(written), False)
    if _t(values):
        grads["values"] = sum_to(_index(g, indices), values._tt_shape)
    return grads


# ---------------------------------------------------------------------------
# Linear algebra and convolution
# ---------------------------------------------------------------------------
@register_vjp(prims.matmul)
def matmul_vjp(g, out, /, a, b):
    if a.ndim_ == 1 and b.ndim_ == 1:
        gs = prims.broadcast_in_dim(g, a._tt_shape, ())
        return {"a": mul(gs, b), "b": mul(gs, a)}
    # View vectors as matrices, so both products below are plain (batched) matmuls.
    A = clang.unsqueeze(a, 0) if a.ndim_ == 1 else a
    B = clang.unsqueeze(b, -1) if b.ndim_ == 1 else b
    G = clang.unsqueeze(g, -2) if a.ndim_ == 1 else g
    G = clang.unsqueeze(G, -1) if b.ndim_ == 1 else G
    ga = sum_to(prims.matmul(G, clang.transpose(B, -1, -2)), A._tt_shape)
    if B.ndim_ == 2 and A.ndim_ > 2:
        # Fold the batch into the rows: one (K, M·batch) @ (M·batch, N) product.
        k, n = B._tt_shape
        gb = prims.matmul(clang.transpose(clang.reshape(A, (-1, k)), 0, 1), clang.reshape(G, (-1, n)))
    else:
        gb = sum_to(prims.matmul(clang.transpose(A, -1, -2), G), B._tt_shape)
    return {"a": clang.reshape(ga, a._tt_shape), "b": clang.reshape(gb, b._tt_shape)}


class GradOp(Symbol):
    """An operation only backward traces use, run by torch (e.g. convolution's backward).

    Printed as ``grad_rules.<name>``; the torch executor runs ``torch_impl``.
    """

    def __init__(self, name, meta, torch_impl):
        super().__init__(name, meta, module="opaque", is_prim=True)
        self.torch_impl = torch_impl
        self.id = f"grad_rules.{name}"

    @property
    def print_name(self) -> str:
        return self.id

    def codegen_globals(self) -> dict:
        import sys

        return {"grad_rules": sys.modules[__name__]}


def _convolution_backward_meta(g, a, weight, stride, padding, dilation, groups):
    return (
        TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device),
        TensorProxy(shape=weight._tt_shape, dtype=weight._tt_dtype, device=weight._tt_device),
    )


def _convolution_backward_torch(g, a, weight, stride, padding, dilation, groups):
    gi, gw, _ = torch.ops.aten.convolution_backward(
        g, a, weight, None, list(stride), list(padding), list(dilation), False, [0] * len(stride), groups, [True, True, False]
    )
    return gi, gw


convolution_backward = GradOp("convolution_backward", _convolution_backward_meta, _convolution_backward_torch)


@register_vjp(prims.convolution)
def convolution_vjp(g, out, /, a, weight, bias, stride, padding, dilation, groups):
    ga, gw = convolution_backward(g, a, weight, tuple(stride), tuple(padding), tuple(dilation), groups)
    grads = {"a": ga, "weight": gw}
    if _t(bias):
        grads["bias"] = prims.sum(g, tuple(d for d in range(g.ndim_) if d != 1))
    return grads


# ---------------------------------------------------------------------------
# Direct rules for torch-language composites
# ---------------------------------------------------------------------------
def _up(x):
    return clang.maybe_convert(x, clang.compute_dtype(x._tt_dtype))


def _back(grad, like):
    return clang.maybe_convert(grad, like._tt_dtype) if grad is not None else None


# ---------------------------------------------------------------------------
# split-like composites: one cat of the pieces' gradients (not a padded sum per piece)
# ---------------------------------------------------------------------------
def _cat_piece_grads(g, out, dim):
    pieces = [gi if gi is not None else prims.full(o._tt_shape, 0, device=o._tt_device, dtype=o._tt_dtype) for gi, o in zip(g, out)]
    return pieces[0] if len(pieces) == 1 else prims.cat(tuple(pieces), dim)


@register_vjp(tshapes.split)
def split_vjp(g, out, /, tensor, split_size_or_sections, dim=0):
    return {"tensor": _cat_piece_grads(g, out, clang.canonicalize_dim(tensor.ndim_, dim))}


@register_vjp(tshapes.tensor_split)
def tensor_split_vjp(g, out, /, input, indices_or_sections, dim=0):
    return {"input": _cat_piece_grads(g, out, clang.canonicalize_dim(input.ndim_, dim))}


@register_vjp(tnn.linear, supports=lambda input, weight, bias=None: weight.ndim_ == 2 and input._tt_dtype is weight._tt_dtype)
def linear_vjp(g, out, /, input, weight, bias=None):
    n_out, n_in = weight._tt_shape
    g2 = clang.reshape(g, (-1, n_out))
    grads = {
        "input": clang.reshape(prims.matmul(g2, weight), input._tt_shape),
        "weight": prims.matmul(clang.transpose(g2, 0, 1), clang.reshape(input, (-1, n_in))),
    }
    if _t(bias):
        grads["bias"] = _back(prims.sum(g2, (0,)), bias)
    return grads


@register_vjp(tnn.relu)
def relu_vjp(g, out, /, input, inplace=False):
    return {"input": prims.where(prims.gt(out, 0.0), g, 0.0)}


@register_vjp(tnn.gelu)
def gelu_vjp(g, out, /, input, approximate="none"):
    x, gu = _up(input), _up(g)
    if approximate == "tanh":
        k = math.sqrt(2 / math.pi)
        inner = mul(add(x, mul(mul(_square(x), x), 0.044715)), k)
        t = prims.tanh(inner)
        dinner = mul(add(mul(_square(x), 3 * 0.044715), 1.0), k)
        d = add(mul(add(t, 1.0), 0.5), mul(mul(mul(x, 0.5), sub(1.0, _square(t))), dinner))
    else:
        cdf = mul(add(prims.erf(mul(x, 1 / math.sqrt(2))), 1.0), 0.5)
        pdf = mul(prims.exp(mul(_square(x), -0.5)), 1 / math.sqrt(2 * math.pi))
        d = add(cdf, mul(x, pdf))
    return {"input": _back(mul(gu, d), input)}


@register_vjp(tnn.silu)
def silu_vjp(g, out, /, input, inplace=False):
    x, gu = _up(input), _up(g)
    s = prims.sigmoid(x)
    return {"input": _back(mul(gu, mul(s, add(mul(x, sub(1.0, s)), 1.0))), input)}


def _softmax_dims_ok(input, dim=None, _stacklevel=3, dtype=None):
    return dim is not None and dtype is None and input._tt_dtype.is_float


@register_vjp(treductions.softmax, supports=_softmax_dims_ok)
def softmax_vjp(g, out, /, input, dim=None, _stacklevel=3, dtype=None):
    y, gu = _up(out), _up(g)
    d = clang.canonicalize_dim(input.ndim_, dim)
    inner = clang.sum(mul(gu, y), d, keepdim=True)
    return {"input": _back(mul(y, sub(gu, clang.expand(inner, y._tt_shape))), input)}


@register_vjp(treductions.log_softmax, supports=_softmax_dims_ok)
def log_softmax_vjp(g, out, /, input, dim=None, _stacklevel=3, dtype=None):
    y, gu = _up(out), _up(g)
    d = clang.canonicalize_dim(input.ndim_, dim)
    total = clang.expand(clang.sum(gu, d, keepdim=True), y._tt_shape)
    return {"input": _back(sub(gu, mul(prims.exp(y), total)), input)}


def _norm_dims(x, normalized_shape):
    nd = len(tuple(normalized_shape))
    return tuple(range(x.ndim_ - nd, x.ndim_))


def _mean_keep(x, dims):
    return clang.expand(clang.mean(x, dims, keepdim=True), x._tt_shape)


def _affine_grads(gy, xhat, weight, bias, dims):
    """Gradients of ``y = xhat * weight + bias`` for weight and bias (summed over the batch dims)."""
    batch = tuple(d for d in range(gy.ndim_) if d not in dims)
    grads = {}
    if _t(weight):
        grads["weight"] = _back(clang.reshape(clang.sum(mul(gy, xhat), batch), weight._tt_shape), weight)
    if _t(bias):
        grads["bias"] = _back(clang.reshape(clang.sum(gy, batch), bias._tt_shape), bias)
    return grads


@register_vjp(tnn.layer_norm)
def layer_norm_vjp(g, out, /, input, normalized_shape, weight=None, bias=None, eps=1e-5):
    # Mean and rstd are recomputed from the input (cheap reductions) instead of being saved.
    x, gy = _up(input), _up(g)
    dims = _norm_dims(x, normalized_shape)
    mean = _mean_keep(x, dims)
    centred = sub(x, mean)
    rstd = clang.expand(prims.rsqrt(add(clang.mean(_square(centred), dims, keepdim=True), eps)), x._tt_shape)
    xhat = mul(centred, rstd)
    gxhat = clang.mul(gy, weight) if _t(weight) else gy
    gx = mul(rstd, sub(sub(gxhat, _mean_keep(gxhat, dims)), mul(xhat, _mean_keep(mul(gxhat, xhat), dims))))
    return {"input": _back(gx, input), **_affine_grads(gy, xhat, weight, bias, dims)}


@register_vjp(tnn.rms_norm)
def rms_norm_vjp(g, out, /, input, normalized_shape, weight=None, eps=None):
    x, gy = _up(input), _up(g)
    dims = _norm_dims(x, normalized_shape)
    if eps is None:
        eps = torch.finfo(input._tt_dtype.torch).eps
    rrms = clang.expand(prims.rsqrt(add(clang.mean(_square(x), dims, keepdim=True), eps)), x._tt_shape)
    xhat = mul(x, rrms)
    gxhat = clang.mul(gy, weight) if _t(weight) else gy
    gx = mul(rrms, sub(gxhat, mul(xhat, _mean_keep(mul(gxhat, xhat), dims))))
    return {"input": _back(gx, input), **_affine_grads(gy, xhat, weight, None, dims)}


@register_vjp(tnn.embedding, supports=lambda input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False: not scale_grad_by_freq and not sparse)
def embedding_vjp(g, out, /, input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False):
    # Rows are accumulated with index_put; the padding row gets no gradient (torch semantics).
    idx = clang.reshape(input, (-1,))
    rows = clang.reshape(g, (-1, weight._tt_shape[1]))
    if padding_idx is not None:
        pad = padding_idx % weight._tt_shape[0]
        is_pad = prims.broadcast_in_dim(prims.eq(idx, pad), rows._tt_shape, (0,))
        rows = prims.where(is_pad, 0.0, rows)
    return {"weight": prims.index_put(zeros_like(weight), (idx,), rows, True)}


def _cross_entropy_supported(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean", label_smoothing=0.0):
    if size_average is not None or reduce is not None or reduction not in ("none", "sum", "mean"):
        return False
    if target._tt_dtype.is_float:
        return target._tt_shape == input._tt_shape
    # A weight that is an input requiring grad: the decomposition differentiates it everywhere (the torch
    # executor runs this rule's backward with eager's kernels, which refuse weight gradients for class indices).
    return not (_t(weight) and weight._tt_requires_grad)


@register_vjp(tnn.cross_entropy, supports=_cross_entropy_supported)
def cross_entropy_vjp(g, out, /, input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean", label_smoothing=0.0):
    """Gradients from ``softmax(x)`` recomputed from the logits (class indices or probabilities, label smoothing).

    With class indices, per sample ``i`` (``w_t`` its target's weight, 0 if ignored)::

        dloss_i/dx = (1 - ε) · w_t · (p - onehot(t)) + ε/C · (p · Σ_c w_c - w)   (second term 0 if ignored)

    scaled by the cotangent, and for ``mean`` divided by ``Σ_i w_t`` (eager's
    normaliser for both terms).  Probability targets: see ``_cross_entropy_probs_vjp``.
    """
    x, gu = _up(input), _up(g)
    c_dim = 0 if x.ndim_ == 1 else 1
    C = x._tt_shape[c_dim]
    eps = float(label_smoothing)
    classes_shape = tuple(C if i == c_dim else 1 for i in range(x.ndim_))
    wc = clang.reshape(clang.maybe_convert(weight, x._tt_dtype), classes_shape) if _t(weight) else None
    p = clang.softmax(x, c_dim)
    if target._tt_dtype.is_float:
        return _cross_entropy_probs_vjp(gu, x, p, target, weight, wc, c_dim, C, eps, reduction, input)
    batch_dims = tuple(d for d in range(x.ndim_) if d != c_dim)
    t = clang.unsqueeze(target, c_dim)
    classes = clang.reshape(prims.iota(C, start=0, step=1, device=x._tt_device, dtype=target._tt_dtype), classes_shape)
    onehot = clang.maybe_convert(clang.eq(classes, t), x._tt_dtype)
    valid = clang.ne(target, ignore_index)
    vf = clang.maybe_convert(valid, x._tt_dtype)
    w_t = vf
    if _t(weight):
        safe = clang.where(valid, target, 0)
        w_per = clang.reshape(prims.take(clang.maybe_convert(weight, x._tt_dtype), clang.reshape(safe, (-1,)), 0), target._tt_shape)
        w_t = clang.mul(vf, w_per)
    if reduction == "mean":
        total = clang.sum(w_t)
        s = clang.expand(clang.true_divide(gu, total), target._tt_shape)
    else:
        s = clang.expand(gu, target._tt_shape)  # "sum": one scalar for every sample
    gx = clang.mul(clang.sub(p, onehot), clang.unsqueeze(w_t, c_dim))
    if eps:
        w_sum = clang.sum(wc) if wc is not None else float(C)
        smooth = clang.sub(clang.mul(p, w_sum), wc if wc is not None else 1.0)
        gx = clang.add(clang.mul(gx, 1.0 - eps), clang.mul(clang.mul(smooth, clang.unsqueeze(vf, c_dim)), eps / C))
    grads = {"input": _back(clang.mul(gx, clang.unsqueeze(s, c_dim)), input)}
    if _t(weight):
        # d/dw_c: the -log p terms that w_c multiplies; "mean" also moves the normaliser Σ w_t.
        neg_logp = clang.neg(clang.log_softmax(x, c_dim))
        sv = clang.unsqueeze(clang.mul(s, vf), c_dim)
        per_class = clang.mul(clang.mul(onehot, neg_logp), 1.0 - eps)
        if eps:
            per_class = clang.add(per_class, clang.mul(neg_logp, eps / C))
        gw = clang.sum(clang.mul(per_class, sv), batch_dims) if batch_dims else clang.mul(per_class, sv)
        if reduction == "mean":
            count = clang.sum(clang.mul(onehot, clang.unsqueeze(vf, c_dim)), batch_dims) if batch_dims else clang.mul(onehot, vf)
            gw = clang.sub(gw, clang.mul(clang.mul(count, clang.true_divide(gu, total)), _up(out)))
        grads["weight"] = _back(clang.reshape(gw, weight._tt_shape), weight)
    return grads


def _cross_entropy_probs_vjp(gu, x, p, target, weight, wc, c_dim, C, eps, reduction, input):
    """Probability targets: ``loss_i = -Σ_c w_c t_ic log p_ic`` with ``t = t (1 - ε) + ε / C``."""
    t = clang.maybe_convert(target, x._tt_dtype)
    if eps:
        t = clang.add(clang.mul(t, 1.0 - eps), eps / C)
    wt = clang.mul(t, wc) if wc is not None else t
    sample_shape = tuple(n for i, n in enumerate(x._tt_shape) if i != c_dim)
    if reduction == "mean":
        gu = clang.true_divide(gu, float(math.prod(x._tt_shape) // C))
    s = clang.unsqueeze(clang.expand(gu, sample_shape), c_dim)
    gx = clang.mul(clang.sub(clang.mul(p, clang.sum(wt, c_dim, keepdim=True)), wt), s)
    grads = {"input": _back(gx, input)}
    if _float(target) or _t(weight):
        neg_logp_s = clang.mul(clang.neg(clang.log_softmax(x, c_dim)), s)
        if _float(target):
            gt = clang.mul(neg_logp_s, clang.mul(wc, 1.0 - eps) if wc is not None else 1.0 - eps)
            grads["target"] = _back(gt, target)
        if _t(weight):
            batch_dims = tuple(d for d in range(x.ndim_) if d != c_dim)
            gw = clang.mul(neg_logp_s, t)
            gw = clang.sum(gw, batch_dims) if batch_dims else gw
            grads["weight"] = _back(clang.reshape(gw, weight._tt_shape), weight)
    return grads


def _sdpa_supported(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """No dropout (its mask exists only inside the forward: the decomposition, which keeps it, is used then)."""
    if dropout_p != 0.0 or not query.ndim_ == key.ndim_ == value.ndim_:
        return False
    hq, hk, hv = (t._tt_shape[-3:-2] for t in (query, key, value))
    if hq == hk == hv:
        return True
    return bool(enable_gqa) and hk == hv and hq[0] % hk[0] == 0


@register_vjp(tnn.scaled_dot_product_attention, supports=_sdpa_supported)
def sdpa_vjp(g, out, /, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Attention probabilities are recomputed from q and k; nothing of size L×S is saved.

    Grouped-query attention (``enable_gqa``, fewer key/value heads): each kv
    head serves ``Hq / Hkv`` consecutive query heads, so it is repeated for the
    computation and its gradient is the sum over its group.
    """
    q, k, v, gu = _up(query), _up(key), _up(value), _up(g)
    rep = 1
    if q.ndim_ >= 3 and k._tt_shape[-3] != q._tt_shape[-3]:
        rep = q._tt_shape[-3] // k._tt_shape[-3]
        k, v = tnn._repeat_heads(k, rep), tnn._repeat_heads(v, rep)
    L, S = q._tt_shape[-2], k._tt_shape[-2]
    scale = 1.0 / math.sqrt(q._tt_shape[-1]) if scale is None else scale
    scores = mul(prims.matmul(q, clang.transpose(k, -2, -1)), scale)
    if is_causal:
        r = prims.broadcast_in_dim(prims.iota(L, start=0, step=1, device=q._tt_device, dtype=dtypes.int64), (L, S), (0,))
        c = prims.broadcast_in_dim(prims.iota(S, start=0, step=1, device=q._tt_device, dtype=dtypes.int64), (L, S), (1,))
        scores = clang.where(clang.expand(prims.ge(r, c), scores._tt_shape), scores, -math.inf)
    elif _t(attn_mask):
        if attn_mask._tt_dtype.is_bool:
            scores = clang.where(clang.expand(attn_mask, scores._tt_shape), scores, -math.inf)
        else:
            scores = clang.add(scores, clang.maybe_convert(attn_mask, scores._tt_dtype))
    p = clang.softmax(scores, -1)
    gv = prims.matmul(clang.transpose(p, -2, -1), gu)
    gp = prims.matmul(gu, clang.transpose(v, -2, -1))
    gs = mul(p, sub(gp, clang.expand(clang.sum(mul(gp, p), -1, keepdim=True), p._tt_shape)))
    gk = mul(prims.matmul(clang.transpose(gs, -2, -1), q), scale)
    if rep > 1:
        gk, gv = _sum_head_groups(gk, rep), _sum_head_groups(gv, rep)
    grads = {
        "query": _back(sum_to(mul(prims.matmul(gs, k), scale), query._tt_shape), query),
        "key": _back(sum_to(gk, key._tt_shape), key),
        "value": _back(sum_to(gv, value._tt_shape), value),
    }
    if _float(attn_mask) and not is_causal:
        grads["attn_mask"] = _back(sum_to(gs, attn_mask._tt_shape), attn_mask)
    return grads


def _sum_head_groups(x, rep):
    """(..., H·rep, S, E) -> (..., H, S, E): the sum over each group of ``rep`` consecutive heads."""
    shape = x._tt_shape
    grouped = clang.reshape(x, shape[:-3] + (shape[-3] // rep, rep) + shape[-2:])
    return prims.sum(grouped, (len(shape) - 2,))
