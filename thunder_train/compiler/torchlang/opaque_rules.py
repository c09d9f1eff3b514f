"""Output rules (``opaque.meta_rule``) for torch ops that run opaquely and have no meta kernel, of families without a
module of their own: torch.distributions' Dirichlet sampler and its gradient, and fake quantization.

Each output is shaped like the op's first input and requires grad as eager's does.  At run time torch computes it
(and, on the gradient path, differentiates it: ``transforms/opaque_grad.py``); torch tags the sampler random, so it
draws from the generator in the program's order.
"""
from __future__ import annotations

import torch

from ..opaque import meta_rule


def _like(input, *others):
    return torch.empty_like(input, device="meta").requires_grad_(any(t.requires_grad for t in (input, *others)))


# Beta(a, b).sample() and Dirichlet(c).sample()/rsample(): torch defines no derivative for them (a backward through
# the sampler itself is eager's error; Dirichlet.rsample's gradient is _dirichlet_grad, called by its Function).
@meta_rule(torch._sample_dirichlet)
def _sample_dirichlet_meta(input, generator=None):
    return _like(input)


@meta_rule(torch._dirichlet_grad)
def _dirichlet_grad_meta(x, alpha, total):
    return _like(x, alpha, total)


# Quantization-aware training: torch.ao.quantization.FakeQuantize calls these (the straight-through gradient is
# torch's).  The output requires grad like the input (scale and zero point carry none).
@meta_rule(torch.fake_quantize_per_tensor_affine)
def _fake_quantize_per_tensor_meta(input, scale, zero_point, quant_min, quant_max):
    return _like(input)


@meta_rule(torch.fake_quantize_per_channel_affine)
def _fake_quantize_per_channel_meta(input, scale, zero_point, axis, quant_min, quant_max):
    return _like(input)
