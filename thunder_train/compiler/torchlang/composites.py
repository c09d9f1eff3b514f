"""Torch ops written as compositions of other torch calls, traced as the user's own calls.

Each function below is what the op computes, in torch ops the torch language already knows, so it runs
natively (prims) with the gradient of its parts.  Argument forms a function does not cover raise
``NotImplementedError`` and the dispatcher runs the call opaquely (eager's result).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .decided import _register


def _real(x, op):
    if x.dtype.is_complex:
        raise NotImplementedError(f"{op} of a complex tensor is run by torch")


def _float(x):
    return x if x.dtype.is_floating_point else x.to(torch.get_default_dtype())


# ---- elementwise ----
def positive(input):
    if input.dtype is torch.bool:
        raise TypeError("The `+` operator, on a bool tensor is not supported.")
    return input


def conj(input):
    _real(input, "conj")
    return input


def resolve_neg(input):
    _real(input, "resolve_neg")
    return input


def deg2rad(input):
    _real(input, "deg2rad")
    return _float(input) * (math.pi / 180)


def rad2deg(input):
    _real(input, "rad2deg")
    return _float(input) * (180 / math.pi)


def frac(input):
    _real(input, "frac")
    if not input.dtype.is_floating_point:
        raise RuntimeError('"frac_cpu" not implemented for integer dtypes')
    return input - torch.trunc(input)


def logaddexp(input, other):
    _real(input, "logaddexp")
    m = torch.maximum(input, other)
    d = torch.abs(input - other)
    # equal infinities: m itself (the formula gives NaN for inf - inf)
    return torch.where(torch.isinf(m) & (input == other), m, m + torch.log1p(torch.exp(-d)))


def logaddexp2(input, other):
    _real(input, "logaddexp2")
    m = torch.maximum(input, other)
    d = torch.abs(input - other)
    return torch.where(torch.isinf(m) & (input == other), m, m + torch.log1p(torch.exp2(-d)) / math.log(2))


def sinc(input):
    _real(input, "sinc")
    x = _float(input) * math.pi
    return torch.where(x == 0, torch.ones_like(x), torch.sin(x) / x)


def heaviside(input, values):
    if input.dtype != values.dtype:
        raise RuntimeError("heaviside is not yet implemented for tensors with different dtypes")
    return torch.where(input == 0, values, (input > 0).to(input.dtype))


def isposinf(input):
    return input == math.inf if input.dtype.is_floating_point else torch.zeros_like(input, dtype=torch.bool)


def isneginf(input):
    return input == -math.inf if input.dtype.is_floating_point else torch.zeros_like(input, dtype=torch.bool)


def isreal(input):
    _real(input, "isreal")
    return torch.ones_like(input, dtype=torch.bool)


def xlog1py(input, other):
    if not isinstance(input, torch.Tensor) or not isinstance(other, torch.Tensor):
        raise NotImplementedError("xlog1py with a number argument is run by torch")
    out = input * torch.log1p(other)
    return torch.where((input == 0) & ~torch.isnan(other), torch.zeros_like(out), out)


def entr(input):
    x = _float(input)
    return torch.where(x > 0, -x * torch.log(x), torch.where(x == 0, torch.zeros_like(x), torch.full_like(x, -math.inf) + x * 0))


def ndtr(input):
    x = _float(input)
    return (1 + torch.erf(x * (1 / math.sqrt(2)))) * 0.5


def logit(input, eps=None):
    x = _float(input)
    if eps is not None:
        x = torch.clamp(x, eps, 1 - eps)
    return torch.log(x / (1 - x))


# ---- activations ----
def _maybe_inplace(input, out, inplace):
    return input.copy_(out) if inplace else out  # the copy_ is functionalized like the user's own


def celu(input, alpha=1.0, inplace=False):
    return _maybe_inplace(input, torch.where(input > 0, input, alpha * torch.expm1(input / alpha)), inplace)


def selu(input, inplace=False):
    alpha, scale = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946
    return _maybe_inplace(input, scale * torch.where(input > 0, input, alpha * torch.expm1(input)), inplace)


def threshold(input, threshold, value, inplace=False):
    return _maybe_inplace(input, torch.where(input > threshold, input, torch.full_like(input, value)), inplace)


def tanhshrink(input):
    return input - torch.tanh(input)


def softshrink(input, lambd=0.5):
    return torch.where(input > lambd, input - lambd, torch.where(input < -lambd, input + lambd, torch.zeros_like(input)))


def hardshrink(input, lambd=0.5):
    return torch.where((input > lambd) | (input < -lambd), input, torch.zeros_like(input))


def softmin(input, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        raise NotImplementedError("softmin without dim is run by torch")
    return F.softmax(-input if dtype is None else -input.to(dtype), dim)


# ---- shapes ----
def ravel(input):
    return input.reshape(-1)


def fliplr(input):
    return torch.flip(input, (1,))


def flipud(input):
    return torch.flip(input, (0,))


def _atleast(n):
    def fn(*tensors):
        one = len(tensors) == 1 and isinstance(tensors[0], torch.Tensor)
        ts = tensors if not (len(tensors) == 1 and isinstance(tensors[0], (list, tuple))) else tensors[0]
        out = []
        for t in ts:
            if t.ndim == 0:
                t = t.reshape((1,) * n)
            elif n >= 2 and t.ndim == 1:
                t = t.unsqueeze(0)
                if n == 3:
                    t = t.unsqueeze(-1)
            elif n == 3 and t.ndim == 2:
                t = t.unsqueeze(-1)
            out.append(t)
        return out[0] if one else tuple(out)

    return fn


def column_stack(tensors):
    return torch.hstack([t.reshape(t.numel(), 1) if t.ndim <= 1 else t for t in tensors])


def dstack(tensors):
    return torch.cat(_atleast(3)(*tensors) if len(tensors) > 1 else [_atleast(3)(tensors[0])], 2)


def _split_dim(name, dim, min_ndim):
    def fn(input, indices_or_sections):
        if input.ndim < min_ndim:
            raise RuntimeError(f"torch.{name} requires a tensor with at least {min_ndim} dimension, but got a tensor with "
                               f"{input.ndim} dimensions!")
        d = 0 if (name == "hsplit" and input.ndim == 1) else dim
        if isinstance(indices_or_sections, int) and input.shape[d] % indices_or_sections:
            raise RuntimeError(f"torch.{name} attempted to split along dimension {d}, but the size of the dimension "
                               f"{input.shape[d]} is not divisible by the split_size {indices_or_sections}!")
        return torch.tensor_split(input, indices_or_sections, d)

    return fn


def split_with_sizes(input, split_sizes, dim=0):
    return torch.split(input, list(split_sizes), dim)


def unsafe_split(input, split_size, dim=0):
    return torch.split(input, split_size, dim)


def unsafe_chunk(input, chunks, dim=0):
    return torch.chunk(input, chunks, dim)


def pixel_shuffle(input, upscale_factor):
    r = upscale_factor
    *b, c, h, w = input.shape
    x = input.reshape(*b, c // (r * r), r, r, h, w)
    n = len(b)
    x = x.permute(*range(n), n, n + 3, n + 1, n + 4, n + 2)
    return x.reshape(*b, c // (r * r), h * r, w * r)


def pixel_unshuffle(input, downscale_factor):
    r = downscale_factor
    *b, c, h, w = input.shape
    x = input.reshape(*b, c, h // r, r, w // r, r)
    n = len(b)
    x = x.permute(*range(n), n, n + 2, n + 4, n + 1, n + 3)
    return x.reshape(*b, c * r * r, h // r, w // r)


def channel_shuffle(input, groups):
    b, c, *rest = input.shape
    return input.reshape(b, groups, c // groups, *rest).transpose(1, 2).reshape(input.shape)


def fftshift(input, dim=None):
    dims = tuple(range(input.ndim)) if dim is None else ((dim,) if isinstance(dim, int) else tuple(dim))
    return torch.roll(input, [input.shape[d] // 2 for d in dims], dims)


def ifftshift(input, dim=None):
    dims = tuple(range(input.ndim)) if dim is None else ((dim,) if isinstance(dim, int) else tuple(dim))
    return torch.roll(input, [-(input.shape[d] // 2) for d in dims], dims)


# ---- reductions and products ----
def nansum(input, dim=None, keepdim=False, *, dtype=None):
    if input.dtype.is_complex:
        raise NotImplementedError("nansum of a complex tensor is run by torch")
    x = torch.where(torch.isnan(input), torch.zeros_like(input), input) if input.dtype.is_floating_point else input
    return torch.sum(x, dim, keepdim, dtype=dtype) if dim is not None else torch.sum(x, dtype=dtype)


def nanmean(input, dim=None, keepdim=False, *, dtype=None):
    if not input.dtype.is_floating_point:
        raise NotImplementedError("nanmean of a non-float tensor is run by torch")
    keep = ~torch.isnan(input)
    n = torch.sum(keep, dim, keepdim) if dim is not None else torch.sum(keep)
    return nansum(input, dim, keepdim, dtype=dtype) / n


def trace(input):
    if input.ndim != 2:
        raise RuntimeError(f"trace: expected a matrix, but got tensor with dim {input.ndim}")
    n, m = input.shape
    k = min(n, m)
    out = input.reshape(-1)[: (k - 1) * (m + 1) + 1 : m + 1].sum() if k else input.sum()
    return out


def mv(input, vec):
    if input.ndim != 2 or vec.ndim != 1:
        raise RuntimeError("vector + matrix @ vector expected")
    return torch.matmul(input, vec)


def addmv(input, mat, vec, *, beta=1, alpha=1):
    if input.dtype is torch.bool:
        raise NotImplementedError("addmv of bool tensors is run by torch")
    if not (input.dtype.is_floating_point or input.dtype.is_complex):
        beta, alpha = int(beta), int(alpha)  # eager truncates the factors for integer results
    p = torch.mv(mat, vec)
    p = p if alpha == 1 else p * alpha
    return p + input if beta == 1 else (p + 0 * input if beta == 0 else p + beta * input)


def addr(input, vec1, vec2, *, beta=1, alpha=1):
    if input.dtype is torch.bool or not (beta == 1 and alpha == 1 or input.dtype.is_floating_point):
        raise NotImplementedError("addr with these dtypes and factors is run by torch")
    p = torch.outer(vec1, vec2)
    p = p if alpha == 1 else p * alpha
    return p + input if beta == 1 else (p + torch.zeros_like(input) if beta == 0 else p + beta * input)


def vdot(input, other):
    _real(input, "vdot")
    if input.ndim != 1 or other.ndim != 1:
        raise RuntimeError(f"1D tensors expected, but got {input.ndim}D and {other.ndim}D tensors")
    if input.dtype != other.dtype:
        raise RuntimeError(f"vdot : expected both vectors to have same dtype, but found {input.dtype} and {other.dtype}")
    return (input * other).sum()


def vecdot(x, y, *, dim=-1):
    _real(x, "linalg.vecdot")
    return (x * y).sum(dim)


# ---- losses ----
def reduce_loss(loss, reduction):
    """A loss's ``reduction=`` argument, in torch calls (the composed losses share it)."""
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"{reduction} is not a valid value for reduction")



def _reduction(size_average, reduce, reduction):
    if size_average is not None or reduce is not None:
        raise NotImplementedError("the deprecated size_average/reduce arguments are run by torch")
    return reduction


def margin_ranking_loss(input1, input2, target, margin=0.0, size_average=None, reduce=None, reduction="mean"):
    return reduce_loss(torch.clamp_min(-target * (input1 - input2) + margin, 0), _reduction(size_average, reduce, reduction))


def soft_margin_loss(input, target, size_average=None, reduce=None, reduction="mean"):
    return reduce_loss(torch.log1p(torch.exp(-target * input)), _reduction(size_average, reduce, reduction))


def hinge_embedding_loss(input, target, margin=1.0, size_average=None, reduce=None, reduction="mean"):
    zeros = torch.zeros_like(input)
    loss = torch.where(target != 1, torch.clamp_min(margin - input, 0), zeros) + torch.where(target != -1, input, zeros)
    return reduce_loss(loss, _reduction(size_average, reduce, reduction))


def poisson_nll_loss(input, target, log_input=True, full=False, size_average=None, eps=1e-8, reduce=None, reduction="mean"):
    loss = torch.exp(input) - target * input if log_input else input - target * torch.log(input + eps)
    if full:
        stirling = target * torch.log(target) - target + 0.5 * torch.log(2 * math.pi * target)
        loss = loss + torch.where(target > 1, stirling, torch.zeros_like(stirling))
    return reduce_loss(loss, _reduction(size_average, reduce, reduction))


def multilabel_soft_margin_loss(input, target, weight=None, size_average=None, reduce=None, reduction="mean"):
    loss = -(target * F.logsigmoid(input) + (1 - target) * F.logsigmoid(-input))
    if weight is not None:
        loss = loss * weight
    loss = loss.sum(dim=input.ndim - 1) / input.shape[-1] if input.ndim else loss
    return reduce_loss(loss, _reduction(size_average, reduce, reduction))


def cosine_embedding_loss(input1, input2, target, margin=0.0, size_average=None, reduce=None, reduction="mean"):
    eps = 1e-12
    d = input1.ndim - 1
    prod = (input1 * input2).sum(d)
    mag = torch.sqrt(((input1 * input1).sum(d) + eps) * ((input2 * input2).sum(d) + eps))
    cos = prod / mag
    zeros = torch.zeros_like(cos)
    loss = torch.where(target == 1, 1 - cos, zeros) + torch.where(target == -1, torch.clamp_min(cos - margin, 0), zeros)
    return reduce_loss(loss, _reduction(size_average, reduce, reduction))


_ALL = [
    ("positive", positive, (torch.positive,), ("positive",)),
    ("conj", conj, (torch.conj,), ("conj",)),
    ("resolve_conj", conj, (torch.resolve_conj,), ("resolve_conj",)),
    ("resolve_neg", resolve_neg, (torch.resolve_neg,), ("resolve_neg",)),
    ("deg2rad", deg2rad, (torch.deg2rad,), ("deg2rad",)),
    ("rad2deg", rad2deg, (torch.rad2deg,), ("rad2deg",)),
    ("frac", frac, (torch.frac,), ("frac",)),
    ("logaddexp", logaddexp, (torch.logaddexp,), ("logaddexp",)),
    ("logaddexp2", logaddexp2, (torch.logaddexp2,), ("logaddexp2",)),
    ("sinc", sinc, (torch.sinc, torch.special.sinc), ("sinc",)),
    ("heaviside", heaviside, (torch.heaviside,), ("heaviside",)),
    ("isposinf", isposinf, (torch.isposinf,), ("isposinf",)),
    ("isneginf", isneginf, (torch.isneginf,), ("isneginf",)),
    ("isreal", isreal, (torch.isreal,), ("isreal",)),
    ("xlog1py", xlog1py, (torch.special.xlog1py,), ()),
    ("entr", entr, (torch.special.entr,), ()),
    ("ndtr", ndtr, (torch.special.ndtr,), ()),
    ("logit", logit, (torch.logit, torch.special.logit), ("logit",)),
    ("celu", celu, (F.celu, torch.celu), ()),
    ("selu", selu, (F.selu, torch.selu), ()),
    ("threshold", threshold, (F.threshold, torch.threshold, F._threshold), ()),
    ("tanhshrink", tanhshrink, (F.tanhshrink,), ()),
    ("softshrink", softshrink, (F.softshrink,), ()),
    ("hardshrink", hardshrink, (F.hardshrink, torch.hardshrink), ("hardshrink",)),
    ("softmin", softmin, (F.softmin,), ()),
    ("ravel", ravel, (torch.ravel,), ("ravel",)),
    ("fliplr", fliplr, (torch.fliplr,), ("fliplr",)),
    ("flipud", flipud, (torch.flipud,), ("flipud",)),
    ("atleast_1d", _atleast(1), (torch.atleast_1d,), ()),
    ("atleast_2d", _atleast(2), (torch.atleast_2d,), ()),
    ("atleast_3d", _atleast(3), (torch.atleast_3d,), ()),
    ("column_stack", column_stack, (torch.column_stack,), ()),
    ("dstack", dstack, (torch.dstack,), ()),
    ("hsplit", _split_dim("hsplit", 1, 1), (torch.hsplit,), ("hsplit",)),
    ("vsplit", _split_dim("vsplit", 0, 2), (torch.vsplit,), ("vsplit",)),
    ("dsplit", _split_dim("dsplit", 2, 3), (torch.dsplit,), ("dsplit",)),
    ("split_with_sizes", split_with_sizes, (torch.split_with_sizes,), ("split_with_sizes",)),
    ("unsafe_split", unsafe_split, (torch.unsafe_split,), ("unsafe_split",)),
    ("unsafe_chunk", unsafe_chunk, (torch.unsafe_chunk,), ("unsafe_chunk",)),
    ("pixel_shuffle", pixel_shuffle, (F.pixel_shuffle, torch.pixel_shuffle), ()),
    ("pixel_unshuffle", pixel_unshuffle, (F.pixel_unshuffle, torch.pixel_unshuffle), ()),
    ("channel_shuffle", channel_shuffle, (F.channel_shuffle, torch.channel_shuffle), ()),
    ("fftshift", fftshift, (torch.fft.fftshift,), ()),
    ("ifftshift", ifftshift, (torch.fft.ifftshift,), ()),
    ("nansum", nansum, (torch.nansum,), ("nansum",)),
    ("nanmean", nanmean, (torch.nanmean,), ("nanmean",)),
    ("trace", trace, (torch.trace,), ("trace",)),
    ("mv", mv, (torch.mv,), ("mv",)),
    ("addmv", addmv, (torch.addmv,), ("addmv",)),
    ("addr", addr, (torch.addr,), ("addr",)),
    ("vdot", vdot, (torch.vdot,), ("vdot",)),
    ("vecdot", vecdot, (torch.linalg.vecdot,), ()),
    ("margin_ranking_loss", margin_ranking_loss, (F.margin_ranking_loss,), ()),
    ("soft_margin_loss", soft_margin_loss, (F.soft_margin_loss,), ()),
    ("hinge_embedding_loss", hinge_embedding_loss, (F.hinge_embedding_loss,), ()),
    ("poisson_nll_loss", poisson_nll_loss, (F.poisson_nll_loss,), ()),
    ("multilabel_soft_margin_loss", multilabel_soft_margin_loss, (F.multilabel_soft_margin_loss,), ()),
    ("cosine_embedding_loss", cosine_embedding_loss, (F.cosine_embedding_loss,), ()),
]
for _name, _fn, _fns, _methods in _ALL:
    _register(_name, _fn, _fns, _methods)
