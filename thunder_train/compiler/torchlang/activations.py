"""Activation functions written as torch calls (``registry.composed``): celu, selu, threshold, tanhshrink,
softshrink, hardshrink, softmin, rrelu (outside training) and prelu.  Activations with their own symbol
(relu, gelu, silu, ...) are in nn.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import composed


def _maybe_inplace(input, out, inplace):
    return input.copy_(out) if inplace else out  # the copy_ is functionalized like the user's own


def celu(input, alpha=1.0, inplace=False):
    return _maybe_inplace(input, torch.where(input > 0, input, alpha * torch.expm1(input / alpha)), inplace)


composed("celu", celu, (F.celu, torch.celu))


def selu(input, inplace=False):
    alpha, scale = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946
    return _maybe_inplace(input, scale * torch.where(input > 0, input, alpha * torch.expm1(input)), inplace)


composed("selu", selu, (F.selu, torch.selu))


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
