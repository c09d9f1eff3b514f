"""Attention as two matrix products around a softmax: what a fused program compiles for small narrow-value attention.

DeepSeek-V3's attention has value heads narrower than its query and key heads; a fused program runs it as the CPU
flash pair on v padded to the key's width (executors/narrow_value_attention.py), which at the zoo's sizes costs
about 75 us forward and 115 us backward a layer, most of it fixed costs (pads, slices, layout copies, the flash
kernels' own set-up).  For small attention (``SMALL_SCORES``) the fused program compiles the pair's two lines whole
(executors/whole_lines.py) by the functions here instead: the same arguments and results (the output, the padded
output the pair keeps, the log-sum-exp; the gradients), computed as products, with the probabilities recomputed from
the log-sum-exp in the backward as flash's backward does.  The program keeps what the flash pair keeps, so its
memory plan is unchanged; the scores exist whole only inside the kernel, which is why only small attention takes
this form.

Values round as these products and Inductor's loops round: within the fused programs' tolerances
(tests/test_whole_lines.py); the torch program keeps eager's math kernel.  (The plain flash pair stays: there the
products measured no faster, benchmarks/attention_products.py.)
"""
from __future__ import annotations

import math

import torch

from .. import dtypes
from ..proxies import TensorProxy

# The largest attention (batch x heads x queries x keys) compiled as products: 16 heads of 32 x 32 positions.  On one
# core the products took 0.55 of the flash pair's time at the zoo's 1,152 scores, 0.93 at 16,384, 0.99 at 32,768 and
# 1.3 at 65,536 (benchmarks/attention_products.py); the scores a kernel holds at once are then at most 64 KiB.
SMALL_SCORES = 16 * 32 * 32


def _scale(query, scale) -> float:
    return 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale


def _scores(query, key, is_causal, scale):
    scores = torch.matmul(query, key.transpose(-2, -1)) * _scale(query, scale)
    if is_causal:  # the flash kernels' causal mask: query i attends keys 0..i (top-left aligned)
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(keep.logical_not(), float("-inf"))
    return scores


def attention_by_products(query, key, value, is_causal, scale):
    """``(output, log-sum-exp)`` as the CPU flash kernel returns them (each query attends at least its first key)."""
    scores = _scores(query, key, is_causal, scale)
    top = scores.amax(-1, keepdim=True)
    lse = top + torch.exp(scores - top).sum(-1, keepdim=True).log()
    probs = torch.exp(scores - lse)
    out = torch.matmul(probs, value)
    return out, lse.squeeze(-1).to(torch.float64 if query.dtype == torch.float64 else torch.float32)


def attention_grads_by_products(g, query, key, value, out, lse, is_causal, scale, which):
    """The gradients of q, k, v at the positions ``which`` (0-2), as the flash backward computes them from the
    forward's output and log-sum-exp."""
    probs = torch.exp(_scores(query, key, is_causal, scale) - lse.unsqueeze(-1).to(query.dtype))
    grads = {}
    if 2 in which:
        grads[2] = torch.matmul(probs.transpose(-2, -1), g)
    dprobs = torch.matmul(g, value.transpose(-2, -1))
    dscores = probs * (dprobs - (g * out).sum(-1, keepdim=True)) * _scale(query, scale)
    if 0 in which:
        grads[0] = torch.matmul(dscores, key)
    if 1 in which:
        grads[1] = torch.matmul(dscores.transpose(-2, -1), query)
    return tuple(grads[i] for i in which)


# ---------------------------------------------------------------------------
# The narrow-value flash pair's lines by products: same arguments, same results (narrow_value_attention.py)
# ---------------------------------------------------------------------------
def narrow_value_by_products(query, key, value, strides, is_causal, scale):
    """The attention, it padded with zero columns to the key's width (the flash pair keeps that), the log-sum-exp."""
    out, lse = attention_by_products(query, key, value, is_causal, scale)
    return out, torch.constant_pad_nd(out, (0, key.shape[-1] - value.shape[-1])), lse


def narrow_value_backward_by_products(g, query, key, value, out, lse, is_causal, scale, which, strides):
    out = out[..., :value.shape[-1]]  # the padded output's columns of v
    return attention_grads_by_products(g, query, key, value, out, lse, is_causal, scale, which)


def small(query, key) -> bool:
    """Whether an attention of these operands (proxies) is small enough for the products, in float32 or float64."""
    if type(query) is not TensorProxy or type(key) is not TensorProxy or query._tt_dtype not in (dtypes.float32, dtypes.float64):
        return False
    sizes = (*query._tt_shape[:-1], key._tt_shape[-2])
    return all(type(s) is int for s in sizes) and math.prod(sizes) <= SMALL_SCORES


def when_small(form, query_at: int):
    """A flash line's ``whole_form`` (executors/regions.py): ``form`` for small float operands, else None (the line stays
    on the flash kernel).  ``query_at``: the query's position among the line's arguments (the key follows it)."""

    def whole_form(*args, **kwargs):
        return form if small(args[query_at], args[query_at + 1]) else None

    return whole_form
