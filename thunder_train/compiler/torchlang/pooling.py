"""Pooling: max_pool2d (with its gradient rule), avg_pool2d, adaptive_avg_pool2d (symbols); unpooling, adaptive
average pooling (1-3d) and nearest resampling (``interpolate``) written as torch calls."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch._prims_common import suggest_memory_format

from .. import clang, dtypes, prims
from ..grad_rules import register_vjp
from ..proxies import is_int, is_number
from .helpers import as_eager_allocates, ntuple, upcast_and_dtype
from .registry import composed, torchsymbol


# Gradient rules are written with prims (the backward is an ordinary trace); see compiler/grad_rules.py.
_mul, _add, _sub = prims.mul, prims.add, prims.sub


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
    if ceil_mode or return_indices or ntuple(dilation, 2) != (1, 1):
        raise NotImplementedError("max_pool2d: ceil_mode, return_indices and dilation are not supported in the decomposition")
    k = ntuple(kernel_size, 2)
    s = ntuple(stride, 2) if stride not in (None, [], ()) else k
    w = _pool_windows(input, k, s, ntuple(padding, 2), -math.inf if input._tt_dtype.is_float else torch.iinfo(input._tt_dtype.torch).min)
    return prims.amax(w, (w.ndim_ - 3,))


def _max_pool2d_float(input, *args, **kwargs):
    return input._tt_dtype.is_float


@register_vjp(max_pool2d, supports=_max_pool2d_float)
def _max_pool2d_vjp(g, out, /, input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    """As eager's kernel, each window's gradient goes to one position: its first maximum in scan order, or its
    last NaN (``val > maxval || isnan(val)``); never to the padding."""
    k = ntuple(kernel_size, 2)
    s = ntuple(stride, 2) if stride not in (None, [], ()) else k
    p = ntuple(padding, 2)
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
    k = ntuple(kernel_size, 2)
    s = ntuple(stride, 2) if stride not in (None, [], ()) else k
    p = ntuple(padding, 2)
    x, dt = upcast_and_dtype(input)
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
    oh, ow = ntuple(output_size, 2)
    oh, ow = oh or H, ow or W
    if H % oh or W % ow:
        raise NotImplementedError("adaptive_avg_pool2d: only output sizes that divide the input are supported")
    return avg_pool2d(input, (H // oh, W // ow))


# ---------------------------------------------------------------------------
# Written as torch calls the torch language knows (registry.composed: traced as the user's own calls)
# ---------------------------------------------------------------------------
def _max_unpool(n):
    def fn(input, indices, kernel_size, stride=None, padding=0, output_size=None):
        tup = lambda v: (v,) * n if is_int(v) else tuple(v)  # noqa: E731
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
        if n == 2:  # eager's 2-d kernel writes a channels_last batch's result channels_last
            out = as_eager_allocates(out, x)
        return out.squeeze(0) if unbatched else out

    return fn


composed("max_unpool1d", _max_unpool(1), (F.max_unpool1d,))
composed("max_unpool2d", _max_unpool(2), (F.max_unpool2d,))
composed("max_unpool3d", _max_unpool(3), (F.max_unpool3d,))


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
        out_sp = (size,) * n if is_int(size) else tuple(size)
        scales = [None] * n
    else:
        sf = (scale_factor,) * n if is_number(scale_factor) else tuple(scale_factor)
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


composed("interpolate", interpolate, (F.interpolate,))


# Adaptive average pooling: separable means over eager's windows
def _adaptive_avg(n):
    def fn(input, output_size):
        size = (output_size,) * n if is_int(output_size) else tuple(output_size)
        out = input
        for k in range(n):
            d = input.ndim - n + k
            n_in = input.shape[d]
            n_out = n_in if size[k] is None else size[k]
            if n_out == n_in:
                continue
            parts = []
            for i in range(n_out):
                start, end = (i * n_in) // n_out, -((-(i + 1) * n_in) // n_out)
                parts.append(out.narrow(d, start, end - start).mean(d, keepdim=True))
            out = torch.cat(parts, d)
        if n == 3:
            return out if out is not input else input.clone()
        # Eager's kernel (a 1-d call runs as a 2-d one of height 1) writes a new tensor in its input's suggested
        # memory format: channels_last for a channels_last batch, else row-major, whatever the means above give.
        as2d = (lambda t: t.unsqueeze(-2)) if n == 1 else (lambda t: t)  # noqa: E731
        batch = as2d(input)
        fmt = suggest_memory_format(batch) if batch.ndim == 4 else torch.contiguous_format
        laid = batch.clone(memory_format=fmt) if out is input else as2d(out).contiguous(memory_format=fmt)
        return laid.squeeze(-2) if n == 1 else laid

    return fn


composed("adaptive_avg_pool1d", _adaptive_avg(1), (F.adaptive_avg_pool1d, torch.adaptive_avg_pool1d))
composed("adaptive_avg_pool2d", _adaptive_avg(2), (F.adaptive_avg_pool2d,))
composed("adaptive_avg_pool3d", _adaptive_avg(3), (F.adaptive_avg_pool3d,))
