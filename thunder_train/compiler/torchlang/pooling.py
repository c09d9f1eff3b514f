"""Unpooling, adaptive average pooling (1-3d) and nearest resampling (``interpolate``), written as torch calls
(``registry.composed``).  The max/avg pooling symbols and their gradient rules are in nn.py."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..proxies import is_int, is_number
from .registry import composed


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
        return out if out is not input else input.clone()

    return fn


composed("adaptive_avg_pool1d", _adaptive_avg(1), (F.adaptive_avg_pool1d, torch.adaptive_avg_pool1d))
composed("adaptive_avg_pool2d", _adaptive_avg(2), (F.adaptive_avg_pool2d,))
composed("adaptive_avg_pool3d", _adaptive_avg(3), (F.adaptive_avg_pool3d,))
