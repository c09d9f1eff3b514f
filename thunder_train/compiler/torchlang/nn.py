"""torch.nn.functional: activations, linear/bilinear/embedding/dropout, normalisation, attention, convolution,
pooling.

Losses are in losses.py; the ops of these families written as torch calls are in activations.py,
normalization.py, dropout.py, padding.py, pooling.py and distances.py.  Each op's gradient rule, where it has
a direct one, follows its definition."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import clang, dtypes, prims
from ..clang import Promotion
from ..proxies import TensorProxy, as_divisor
from ..clang import downcast_like, upcast
from ..grad_rules import register_vjp
from ..prims.core import is_float as _float, sum_to, zeros_like
from .autocast import FP32, LOWER  # autocast policies: see autocast.py
from .registry import composed, torchsymbol


def _t(x):
    return type(x) is TensorProxy


def _up(a):
    """Upcast low-precision floats for a composite; returns (value, original dtype)."""
    return clang.maybe_convert(a, clang.compute_dtype(a._tt_dtype)), a._tt_dtype


def _back(grad, like):
    """A gradient computed in the upcast dtype, converted back to its input's dtype."""
    return clang.maybe_convert(grad, like._tt_dtype) if grad is not None else None


# Gradient rules are written with prims (the backward is an ordinary trace); see compiler/grad_rules.py.
_mul, _add, _sub = prims.mul, prims.add, prims.sub


def _square(x):
    return prims.mul(x, x)


# ---------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------
@torchsymbol(torch.relu, F.relu, methods=("relu",), torch_impl=torch.relu, tags=("fusible",))
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


@torchsymbol(F.gelu, tags=("fusible", "fused_backward",))
def gelu(input, approximate="none"):
    """GELU, exact (erf) or tanh approximation; computed in float32 for low precision."""
    x, dt = _up(input)
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
    x, gu = _up(input)[0], _up(g)[0]
    if approximate == "tanh":
        k = math.sqrt(2 / math.pi)
        inner = _mul(_add(x, _mul(_mul(_square(x), x), 0.044715)), k)
        t = prims.tanh(inner)
        dinner = _mul(_add(_mul(_square(x), 3 * 0.044715), 1.0), k)
        d = _add(_mul(_add(t, 1.0), 0.5), _mul(_mul(_mul(x, 0.5), _sub(1.0, _square(t))), dinner))
    else:
        cdf = _mul(_add(prims.erf(_mul(x, 1 / math.sqrt(2))), 1.0), 0.5)
        pdf = _mul(prims.exp(_mul(_square(x), -0.5)), 1 / math.sqrt(2 * math.pi))
        d = _add(cdf, _mul(x, pdf))
    return {"input": _back(_mul(gu, d), input)}


@torchsymbol(F.silu, tags=("fusible", "fused_backward",))
def silu(input, inplace=False):
    x, dt = _up(input)
    return clang.maybe_convert(prims.mul(x, prims.sigmoid(x)), dt)


@register_vjp(silu)
def _silu_vjp(g, out, /, input, inplace=False):
    x, gu = _up(input)[0], _up(g)[0]
    s = prims.sigmoid(x)
    return {"input": _back(_mul(gu, _mul(s, _add(_mul(x, _sub(1.0, s)), 1.0))), input)}


@torchsymbol(F.mish, tags=("fusible",))
def mish(input, inplace=False):
    x, dt = _up(input)
    return clang.maybe_convert(prims.mul(x, prims.tanh(_softplus(x, 1.0, 20.0))), dt)


def _softplus(x, beta, threshold):
    bx = prims.mul(x, beta) if beta != 1 else x
    soft = prims.div(prims.log1p(prims.exp(bx)), beta) if beta != 1 else prims.log1p(prims.exp(bx))
    return prims.where(prims.gt(bx, threshold), x, soft)


@torchsymbol(F.softplus, tags=("fusible",), autocast={"cuda": FP32})
def softplus(input, beta=1.0, threshold=20.0):
    x, dt = _up(input)
    return clang.maybe_convert(_softplus(x, beta, threshold), dt)


@register_vjp(softplus)
def _softplus_vjp(g, out, /, input, beta=1.0, threshold=20.0):
    # eager's softplus_backward: g where beta * x > threshold (so softplus'(inf) = 1), else g * z / (z + 1), z = exp(beta * x)
    x, gu = _up(input)[0], _up(g)[0]
    bx = _mul(x, beta) if beta != 1 else x
    z = prims.exp(bx)
    return {"input": _back(prims.where(prims.gt(bx, threshold), gu, prims.div(_mul(gu, z), _add(z, 1.0))), input)}


@torchsymbol(F.elu, tags=("fusible",))
def elu(input, alpha=1.0, inplace=False):
    x, dt = _up(input)
    return clang.maybe_convert(prims.where(prims.gt(x, 0.0), x, prims.mul(prims.expm1(x), alpha)), dt)


@register_vjp(elu)
def _elu_vjp(g, out, /, input, alpha=1.0, inplace=False):
    # eager's elu_backward (of the input): g * alpha * exp(x) where x <= 0, else g (NaN and inf included)
    x, gu = _up(input)[0], _up(g)[0]
    return {"input": _back(prims.where(prims.le(x, 0.0), _mul(_mul(gu, alpha), prims.exp(x)), gu), input)}


@torchsymbol(F.logsigmoid)
def logsigmoid(input):
    x, dt = _up(input)
    return clang.maybe_convert(prims.neg(_softplus(prims.neg(x), 1.0, 20.0)), dt)


@register_vjp(logsigmoid)
def _logsigmoid_vjp(g, out, /, input):
    # eager's log_sigmoid_backward: g * (max_deriv - sign * z / (1 + z)), z = exp(-|x|); exact at -inf (1) and inf (0)
    x, gu = _up(input)[0], _up(g)[0]
    negative = prims.lt(x, 0.0)
    z = prims.exp(prims.neg(prims.abs(x)))
    frac = prims.div(z, _add(z, 1.0))
    return {"input": _back(_mul(gu, prims.where(negative, _sub(1.0, frac), frac)), input)}


@torchsymbol(F.hardsigmoid, tags=("fusible",))
def hardsigmoid(input, inplace=False):
    return clang.true_divide(hardtanh(clang.add(input, 3.0), -3.0 + 3.0, 6.0), 6.0)


@register_vjp(hardsigmoid)
def _hardsigmoid_vjp(g, out, /, input, inplace=False):
    # eager's hardsigmoid_backward: g / 6 where -3 < x < 3, else 0 (NaN included)
    x, gu = _up(input)[0], _up(g)[0]
    inside = prims.bitwise_and(prims.gt(x, -3.0), prims.lt(x, 3.0))
    return {"input": _back(prims.where(inside, prims.div(gu, 6.0), 0.0), input)}


@torchsymbol(F.hardswish, tags=("fusible",))
def hardswish(input, inplace=False):
    return clang.mul(input, hardsigmoid(input))


@register_vjp(hardswish)
def _hardswish_vjp(g, out, /, input, inplace=False):
    # eager's hardswish_backward: 0 where x <= -3, g * (x / 3 + 0.5) where x < 3, else g (NaN included)
    x, gu = _up(input)[0], _up(g)[0]
    middle = prims.where(prims.lt(x, 3.0), _mul(gu, _add(prims.div(x, 3.0), 0.5)), gu)
    return {"input": _back(prims.where(prims.le(x, -3.0), 0.0, middle), input)}


@torchsymbol(F.softsign)
def softsign(input):
    return clang.true_divide(input, clang.add(clang.elementwise_unary(prims.abs, input), 1))


@torchsymbol(F.glu)
def glu(input, dim=-1):
    a, b = clang.slice_in_dim(input, 0, input._tt_shape[dim] // 2, 1, dim), clang.slice_in_dim(input, input._tt_shape[dim] // 2, input._tt_shape[dim], 1, dim)
    return clang.mul(a, clang.elementwise_unary(prims.sigmoid, b, Promotion.INT_TO_FLOAT))


# ---------------------------------------------------------------------------
# Linear, embedding, dropout
# ---------------------------------------------------------------------------
@torchsymbol(F.linear, autocast={"cpu": LOWER, "cuda": LOWER})
def linear(input, weight, bias=None):
    out = prims.matmul(input, clang.transpose(weight, 0, 1) if weight.ndim_ == 2 else weight)
    if bias is not None:
        out = clang.add(out, bias)
    return out


@register_vjp(linear, supports=lambda input, weight, bias=None: weight.ndim_ == 2 and input._tt_dtype is weight._tt_dtype)
def _linear_vjp(g, out, /, input, weight, bias=None):
    n_out, n_in = weight._tt_shape
    g2 = clang.reshape(g, (-1, n_out))
    grads = {
        "input": clang.reshape(prims.matmul(g2, weight), input._tt_shape),
        "weight": prims.matmul(clang.transpose(g2, 0, 1), clang.reshape(input, (-1, n_in))),
    }
    if _t(bias):
        grads["bias"] = downcast_like(prims.sum(g2, (0,)), bias)
    return grads


@torchsymbol(F.embedding, tags=("fused_backward", "fallible"))
def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False):
    if max_norm is not None:
        raise NotImplementedError("embedding(max_norm=...) renormalises the weight in place; not supported")
    flat = clang.reshape(input, (-1,))
    out = prims.take(weight, flat, 0)
    return clang.reshape(out, input._tt_shape + (weight._tt_shape[1],))


@register_vjp(embedding, supports=lambda input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False: not scale_grad_by_freq and not sparse)
def _embedding_vjp(g, out, /, input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False):
    # Rows are accumulated with index_put; the padding row gets no gradient (torch semantics).
    idx = clang.reshape(input, (-1,))
    rows = clang.reshape(g, (-1, weight._tt_shape[1]))
    if padding_idx is not None:
        pad = padding_idx % weight._tt_shape[0]
        is_pad = prims.broadcast_in_dim(prims.eq(idx, pad), rows._tt_shape, (0,))
        rows = prims.where(is_pad, 0.0, rows)
    return {"weight": prims.index_put(zeros_like(weight), (idx,), rows, True)}


@torchsymbol(F.dropout, torch.dropout)
def dropout(input, p=0.5, training=True, inplace=False):
    """Dropout with a fresh mask each call; identity when not training or p == 0."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    if p == 1.0:
        return clang.mul(input, 0.0)
    # As eager computes it on CPU: noise = bernoulli(1 - p) / (1 - p); input * noise (the same random draws).
    noise = prims.div(prims.bernoulli(input, 1.0 - p), 1.0 - p)
    return prims.mul(input, noise)


# ---------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------
@torchsymbol(F.layer_norm, tags=("fused_backward",), autocast={"cuda": FP32})
def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    x, dt = _up(input)
    nd = len(tuple(normalized_shape))
    dims = tuple(range(x.ndim_ - nd, x.ndim_))
    var = prims.var(x, dims, 0)
    mean = prims.div(prims.sum(x, dims), as_divisor(math.prod(x._tt_shape[d] for d in dims)))
    var = clang._restore_dims(var, x._tt_shape, dims)
    mean = clang._restore_dims(mean, x._tt_shape, dims)
    out = prims.mul(prims.sub(x, clang.expand(mean, x._tt_shape)), clang.expand(prims.rsqrt(prims.add(var, eps)), x._tt_shape))
    if weight is not None:
        out = clang.mul(out, clang.maybe_convert(weight, out._tt_dtype))
    if bias is not None:
        out = clang.add(out, clang.maybe_convert(bias, out._tt_dtype))
    return clang.maybe_convert(out, dt)


@torchsymbol(F.rms_norm, tags=("fused_backward",), autocast={"cuda": FP32})
def rms_norm(input, normalized_shape, weight=None, eps=None):
    x, dt = _up(input)
    nd = len(tuple(normalized_shape))
    dims = tuple(range(x.ndim_ - nd, x.ndim_))
    if eps is None:
        eps = torch.finfo(input._tt_dtype.torch).eps
    ms = clang.mean(prims.mul(x, x), dims, keepdim=True)
    out = prims.mul(x, clang.expand(prims.rsqrt(prims.add(ms, eps)), x._tt_shape))
    if weight is not None:
        out = clang.mul(out, clang.maybe_convert(weight, out._tt_dtype))
    return clang.maybe_convert(out, dt)


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
        grads["weight"] = downcast_like(clang.reshape(clang.sum(_mul(gy, xhat), batch), weight._tt_shape), weight)
    if _t(bias):
        grads["bias"] = downcast_like(clang.reshape(clang.sum(gy, batch), bias._tt_shape), bias)
    return grads


@register_vjp(layer_norm)
def _layer_norm_vjp(g, out, /, input, normalized_shape, weight=None, bias=None, eps=1e-5):
    # Mean and rstd are recomputed from the input (cheap reductions) instead of being saved.
    x, gy = upcast(input), upcast(g)
    dims = _norm_dims(x, normalized_shape)
    mean = _mean_keep(x, dims)
    centred = _sub(x, mean)
    rstd = clang.expand(prims.rsqrt(_add(clang.mean(_square(centred), dims, keepdim=True), eps)), x._tt_shape)
    xhat = _mul(centred, rstd)
    gxhat = clang.mul(gy, weight) if _t(weight) else gy
    gx = _mul(rstd, _sub(_sub(gxhat, _mean_keep(gxhat, dims)), _mul(xhat, _mean_keep(_mul(gxhat, xhat), dims))))
    return {"input": downcast_like(gx, input), **_affine_grads(gy, xhat, weight, bias, dims)}


@register_vjp(rms_norm)
def _rms_norm_vjp(g, out, /, input, normalized_shape, weight=None, eps=None):
    x, gy = upcast(input), upcast(g)
    dims = _norm_dims(x, normalized_shape)
    if eps is None:
        eps = torch.finfo(input._tt_dtype.torch).eps
    rrms = clang.expand(prims.rsqrt(_add(clang.mean(_square(x), dims, keepdim=True), eps)), x._tt_shape)
    xhat = _mul(x, rrms)
    gxhat = clang.mul(gy, weight) if _t(weight) else gy
    gx = _mul(rrms, _sub(gxhat, _mul(xhat, _mean_keep(_mul(gxhat, xhat), dims))))
    return {"input": downcast_like(gx, input), **_affine_grads(gy, xhat, weight, None, dims)}


@torchsymbol(F.batch_norm)
def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """Batch norm; in training mode the running statistics are updated in place (copy_)."""
    x, dt = _up(input)
    C = x._tt_shape[1]
    dims = (0,) + tuple(range(2, x.ndim_))
    bshape = (1, C) + (1,) * (x.ndim_ - 2)
    if training:
        n = math.prod(x._tt_shape[d] for d in dims)
        var = prims.var(x, dims, 0)
        mean = prims.div(prims.sum(x, dims), as_divisor(n))
        if running_mean is not None:
            new_mean = clang.add(clang.mul(running_mean, 1 - momentum), clang.mul(clang.maybe_convert(mean, running_mean._tt_dtype), momentum))
            prims.copy_(new_mean, running_mean)
        if running_var is not None:
            unbiased = prims.mul(var, n / max(n - 1, 1))
            new_var = clang.add(clang.mul(running_var, 1 - momentum), clang.mul(clang.maybe_convert(unbiased, running_var._tt_dtype), momentum))
            prims.copy_(new_var, running_var)
    else:
        mean = clang.maybe_convert(running_mean, x._tt_dtype)
        var = clang.maybe_convert(running_var, x._tt_dtype)
    out = prims.mul(
        prims.sub(x, clang.expand(clang.reshape(mean, bshape), x._tt_shape)),
        clang.expand(clang.reshape(prims.rsqrt(prims.add(var, eps)), bshape), x._tt_shape),
    )
    if weight is not None:
        out = clang.mul(out, clang.reshape(clang.maybe_convert(weight, out._tt_dtype), bshape))
    if bias is not None:
        out = clang.add(out, clang.reshape(clang.maybe_convert(bias, out._tt_dtype), bshape))
    return clang.maybe_convert(out, dt)


def _batch_norm_functionalize(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """The tracer's form: the normalised output plus the running statistics' new values as writes."""
    if not training or (running_mean is None and running_var is None):
        return batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps), []
    out = batch_norm(input, None, None, weight, bias, True, momentum, eps)
    x, _ = _up(input)
    dims = (0,) + tuple(range(2, x.ndim_))
    n = math.prod(x._tt_shape[d] for d in dims)
    writes = []
    if running_mean is not None:
        mean = prims.div(prims.sum(x, dims), as_divisor(n))
        writes.append((running_mean, clang.add(clang.mul(running_mean, 1 - momentum), clang.mul(clang.maybe_convert(mean, running_mean._tt_dtype), momentum))))
    if running_var is not None:
        unbiased = prims.var(x, dims, 1 if n > 1 else 0)
        writes.append((running_var, clang.add(clang.mul(running_var, 1 - momentum), clang.mul(clang.maybe_convert(unbiased, running_var._tt_dtype), momentum))))
    return out, writes


batch_norm.functionalize = _batch_norm_functionalize


@torchsymbol(F.group_norm, autocast={"cuda": FP32})
def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    """Normalise over (C / num_groups, *spatial) per sample and group, then a per-channel affine."""
    x, dt = _up(input)
    N, C = x._tt_shape[0], x._tt_shape[1]
    if C % num_groups:
        raise ValueError(f"Expected number of channels in input to be divisible by num_groups, but got input of shape {x._tt_shape} and num_groups={num_groups}")
    g = clang.reshape(x, (N, num_groups, -1))
    var = clang._restore_dims(prims.var(g, (2,), 0), g._tt_shape, (2,))
    mean = clang._restore_dims(prims.div(prims.sum(g, (2,)), as_divisor(g._tt_shape[2])), g._tt_shape, (2,))
    out = prims.mul(prims.sub(g, clang.expand(mean, g._tt_shape)), clang.expand(prims.rsqrt(prims.add(var, eps)), g._tt_shape))
    out = clang.reshape(out, x._tt_shape)
    bshape = (1, C) + (1,) * (x.ndim_ - 2)
    if weight is not None:
        out = clang.mul(out, clang.reshape(clang.maybe_convert(weight, out._tt_dtype), bshape))
    if bias is not None:
        out = clang.add(out, clang.reshape(clang.maybe_convert(bias, out._tt_dtype), bshape))
    return clang.maybe_convert(out, dt)


@torchsymbol(F.normalize, autocast={"cuda": FP32})
def normalize(input, p=2.0, dim=1, eps=1e-12, out=None):
    from .reductions import norm

    n = norm(input, p, dim, True)
    return clang.true_divide(input, clang.expand(clang.maximum(n, eps), input._tt_shape))


# ---------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------
@torchsymbol(F.scaled_dot_product_attention, tags=("fused_backward",), autocast={"cpu": LOWER, "cuda": LOWER})
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """softmax(q kᵀ · scale + mask) v, with causal masking and grouped-query attention."""
    q, dt = _up(query)
    k = clang.maybe_convert(key, q._tt_dtype)
    v = clang.maybe_convert(value, q._tt_dtype)
    E = q._tt_shape[-1]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    if enable_gqa and k._tt_shape[-3] != q._tt_shape[-3]:
        rep = q._tt_shape[-3] // k._tt_shape[-3]
        k = _repeat_heads(k, rep)
        v = _repeat_heads(v, rep)
    scores = prims.mul(prims.matmul(q, clang.transpose(k, -2, -1)), scale)
    L, S = q._tt_shape[-2], k._tt_shape[-2]
    if is_causal:
        if attn_mask is not None:
            raise ValueError("scaled_dot_product_attention: pass either attn_mask or is_causal, not both")
        r = prims.broadcast_in_dim(prims.iota(L, start=0, step=1, device=q._tt_device, dtype=dtypes.int64), (L, S), (0,))
        c = prims.broadcast_in_dim(prims.iota(S, start=0, step=1, device=q._tt_device, dtype=dtypes.int64), (L, S), (1,))
        keep = prims.ge(r, c)
        scores = clang.where(clang.expand(keep, scores._tt_shape), scores, -math.inf)
    elif attn_mask is not None:
        if attn_mask._tt_dtype.is_bool:
            scores = clang.where(clang.expand(attn_mask, scores._tt_shape) if attn_mask._tt_shape != scores._tt_shape else attn_mask, scores, -math.inf)
        else:
            scores = clang.add(scores, clang.maybe_convert(attn_mask, scores._tt_dtype))
    p = clang.softmax(scores, -1)
    if dropout_p > 0.0:
        p = dropout(p, dropout_p, True)
    return clang.maybe_convert(prims.matmul(p, v), dt)


def _repeat_heads(x, rep):
    shape = x._tt_shape
    x = clang.unsqueeze(x, -3)
    x = clang.expand(x, shape[:-2] + (rep,) + shape[-2:])
    return clang.reshape(x, shape[:-3] + (shape[-3] * rep,) + shape[-2:])


def _sdpa_supported(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """No dropout (its mask exists only inside the forward: the decomposition, which keeps it, is used then)."""
    if dropout_p != 0.0 or not query.ndim_ == key.ndim_ == value.ndim_:
        return False
    hq, hk, hv = (t._tt_shape[-3:-2] for t in (query, key, value))
    if hq == hk == hv:
        return True
    return bool(enable_gqa) and hk == hv and hq[0] % hk[0] == 0


@register_vjp(scaled_dot_product_attention, supports=_sdpa_supported)
def _sdpa_vjp(g, out, /, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Attention probabilities are recomputed from q and k; nothing of size L×S is saved.

    Grouped-query attention (``enable_gqa``, fewer key/value heads): each kv
    head serves ``Hq / Hkv`` consecutive query heads, so it is repeated for the
    computation and its gradient is the sum over its group.
    """
    q, k, v, gu = upcast(query), upcast(key), upcast(value), upcast(g)
    rep = 1
    if q.ndim_ >= 3 and k._tt_shape[-3] != q._tt_shape[-3]:
        rep = q._tt_shape[-3] // k._tt_shape[-3]
        k, v = _repeat_heads(k, rep), _repeat_heads(v, rep)
    L, S = q._tt_shape[-2], k._tt_shape[-2]
    scale = 1.0 / math.sqrt(q._tt_shape[-1]) if scale is None else scale
    scores = _mul(prims.matmul(q, clang.transpose(k, -2, -1)), scale)
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
    gs = _mul(p, _sub(gp, clang.expand(clang.sum(_mul(gp, p), -1, keepdim=True), p._tt_shape)))
    gk = _mul(prims.matmul(clang.transpose(gs, -2, -1), q), scale)
    if rep > 1:
        gk, gv = _sum_head_groups(gk, rep), _sum_head_groups(gv, rep)
    grads = {
        "query": downcast_like(sum_to(_mul(prims.matmul(gs, k), scale), query._tt_shape), query),
        "key": downcast_like(sum_to(gk, key._tt_shape), key),
        "value": downcast_like(sum_to(gv, value._tt_shape), value),
    }
    if _float(attn_mask) and not is_causal:
        grads["attn_mask"] = downcast_like(sum_to(gs, attn_mask._tt_shape), attn_mask)
    return grads


def _sum_head_groups(x, rep):
    """(..., H·rep, S, E) -> (..., H, S, E): the sum over each group of ``rep`` consecutive heads."""
    shape = x._tt_shape
    grouped = clang.reshape(x, shape[:-3] + (shape[-3] // rep, rep) + shape[-2:])
    return prims.sum(grouped, (len(shape) - 2,))


# ---------------------------------------------------------------------------
# Convolution and pooling
# ---------------------------------------------------------------------------
def _ntuple(x, n):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,) * n


def _conv(input, weight, bias, stride, padding, dilation, groups, nd):
    if isinstance(padding, str):
        if padding == "valid":
            padding = 0
        elif padding == "same":
            padding = tuple((dilation_i * (k - 1)) // 2 for dilation_i, k in zip(_ntuple(dilation, nd), weight._tt_shape[2:]))
            if any((d * (k - 1)) % 2 for d, k in zip(_ntuple(dilation, nd), weight._tt_shape[2:])):
                raise NotImplementedError("padding='same' with an even effective kernel size is not supported")
        else:
            raise ValueError(f"invalid padding string {padding!r}")
    unbatched = input.ndim_ == nd + 1
    x = clang.unsqueeze(input, 0) if unbatched else input
    out = prims.convolution(x, weight, None, _ntuple(stride, nd), _ntuple(padding, nd), _ntuple(dilation, nd), groups)
    if bias is not None:
        out = clang.add(out, clang.reshape(bias, (1, -1) + (1,) * nd))
    return clang.squeeze(out, (0,)) if unbatched else out


@torchsymbol(F.conv1d, torch.conv1d, autocast={"cpu": LOWER, "cuda": LOWER})
def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return _conv(input, weight, bias, stride, padding, dilation, groups, 1)


@torchsymbol(F.conv2d, torch.conv2d, autocast={"cpu": LOWER, "cuda": LOWER})
def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return _conv(input, weight, bias, stride, padding, dilation, groups, 2)


def _pool_windows(x, kernel, stride, padding, fill):
    """Stack every kernel offset's strided slice: (..., kh*kw, Ho, Wo)."""
    kh, kw = kernel
    sh, sw = stride
    ph, pw = padding
    if ph or pw:
        cfg = [(0, 0, 0)] * (x.ndim_ - 2) + [(ph, ph, 0), (pw, pw, 0)]
        x = prims.pad(x, fill, tuple(cfg))
    H, W = x._tt_shape[-2], x._tt_shape[-1]
    Ho, Wo = (H - kh) // sh + 1, (W - kw) // sw + 1
    views = []
    for i in range(kh):
        for j in range(kw):
            lo = [0] * (x.ndim_ - 2) + [i, j]
            hi = list(x._tt_shape[:-2]) + [i + sh * (Ho - 1) + 1, j + sw * (Wo - 1) + 1]
            st = [1] * (x.ndim_ - 2) + [sh, sw]
            views.append(clang.unsqueeze(prims.slice(x, tuple(lo), tuple(hi), tuple(st)), -3))
    return clang.cat(views, -3)


@torchsymbol(F.max_pool2d, torch.max_pool2d)
def max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    if ceil_mode or return_indices or _ntuple(dilation, 2) != (1, 1):
        raise NotImplementedError("max_pool2d: ceil_mode, return_indices and dilation are not supported in the decomposition")
    k = _ntuple(kernel_size, 2)
    s = _ntuple(stride, 2) if stride not in (None, [], ()) else k
    w = _pool_windows(input, k, s, _ntuple(padding, 2), -math.inf if input._tt_dtype.is_float else torch.iinfo(input._tt_dtype.torch).min)
    return prims.amax(w, (w.ndim_ - 3,))


def _max_pool2d_float(input, *args, **kwargs):
    return input._tt_dtype.is_float


@register_vjp(max_pool2d, supports=_max_pool2d_float)
def _max_pool2d_vjp(g, out, /, input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    """As eager's kernel, each window's gradient goes to one position: its first maximum in scan order, or its
    last NaN (``val > maxval || isnan(val)``); never to the padding."""
    k = _ntuple(kernel_size, 2)
    s = _ntuple(stride, 2) if stride not in (None, [], ()) else k
    p = _ntuple(padding, 2)
    w = _pool_windows(input, k, s, p, -math.inf)  # (..., K, Ho, Wo)
    kd, n = w.ndim_ - 3, k[0] * k[1]
    per_window = tuple(d for d in range(w.ndim_) if d != kd)
    best = prims.broadcast_in_dim(out, w._tt_shape, per_window)
    first_max = prims.eq(w, best)
    if p != (0, 0):
        ones = prims.full(input._tt_shape, 1.0, device=input._tt_device, dtype=input._tt_dtype)
        first_max = prims.bitwise_and(first_max, prims.ne(_pool_windows(ones, k, s, p, 0.0), 0.0))
    nan = prims.isnan(w)
    any_nan = prims.broadcast_in_dim(prims.gt(prims.amax(prims.convert_element_type(nan, dtypes.int64), (kd,)), 0), w._tt_shape, per_window)
    pos = prims.broadcast_in_dim(prims.iota(n, start=0, step=1, device=input._tt_device, dtype=dtypes.int64), w._tt_shape, (kd,))
    # A score per candidate position, highest for the one eager picks: the last NaN, else the first maximum.
    score = prims.where(any_nan, prims.where(nan, _add(pos, 1), 0), prims.where(first_max, _sub(n, pos), 0))
    chosen = prims.eq(score, prims.broadcast_in_dim(prims.amax(score, (kd,)), w._tt_shape, per_window))
    gw = prims.where(chosen, prims.broadcast_in_dim(g, w._tt_shape, per_window), 0.0)
    # Each kernel offset (i, j) read a strided slice of the padded input: pad its gradient back and add them up.
    lead = [(0, 0, 0)] * (input.ndim_ - 2)
    H, W = input._tt_shape[-2] + 2 * p[0], input._tt_shape[-1] + 2 * p[1]
    Ho, Wo = g._tt_shape[-2], g._tt_shape[-1]
    total = None
    for t in range(n):
        i, j = divmod(t, k[1])
        lo, hi = [0] * w.ndim_, list(w._tt_shape)
        lo[kd], hi[kd] = t, t + 1
        gt_ = clang.reshape(prims.slice(gw, tuple(lo), tuple(hi), (1,) * w.ndim_), g._tt_shape)
        cfg = lead + [(i, H - (i + s[0] * (Ho - 1) + 1), s[0] - 1), (j, W - (j + s[1] * (Wo - 1) + 1), s[1] - 1)]
        part = prims.pad(gt_, 0.0, tuple(cfg))
        total = part if total is None else _add(total, part)
    if p != (0, 0):
        total = prims.pad(total, 0.0, tuple(lead + [(-p[0], -p[0], 0), (-p[1], -p[1], 0)]))
    return {"input": total}


@torchsymbol(F.avg_pool2d, torch._C._nn.avg_pool2d)
def avg_pool2d(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    if ceil_mode:
        raise NotImplementedError("avg_pool2d: ceil_mode is not supported in the decomposition")
    k = _ntuple(kernel_size, 2)
    s = _ntuple(stride, 2) if stride not in (None, [], ()) else k
    p = _ntuple(padding, 2)
    x, dt = _up(input)
    w = _pool_windows(x, k, s, p, 0.0)
    total = prims.sum(w, (w.ndim_ - 3,))
    if divisor_override:
        return clang.maybe_convert(prims.div(total, float(divisor_override)), dt)
    if count_include_pad or (p == (0, 0)):
        return clang.maybe_convert(prims.div(total, float(k[0] * k[1])), dt)
    ones = prims.full(x._tt_shape[-2:], 1.0, device=x._tt_device, dtype=x._tt_dtype)
    cnt = prims.sum(_pool_windows(ones, k, s, p, 0.0), (0,))
    return clang.maybe_convert(prims.div(total, clang.expand(cnt, total._tt_shape)), dt)


@torchsymbol(F.adaptive_avg_pool2d)
def adaptive_avg_pool2d(input, output_size):
    H, W = input._tt_shape[-2:]
    oh, ow = _ntuple(output_size, 2)
    oh, ow = oh or H, ow or W
    if H % oh or W % ow:
        raise NotImplementedError("adaptive_avg_pool2d: only output sizes that divide the input are supported")
    return avg_pool2d(input, (H // oh, W // ow))


@torchsymbol(F.pad)
def pad(input, pad, mode="constant", value=None):
    if mode != "constant":
        raise NotImplementedError(f"F.pad(mode={mode!r}) is not supported; only 'constant'")
    pad = tuple(pad)
    cfg = [(0, 0, 0)] * input.ndim_
    for i in range(len(pad) // 2):
        d = input.ndim_ - 1 - i
        cfg[d] = (pad[2 * i], pad[2 * i + 1], 0)
    return prims.pad(input, 0 if value is None else value, tuple(cfg))


@torchsymbol(F.one_hot, tags=("fallible",))
def one_hot(tensor, num_classes=-1):
    if num_classes < 0:
        raise NotImplementedError("one_hot needs num_classes inside a compiled function (inferring it reads tensor values)")
    classes = prims.iota(num_classes, start=0, step=1, device=tensor._tt_device, dtype=dtypes.int64)
    shape = tensor._tt_shape + (num_classes,)
    eq = prims.eq(clang.expand(clang.unsqueeze(tensor, -1), shape), prims.broadcast_in_dim(classes, shape, (len(shape) - 1,)))
    return prims.convert_element_type(eq, dtypes.int64)


@torchsymbol(F.cosine_similarity, torch.cosine_similarity, autocast={"cuda": FP32})
def cosine_similarity(x1, x2, dim=1, eps=1e-8):
    num = clang.sum(clang.mul(x1, x2), dim)
    n1 = clang.sqrt(clang.sum(clang.mul(x1, x1), dim))
    n2 = clang.sqrt(clang.sum(clang.mul(x2, x2), dim))
    return clang.true_divide(num, clang.maximum(clang.mul(n1, n2), eps))


# ---------------------------------------------------------------------------
# Written as torch calls the torch language knows (registry.composed: traced as the user's own calls)
# ---------------------------------------------------------------------------
def bilinear(input1, input2, weight, bias=None):
    o, i, j = weight.shape
    lead = input1.shape[:-1]
    t = torch.matmul(input1.reshape(-1, i), weight.permute(1, 0, 2).reshape(i, o * j)).reshape(-1, o, j)
    out = (t * input2.reshape(-1, 1, j)).sum(-1).reshape(tuple(lead) + (o,))
    return out + bias if bias is not None else out


composed("bilinear", bilinear, (F.bilinear, torch.bilinear))
