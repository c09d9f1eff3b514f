"""Elementwise torch functions, Tensor methods and operators, special functions (``xlog1py``, ``entr``,
``ndtr``, ``logit``, ``sinc``) and the small forms of real tensors (``conj``, ``real``, ``angle``)."""
from __future__ import annotations

import builtins

import torch

import math

from .. import clang, dtypes, prims
from ..clang import Promotion
from ..errors import DataDependentError
from ..grad_rules import register_vjp
from ..prims.core import sum_to
from ..proxies import NumberProxy, TensorProxy
from .autocast import FP32, PROMOTE  # autocast policies: see autocast.py
from .registry import composed, torchsymbol as _torchsymbol

P = Promotion


# Tag "fusible" (Symbol): Inductor fusion may take the op's torch call into a kernel.  Elementwise ops are,
# except the few passed ``tags=()`` below (not checked with Inductor).
FUSIBLE = ("fusible",)


def torchsymbol(*torch_fns, tags=(), **facts):
    """``registry.torchsymbol`` with the tag every op of this module carries: ``"elementwise"`` (its result has its
    inputs' broadcast shape, row-major when they are row-major and of that shape: executors/layout_rules.py)."""
    return _torchsymbol(*torch_fns, tags=("elementwise", *tags), **facts)


def _unary(name, prim, kind=P.DEFAULT, torch_fns=None, methods=None, upcast=True, doc=None, tags=FUSIBLE, autocast=None):
    def fn(input):
        return clang.elementwise_unary(prim, input, kind, upcast=upcast)

    fn.__name__ = name
    fn.__doc__ = doc or f"torch.{name}"
    fns = torch_fns if torch_fns is not None else tuple(f for f in (getattr(torch, name, None),) if f is not None)
    return torchsymbol(*fns, methods=methods if methods is not None else (name,), name=name, tags=tags, autocast=autocast)(fn)


F_ = P.INT_TO_FLOAT
abs = _unary("abs", prims.abs, P.COMPLEX_TO_FLOAT, methods=("abs", "__abs__"), upcast=False)
neg = _unary("neg", prims.neg, methods=("neg", "__neg__", "negative"), upcast=False)
exp = _unary("exp", prims.exp, F_, autocast={"cuda": FP32})
exp2 = _unary("exp2", prims.exp2, F_)
expm1 = _unary("expm1", prims.expm1, F_, autocast={"cuda": FP32})
log = _unary("log", prims.log, F_, autocast={"cuda": FP32})
log1p = _unary("log1p", prims.log1p, F_, autocast={"cuda": FP32})
log2 = _unary("log2", prims.log2, F_, autocast={"cuda": FP32})
log10 = _unary("log10", prims.log10, F_, autocast={"cuda": FP32})
sqrt = _unary("sqrt", prims.sqrt, F_)
rsqrt = _unary("rsqrt", prims.rsqrt, F_, autocast={"cuda": FP32})
sin = _unary("sin", prims.sin, F_)
cos = _unary("cos", prims.cos, F_)
tan = _unary("tan", prims.tan, F_, autocast={"cuda": FP32})
asin = _unary("asin", prims.asin, F_, autocast={"cuda": FP32})
acos = _unary("acos", prims.acos, F_, autocast={"cuda": FP32})
atan = _unary("atan", prims.atan, F_)
sinh = _unary("sinh", prims.sinh, F_, autocast={"cuda": FP32})
cosh = _unary("cosh", prims.cosh, F_, autocast={"cuda": FP32})
tanh = _unary("tanh", prims.tanh, F_, torch_fns=(torch.tanh, torch.nn.functional.tanh))
asinh = _unary("asinh", prims.asinh, F_)
acosh = _unary("acosh", prims.acosh, F_)
atanh = _unary("atanh", prims.atanh, F_)
erf = _unary("erf", prims.erf, F_, torch_fns=(torch.erf, torch.special.erf))
erfc = _unary("erfc", prims.erfc, F_, torch_fns=(torch.erfc, torch.special.erfc))
erfinv = _unary("erfinv", prims.erfinv, F_, torch_fns=(torch.erfinv, torch.special.erfinv), autocast={"cuda": FP32})
lgamma = _unary("lgamma", prims.lgamma, F_)
digamma = _unary("digamma", prims.digamma, F_, torch_fns=(torch.digamma, torch.special.digamma), tags=())
sigmoid = _unary("sigmoid", prims.sigmoid, F_, torch_fns=(torch.sigmoid, torch.nn.functional.sigmoid, torch.special.expit))
reciprocal = _unary("reciprocal", prims.reciprocal, F_, autocast={"cuda": FP32})
floor = _unary("floor", prims.floor, upcast=False)
ceil = _unary("ceil", prims.ceil, upcast=False)
trunc = _unary("trunc", prims.trunc, upcast=False, methods=("trunc", "fix"))
sign = _unary("sign", prims.sign, upcast=False)
sgn = _unary("sgn", prims.sign, upcast=False, tags=())
bitwise_not = _unary("bitwise_not", prims.bitwise_not, upcast=False, methods=("bitwise_not", "__invert__"))
isfinite = _unary("isfinite", prims.isfinite, P.ALWAYS_BOOL, upcast=False)
isnan = _unary("isnan", prims.isnan, P.ALWAYS_BOOL, upcast=False)
isinf = _unary("isinf", prims.isinf, P.ALWAYS_BOOL, upcast=False)
signbit = _unary("signbit", prims.signbit, P.ALWAYS_BOOL, upcast=False, tags=())



@torchsymbol(torch.round, methods=("round",), tags=("fusible",))
def round(input, *, decimals=0):
    """torch.round (half to even), optionally to ``decimals`` places."""
    if decimals == 0:
        return clang.elementwise_unary(prims.round, input, upcast=False)
    if not input._tt_dtype.is_float:
        raise NotImplementedError(f"round(decimals={decimals}) is only supported for floating point tensors, like eager")
    scale = 10.0**decimals
    return clang.true_divide(clang.elementwise_unary(prims.round, clang.mul(input, scale), upcast=False), scale)


@torchsymbol(torch.square, methods=("square",), tags=("fusible",), autocast={"cuda": FP32})
def square(input):
    if input._tt_dtype.is_bool:
        input = clang.maybe_convert(input, dtypes.int64)
    return clang.mul(input, input)


@torchsymbol(torch.logical_not, methods=("logical_not",), tags=("fusible",))
def logical_not(input):
    return prims.eq(clang.to_bool(input), False) if input._tt_dtype.is_bool else clang.eq(input, 0)


@torchsymbol(torch.nan_to_num, methods=("nan_to_num",), tags=("fusible",))
def nan_to_num(input, nan=0.0, posinf=None, neginf=None):
    if not input._tt_dtype.is_float:
        return clang.maybe_convert(input, input._tt_dtype) if False else prims.clone(input)
    info = torch.finfo(input._tt_dtype.torch)
    posinf = info.max if posinf is None else posinf
    neginf = info.min if neginf is None else neginf
    out = clang.where(prims.isnan(input), nan, input)
    out = clang.where(clang.logical_and(prims.isinf(out), clang.ge(out, 0)), posinf, out)
    return clang.where(clang.logical_and(prims.isinf(out), clang.lt(out, 0)), neginf, out)


@register_vjp(nan_to_num)
def _nan_to_num_vjp(g, out, /, input, nan=0.0, posinf=None, neginf=None):
    # eager: g * isfinite(input), so a NaN or infinite cotangent at a replaced entry stays NaN (not 0)
    if not input._tt_dtype.is_float:
        return {}
    return {"input": prims.mul(g, prims.convert_element_type(prims.isfinite(input), g._tt_dtype))}


# ---------------------------------------------------------------------------
# Binary
# ---------------------------------------------------------------------------
def _binary(name, prim, kind=P.DEFAULT, torch_fns=None, methods=None, upcast=True, reverse_methods=(), tags=FUSIBLE,
            autocast=None):
    def fn(input, other):
        return clang.elementwise_binary(prim, input, other, kind, upcast=upcast)

    fn.__name__ = name
    fn.__doc__ = f"torch.{name}"
    fns = torch_fns if torch_fns is not None else tuple(f for f in (getattr(torch, name, None),) if f is not None)
    sym = torchsymbol(*fns, methods=methods if methods is not None else (name,), name=name, tags=tags, autocast=autocast)(fn)
    for rm in reverse_methods:
        _reversed(rm, sym)
    return sym


def _reversed(method, sym):
    def fn(input, other):
        return sym(other, input)

    fn.__name__ = method.strip("_")
    fn.__doc__ = f"Tensor.{method}: ``other {method}`` with the tensor on the right."
    return torchsymbol(methods=(method,), name=fn.__name__)(fn)


def _scales(alpha) -> bool:
    """Whether ``alpha`` (a number or a runtime number) needs a multiplication."""
    return isinstance(alpha, NumberProxy) or alpha != 1


def _scaled(other, alpha):
    """``alpha * other``; two Python numbers multiply in Python (``torch.add(x, 3, alpha=2)``)."""
    if type(other) in (bool, int, float) and type(alpha) in (bool, int, float):
        return other * alpha
    return clang.mul(other, alpha)


@torchsymbol(torch.add, methods=("add", "__add__", "__radd__"), tags=("fusible",))
def add(input, other, *, alpha=1):
    """torch.add: ``input + alpha * other``."""
    if _scales(alpha):
        other = _scaled(other, alpha)
    return clang.add(input, other)


@torchsymbol(torch.sub, torch.subtract, methods=("sub", "__sub__", "subtract"), tags=("fusible",))
def sub(input, other, *, alpha=1):
    """torch.sub: ``input - alpha * other``."""
    if _scales(alpha):
        other = _scaled(other, alpha)
    return clang.sub(input, other)


@torchsymbol(torch.rsub, methods=("__rsub__",), name="rsub", tags=("fusible",))
def rsub(input, other, *, alpha=1):
    """``other - input`` (Tensor.__rsub__)."""
    return sub(other, input, alpha=alpha) if type(other) is TensorProxy else clang.sub(other, clang.mul(input, alpha) if _scales(alpha) else input)


mul = _binary("mul", prims.mul, torch_fns=(torch.mul, torch.multiply), methods=("mul", "__mul__", "__rmul__", "multiply"))


@torchsymbol(torch.div, torch.divide, torch.true_divide, methods=("div", "__truediv__", "divide", "true_divide"), tags=("fusible",))
def div(input, other, *, rounding_mode=None):
    """torch.div with rounding_mode None (true), 'trunc' or 'floor'."""
    if rounding_mode is None:
        return clang.true_divide(input, other)
    if rounding_mode == "trunc":
        d = clang.result_dtype(input, other)
        if d.category >= dtypes.FLOAT:
            return clang.elementwise_unary(prims.trunc, clang.true_divide(input, other), upcast=False)
        return clang.elementwise_binary(prims.div, input, other, upcast=False)
    if rounding_mode == "floor":
        return floor_divide(input, other)
    raise ValueError(f"div expected rounding_mode to be one of None, 'trunc', or 'floor' but found {rounding_mode!r}")


@torchsymbol(methods=("__rtruediv__", "__rdiv__"), name="rtruediv", tags=("fusible",),
             autocast={"cuda": FP32})
def rtruediv(input, other):
    """``other / input`` as eager's ``Tensor.__rdiv__``: ``input.reciprocal() * other`` (two roundings)."""
    if type(input) is TensorProxy:
        return clang.mul(reciprocal(input), other)
    return clang.true_divide(other, input)


floor_divide = _binary("floor_divide", prims.floor_divide, methods=("floor_divide", "__floordiv__"), upcast=False, reverse_methods=("__rfloordiv__",))
remainder = _binary("remainder", prims.remainder, methods=("remainder", "__mod__"), upcast=False, reverse_methods=("__rmod__",))
fmod = _binary("fmod", prims.fmod, upcast=False)
maximum = _binary("maximum", prims.maximum, upcast=False)
minimum = _binary("minimum", prims.minimum, upcast=False)


def _nan_ignoring(name, prim):
    """fmax/fmin: like maximum/minimum, but a NaN loses to a number."""

    def fn(input, other):
        both = clang.elementwise_binary(prim, input, other, upcast=False)
        if not both._tt_dtype.is_float:
            return both
        a, b = clang.maybe_broadcast(clang.maybe_convert(input, both._tt_dtype), clang.maybe_convert(other, both._tt_dtype))
        out = clang.where(clang.elementwise_unary(prims.isnan, b, P.ALWAYS_BOOL, upcast=False), a, both) if type(b) is TensorProxy else both
        return clang.where(clang.elementwise_unary(prims.isnan, a, P.ALWAYS_BOOL, upcast=False), b, out) if type(a) is TensorProxy else out

    fn.__name__ = name
    fn.__doc__ = f"torch.{name}"
    return torchsymbol(getattr(torch, name), methods=(name,), name=name)(fn)


fmax = _nan_ignoring("fmax", prims.maximum)
fmin = _nan_ignoring("fmin", prims.minimum)


# Gradient rules of binary ops with eager's conventions at ties and NaN: computed on the operands at the
# output's dtype and shape, then summed back to each input (and converted to its dtype).
def _operand(x, out):
    if type(x) is not TensorProxy:
        return prims.full(out._tt_shape, x, device=out._tt_device, dtype=out._tt_dtype)
    return clang.expand(clang.maybe_convert(x, out._tt_dtype), out._tt_shape)


def _to_input(grad, x):
    if type(x) is not TensorProxy or not x._tt_dtype.is_float or grad is None:
        return None
    return clang.maybe_convert(sum_to(grad, x._tt_shape), x._tt_dtype)


def _nan_ignoring_vjp(wins):
    """fmax/fmin (derivatives.yaml): ``input`` gets the gradient where it wins or ties, or where ``other`` is
    NaN; ``other`` everywhere else."""

    def rule(g, out, /, input, other):
        if not out._tt_dtype.is_float:
            return {}
        a, b = _operand(input, out), _operand(other, out)
        to_a = prims.bitwise_or(wins(a, b), prims.isnan(b))
        return {"input": _to_input(prims.where(to_a, g, 0.0), input), "other": _to_input(prims.where(to_a, 0.0, g), other)}

    return rule


register_vjp(fmax)(_nan_ignoring_vjp(prims.ge))
register_vjp(fmin)(_nan_ignoring_vjp(prims.le))
atan2 = _binary("atan2", prims.atan2, P.INT_TO_FLOAT, torch_fns=(torch.atan2, torch.arctan2), methods=("atan2", "arctan2"), autocast={"cuda": PROMOTE})
copysign = _binary("copysign", prims.copysign, P.INT_TO_FLOAT, tags=())
hypot = _binary("hypot", prims.hypot)
nextafter = _binary("nextafter", prims.nextafter, upcast=False, tags=())
bitwise_and = _binary("bitwise_and", prims.bitwise_and, methods=("bitwise_and", "__and__", "__rand__"), upcast=False)
bitwise_or = _binary("bitwise_or", prims.bitwise_or, methods=("bitwise_or", "__or__", "__ror__"), upcast=False)
bitwise_xor = _binary("bitwise_xor", prims.bitwise_xor, methods=("bitwise_xor", "__xor__", "__rxor__"), upcast=False)
bitwise_left_shift = _binary("bitwise_left_shift", prims.bitwise_left_shift, methods=("bitwise_left_shift", "__lshift__"), upcast=False, reverse_methods=("__rlshift__",), tags=())
bitwise_right_shift = _binary("bitwise_right_shift", prims.bitwise_right_shift, methods=("bitwise_right_shift", "__rshift__"), upcast=False, reverse_methods=("__rrshift__",), tags=())
eq = _binary("eq", prims.eq, P.ALWAYS_BOOL, methods=("eq", "__eq__"), upcast=False)
ne = _binary("ne", prims.ne, P.ALWAYS_BOOL, torch_fns=(torch.ne, torch.not_equal), methods=("ne", "__ne__", "not_equal"), upcast=False)
lt = _binary("lt", prims.lt, P.ALWAYS_BOOL, torch_fns=(torch.lt, torch.less), methods=("lt", "__lt__", "less"), upcast=False)
le = _binary("le", prims.le, P.ALWAYS_BOOL, torch_fns=(torch.le, torch.less_equal), methods=("le", "__le__", "less_equal"), upcast=False)
gt = _binary("gt", prims.gt, P.ALWAYS_BOOL, torch_fns=(torch.gt, torch.greater), methods=("gt", "__gt__", "greater"), upcast=False)
ge = _binary("ge", prims.ge, P.ALWAYS_BOOL, torch_fns=(torch.ge, torch.greater_equal), methods=("ge", "__ge__", "greater_equal"), upcast=False)


@torchsymbol(torch.pow, methods=("pow", "__pow__"), tags=("fusible",), autocast={"cuda": FP32})
def pow(input, exponent):
    """torch.pow; ``x ** 2`` becomes ``x * x``."""
    if type(input) is TensorProxy and type(exponent) in (int, float) and exponent == 2:
        d = clang.result_dtype(input, exponent)
        x = clang.maybe_convert(input, clang.compute_dtype(d))
        return clang.maybe_convert(prims.mul(x, x), d)
    return clang.elementwise_binary(prims.pow, input, exponent)


@torchsymbol(methods=("__rpow__",), name="rpow", tags=("fusible",), autocast={"cuda": FP32})
def rpow(input, other):
    """``other ** input``."""
    return clang.elementwise_binary(prims.pow, other, input)


def _logical(name, prim):  # fusible
    def fn(input, other):
        a, b = clang.maybe_broadcast(clang.to_bool(input), clang.to_bool(other))
        if type(a) is not TensorProxy:
            a = clang.full_like(b, a, dtype=dtypes.bool8)
        if type(b) is not TensorProxy:
            b = clang.full_like(a, b, dtype=dtypes.bool8)
        return prim(a, b)

    fn.__name__ = name
    fn.__doc__ = f"torch.{name}"
    return torchsymbol(getattr(torch, name), methods=(name,), name=name, tags=FUSIBLE)(fn)


logical_and = _logical("logical_and", prims.bitwise_and)
logical_or = _logical("logical_or", prims.bitwise_or)
logical_xor = _logical("logical_xor", prims.bitwise_xor)


@torchsymbol(torch.where, methods=("where",), tags=("fusible",))
def where(condition, input=None, other=None):
    """torch.where(condition, input, other); the one-argument form is data-dependent."""
    if input is None and other is None:
        raise NotImplementedError("torch.where(condition) returns data-dependent shapes and cannot be compiled; use the three-argument form")
    return clang.where(condition, input, other)


@torchsymbol(torch.clamp, torch.clip, methods=("clamp", "clip"), tags=("fusible",))
def clamp(input, min=None, max=None):
    """torch.clamp = minimum(maximum(input, min), max); NaN in input or a bound propagates."""
    if min is None and max is None:
        raise ValueError("torch.clamp: at least one of 'min' or 'max' must not be None")
    out = input
    if min is not None:
        out = clang.elementwise_binary(prims.maximum, out, min, upcast=False)
    if max is not None:
        out = clang.elementwise_binary(prims.minimum, out, max, upcast=False)
    return out


@register_vjp(clamp)
def _clamp_vjp(g, out, /, input, min=None, max=None):
    """As eager (``clamp_backward_min_max``): ``input`` gets the gradient where min <= input <= max (not where it
    or a bound is NaN); ``min`` where input < min (and min < max); ``max`` where input > max (or max < min)."""
    if not out._tt_dtype.is_float:
        return {}
    x = _operand(input, out)
    lo = _operand(min, out) if min is not None else None
    hi = _operand(max, out) if max is not None else None
    conds = [c for c in (lo is not None and prims.ge(x, lo), hi is not None and prims.le(x, hi)) if c is not False]
    keep = conds[0] if len(conds) == 1 else prims.bitwise_and(*conds)
    grads = {"input": _to_input(prims.where(keep, g, 0.0), input)}
    if type(min) is TensorProxy:
        below = prims.lt(x, lo) if hi is None else prims.bitwise_and(prims.lt(x, lo), prims.lt(lo, hi))
        grads["min"] = _to_input(prims.where(below, g, 0.0), min)
    if type(max) is TensorProxy:
        above = prims.gt(x, hi) if lo is None else prims.bitwise_or(prims.gt(x, hi), prims.lt(hi, lo))
        grads["max"] = _to_input(prims.where(above, g, 0.0), max)
    return grads


@torchsymbol(torch.clamp_min, methods=("clamp_min",), tags=("fusible",))
def clamp_min(input, min):
    return clamp(input, min=min)


@torchsymbol(torch.clamp_max, methods=("clamp_max",), tags=("fusible",))
def clamp_max(input, max):
    return clamp(input, max=max)


@torchsymbol(torch.lerp, methods=("lerp",), tags=("fusible",))
def lerp(input, end, weight):
    """Like torch: ``input + w * d`` for |w| < 0.5, else ``end - d * (1 - w)`` (exact at w = 1)."""
    diff = clang.sub(end, input)
    if type(weight) is not TensorProxy:
        try:
            small = bool(builtins.abs(weight) < 0.5)  # (a runtime number computed from inputs: a decision the key holds)
        except DataDependentError:  # (one the program computes: Adafactor's ``step ** decay``) both forms, chosen by it
            low = clang.add(input, clang.mul(weight, diff))
            return clang.where(builtins.abs(weight) < 0.5, low, clang.sub(end, clang.mul(diff, 1 - weight)))
        if small:
            return clang.add(input, clang.mul(weight, diff))
        return clang.sub(end, clang.mul(diff, 1 - weight))
    low = clang.add(input, clang.mul(weight, diff))
    high = clang.sub(end, clang.mul(diff, clang.sub(1, weight)))
    small = clang.lt(clang.elementwise_unary(prims.abs, weight, upcast=False), 0.5)
    return clang.where(small, low, high)


@torchsymbol(torch.addcmul, methods=("addcmul",), tags=("fusible",), autocast={"cuda": PROMOTE})
def addcmul(input, tensor1, tensor2, *, value=1):
    return clang.add(input, clang.mul(clang.mul(tensor1, tensor2), value))


@torchsymbol(torch.addcdiv, methods=("addcdiv",), tags=("fusible",), autocast={"cuda": PROMOTE})
def addcdiv(input, tensor1, tensor2, *, value=1):
    if not clang.result_dtype(tensor1, tensor2).is_float:
        raise RuntimeError("Integer division with addcdiv is no longer supported (as in eager); use addcmul(input, tensor1, 1 / tensor2)")
    return clang.add(input, clang.mul(clang.true_divide(tensor1, tensor2), value))


@torchsymbol(torch.xlogy, torch.special.xlogy, methods=("xlogy",))
def xlogy(input, other):
    d = clang.result_dtype(input, other)
    d = d if d.is_float else dtypes.default_float()
    # a number operand: a 0-d tensor of the result's dtype (so that log/eq apply; the dtype is already decided)
    if type(other) is not TensorProxy:
        other = prims.full((), other, device=input._tt_device, dtype=d)
    if type(input) is not TensorProxy:
        input = prims.full((), input, device=other._tt_device, dtype=d)
    prod = clang.mul(input, clang.log(other))
    zero_x = clang.eq(input, 0)
    out = clang.where(zero_x, 0.0, prod)
    return clang.where(clang.elementwise_unary(prims.isnan, clang.maybe_convert(other, d) if type(other) is TensorProxy else clang.full_like(out, other), P.ALWAYS_BOOL, upcast=False), float("nan"), out)


@register_vjp(xlogy)
def _xlogy_vjp(g, out, /, input, other):
    """As eager (derivatives.yaml): ``input`` gets ``xlogy(g, other)``, 0 where input == 0 and other <= 0;
    ``other`` gets ``g * input / other``."""
    x, y = _operand(input, out), _operand(other, out)
    g_log_y = xlogy(g, y)  # eager's xlogy kernel (as separate ops, an ulp off in 8 % of float32 elements)
    # a number ``other`` (eager's xlogy.Scalar_Other): 0 where input == 0 and not other > 0 (other = NaN too)
    not_positive = prims.le(y, 0.0) if type(other) is TensorProxy else prims.bitwise_not(prims.gt(y, 0.0))
    zero = prims.bitwise_and(prims.eq(x, 0.0), not_positive)
    ga = prims.where(zero, 0.0, g_log_y)
    return {"input": _to_input(ga, input), "other": _to_input(prims.div(prims.mul(g, x), y), other)}


@torchsymbol(torch.logit, torch.special.logit, methods=("logit",), tags=FUSIBLE)
def logit(input, eps=None):
    """log(x / (1 - x)), x clamped to [eps, 1 - eps] (NaN kept) when eps is given; computed in float32 for low
    precision, an integer input in the default float dtype."""
    dt = input._tt_dtype if input._tt_dtype.is_float else dtypes.default_float()
    x = clang.upcast(clang.maybe_convert(input, dt))
    if eps is not None:
        x = prims.where(prims.lt(x, eps), eps, prims.where(prims.gt(x, 1 - eps), 1 - eps, x))
    return clang.maybe_convert(prims.log(prims.div(x, prims.sub(1.0, x))), dt)


# eager's logit_backward kernel: the same formula as separate ops is an ulp off in 41 % of float32 elements
@torchsymbol(torch.ops.aten.logit_backward.default, name="logit_backward", tags=FUSIBLE)
def logit_backward(grad_output, input, eps=None):
    """g / (x (1 - x)); without eps NaN outside [0, 1] and g * inf at 0 and 1, with eps 0 outside [eps, 1 - eps]."""
    x, g = clang.upcast(input), clang.upcast(grad_output)
    d = prims.div(g, prims.mul(x, prims.sub(1.0, x)))
    if eps is None:
        at_bound = prims.bitwise_or(prims.eq(x, 0.0), prims.eq(x, 1.0))
        d = prims.where(at_bound, prims.mul(g, math.inf), d)
        d = prims.where(prims.bitwise_or(prims.lt(x, 0.0), prims.gt(x, 1.0)), math.nan, d)
    else:
        d = prims.where(prims.bitwise_or(prims.lt(x, eps), prims.gt(x, 1 - eps)), 0.0, d)
    return clang.maybe_convert(d, input._tt_dtype)


@register_vjp(logit)
def _logit_vjp(g, out, /, input, eps=None):
    return {"input": logit_backward(g, input, eps) if input._tt_dtype.is_float else None}


@torchsymbol(torch.isclose, methods=("isclose",))
def isclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    """|input - other| <= atol + rtol * |other|; equal infinities are close, NaNs only with equal_nan."""
    d = clang.result_dtype(input, other)
    a, b = clang.maybe_convert(input, d), clang.maybe_convert(other, d)
    close = clang.eq(a, b)
    if d.is_float:
        diff = clang.elementwise_unary(prims.abs, clang.sub(a, b), upcast=False)
        bound = clang.add(clang.mul(clang.elementwise_unary(prims.abs, b, upcast=False), rtol), atol)
        finite = clang.logical_and(clang.elementwise_unary(prims.isfinite, a, P.ALWAYS_BOOL), clang.elementwise_unary(prims.isfinite, b, P.ALWAYS_BOOL))
        close = logical_or(close, clang.logical_and(finite, clang.elementwise_binary(prims.le, diff, bound, P.ALWAYS_BOOL, upcast=False)))
        if equal_nan:
            nan_a = clang.elementwise_unary(prims.isnan, a, P.ALWAYS_BOOL)
            close = logical_or(close, clang.logical_and(nan_a, clang.elementwise_unary(prims.isnan, b, P.ALWAYS_BOOL)))
    return close


def _logaddexp(input, other, name, exp_prim, scale):
    """``max + log1p(exp(-|input - other|)) * scale`` (``m`` itself at equal infinities, where the formula gives
    NaN), computed in float32 for half and bfloat16 and rounded once, as eager's kernel."""
    for x in (input, other):
        if type(x) is TensorProxy and x._tt_dtype.is_complex:
            raise NotImplementedError(f"{name} of a complex tensor is run by torch")
    comp, res = clang.promote_for(P.INT_TO_FLOAT, input, other)
    a, b = clang.maybe_broadcast(input, other)
    a, b = clang.maybe_convert(a, clang.compute_dtype(comp)), clang.maybe_convert(b, clang.compute_dtype(comp))
    m = prims.maximum(a, b)
    tail = prims.log1p(exp_prim(prims.neg(prims.abs(prims.sub(a, b)))))
    out = prims.add(m, prims.mul(tail, scale) if scale != 1 else tail)
    return clang.maybe_convert(prims.where(prims.bitwise_and(prims.isinf(m), prims.eq(a, b)), m, out), res)


@torchsymbol(torch.logaddexp, methods=("logaddexp",), tags=FUSIBLE)
def logaddexp(input, other):
    """torch.logaddexp"""
    return _logaddexp(input, other, "logaddexp", prims.exp, 1)


@torchsymbol(torch.logaddexp2, methods=("logaddexp2",), tags=FUSIBLE)
def logaddexp2(input, other):
    """torch.logaddexp2"""
    return _logaddexp(input, other, "logaddexp2", prims.exp2, 1 / math.log(2))


# ---------------------------------------------------------------------------
# Gradient rules of half and bfloat16 ops that round where eager's formulas round
# ---------------------------------------------------------------------------
# A low-precision op computes in float32 and rounds once (``clang.elementwise_unary``); differentiating that
# decomposition computes the whole gradient formula in float32 and rounds once more.  Eager's derivative formulas
# (PyTorch's ``derivatives.yaml``) are themselves low-precision torch ops, each computing in float32 and rounding,
# and where a formula reads the op's result it reads the rounded result.  The two differ by an ulp in a quarter of
# the elements or more.  These rules write eager's formula with one torch-language op per eager op on the
# low-precision values, so every step rounds as eager's does (``tests/test_low_precision_grads.py`` and
# ``tests/test_low_precision_sweep.py`` compare bitwise).  They apply only where every tensor argument has one
# low-precision dtype; float32 and float64 calls, and mixed dtypes, are differentiated as before.
#
# ``tanh_backward`` and ``sigmoid_backward`` are eager's kernels (their rounding depends on the device and dtype).
_add, _sub, _mul, _div, _neg = clang.add, clang.sub, clang.mul, clang.true_divide, clang.neg


def _low_precision(*values, **named):
    """Every tensor argument has one low-precision dtype (at least one tensor; plain real numbers allowed)."""
    values = values + tuple(named.values())
    tensors = [v for v in values if type(v) is TensorProxy]
    if not tensors or not tensors[0]._tt_dtype.is_low_precision:
        return False
    if any(isinstance(v, (NumberProxy, complex)) for v in values):
        return False
    return all(t._tt_dtype is tensors[0]._tt_dtype for t in tensors)


def _to(grad, x):
    """A gradient computed at the broadcast shape, summed to ``x``'s shape (as autograd's ``sum_to_size``)."""
    if type(x) is not TensorProxy:
        return None
    return sum_to(grad, x._tt_shape)


# ---------------------------------------------------------------------------
# Eager's kernels for the derivatives of tanh and sigmoid
# ---------------------------------------------------------------------------
@torchsymbol(torch.ops.aten.tanh_backward.default, name="tanh_backward", tags=FUSIBLE)
def tanh_backward(grad_output, output):
    """eager's kernel: grad_output * (1 - output ** 2), computed in float32 for low precision."""
    g, o = clang.upcast(grad_output), clang.upcast(output)
    return clang.maybe_convert(prims.mul(g, prims.sub(1.0, prims.mul(o, o))), grad_output._tt_dtype)


@torchsymbol(torch.ops.aten.sigmoid_backward.default, name="sigmoid_backward", tags=FUSIBLE)
def sigmoid_backward(grad_output, output):
    """eager's kernel: grad_output * (1 - output) * output, computed in float32 for low precision."""
    g, o = clang.upcast(grad_output), clang.upcast(output)
    return clang.maybe_convert(prims.mul(prims.mul(g, prims.sub(1.0, o)), o), grad_output._tt_dtype)


# ---------------------------------------------------------------------------
# Unary ops: eager's formula of ``g`` (the cotangent), ``o`` (the rounded result) and ``x`` (the input)
# ---------------------------------------------------------------------------
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)

_UNARY = {
    tanh: lambda g, o, x: tanh_backward(g, o),
    sigmoid: lambda g, o, x: sigmoid_backward(g, o),
    exp: lambda g, o, x: _mul(g, o),
    exp2: lambda g, o, x: _mul(_mul(g, o), math.log(2.0)),
    expm1: lambda g, o, x: _mul(g, _add(o, 1.0)),
    sqrt: lambda g, o, x: _div(g, _mul(o, 2.0)),
    rsqrt: lambda g, o, x: _mul(_mul(g, -0.5), pow(o, 3)),
    tan: lambda g, o, x: _mul(g, _add(_mul(o, o), 1.0)),
    reciprocal: lambda g, o, x: _mul(_neg(g), _mul(o, o)),
    erfinv: lambda g, o, x: _mul(_mul(exp(_mul(o, o)), 0.5 * math.sqrt(math.pi)), g),
    sin: lambda g, o, x: _mul(g, cos(x)),
    cos: lambda g, o, x: _mul(g, _neg(sin(x))),
    asin: lambda g, o, x: _mul(g, rsqrt(_add(_mul(_neg(x), x), 1.0))),
    acos: lambda g, o, x: _mul(g, _neg(rsqrt(_add(_mul(_neg(x), x), 1.0)))),
    atan: lambda g, o, x: _div(g, _add(_mul(x, x), 1.0)),
    sinh: lambda g, o, x: _mul(g, cosh(x)),
    cosh: lambda g, o, x: _mul(g, sinh(x)),
    asinh: lambda g, o, x: _mul(g, rsqrt(_add(_mul(x, x), 1.0))),
    acosh: lambda g, o, x: _mul(g, rsqrt(_sub(_mul(x, x), 1.0))),
    atanh: lambda g, o, x: _div(g, _sub(1.0, _mul(x, x))),
    log1p: lambda g, o, x: _div(g, _add(x, 1.0)),
    log2: lambda g, o, x: _div(g, _mul(x, math.log(2.0))),
    log10: lambda g, o, x: _div(g, _mul(x, math.log(10.0))),
    erf: lambda g, o, x: _mul(_mul(exp(_neg(_mul(x, x))), _TWO_OVER_SQRT_PI), g),
    erfc: lambda g, o, x: _mul(_mul(exp(_neg(_mul(x, x))), -_TWO_OVER_SQRT_PI), g),
    lgamma: lambda g, o, x: _mul(g, digamma(x)),
}


def _real_float(input):
    return isinstance(input, TensorProxy) and input._tt_dtype.is_float


# tanh and sigmoid in float32 and float64 too: eager's kernels (tanh_backward, sigmoid_backward) round differently
# from the same formula run as separate ops (56 % and 35 % of float32 gradient elements an ulp off otherwise).
_EAGER_KERNEL_IN_EVERY_DTYPE = (tanh, sigmoid)


def _register_unary(sym, formula):
    @register_vjp(sym, supports=_real_float if sym in _EAGER_KERNEL_IN_EVERY_DTYPE else _low_precision)
    def rule(g, out, /, input):
        return {"input": formula(g, out, input)}

    rule.__name__ = f"{sym.name}_eager_formula_vjp"


for _sym, _formula in _UNARY.items():
    _register_unary(_sym, _formula)


# ---------------------------------------------------------------------------
# Binary ops: formulas at the broadcast shape, summed to each input's shape
# ---------------------------------------------------------------------------
@register_vjp(mul, supports=lambda input, other: _low_precision(input, other))
def _mul_vjp(g, out, /, input, other):
    """eager: ``g * other`` and ``g * input``, rounded at the broadcast shape before a broadcast input's sum."""
    return {"input": _to(_mul(g, other), input) if type(input) is TensorProxy else None,
            "other": _to(_mul(g, input), other) if type(other) is TensorProxy else None}


def _pow_grads(g, out, base, exponent):
    """eager's pow_backward_self / pow_backward_exponent: 0 where the exponent is 0 (base) and where the base is 0
    with an exponent >= 0 (exponent)."""
    grads = {}
    if type(base) is TensorProxy:
        if type(exponent) is TensorProxy:
            ga = _mul(g, _mul(exponent, pow(base, _sub(exponent, 1.0))))
            grads["base"] = clang.where(clang.eq(exponent, 0.0), 0.0, ga)
        elif exponent == 0:
            grads["base"] = clang.full_like(base, 0.0)
        else:
            grads["base"] = _mul(g, _mul(exponent, pow(base, exponent - 1)))
    if type(exponent) is TensorProxy:
        if type(base) is TensorProxy:
            log_base = log(base)
            zero = clang.logical_and(clang.eq(base, 0.0), clang.ge(exponent, 0.0))
        else:
            log_base = math.log(base) if base > 0 else (-math.inf if base == 0 else math.nan)
            zero = clang.ge(exponent, 0.0) if base == 0 else None
        term = _mul(out, log_base)
        grads["exponent"] = _mul(g, term if zero is None else clang.where(zero, 0.0, term))
    return grads


def _pow_supported(input, exponent):
    return _low_precision(input, exponent)


@register_vjp(pow, supports=_pow_supported)
def _pow_vjp(g, out, /, input, exponent):
    grads = _pow_grads(g, out, input, exponent)
    return {"input": _to(grads.get("base"), input) if "base" in grads else None,
            "exponent": _to(grads.get("exponent"), exponent) if "exponent" in grads else None}


@register_vjp(rpow, supports=lambda input, other: _low_precision(input, other))
def _rpow_vjp(g, out, /, input, other):
    grads = _pow_grads(g, out, other, input)  # other ** input
    return {"input": _to(grads.get("exponent"), input) if "exponent" in grads else None,
            "other": _to(grads.get("base"), other) if "base" in grads else None}


def _true_division(input, other, *, rounding_mode=None):
    return rounding_mode is None and _low_precision(input, other)


@register_vjp(div, supports=_true_division)
def _div_vjp(g, out, /, input, other, *, rounding_mode=None):
    """eager: ``g / other`` and ``-g * ((input / other) / other)``."""
    gb = _mul(_neg(g), _div(_div(input, other), other)) if type(other) is TensorProxy else None
    return {"input": _to(_div(g, other), input), "other": _to(gb, other) if gb is not None else None}


@register_vjp(rtruediv, supports=lambda input, other: _low_precision(input, other))
def _rtruediv_vjp(g, out, /, input, other):
    """``other / input``: eager's ``Tensor.__rdiv__`` is ``input.reciprocal() * other``, so ``input`` gets
    reciprocal's gradient of ``g * other``, ``-(g * other) * (r * r)`` on the rounded reciprocal ``r``, and a tensor
    ``other`` gets ``g * r``."""
    r = reciprocal(input)
    return {"input": _to(_mul(_neg(_mul(g, other)), _mul(r, r)), input),
            "other": _to(_mul(g, r), other) if type(other) is TensorProxy else None}


@register_vjp(atan2, supports=lambda input, other: _low_precision(input, other) and type(other) is TensorProxy)
def _atan2_vjp(g, out, /, input, other):
    """eager: ``recip = 1 / (input * input + other * other)``; ``g * other * recip`` and ``g * -input * recip``."""
    recip = reciprocal(_add(_mul(input, input), _mul(other, other)))
    return {"input": _to(_mul(_mul(g, other), recip), input), "other": _to(_mul(_mul(g, _neg(input)), recip), other)}


@register_vjp(hypot, supports=lambda input, other: _low_precision(input, other))
def _hypot_vjp(g, out, /, input, other):
    """eager: ``g * input / out`` and ``g * other / out``."""
    return {"input": _to(_div(_mul(g, input), out), input),
            "other": _to(_div(_mul(g, other), out), other) if type(other) is TensorProxy else None}


def _logaddexp_rule(exp_of):
    """eager: ``g / (1 + exp(other - input))`` and ``g / (1 + exp(input - other))`` (``exp2`` for logaddexp2)."""

    def rule(g, out, /, input, other):
        return {"input": _to(_div(g, _add(1.0, exp_of(_sub(other, input)))), input),
                "other": _to(_div(g, _add(1.0, exp_of(_sub(input, other)))), other)}

    return rule


_both_tensors = lambda input, other: _low_precision(input, other) and type(other) is TensorProxy  # noqa: E731
register_vjp(logaddexp, supports=_both_tensors)(_logaddexp_rule(exp))
register_vjp(logaddexp2, supports=_both_tensors)(_logaddexp_rule(lambda t: pow(2.0, t)))
