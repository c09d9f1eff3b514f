"""Normalisations: layer_norm, rms_norm, batch_norm, group_norm, normalize (symbols, with the direct gradient
rules of layer_norm, rms_norm, batch_norm and group_norm), and local_response_norm, instance_norm (input statistics),
native_layer_norm and native_group_norm written as torch calls."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import clang, prims
from ..clang import downcast_like, is_tensor, upcast
from ..grad_rules import register_vjp
from ..proxies import as_divisor
from .autocast import FP32  # autocast policies: see autocast.py
from .helpers import square, upcast_and_dtype
from .reductions import norm
from .registry import composed, torchsymbol


# Gradient rules are written with prims (the backward is an ordinary trace); see compiler/grad_rules.py.
_mul, _add, _sub = prims.mul, prims.add, prims.sub


@torchsymbol(F.layer_norm, tags=("fused_backward",), autocast={"cuda": FP32})
def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    x, dt = upcast_and_dtype(input)
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
    x, dt = upcast_and_dtype(input)
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
    if is_tensor(weight):
        grads["weight"] = downcast_like(clang.reshape(clang.sum(_mul(gy, xhat), batch), weight._tt_shape), weight)
    if is_tensor(bias):
        grads["bias"] = downcast_like(clang.reshape(clang.sum(gy, batch), bias._tt_shape), bias)
    return grads


def _centred_and_rstd(x, dims, eps):
    """``x - mean`` and ``1 / sqrt(var + eps)`` over ``dims`` (biased variance), both of x's shape: recomputed
    from the input by the norms' gradients instead of saved."""
    centred = _sub(x, _mean_keep(x, dims))
    rstd = clang.expand(prims.rsqrt(_add(clang.mean(square(centred), dims, keepdim=True), eps)), x._tt_shape)
    return centred, rstd


def _normalized_input_grad(gxhat, xhat, rstd, dims):
    """d/dx of ``xhat = (x - mean) * rstd`` with mean and rstd taken over ``dims`` of x itself."""
    return _mul(rstd, _sub(_sub(gxhat, _mean_keep(gxhat, dims)), _mul(xhat, _mean_keep(_mul(gxhat, xhat), dims))))


@register_vjp(layer_norm)
def _layer_norm_vjp(g, out, /, input, normalized_shape, weight=None, bias=None, eps=1e-5):
    # Mean and rstd are recomputed from the input (cheap reductions) instead of being saved.
    x, gy = upcast(input), upcast(g)
    dims = _norm_dims(x, normalized_shape)
    centred, rstd = _centred_and_rstd(x, dims, eps)
    xhat = _mul(centred, rstd)
    gxhat = clang.mul(gy, weight) if is_tensor(weight) else gy
    gx = _normalized_input_grad(gxhat, xhat, rstd, dims)
    return {"input": downcast_like(gx, input), **_affine_grads(gy, xhat, weight, bias, dims)}


@register_vjp(rms_norm)
def _rms_norm_vjp(g, out, /, input, normalized_shape, weight=None, eps=None):
    x, gy = upcast(input), upcast(g)
    dims = _norm_dims(x, normalized_shape)
    if eps is None:
        eps = torch.finfo(input._tt_dtype.torch).eps
    rrms = clang.expand(prims.rsqrt(_add(clang.mean(square(x), dims, keepdim=True), eps)), x._tt_shape)
    xhat = _mul(x, rrms)
    gxhat = clang.mul(gy, weight) if is_tensor(weight) else gy
    gx = _mul(rrms, _sub(gxhat, _mul(xhat, _mean_keep(_mul(gxhat, xhat), dims))))
    return {"input": downcast_like(gx, input), **_affine_grads(gy, xhat, weight, None, dims)}


# "vjp_layout_from_kernel": the CPU batch/group norm backward kernels lay the input's gradient out as the input
# (channels_last for a channels_last input), which their fake run gives (tests/test_recorded_layouts.py)
@torchsymbol(F.batch_norm, tags=("fused_backward", "vjp_layout_from_kernel"))
def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """Batch norm; in training mode the running statistics are updated in place (copy_)."""
    x, dt = upcast_and_dtype(input)
    if x.ndim_ < 2:  # eager counts no channels in a 1-d input: only an empty one (with empty statistics) runs
        if x._tt_shape != (0,) or any(t is not None and t._tt_shape != (0,) for t in (running_mean, running_var, weight, bias)):
            raise RuntimeError(f"batch_norm: expected an input with at least 2 dimensions (N, C, ...), got shape {tuple(x._tt_shape)}")
        return clang.maybe_convert(clang.mul(x, 1), dt)
    C = x._tt_shape[1]
    dims = (0,) + tuple(range(2, x.ndim_))
    bshape = (1, C) + (1,) * (x.ndim_ - 2)
    if training:
        n = math.prod(x._tt_shape[d] for d in dims)
        var = prims.var(x, dims, 0)
        mean = prims.div(prims.sum(x, dims), as_divisor(n))
        for buffer, new in _running_stat_updates(x, running_mean, running_var, momentum):
            prims.copy_(new, buffer)
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


def _new_running_stats(x, running_mean, running_var, momentum):
    """The running statistics' new values after a training-mode batch norm (the unbiased variance)."""
    dims = (0,) + tuple(range(2, x.ndim_))
    n = math.prod(x._tt_shape[d] for d in dims)
    new = []
    if running_mean is not None:
        mean = prims.div(prims.sum(x, dims), as_divisor(n))
        new.append(clang.add(clang.mul(running_mean, 1 - momentum), clang.mul(clang.maybe_convert(mean, running_mean._tt_dtype), momentum)))
    if running_var is not None:
        unbiased = prims.var(x, dims, 1 if n > 1 else 0)
        new.append(clang.add(clang.mul(running_var, 1 - momentum), clang.mul(clang.maybe_convert(unbiased, running_var._tt_dtype), momentum)))
    return new


def _running_stat_updates(x, running_mean, running_var, momentum):
    """(buffer, new value) for each running statistic that is not None."""
    stats = [t for t in (running_mean, running_var) if t is not None]
    return list(zip(stats, _new_running_stats(x, running_mean, running_var, momentum)))


@torchsymbol(name="batch_norm_running_stats", torch_impl=None, tags=("non_differentiable",))
def batch_norm_running_stats(input, running_mean, running_var, momentum):
    """Both running statistics' new values; the torch executor runs eager's own update kernel for it
    (``Symbol.torch_impl``, registered by executors/torch_impls.py), so they come out bitwise equal."""
    x, _ = upcast_and_dtype(input)
    new_mean, new_var = _new_running_stats(x, running_mean, running_var, momentum)
    return new_mean, new_var


def _batch_norm_functionalize(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """The tracer's form: the normalised output plus the running statistics' new values as writes."""
    if not training or (running_mean is None and running_var is None):
        return batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps), []
    out = batch_norm(input, None, None, weight, bias, True, momentum, eps)
    if running_mean is not None and running_var is not None:
        return out, list(zip((running_mean, running_var), batch_norm_running_stats(input, running_mean, running_var, momentum)))
    return out, _running_stat_updates(upcast_and_dtype(input)[0], running_mean, running_var, momentum)


batch_norm.functionalize = _batch_norm_functionalize


@torchsymbol(F.group_norm, tags=("fused_backward", "vjp_layout_from_kernel"), autocast={"cuda": FP32})
def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    """Normalise over (C / num_groups, *spatial) per sample and group, then a per-channel affine."""
    x, dt = upcast_and_dtype(input)
    N, C = x._tt_shape[0], x._tt_shape[1]
    if C % num_groups:
        raise ValueError(f"Expected number of channels in input to be divisible by num_groups, but got input of shape {x._tt_shape} and num_groups={num_groups}")
    g = clang.reshape(x, (N, num_groups, C // num_groups * math.prod(x._tt_shape[2:])))  # (no -1: N may be 0)
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


def _per_channel(t, x):
    """A (C,) tensor broadcast along dim 1 of ``x``."""
    return clang.expand(clang.reshape(clang.maybe_convert(t, x._tt_dtype), (1, x._tt_shape[1]) + (1,) * (x.ndim_ - 2)), x._tt_shape)


@register_vjp(batch_norm, supports=lambda input, *args, **kwargs: input.ndim_ >= 2)  # (an empty 1-d input: its decomposition)
def _batch_norm_vjp(g, out, /, input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """Training: the batch statistics' gradient, as layer norm's over (N, *spatial); evaluation: the running
    statistics are constants.  The running statistics get no gradient (eager's buffers need none)."""
    x, gy = upcast(input), upcast(g)
    dims = (0,) + tuple(range(2, x.ndim_))
    if training:
        centred, rstd = _centred_and_rstd(x, dims, eps)
    else:
        centred = _sub(x, _per_channel(running_mean, x))
        rstd = _per_channel(prims.rsqrt(prims.add(clang.maybe_convert(running_var, x._tt_dtype), eps)), x)
    xhat = _mul(centred, rstd)
    gxhat = clang.mul(gy, _per_channel(weight, x)) if is_tensor(weight) else gy
    gx = _normalized_input_grad(gxhat, xhat, rstd, dims) if training else _mul(gxhat, rstd)
    return {"input": downcast_like(gx, input), **_affine_grads(gy, xhat, weight, bias, (1,))}


@register_vjp(group_norm)
def _group_norm_vjp(g, out, /, input, num_groups, weight=None, bias=None, eps=1e-5):
    """Layer norm's gradient over each (sample, group) of (C / num_groups, *spatial), then the per-channel affine."""
    x, gy = upcast(input), upcast(g)
    grouped = (x._tt_shape[0], num_groups, -1)
    xg = clang.reshape(x, grouped)
    centred, rstd = _centred_and_rstd(xg, (2,), eps)
    xhat = _mul(centred, rstd)
    gxhat = clang.mul(gy, _per_channel(weight, x)) if is_tensor(weight) else gy
    gx = clang.reshape(_normalized_input_grad(clang.reshape(gxhat, grouped), xhat, rstd, (2,)), x._tt_shape)
    return {"input": downcast_like(gx, input), **_affine_grads(gy, clang.reshape(xhat, x._tt_shape), weight, bias, (1,))}


@torchsymbol(F.normalize, autocast={"cuda": FP32})
def normalize(input, p=2.0, dim=1, eps=1e-12, out=None):
    n = norm(input, p, dim, True)
    return clang.true_divide(input, clang.expand(clang.maximum(n, eps), input._tt_shape))


def over_norm_grad(gu, x, n, c, dims, clamp_at=None):
    """Eager's gradient of ``x / c`` (``c``: the 2-norm ``n`` of ``x`` over ``dims``, kept, clamped at a minimum),
    op by op as its autograd runs it: div's ``g / c`` and ``-g * ((x / c) / c)`` (summed over ``dims``), the
    clamp's mask where ``clamp_at`` is given (``clamp_min``; ``cosine_similarity`` clamps without a gradient), the
    norm's ``g * (x / n)`` (0 where n is 0).  The same formulas as separate rules differ in the last bits."""
    shape = x._tt_shape
    ce = clang.expand(c, shape)
    gc = clang.sum(clang.mul(clang.neg(gu), clang.true_divide(clang.true_divide(x, ce), ce)), dims, keepdim=True)
    if clamp_at is not None:
        gc = clang.where(clang.ge(n, clamp_at), gc, 0.0)
    unit = clang.where(clang.eq(clang.expand(n, shape), 0), 0.0, clang.true_divide(x, clang.expand(n, shape)))
    return clang.add(clang.true_divide(gu, ce), clang.mul(clang.expand(gc, shape), unit))


def _two_norm(input, p=2.0, dim=1, eps=1e-12, out=None):
    return p == 2 and out is None and input._tt_dtype.is_float


@register_vjp(normalize, supports=_two_norm)
def _normalize_vjp(g, result, /, input, p=2.0, dim=1, eps=1e-12, out=None):
    dims = clang.canonicalize_dims(input.ndim_, dim)
    n = norm(input, 2, dims, True)
    return {"input": over_norm_grad(g, input, n, clang.maximum(n, eps), dims, clamp_at=eps)}


# ---------------------------------------------------------------------------
# Written as torch calls the torch language knows (registry.composed: traced as the user's own calls)
# ---------------------------------------------------------------------------
def local_response_norm(input, size, alpha=1e-4, beta=0.75, k=1.0):
    if input.ndim < 3:
        raise ValueError(f"Expected 3D or higher dimensionality input (got {input.ndim} dimensions)")
    if input.numel() == 0:
        return input
    if input.dtype in (torch.int8, torch.int16, torch.int32, torch.uint8, torch.bool):
        raise NotImplementedError("local_response_norm of this integer dtype is run by torch (eager's avg_pool raises)")
    c = input.shape[1]
    sq = (input * input).transpose(1, -1)
    sq = F.pad(sq, (size // 2, (size - 1) // 2))
    div = sq.narrow(-1, 0, c)
    for s in range(1, size):
        div = div + sq.narrow(-1, s, c)
    # eager averages with avg_pool, which divides integers with truncation (the squares are >= 0: floor)
    div = (div / size if div.dtype.is_floating_point else torch.div(div, size, rounding_mode="floor")).transpose(1, -1)
    return input / (div * alpha + k) ** beta


composed("local_response_norm", local_response_norm, (F.local_response_norm,))


def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True,
                  momentum=0.1, eps=1e-5):
    if running_mean is not None or running_var is not None or not use_input_stats:
        raise NotImplementedError("instance_norm with running statistics is run by torch")
    dims = list(range(2, input.ndim))
    mean = input.mean(dims, keepdim=True)
    var = input.var(dims, unbiased=False, keepdim=True)
    out = (input - mean) * torch.rsqrt(var + eps)
    shape = [1, -1] + [1] * (input.ndim - 2)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out


composed("instance_norm", instance_norm, (F.instance_norm,))


def native_layer_norm(input, normalized_shape, weight, bias, eps):
    dims = list(range(input.ndim - len(normalized_shape), input.ndim))
    mean = input.mean(dims, keepdim=True)
    rstd = torch.rsqrt(input.var(dims, unbiased=False, keepdim=True) + eps)
    out = (input - mean) * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out, mean.detach(), rstd.detach()  # eager's statistics are not differentiable outputs


composed("native_layer_norm", native_layer_norm, (torch.native_layer_norm,))


def native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    x = input.reshape(N, group, C // group * HxW)  # (no -1: N may be 0)
    mean = x.mean(-1)
    rstd = torch.rsqrt(x.var(-1, unbiased=False) + eps)
    out = ((x - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)).reshape(input.shape)
    shape = [1, C] + [1] * (input.ndim - 2)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out, mean, rstd


composed("native_group_norm", native_group_norm, (torch.native_group_norm,))
