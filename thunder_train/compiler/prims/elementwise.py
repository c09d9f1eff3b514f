"""Elementwise prims: inputs have one shape and one dtype (clang broadcasts and promotes), or are
Python numbers.  Each prim's meta, what it is on Python numbers, its tags and its gradient rule are
declared here, together."""
from __future__ import annotations

import builtins
import math
import operator

from .. import dtypes
from ..errors import NoGradientRuleError
from ..grad_rules import register_vjp
from ..proxies import (CheckedFloat, NumberProxy, SizeProxy, TensorProxy, is_checked, is_number, is_unbacked, number_type,
                       unbacked_size)
from .core import (add_tags, check, common_device, is_float, is_tensor, number_value, prim, prims, remove_tags,
                   square, tensor_args, zeros_like)

UNARY_OPS = (
    "abs neg exp exp2 expm1 log log1p log2 log10 sqrt rsqrt sin cos tan asin acos atan sinh cosh tanh "
    "asinh acosh atanh erf erfc erfinv floor ceil round trunc sign reciprocal bitwise_not lgamma digamma sigmoid"
).split()
UNARY_BOOL_OPS = "isfinite isnan isinf signbit".split()
BINARY_OPS = (
    "add sub mul div floor_divide pow maximum minimum atan2 fmod remainder bitwise_and bitwise_or bitwise_xor "
    "copysign hypot nextafter bitwise_left_shift bitwise_right_shift"
).split()
BINARY_BOOL_OPS = "eq ne lt le gt ge".split()


def _elementwise_meta(sym, args, *, bool_output=False):
    opname = sym.name
    tensors = tensor_args(args)
    if not tensors:
        # A scalar computation on runtime numbers: recorded, output is a NumberProxy.
        check(any(isinstance(a, NumberProxy) for a in args), f"{opname}: expected a tensor or NumberProxy input")
        check(sym.python_op is not None, f"{opname} is not supported on Python numbers")
        values = [number_value(a) for a in args]
        if any(v is None for v in values):  # an item() result: no value yet; the result's type from stand-ins
            stand_in = {bool: True, int: 1, float: 1.0, complex: 1j}
            try:
                kind = type(sym.python_op(*[stand_in[number_type(a)] if v is None else v for a, v in zip(args, values)]))
            except (ArithmeticError, ValueError):
                kind = float
            return NumberProxy(value=None, python_type=kind)
        value = sym.python_op(*values)
        if any(is_unbacked(a) for a in args):
            # On a data-dependent size: still a size (a shape may read it), any other result has no value while
            # tracing (the size's value is a stand-in): a decision on it is a check of the program.
            if type(value) is not int:
                out = NumberProxy(value=None, python_type=type(value))
                out.unbacked = True  # recorded at the top of the program, where a decision on it can find its line
                if opname in ("eq", "ne") and all(isinstance(a, SizeProxy) for a in args):
                    out.equates = (args[0], args[1], opname == "eq")  # (a, b, the answer that makes them equal)
                return out
            out = unbacked_size(value)
            out.origin = ("op", opname) + tuple(args)
            return out
        if any(is_checked(a) for a in args) and type(value) in (int, float):
            # Arithmetic on symbolic sizes / checked hyper-parameters stays checked (their decisions are guarded).
            out = SizeProxy(value=value, python_type=int) if type(value) is int else CheckedFloat(value=value, python_type=float)
            out.origin = ("op", opname) + tuple(args)
            return out
        return NumberProxy(value=value, python_type=type(value))
    shape = tensors[0]._tt_shape
    dtype = tensors[0]._tt_dtype
    for t in tensors[1:]:
        check(t._tt_shape == shape, lambda: f"{opname}: prims need equal shapes, got {shape} and {t._tt_shape}")
        check(t._tt_dtype is dtype, lambda: f"{opname}: prims need equal dtypes, got {dtype} and {t._tt_dtype}")
    for a in args:
        check(
            type(a) is TensorProxy or is_number(a),
            lambda: f"{opname}: unsupported input {a!r}",
        )
    device = common_device(tensors, opname)
    out_dtype = dtypes.bool8 if bool_output else dtype
    return TensorProxy(shape=shape, dtype=out_dtype, device=device)


# Tag "fusible": Inductor fusion (executors/inductor_fusion.py) may take the prim's torch call into a kernel.
# Tag "non_differentiable": the outputs carry no gradient (bool results; integer-valued steps like floor).
_FUSIBLE_ELEMENTWISE = ("elementwise", "fusible")


def _make(name, arity, bool_output=False):
    cell = []  # the symbol, once made: the meta reads its Python-number form

    if arity == 1:
        def meta(a):
            return _elementwise_meta(cell[0], (a,), bool_output=bool_output)
        meta.__doc__ = f"Elementwise {name}."
    else:
        def meta(a, b):
            return _elementwise_meta(cell[0], (a, b), bool_output=bool_output)
        meta.__doc__ = f"Elementwise {name}; inputs have equal shapes and dtypes (or are numbers)."
    meta.__name__ = name
    tags = _FUSIBLE_ELEMENTWISE + (("non_differentiable",) if bool_output else ())
    sym = prim(meta, name=name, tags=tags)
    cell.append(sym)
    return sym


for _n in UNARY_OPS:
    globals()[_n] = _make(_n, 1)
for _n in UNARY_BOOL_OPS:
    globals()[_n] = _make(_n, 1, bool_output=True)
for _n in BINARY_OPS:
    globals()[_n] = _make(_n, 2)
for _n in BINARY_BOOL_OPS:
    globals()[_n] = _make(_n, 2, bool_output=True)

# Transcendental: a CPU kernel spends 1-4 ns an element on these (tanh GELU 4.2 ms for 1 Mi elements on one thread)
# where an add or a mul spends ~0.2 ns; recomputing a large one as a kernel of its own costs a step in proportion
# (transforms/remat_policy.py ``costly_alone``).
for _n in ("exp exp2 expm1 log log1p log2 log10 sin cos tan asin acos atan sinh cosh tanh asinh acosh atanh "
           "erf erfc erfinv lgamma digamma sigmoid atan2").split():
    add_tags(getattr(prims, _n), "transcendental")
# Elementwise, but not taken into Inductor kernels (not checked with Inductor here).
for _p in (prims.digamma, prims.signbit, prims.copysign, prims.nextafter, prims.bitwise_left_shift, prims.bitwise_right_shift):
    remove_tags(_p, "fusible")
# Integer- or bool-valued results: no gradient flows through them (eager's gradient is zero or undefined).
for _p in (prims.floor, prims.ceil, prims.round, prims.trunc, prims.sign, prims.floor_divide, prims.bitwise_not,
           prims.bitwise_and, prims.bitwise_or, prims.bitwise_xor, prims.bitwise_left_shift, prims.bitwise_right_shift):
    add_tags(_p, "non_differentiable")


def _on_numbers(sym, python_op, infix=None, *, commutative=False, mirrored=None):
    """What an elementwise prim is on Python numbers (runtime scalars: an lr, a symbolic size): the Python
    function computing it, its infix spelling (printed programs, prologue checks), whether its operands
    commute and which comparison swaps them (``a < b`` is ``b > a``)."""
    sym.python_op, sym.infix, sym.mirrored = python_op, infix, mirrored
    if commutative:
        add_tags(sym, "commutative")


_on_numbers(prims.add, operator.add, "+", commutative=True)
_on_numbers(prims.sub, operator.sub, "-")
_on_numbers(prims.mul, operator.mul, "*", commutative=True)
_on_numbers(prims.div, operator.truediv, "/")
_on_numbers(prims.floor_divide, operator.floordiv, "//")
_on_numbers(prims.remainder, operator.mod, "%")
_on_numbers(prims.pow, operator.pow, "**")
_on_numbers(prims.maximum, max, commutative=True)
_on_numbers(prims.minimum, min, commutative=True)
_on_numbers(prims.eq, operator.eq, "==", commutative=True)
_on_numbers(prims.ne, operator.ne, "!=", commutative=True)
_on_numbers(prims.lt, operator.lt, "<", mirrored=prims.gt)
_on_numbers(prims.le, operator.le, "<=", mirrored=prims.ge)
_on_numbers(prims.gt, operator.gt, ">", mirrored=prims.lt)
_on_numbers(prims.ge, operator.ge, ">=", mirrored=prims.le)
_on_numbers(prims.neg, operator.neg)
_on_numbers(prims.abs, builtins.abs)
_on_numbers(prims.sqrt, math.sqrt)
_on_numbers(prims.exp, math.exp)
_on_numbers(prims.log, math.log)
_on_numbers(prims.floor, math.floor)
_on_numbers(prims.ceil, math.ceil)
for _p in (prims.bitwise_and, prims.bitwise_or, prims.bitwise_xor, prims.hypot):  # commutative on tensors only
    add_tags(_p, "commutative")

# Python's infix spelling of the scalar prims, by prim name (prologue size checks read it).
SCALAR_INFIX = {s.name: s.infix for s in vars(prims).values() if getattr(s, "infix", None) is not None}


# ---------------------------------------------------------------------------
# Gradient rules of the unary and binary prims
# ---------------------------------------------------------------------------
mul, add, sub, div, neg = prims.mul, prims.add, prims.sub, prims.div, prims.neg

_UNARY_VJP = {
    prims.neg: lambda a, out, g: neg(g),
    prims.abs: lambda a, out, g: mul(g, prims.sign(a)),
    prims.exp: lambda a, out, g: mul(g, out),
    prims.exp2: lambda a, out, g: mul(g, mul(out, math.log(2.0))),
    prims.expm1: lambda a, out, g: mul(g, add(out, 1.0)),
    prims.log: lambda a, out, g: div(g, a),
    prims.log1p: lambda a, out, g: div(g, add(a, 1.0)),
    prims.log2: lambda a, out, g: div(g, mul(a, math.log(2.0))),
    prims.log10: lambda a, out, g: div(g, mul(a, math.log(10.0))),
    prims.sqrt: lambda a, out, g: div(mul(g, 0.5), out),
    prims.rsqrt: lambda a, out, g: mul(g, mul(mul(out, square(out)), -0.5)),
    prims.sin: lambda a, out, g: mul(g, prims.cos(a)),
    prims.cos: lambda a, out, g: neg(mul(g, prims.sin(a))),
    prims.tan: lambda a, out, g: mul(g, add(square(out), 1.0)),
    prims.asin: lambda a, out, g: mul(g, prims.rsqrt(sub(1.0, square(a)))),
    prims.acos: lambda a, out, g: neg(mul(g, prims.rsqrt(sub(1.0, square(a))))),
    prims.atan: lambda a, out, g: div(g, add(square(a), 1.0)),
    prims.sinh: lambda a, out, g: mul(g, prims.cosh(a)),
    prims.cosh: lambda a, out, g: mul(g, prims.sinh(a)),
    prims.tanh: lambda a, out, g: mul(g, sub(1.0, square(out))),
    prims.asinh: lambda a, out, g: mul(g, prims.rsqrt(add(square(a), 1.0))),
    prims.acosh: lambda a, out, g: mul(g, prims.rsqrt(sub(square(a), 1.0))),
    prims.atanh: lambda a, out, g: div(g, sub(1.0, square(a))),
    prims.erf: lambda a, out, g: mul(g, mul(prims.exp(neg(square(a))), 2.0 / math.sqrt(math.pi))),
    prims.erfc: lambda a, out, g: mul(g, mul(prims.exp(neg(square(a))), -2.0 / math.sqrt(math.pi))),
    prims.erfinv: lambda a, out, g: mul(g, mul(prims.exp(square(out)), math.sqrt(math.pi) / 2.0)),
    prims.reciprocal: lambda a, out, g: neg(mul(g, square(out))),
    prims.lgamma: lambda a, out, g: mul(g, prims.digamma(a)),
    prims.digamma: lambda a, out, g: mul(g, prims.polygamma(1, a)),
    prims.sigmoid: lambda a, out, g: mul(g, mul(out, sub(1.0, out))),
}


def _register_unary(sym, grad_fn):
    @register_vjp(sym)
    def rule(g, out, /, a):
        return {"a": grad_fn(a, out, g)}

    rule.__name__ = f"{sym.name}_vjp"


for _sym, _fn in _UNARY_VJP.items():
    _register_unary(_sym, _fn)


@register_vjp(prims.add)
def add_vjp(g, out, /, a, b):
    return {"a": g, "b": g}


@register_vjp(prims.sub)
def sub_vjp(g, out, /, a, b):
    return {"a": g, "b": neg(g)}


@register_vjp(prims.mul)
def mul_vjp(g, out, /, a, b):
    return {"a": mul(g, b) if is_tensor(a) else None, "b": mul(g, a) if is_tensor(b) else None}


@register_vjp(prims.div)
def div_vjp(g, out, /, a, b):
    ga = div(g, b) if is_tensor(a) else None
    gb = neg(div(mul(g, out), b)) if is_tensor(b) else None
    return {"a": ga, "b": gb}


@register_vjp(prims.pow)
def pow_vjp(g, out, /, a, b):
    grads = {}
    if is_tensor(a):
        # b * a^(b-1); exactly 0 where b == 0 (torch's convention)
        if is_tensor(b):
            grads["a"] = prims.where(prims.eq(b, 0.0), 0.0, mul(g, mul(b, prims.pow(a, sub(b, 1.0)))))
        else:
            grads["a"] = zeros_like(a) if b == 0 else mul(g, mul(prims.pow(a, b - 1.0), b))
    if is_tensor(b):
        # out * log(a); 0 where a == 0 and b >= 0 (torch's convention)
        if is_tensor(a):
            gb = mul(g, mul(out, prims.log(a)))
            grads["b"] = prims.where(prims.bitwise_and(prims.eq(a, 0.0), prims.ge(b, 0.0)), 0.0, gb)
        else:
            grads["b"] = mul(g, mul(out, math.log(a))) if a > 0 else zeros_like(b) if a == 0 else mul(g, float("nan"))
    return grads


def _minmax_vjp(pick_a):
    """maximum/minimum as eager (derivatives.yaml): ties split the gradient in half, the losing side gets 0,
    and where a NaN is involved neither side loses, so both get the whole gradient."""

    def rule(g, out, /, a, b):
        if not is_tensor(b) or not is_tensor(a):
            # clamp_min / clamp_max semantics: the tensor gets g where it is the result (ties included, NaN not)
            t, s = (a, b) if is_tensor(a) else (b, a)
            keep = prims.ge(t, s) if pick_a == "max" else prims.le(t, s)
            return {("a" if is_tensor(a) else "b"): prims.where(keep, g, 0.0)}
        shared = prims.where(prims.eq(a, b), mul(g, 0.5), g)
        a_loses, b_loses = (prims.lt(a, b), prims.gt(a, b)) if pick_a == "max" else (prims.gt(a, b), prims.lt(a, b))
        return {"a": prims.where(a_loses, 0.0, shared), "b": prims.where(b_loses, 0.0, shared)}

    return rule


register_vjp(prims.maximum)(_minmax_vjp("max"))
register_vjp(prims.minimum)(_minmax_vjp("min"))


@register_vjp(prims.atan2)
def atan2_vjp(g, out, /, a, b):
    denom = add(square(a), square(b)) if is_tensor(a) and is_tensor(b) else None
    if denom is None:
        raise NoGradientRuleError("atan2 with a Python number argument has no gradient rule yet")
    return {"a": div(mul(g, b), denom), "b": neg(div(mul(g, a), denom))}


@register_vjp(prims.hypot)
def hypot_vjp(g, out, /, a, b):
    return {"a": mul(g, div(a, out)) if is_tensor(a) else None, "b": mul(g, div(b, out)) if is_tensor(b) else None}


@register_vjp(prims.fmod)
def fmod_vjp(g, out, /, a, b):
    return {"a": g, "b": neg(mul(g, prims.trunc(div(a, b)))) if is_tensor(b) else None}


@register_vjp(prims.remainder)
def remainder_vjp(g, out, /, a, b):
    # -g * (a // b) with torch's floor division (1.5 // -inf is -1, floor(1.5 / -inf) is -0), as eager
    return {"a": g, "b": neg(mul(g, prims.floor_divide(a, b))) if is_tensor(b) else None}


@register_vjp(prims.copysign)
def copysign_vjp(g, out, /, a, b):
    """|a| with b's sign: the gradient is ``g`` times ``out / a`` (±1), and 0 where ``a == 0`` (torch); none for ``b``."""
    if not is_tensor(a):
        return {"b": zeros_like(b)}
    ratio = prims.where(prims.eq(a, 0.0), 0.0, div(out, a))
    return {"a": mul(g, ratio), "b": zeros_like(b) if is_tensor(b) else None}


@register_vjp(prims.nextafter)
def nextafter_vjp(g, out, /, a, b):
    """As eager: the result moves by one ulp, so ``a`` gets ``g`` unchanged and ``b`` gets zeros."""
    return {"a": g if is_tensor(a) else None, "b": zeros_like(b) if is_tensor(b) else None}


# ---------------------------------------------------------------------------
# Selection, conversion, copies
# ---------------------------------------------------------------------------
@prim(tags=_FUSIBLE_ELEMENTWISE)
def where(pred, a, b):
    """Select ``a`` where ``pred`` else ``b``; equal shapes, ``a`` and ``b`` one dtype."""
    tensors = tensor_args((pred, a, b))
    check(tensors, "where: expected at least one tensor")
    shape = tensors[0]._tt_shape
    for t in tensors:
        check(t._tt_shape == shape, lambda: f"where: prims need equal shapes, got {shape} and {t._tt_shape}")
    if type(pred) is TensorProxy:
        check(pred._tt_dtype is dtypes.bool8, "where: predicate must be bool")
    vals = tensor_args((a, b))
    if len(vals) == 2:
        check(a._tt_dtype is b._tt_dtype, lambda: f"where: dtypes differ: {a._tt_dtype} and {b._tt_dtype}")
    check(vals, "where: a or b must be a tensor at prim level")
    return TensorProxy(shape=shape, dtype=vals[0]._tt_dtype, device=common_device(tensors, "where"))


@register_vjp(where)
def where_vjp(g, out, /, pred, a, b):
    if not is_tensor(pred):
        return {"a": g if pred else None, "b": None if pred else g}
    return {"a": prims.where(pred, g, 0.0) if is_tensor(a) else None, "b": prims.where(pred, 0.0, g) if is_tensor(b) else None}


# "elementwise" (its output is laid out like its input) and "cheap_to_recompute": the backward recomputes
# it from its input rather than saving its output when that saves no extra value (transforms/autograd.py).
@prim(tags=("elementwise", "fusible", "cheap_to_recompute"))
def convert_element_type(a, dtype):
    """Cast to ``dtype`` (a compiler dtype)."""
    check(isinstance(dtype, dtypes.DType), "convert_element_type: dtype must be a compiler dtype")
    return TensorProxy(shape=a._tt_shape, dtype=dtype, device=a._tt_device)


@register_vjp(convert_element_type)
def convert_element_type_vjp(g, out, /, a, dtype):
    return {"a": prims.convert_element_type(g, a._tt_dtype) if is_float(a) else None}


# "fusible": a copy a fused kernel writes with its neighbours (Falcon's key: ``torch.cat`` of an empty cache and the
# rotary embedding's result, a clone of a region's value).
@prim(tags=("layout_on_meta", "fusible"))
def clone(a, memory_format=None):
    """A fresh copy of ``a`` (never aliases it), laid out in ``memory_format`` (default: like ``a``)."""
    return TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device)


@register_vjp(clone)
def clone_vjp(g, out, /, a, memory_format=None):
    return {"a": g}


@prim
def grad_layout(g, param):
    """``g`` laid out as eager's AccumulateGrad lays out a new ``param.grad``: like the parameter when
    it is dense, else row-major (torch's "gradient layout contract"); ``g`` itself when it already is."""
    check(g._tt_shape == param._tt_shape, f"grad_layout: gradient {g._tt_shape} for a parameter of {param._tt_shape}")
    return TensorProxy(shape=g._tt_shape, dtype=g._tt_dtype, device=g._tt_device)


@register_vjp(grad_layout)
def grad_layout_vjp(ct, out, /, g, param):
    return {"g": ct}


@prim
def unseen_write(value, old):
    """``value``'s values in a tensor that held ``old``, written where autograd does not see it (under
    ``torch.no_grad()``, or through ``.data``/``.detach()``): eager keeps the tensor's graph, so its gradient
    goes to ``old`` unchanged."""
    check(value._tt_shape == old._tt_shape and value._tt_dtype is old._tt_dtype,
          lambda: f"unseen_write: {value._tt_shape} {value._tt_dtype} written over {old._tt_shape} {old._tt_dtype}")
    return TensorProxy(shape=value._tt_shape, dtype=value._tt_dtype, device=value._tt_device,
                       strides=value._tt_strides, storage_offset=value._tt_storage_offset)


@register_vjp(unseen_write)
def unseen_write_vjp(ct, out, /, value, old):
    return {"old": ct}


@prim(tags=("elementwise", "non_differentiable"))
def stop_gradient(a):
    """The value of ``a``, through which no gradient flows (``Tensor.detach``)."""
    return TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device)


# ---------------------------------------------------------------------------
# Special functions with an order argument
# ---------------------------------------------------------------------------
@prim(tags=("elementwise", "transcendental"))
def polygamma(n, a):
    """The ``n``-th derivative of digamma (``torch.polygamma(n, a)``); ``n`` is a non-negative Python int.

    Gradient rules use it (digamma's derivative is ``polygamma(1, a)``).
    """
    check(number_type(n) is int and n >= 0, lambda: f"polygamma: n must be a non-negative int, got {n!r}")
    check(type(a) is TensorProxy and a._tt_dtype.is_float, "polygamma: expected a floating-point tensor")
    return TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device)


@register_vjp(polygamma)
def polygamma_vjp(g, out, /, n, a):
    return {"a": mul(g, prims.polygamma(n + 1, a))}
