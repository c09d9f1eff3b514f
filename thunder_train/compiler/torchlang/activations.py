"""Activation functions: relu, gelu, silu, softplus, elu (celu, selu), the hard* forms, ... (symbols, each with
its direct gradient rule where it has one) and threshold, the shrinks, softmin, rrelu (outside training) and
prelu, written as torch calls."""
from __future__ import annotations

import math
import struct

import torch
import torch.nn.functional as F

from .. import clang, prims
from ..clang import Promotion, downcast_like
from ..grad_rules import register_vjp
from .autocast import FP32  # autocast policies: see autocast.py
from .helpers import square, upcast_and_dtype
from .registry import composed, torchsymbol


# Gradient rules are written with prims (the backward is an ordinary trace); see compiler/grad_rules.py.
_mul, _add, _sub = prims.mul, prims.add, prims.sub


@torchsymbol(torch.relu, F.relu, methods=("relu",), torch_impl=F.relu, tags=("fusible", "layout_on_meta"))
def relu(input, inplace=False):
    """max(input, 0); NaN propagates like eager."""
    return clang.elementwise_binary(prims.maximum, input, 0, upcast=False)


@register_vjp(relu)
def _relu_vjp(g, out, /, input, inplace=False):
    # eager's threshold_backward(g, out, 0): 0 where out <= 0, so relu'(0) = 0 and a NaN passes g
    return {"input": prims.where(prims.le(out, 0.0), 0.0, g)}


@torchsymbol(F.relu6)
def relu6(input, inplace=False):
    return hardtanh(input, 0.0, 6.0)


@torchsymbol(F.hardtanh, tags=("fusible",))
def hardtanh(input, min_val=-1.0, max_val=1.0, inplace=False):
    x = clang.where(clang.lt(input, min_val), clang.maybe_convert(min_val, input._tt_dtype), input)
    return clang.where(clang.elementwise_binary(prims.gt, x, max_val, Promotion.ALWAYS_BOOL, upcast=False), clang.maybe_convert(max_val, input._tt_dtype), x)


@register_vjp(hardtanh)
def _hardtanh_vjp(g, out, /, input, min_val=-1.0, max_val=1.0, inplace=False):
    # eager's hardtanh_backward: 0 where input <= min_val or input >= max_val (the bounds included, NaN not)
    outside = prims.bitwise_or(prims.le(input, min_val), prims.ge(input, max_val))
    return {"input": prims.where(outside, 0.0, g)}


@torchsymbol(F.leaky_relu, tags=("fusible",))
def leaky_relu(input, negative_slope=0.01, inplace=False):
    return clang.where(clang.elementwise_binary(prims.gt, input, 0, Promotion.ALWAYS_BOOL, upcast=False), input, clang.mul(input, negative_slope))


# "vjp_layout_from_kernel": eager's gelu_backward is a TensorIterator kernel, its gradient laid out as the incoming
# gradient (channels_last, a transpose); row-major proxies made kept buffers (and fused regions) use another layout
# than the plain program's kernel, ULPs apart.  The fake run's layout is the kernel's here (not for every backward:
# log-softmax's, executors/layout_rules.py).
@torchsymbol(F.gelu, tags=("fusible", "fused_backward", "vjp_layout_from_kernel"))
def gelu(input, approximate="none"):
    """GELU, exact (erf) or tanh approximation; computed in float32 for low precision."""
    x, dt = upcast_and_dtype(input)
    if approximate == "none":
        out = prims.mul(prims.mul(x, 0.5), prims.add(prims.erf(prims.mul(x, 1 / math.sqrt(2))), 1.0))
    elif approximate == "tanh":
        inner = prims.mul(prims.add(x, prims.mul(prims.mul(prims.mul(x, x), x), 0.044715)), math.sqrt(2 / math.pi))
        out = prims.mul(prims.mul(x, 0.5), prims.add(prims.tanh(inner), 1.0))
    else:
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return clang.maybe_convert(out, dt)


@register_vjp(gelu)
def _gelu_vjp(g, out, /, input, approximate="none"):
    """Computed in float32 for low precision, like the forward.  With the torch executor this rule is the
    decomposition of one ``gelu_vjp`` line that runs PyTorch's own backward kernel (``fused_backward``;
    executors/torch_impls.py ``gelu_vjp``)."""
    x, gu = upcast_and_dtype(input)[0], upcast_and_dtype(g)[0]
    if approximate == "tanh":
        k = math.sqrt(2 / math.pi)
        inner = _mul(_add(x, _mul(_mul(square(x), x), 0.044715)), k)
        t = prims.tanh(inner)
        dinner = _mul(_add(_mul(square(x), 3 * 0.044715), 1.0), k)
        d = _add(_mul(_add(t, 1.0), 0.5), _mul(_mul(_mul(x, 0.5), _sub(1.0, square(t))), dinner))
    else:
        cdf = _mul(_add(prims.erf(_mul(x, 1 / math.sqrt(2))), 1.0), 0.5)
        pdf = _mul(prims.exp(_mul(square(x), -0.5)), 1 / math.sqrt(2 * math.pi))
        d = _add(cdf, _mul(x, pdf))
    return {"input": downcast_like(_mul(gu, d), input)}


# What a fused program compiles for tanh GELU's lines (``Symbol.fusion_form``, executors/regions.py).
# 0.5 * (1 + tanh(u)) is sigmoid(2u), so GELU is x * sigmoid(2u): one exp per element where eager's kernel and
# Inductor's own lowering call a vectorized tanh that costs ~5x an exp on this project's AVX-512 CPUs (the
# 1024-wide GELU of the GPT benchmark: 0.87 ms forward, 1.0 ms backward in eager; 0.3 ms each fused).  The same
# function, rounded differently: within a few float32 ulp of eager's values (tests/test_fusion_forms.py, against
# float64), and the same infinities and NaNs.
_GELU_2K = 2 * math.sqrt(2 / math.pi)
_GELU_C = 0.044715


def _gelu_tanh_by_sigmoid(input, approximate="tanh"):
    x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
    z = _GELU_2K * (x + _GELU_C * (x * x * x))  # 2u
    return (x / (1 + torch.exp(-z))).to(input.dtype)


def _gelu_tanh_vjp_by_sigmoid(g, reads, input, approximate="tanh"):
    x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
    x2 = x * x
    z = _GELU_2K * (x + _GELU_C * (x2 * x))
    e = torch.exp(-z)
    s = 1 / (1 + e)  # sigmoid(z) = 0.5 * (1 + tanh(u))
    rest = torch.where(z >= 0, e * s, 1 - s)  # 1 - s without cancellation where s is near 1
    d = s + x * s * rest * (_GELU_2K * (1 + 3 * _GELU_C * x2))
    return ((g.float() if g.dtype != x.dtype else g) * d).to(input.dtype),


# Exact (erf) GELU on the CPU: eager's kernels (oneDNN's forward, aten's backward) cost ~20 us and ~50 us a call
# whatever the size below some thousands of elements, 45 us and 80 us inside a training step (cold after a matmul),
# where Inductor's kernel for the same op takes 13 us and 21 us (3,072 floats, one thread).  From ~64 Ki elements
# eager's are as fast or faster (1 Mi: 1.7 ms against 2.0 ms), so only small GELUs are declared: there a lone GELU
# line forms a region of its own.  The same functions (Inductor's lowering of ``gelu``/``gelu_backward``), rounded
# differently: within 2 float32 ulp of eager's (tests/test_fusion_forms.py).
_GELU_EXACT_FORM_MAX = 16384  # elements


def _gelu_exact(input, approximate="none"):
    return F.gelu(input)


def _gelu_exact_vjp(g, reads, input, approximate="none"):
    return torch.ops.aten.gelu_backward(g, input),


def _small_on_cpu(p) -> bool:
    # Asked by the fusion pass, outside any trace: a symbolic size (ModernBERT's unpadded tokens, ``u0``) has no
    # product to compute there (``numel_`` would record a line, and with no trace to record it in recursed forever).
    if not all(type(s) is int for s in p._tt_shape):
        return False
    return p._tt_device.type == "cpu" and math.prod(p._tt_shape) <= _GELU_EXACT_FORM_MAX


def _gelu_fusion_form(input, approximate="none"):
    # CPU only: a GPU's tanh is not the bottleneck, and a lone GELU is not worth a kernel there
    if approximate == "tanh" and input._tt_device.type == "cpu":
        return _gelu_tanh_by_sigmoid
    return _gelu_exact if approximate == "none" and _small_on_cpu(input) else None


def _gelu_fusion_vjp_form(g, reads, input, approximate="none"):
    if approximate == "tanh" and input._tt_device.type == "cpu":
        return _gelu_tanh_vjp_by_sigmoid
    return _gelu_exact_vjp if approximate == "none" and _small_on_cpu(input) else None


gelu.fusion_form, gelu.fusion_vjp_form = _gelu_fusion_form, _gelu_fusion_vjp_form


@torchsymbol(F.silu, tags=("fusible", "fused_backward",))
def silu(input, inplace=False):
    x, dt = upcast_and_dtype(input)
    return clang.maybe_convert(prims.mul(x, prims.sigmoid(x)), dt)


@register_vjp(silu)
def _silu_vjp(g, out, /, input, inplace=False):
    x, gu = upcast_and_dtype(input)[0], upcast_and_dtype(g)[0]
    s = prims.sigmoid(x)
    return {"input": downcast_like(_mul(gu, _mul(s, _add(_mul(x, _sub(1.0, s)), 1.0))), input)}


@torchsymbol(F.mish, tags=("fusible",))
def mish(input, inplace=False):
    x, dt = upcast_and_dtype(input)
    return clang.maybe_convert(prims.mul(x, prims.tanh(_softplus(x, 1.0, 20.0))), dt)


# Eager's backward kernels as symbols (softplus_backward, elu_backward, mish_backward): the torch executor runs
# the kernel, whose order of operations (and contraction) is eager's, where the same formula as separate ops is an
# ulp off in 4-58 % of the float32 gradient elements; a fused program compiles the decomposition.
@torchsymbol(torch.ops.aten.mish_backward.default, name="mish_backward", tags=("fusible",))
def mish_backward(grad_output, input):
    """g * (tanh(softplus(x)) + x * sigmoid(x) * (1 - tanh(softplus(x)) ** 2)), in float32 for low precision."""
    x, gu = upcast_and_dtype(input)[0], upcast_and_dtype(grad_output)[0]
    t = prims.tanh(prims.log1p(prims.exp(x)))
    d = _add(t, _mul(_mul(x, prims.sigmoid(x)), _sub(1.0, square(t))))
    return downcast_like(_mul(gu, d), input)


@register_vjp(mish)
def _mish_vjp(g, out, /, input, inplace=False):
    return {"input": mish_backward(g, input)}


def _softplus(x, beta, threshold):
    bx = prims.mul(x, beta) if beta != 1 else x
    soft = prims.div(prims.log1p(prims.exp(bx)), beta) if beta != 1 else prims.log1p(prims.exp(bx))
    return prims.where(prims.gt(bx, threshold), x, soft)


@torchsymbol(F.softplus, tags=("fusible",), autocast={"cuda": FP32})
def softplus(input, beta=1.0, threshold=20.0):
    x, dt = upcast_and_dtype(input)
    return clang.maybe_convert(_softplus(x, beta, threshold), dt)


@torchsymbol(torch.ops.aten.softplus_backward.default, name="softplus_backward", tags=("fusible",))
def softplus_backward(grad_output, input, beta, threshold):
    """g where beta * x > threshold (so softplus'(inf) = 1), else g * z / (z + 1), z = exp(beta * x)."""
    x, gu = upcast_and_dtype(input)[0], upcast_and_dtype(grad_output)[0]
    bx = _mul(x, beta) if beta != 1 else x
    z = prims.exp(bx)
    return downcast_like(prims.where(prims.gt(bx, threshold), gu, prims.div(_mul(gu, z), _add(z, 1.0))), input)


@register_vjp(softplus)
def _softplus_vjp(g, out, /, input, beta=1.0, threshold=20.0):
    return {"input": softplus_backward(g, input, beta, threshold)}


def _elu(input, alpha, scale=1.0, input_scale=1.0):
    """eager's elu kernel: scale * x where x > 0, else alpha * scale * expm1(input_scale * x)."""
    x, dt = upcast_and_dtype(input)
    pos = _mul(x, scale) if scale != 1 else x
    neg = prims.mul(prims.expm1(_mul(x, input_scale) if input_scale != 1 else x), alpha * scale)
    return clang.maybe_convert(prims.where(prims.gt(x, 0.0), pos, neg), dt)


@torchsymbol(F.elu, tags=("fusible",))
def elu(input, alpha=1.0, inplace=False):
    return _elu(input, alpha)


# celu and selu are eager's elu kernel with a scale and an input scale (ATen's celu and selu call at::elu), so
# the torch executor runs them whole and their gradient is eager's elu_backward with those scales.
_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


@torchsymbol(F.celu, torch.celu, tags=("fusible",))
def celu(input, alpha=1.0, inplace=False):
    if alpha == 0:
        raise RuntimeError("ZeroDivisionError: alpha cannot be 0 for CELU")  # eager's message
    return _elu(input, alpha, 1.0, 1.0 / alpha)


@torchsymbol(F.selu, torch.selu, tags=("fusible",))
def selu(input, inplace=False):
    return _elu(input, _SELU_ALPHA, _SELU_SCALE)


@torchsymbol(torch.ops.aten.elu_backward.default, name="elu_backward", tags=("fusible",))
def elu_backward(grad_output, alpha, scale, input_scale, is_result, self_or_result):
    """Of the input (``is_result`` False): g * input_scale * alpha * scale * exp(input_scale * x) where x <= 0,
    else g * scale (NaN and inf included)."""
    if is_result:  # eager's kernel: g * input_scale * (r + alpha * scale) where the result r <= 0
        r, gu = upcast_and_dtype(self_or_result)[0], upcast_and_dtype(grad_output)[0]
        neg = _mul(_mul(gu, input_scale), _add(r, alpha * scale))
        return downcast_like(prims.where(prims.le(r, 0.0), neg, _mul(gu, scale) if scale != 1 else gu), self_or_result)
    x, gu = upcast_and_dtype(self_or_result)[0], upcast_and_dtype(grad_output)[0]
    e = prims.exp(_mul(x, input_scale) if input_scale != 1 else x)
    neg = _mul(_mul(_mul(gu, input_scale), alpha * scale), e)
    return downcast_like(prims.where(prims.le(x, 0.0), neg, _mul(gu, scale) if scale != 1 else gu), self_or_result)


@register_vjp(elu)
def _elu_vjp(g, out, /, input, alpha=1.0, inplace=False):
    return {"input": elu_backward(g, alpha, 1.0, 1.0, False, input)}


@register_vjp(celu)
def _celu_vjp(g, out, /, input, alpha=1.0, inplace=False):
    # eager's derivative (derivatives.yaml) passes input_scale 1.0 / alpha.toFloat(): alpha rounded to float32
    return {"input": elu_backward(g, alpha, 1.0, 1.0 / struct.unpack("f", struct.pack("f", alpha))[0], False, input)}


@register_vjp(selu)
def _selu_vjp(g, out, /, input, inplace=False):
    return {"input": elu_backward(g, _SELU_ALPHA, _SELU_SCALE, 1.0, False, input)}


def _elu_kernel(input, alpha, scale, input_scale, grad_input_scale):
    """Eager's elu kernel out of place (``grad_input_scale`` is for the gradient only)."""
    return torch.ops.aten.elu.default(input, alpha, scale, input_scale)


# The in-place forms (``elu_``, ``celu_``, ``selu_``, ``inplace=True``) run eager's elu kernel into the input, and
# eager differentiates them from the result (derivatives.yaml: ``elu_`` and ``celu_`` pass is_result=True): the same
# gradient as the out-of-place forms', rounded differently.  Their new value is this symbol (the dispatcher asks
# each symbol for ``written_in_place``).
@torchsymbol(name="elu_written", torch_impl=_elu_kernel, tags=("fusible",))
def elu_written(input, alpha, scale, input_scale, grad_input_scale):
    return _elu(input, alpha, scale, input_scale)


@register_vjp(elu_written)
def _elu_written_vjp(g, out, /, input, alpha, scale, input_scale, grad_input_scale):
    return {"input": elu_backward(g, alpha, scale, grad_input_scale, True, out)}


elu.written_in_place = lambda input, alpha=1.0, inplace=False: elu_written(input, alpha, 1.0, 1.0, 1.0)
celu.written_in_place = lambda input, alpha=1.0, inplace=False: elu_written(
    input, alpha, 1.0, 1.0 / alpha, 1.0 / struct.unpack("f", struct.pack("f", alpha))[0])  # celu_'s derivative
selu.written_in_place = lambda input, inplace=False: elu_written(input, _SELU_ALPHA, _SELU_SCALE, 1.0, 1.0)


@torchsymbol(F.logsigmoid)
def logsigmoid(input):
    x, dt = upcast_and_dtype(input)
    return clang.maybe_convert(prims.neg(_softplus(prims.neg(x), 1.0, 20.0)), dt)


@register_vjp(logsigmoid)
def _logsigmoid_vjp(g, out, /, input):
    # eager's log_sigmoid_backward: g * (max_deriv - sign * z / (1 + z)), z = exp(-|x|); exact at -inf (1) and inf (0)
    x, gu = upcast_and_dtype(input)[0], upcast_and_dtype(g)[0]
    negative = prims.lt(x, 0.0)
    # eager's forward keeps z in the input's dtype (its buffer): a half or bfloat16 z is rounded
    z = clang.upcast(clang.maybe_convert(prims.exp(prims.neg(prims.abs(x))), input._tt_dtype))
    frac = prims.div(z, _add(z, 1.0))
    return {"input": downcast_like(_mul(gu, prims.where(negative, _sub(1.0, frac), frac)), input)}


@torchsymbol(F.hardsigmoid, tags=("fusible",))
def hardsigmoid(input, inplace=False):
    return clang.true_divide(hardtanh(clang.add(input, 3.0), -3.0 + 3.0, 6.0), 6.0)


@register_vjp(hardsigmoid)
def _hardsigmoid_vjp(g, out, /, input, inplace=False):
    # eager's hardsigmoid_backward: g / 6 where -3 < x < 3, else 0 (NaN included)
    x, gu = upcast_and_dtype(input)[0], upcast_and_dtype(g)[0]
    inside = prims.bitwise_and(prims.gt(x, -3.0), prims.lt(x, 3.0))
    return {"input": downcast_like(prims.where(inside, prims.div(gu, 6.0), 0.0), input)}


@torchsymbol(F.hardswish, tags=("fusible",))
def hardswish(input, inplace=False):
    return clang.mul(input, hardsigmoid(input))


@register_vjp(hardswish)
def _hardswish_vjp(g, out, /, input, inplace=False):
    # eager's hardswish_backward: 0 where x <= -3, g * (x / 3 + 0.5) where x < 3, else g (NaN included)
    x, gu = upcast_and_dtype(input)[0], upcast_and_dtype(g)[0]
    middle = prims.where(prims.lt(x, 3.0), _mul(gu, _add(prims.div(x, 3.0), 0.5)), gu)
    return {"input": downcast_like(prims.where(prims.le(x, -3.0), 0.0, middle), input)}


@torchsymbol(F.glu)
def glu(input, dim=-1):
    a, b = clang.slice_in_dim(input, 0, input._tt_shape[dim] // 2, 1, dim), clang.slice_in_dim(input, input._tt_shape[dim] // 2, input._tt_shape[dim], 1, dim)
    return clang.mul(a, clang.elementwise_unary(prims.sigmoid, b, Promotion.INT_TO_FLOAT))


# ---------------------------------------------------------------------------
# Written as torch calls the torch language knows (registry.composed: traced as the user's own calls)
# ---------------------------------------------------------------------------
def softsign(input):
    """As eager's ``F.softsign``, torch calls (each rounding, with its own gradient rule, as eager's)."""
    return input / (input.abs() + 1)


composed("softsign", softsign, (F.softsign,))


def _maybe_inplace(input, out, inplace):
    return input.copy_(out) if inplace else out  # the copy_ is functionalized like the user's own


def threshold(input, threshold, value, inplace=False):
    return _maybe_inplace(input, torch.where(input > threshold, input, torch.full_like(input, value)), inplace)


composed("threshold", threshold, (F.threshold, torch.threshold, F._threshold))


def tanhshrink(input):
    return input - torch.tanh(input)


composed("tanhshrink", tanhshrink, (F.tanhshrink,))


def softshrink(input, lambd=0.5):
    return torch.where(input > lambd, input - lambd, torch.where(input < -lambd, input + lambd, torch.zeros_like(input)))


composed("softshrink", softshrink, (F.softshrink,))


def hardshrink(input, lambd=0.5):
    return torch.where((input > lambd) | (input < -lambd), input, torch.zeros_like(input))


composed("hardshrink", hardshrink, (F.hardshrink, torch.hardshrink), ("hardshrink",))


def softmin(input, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        raise NotImplementedError("softmin without dim is run by torch")
    return F.softmax(-input if dtype is None else -input.to(dtype), dim)


composed("softmin", softmin, (F.softmin,))


def rrelu(input, lower=1.0 / 8, upper=1.0 / 3, training=False, inplace=False):
    if training:
        raise NotImplementedError("rrelu in training (random slopes) is run by torch")
    return F.leaky_relu(input, (lower + upper) / 2, inplace)


composed("rrelu", rrelu, (F.rrelu,))


def prelu(input, weight):
    if weight.numel() == 1:
        w = weight.reshape(())
    else:
        if input.ndim < 2 and input.ndim != 1:
            raise NotImplementedError("prelu of this shape is run by torch")
        ch = 1 if input.ndim >= 2 else 0
        w = weight.reshape([-1 if i == ch else 1 for i in range(input.ndim)])
    return torch.where(input > 0, input, w * input)


composed("prelu", prelu, (F.prelu, torch.prelu), ("prelu",))
