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
from ..errors import NoGradientRuleError  # noqa: F401  (defined with the other user-facing errors)
from ..proxies import TensorProxy
from ..symbols import Symbol

_signatures: dict = {}

# Prims whose outputs carry no gradient (random values, factories, integer-valued results).
NON_DIFFERENTIABLE = {
    prims.stop_gradient, prims.full, prims.empty, prims.iota, prims.uniform, prims.randn, prims.bernoulli,
    prims.floor, prims.ceil, prims.round, prims.trunc, prims.sign, prims.argmax, prims.argmin, prims.shape,
    prims.floor_divide,
}


def register_vjp(*syms, supports=None):
    """Register the decorated function as the gradient rule of ``syms`` (``Symbol.grad_rule``).

    Write it next to the op's definition; ``supports(**arguments)`` restricts it to the calls it handles."""

    def deco(fn):
        for s in syms:
            s.grad_rule = (fn, supports)
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
    entry = bsym.sym.grad_rule
    if entry is None:
        return None
    fn, supports = entry
    if supports is not None and not supports(**bind_arguments(bsym)):
        return None
    return fn


def has_rule(sym) -> bool:
    return sym.grad_rule is not None


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


def upcast(x):
    """Low-precision floats in their compute dtype (float32): rules compute there, like the forwards."""
    return clang.maybe_convert(x, clang.compute_dtype(x._tt_dtype))


def downcast_like(grad, like):
    """A gradient computed in the compute dtype, converted back to its input's dtype."""
    return clang.maybe_convert(grad, like._tt_dtype) if grad is not None else None


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
