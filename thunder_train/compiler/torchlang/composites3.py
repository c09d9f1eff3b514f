"""torch.nn.functional ops written as compositions of torch calls the torch language knows (see
composites.py): padding modes, channel dropout, normalisations, distances and margin losses."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import nn
from .composites import reduce_loss
from .decided import _register, direct


# ---- padding ----
def _pad_index(n, left, right, mode, device):
    """Source positions of the padded dimension (a few index lines, whatever its length)."""
    i = torch.arange(-left, n + right, device=device)
    if mode == "reflect":
        return (n - 1) - torch.abs((n - 1) - torch.abs(i)) if n > 1 else torch.zeros_like(i)
    if mode == "replicate":
        return torch.clamp(i, 0, n - 1)
    return torch.remainder(i, n)  # circular


def pad(input, pad, mode="constant", value=None):
    if mode == "constant":
        return direct(nn.pad, input, pad, mode, value)
    if mode not in ("reflect", "replicate", "circular"):
        raise NotImplementedError(f"F.pad(mode={mode!r}) is run by torch")
    pad = tuple(pad)
    if len(pad) % 2 or len(pad) // 2 > input.ndim - 1:
        raise NotImplementedError("this padding form is run by torch (eager checks it)")
    out = input
    for i in range(len(pad) // 2):
        d = input.ndim - 1 - i
        left, right = pad[2 * i], pad[2 * i + 1]
        n = input.shape[d]
        if mode == "reflect" and (left >= n or right >= n):
            raise NotImplementedError("reflect padding as large as the input is run by torch (eager raises)")
        if mode == "circular" and (left > n or right > n):
            raise NotImplementedError("circular padding larger than the input is run by torch (eager raises)")
        if n == 0:
            raise NotImplementedError("padding an empty dimension is run by torch")
        if left or right:
            out = torch.index_select(out, d, _pad_index(n, left, right, mode, input.device))
    return out


def constant_pad_nd(input, pad, value=0):
    return direct(nn.pad, input, pad, "constant", value)


# ---- channel dropout ----
def _feature_dropout(batched_ndim, name):
    def fn(input, p=0.5, training=True, inplace=False):
        if p < 0 or p > 1:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        if not training or p == 0:
            return input
        if input.ndim not in (batched_ndim - 1, batched_ndim):
            raise NotImplementedError(f"{name} of a {input.ndim}-d input is run by torch")
        lead = 2 if input.ndim == batched_ndim else 1
        mask_shape = tuple(input.shape[:lead]) + (1,) * (input.ndim - lead)
        # made from input: a factory without a tensor argument would run eagerly here (inside the dispatcher no
        # torch-function mode is active), and a random mask drawn once would be a constant of the program
        mask = F.dropout(input.new_ones(mask_shape), p, True)
        out = input * mask
        return input.copy_(out) if inplace else out

    return fn


def feature_alpha_dropout(input, p=0.5, training=False, inplace=False):
    if training and p != 0:
        raise NotImplementedError("feature_alpha_dropout in training is run by torch")
    return input


def alpha_dropout(input, p=0.5, training=False, inplace=False):
    if training and p != 0:
        raise NotImplementedError("alpha_dropout in training is run by torch")
    return input


def rrelu(input, lower=1.0 / 8, upper=1.0 / 3, training=False, inplace=False):
    if training:
        raise NotImplementedError("rrelu in training (random slopes) is run by torch")
    return F.leaky_relu(input, (lower + upper) / 2, inplace)


def prelu(input, weight):
    if weight.numel() == 1:
        w = weight.reshape(())
    else:
        if input.ndim < 2 and input.ndim != 1:
            raise NotImplementedError("prelu of this shape is run by torch")
        ch = 1 if input.ndim >= 2 else 0
        w = weight.reshape([-1 if i == ch else 1 for i in range(input.ndim)])
    return torch.where(input > 0, input, w * input)


def bilinear(input1, input2, weight, bias=None):
    o, i, j = weight.shape
    lead = input1.shape[:-1]
    t = torch.matmul(input1.reshape(-1, i), weight.permute(1, 0, 2).reshape(i, o * j)).reshape(-1, o, j)
    out = (t * input2.reshape(-1, 1, j)).sum(-1).reshape(tuple(lead) + (o,))
    return out + bias if bias is not None else out


# ---- normalisation ----
def local_response_norm(input, size, alpha=1e-4, beta=0.75, k=1.0):
    if input.ndim < 3:
        raise ValueError(f"Expected 3D or higher dimensionality input (got {input.ndim} dimensions)")
    if input.numel() == 0:
        return input
    c = input.shape[1]
    sq = (input * input).transpose(1, -1)
    sq = F.pad(sq, (size // 2, (size - 1) // 2))
    div = sq.narrow(-1, 0, c)
    for s in range(1, size):
        div = div + sq.narrow(-1, s, c)
    div = (div / size).transpose(1, -1)
    return input / (div * alpha + k) ** beta


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


def native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    x = input.reshape(N, group, -1)
    mean = x.mean(-1)
    rstd = torch.rsqrt(x.var(-1, unbiased=False) + eps)
    out = ((x - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)).reshape(input.shape)
    shape = [1, C] + [1] * (input.ndim - 2)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out, mean, rstd


# ---- distances and margin losses ----
def pairwise_distance(x1, x2, p=2.0, eps=1e-6, keepdim=False):
    d = max(x1.ndim, x2.ndim) - 1
    if d < 0:
        raise NotImplementedError("pairwise_distance of 0-d tensors is run by torch")
    return torch.linalg.vector_norm(x1 - x2 + eps, p, d, keepdim)


def pdist(input, p=2):
    n = input.shape[0]
    i = [a for a in range(n) for b in range(a + 1, n)]
    j = [b for a in range(n) for b in range(a + 1, n)]
    if not i:
        return input.reshape(-1)[:0]
    return torch.linalg.vector_norm(input[torch.tensor(i)] - input[torch.tensor(j)], p, -1)




def triplet_margin_loss(anchor, positive, negative, margin=1.0, p=2, eps=1e-6, swap=False, size_average=None,
                        reduce=None, reduction="mean"):
    if size_average is not None or reduce is not None:
        raise NotImplementedError("deprecated reduction arguments are run by torch")
    if not (anchor.ndim == positive.ndim == negative.ndim) or anchor.ndim not in (1, 2):
        raise NotImplementedError("triplet_margin_loss of these shapes is run by torch (eager checks them)")
    dp = pairwise_distance(anchor, positive, p, eps)
    dn = pairwise_distance(anchor, negative, p, eps)
    if swap:
        dn = torch.minimum(dn, pairwise_distance(positive, negative, p, eps))
    return reduce_loss(torch.clamp_min(margin + dp - dn, 0), reduction)


def triplet_margin_with_distance_loss(anchor, positive, negative, *, distance_function=None, margin=1.0, swap=False,
                                      reduction="mean"):
    if not (anchor.ndim == positive.ndim == negative.ndim) or anchor.ndim not in (1, 2):
        raise NotImplementedError("triplet_margin_with_distance_loss of these shapes is run by torch (eager checks them)")
    dist = distance_function if distance_function is not None else pairwise_distance
    dp, dn = dist(anchor, positive), dist(anchor, negative)
    if swap:
        dn = torch.minimum(dn, dist(positive, negative))
    return reduce_loss(torch.clamp_min(margin + dp - dn, 0), reduction)


def multi_margin_loss(input, target, p=1, margin=1.0, weight=None, size_average=None, reduce=None, reduction="mean"):
    if size_average is not None or reduce is not None or p not in (1, 2):
        raise NotImplementedError("this multi_margin_loss form is run by torch")
    x = input if input.ndim == 2 else input.reshape(1, -1)
    t = target.reshape(-1, 1)
    xt = x.gather(1, t)
    z = torch.clamp_min(margin - xt + x, 0)
    if p == 2:
        z = z * z
    if weight is not None:
        z = z * weight[t]
    z = torch.where(torch.arange(x.shape[1]) == t, torch.zeros_like(z), z)
    loss = z.sum(1) / x.shape[1]
    if input.ndim < 2:
        loss = loss.reshape(())
    return reduce_loss(loss, reduction)


_ALL = [
    ("pad", pad, (F.pad, torch._C._nn.pad), (), nn.pad),
    ("constant_pad_nd", constant_pad_nd, (torch.constant_pad_nd,), (), None),
    ("dropout2d", _feature_dropout(4, "dropout2d"), (F.dropout2d,), (), None),
    ("dropout3d", _feature_dropout(5, "dropout3d"), (F.dropout3d,), (), None),
    ("feature_alpha_dropout", feature_alpha_dropout, (F.feature_alpha_dropout,), (), None),
    ("alpha_dropout", alpha_dropout, (F.alpha_dropout,), (), None),
    ("rrelu", rrelu, (F.rrelu,), (), None),
    ("prelu", prelu, (F.prelu, torch.prelu), ("prelu",), None),
    ("bilinear", bilinear, (F.bilinear, torch.bilinear), (), None),
    ("local_response_norm", local_response_norm, (F.local_response_norm,), (), None),
    ("instance_norm", instance_norm, (F.instance_norm,), (), None),
    ("native_layer_norm", native_layer_norm, (torch.native_layer_norm,), (), None),
    ("native_group_norm", native_group_norm, (torch.native_group_norm,), (), None),
    ("pairwise_distance", pairwise_distance, (F.pairwise_distance, torch.pairwise_distance), (), None),
    ("pdist", pdist, (F.pdist, torch.pdist), (), None),
    ("triplet_margin_loss", triplet_margin_loss, (F.triplet_margin_loss,), (), None),
    ("triplet_margin_with_distance_loss", triplet_margin_with_distance_loss, (F.triplet_margin_with_distance_loss,), (), None),
    ("multi_margin_loss", multi_margin_loss, (F.multi_margin_loss,), (), None),
]
for _name, _fn, _fns, _methods, _target in _ALL:
    _register(_name, _fn, _fns, _methods, sym=_target)


# ---- unpooling and nearest resampling ----
def _max_unpool(n):
    def fn(input, indices, kernel_size, stride=None, padding=0, output_size=None):
        tup = lambda v: (v,) * n if isinstance(v, int) else tuple(v)  # noqa: E731
        k, p = tup(kernel_size), tup(padding)
        st = k if stride is None else tup(stride)
        unbatched = input.ndim == n + 1
        x, idx = (input.unsqueeze(0), indices.unsqueeze(0)) if unbatched else (input, indices)
        spatial = tuple(x.shape[2:])
        if output_size is not None:
            out_sp = tuple(output_size)[-n:]
        else:
            out_sp = tuple((spatial[i] - 1) * st[i] - 2 * p[i] + k[i] for i in range(n))
        b, c = x.shape[0], x.shape[1]
        length = 1
        for v in out_sp:
            length *= v
        rows = (torch.arange(b * c, device=x.device) * length).reshape(b, c, 1)
        pos = (rows + idx.reshape(b, c, -1)).reshape(-1)
        out = x.new_zeros(b * c * length)
        out[pos] = x.reshape(-1)
        out = out.reshape((b, c) + out_sp)
        return out.squeeze(0) if unbatched else out

    return fn


def _nearest_index(n_in, n_out, scale, exact, device):
    s = scale if scale is not None and scale > 0 else None
    # eager: a float32 scale (1 / scale_factor, or in / out) and float32 products (UpSample.h nearest_idx)
    scale32 = torch.full((), (1.0 / s) if s is not None else n_in / n_out, dtype=torch.float32, device=device)
    i = torch.arange(n_out, dtype=torch.float32, device=device)
    src = torch.floor((i + 0.5) * scale32 if exact else i * scale32).to(torch.int64)
    return torch.clamp_max(src, n_in - 1)


def interpolate(input, size=None, scale_factor=None, mode="nearest", align_corners=None, recompute_scale_factor=None,
                antialias=False):
    if mode not in ("nearest", "nearest-exact") or antialias or align_corners is not None:
        raise NotImplementedError(f"interpolate(mode={mode!r}) is run by torch")
    n = input.ndim - 2
    if n < 1 or (size is None) == (scale_factor is None):
        raise NotImplementedError("this interpolate form is run by torch (eager checks it)")
    spatial = tuple(input.shape[2:])
    if size is not None:
        out_sp = (size,) * n if isinstance(size, int) else tuple(size)
        scales = [None] * n
    else:
        sf = (scale_factor,) * n if isinstance(scale_factor, (int, float)) else tuple(scale_factor)
        out_sp = tuple(int(math.floor(float(spatial[i]) * sf[i])) for i in range(n))
        scales = [None] * n if recompute_scale_factor else list(sf)
    if len(out_sp) != n:
        raise NotImplementedError("this interpolate form is run by torch (eager checks it)")
    out = input
    for d in range(n):
        if out_sp[d] != spatial[d] or scales[d] not in (None, 1, 1.0):
            out = torch.index_select(out, d + 2, _nearest_index(spatial[d], out_sp[d], scales[d], mode == "nearest-exact",
                                                                input.device))
    return out if out is not input else input.clone()


# ---- small elementwise forms of real tensors ----
def _real_only(name):
    def fn(input):
        if input.dtype.is_complex:
            raise NotImplementedError(f"{name} of a complex tensor is run by torch")
        return input

    return fn


def angle(input):
    if input.dtype.is_complex:
        raise NotImplementedError("angle of a complex tensor is run by torch")
    x = input if input.dtype.is_floating_point else input.to(torch.get_default_dtype())
    return torch.where(torch.isnan(x), x, torch.where(x < 0, torch.full_like(x, math.pi), torch.zeros_like(x)))


def char(input, memory_format=torch.preserve_format):
    if memory_format not in (torch.preserve_format, torch.contiguous_format):
        raise NotImplementedError("char(memory_format=...) is run by torch")
    out = input.to(torch.int8)
    return out.contiguous() if memory_format is torch.contiguous_format else out


def _count_below(seq, x, right):
    hit = seq <= x.unsqueeze(-1) if right else seq < x.unsqueeze(-1)
    count = hit.sum(-1)
    return torch.where(torch.isnan(x), torch.full_like(count, seq.shape[-1]), count) if x.dtype.is_floating_point else count


def bucketize(input, boundaries, *, out_int32=False, right=False):
    if not isinstance(input, torch.Tensor) or boundaries.ndim != 1:
        raise NotImplementedError("bucketize of a number or with N-d boundaries is run by torch")
    out = _count_below(boundaries, input, right)
    return out.to(torch.int32 if out_int32 else torch.int64)


def searchsorted(sorted_sequence, input, *, out_int32=False, right=False, side=None, sorter=None):
    if not isinstance(input, torch.Tensor):
        raise NotImplementedError("searchsorted of a number is run by torch")
    if side is not None:
        if right and side == "left":
            raise RuntimeError("torch.searchsorted(): side and right can't be set to opposites")
        right = side == "right"
    seq = sorted_sequence if sorter is None else sorted_sequence.gather(-1, sorter)
    if seq.ndim > 1:
        if tuple(seq.shape[:-1]) != tuple(input.shape[:-1]):
            raise NotImplementedError("searchsorted with mismatched leading dimensions is run by torch (eager checks them)")
        out = _count_below(seq.unsqueeze(-2), input, right)
    else:
        out = _count_below(seq, input, right)
    return out.to(torch.int32 if out_int32 else torch.int64)


_ALL2 = [
    ("max_unpool1d", _max_unpool(1), (F.max_unpool1d,)),
    ("max_unpool2d", _max_unpool(2), (F.max_unpool2d,)),
    ("max_unpool3d", _max_unpool(3), (F.max_unpool3d,)),
    ("interpolate", interpolate, (F.interpolate,)),
    ("conj_physical", _real_only("conj_physical"), (torch.conj_physical,), ("conj_physical",)),
    ("real", _real_only("real"), (torch.real,)),
    ("angle", angle, (torch.angle,), ("angle",)),
    ("char", char, (), ("char",)),
    ("bucketize", bucketize, (torch.bucketize,)),
    ("searchsorted", searchsorted, (torch.searchsorted,)),
]
for _name, _fn, _fns, *_m in _ALL2:
    _register(_name, _fn, _fns, _m[0] if _m else ())
