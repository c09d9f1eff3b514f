"""Normalisations written as torch calls (``registry.composed``): local_response_norm, instance_norm (input
statistics), native_layer_norm, native_group_norm.  layer_norm, rms_norm, batch_norm and group_norm, with
their gradient rules, are symbols in nn.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import composed


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


composed("native_group_norm", native_group_norm, (torch.native_group_norm,))
