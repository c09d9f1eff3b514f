"""Attention whose value heads are narrower than its query and key heads, in fused programs (torch executor).

DeepSeek-V3's attention (multi-head latent attention) reads q and k of width 16 and v of width 8.  The CPU flash
kernels take one width for all three, so eager runs its math kernel, and the torch program keeps that kernel's
autograd graph from the forward line to the backward line (``kept_graphs.sdpa_keeping_graph``): eager's bits,
at about three times the flash pair's time at the zoo's sizes (its softmax, matmuls and their backward nodes).

A fused program may round otherwise than eager (its values are compared within tolerances), so there the pair runs
the flash kernels on v padded with zero columns to the key's width.  The probabilities do not depend on v; the
output's first columns are the attention of v (the zero columns give zero columns), and the backward, given the
incoming gradient padded with zero columns too, computes dP = g vᵀ exactly as unpadded: dq and dk are the
attention's, and dv's first columns are v's gradient.  Only where the program keeps eager's graph otherwise
(``reuse_forward_statistics``'s ``keep_graphs``: no checkpoint region, no budget): the padded output and the
log-sum-exp it keeps are smaller than the math kernel's probabilities.  The torch program keeps eager's kernel.
"""
from __future__ import annotations

import torch

from .. import dtypes
from ..proxies import TensorProxy, meta_tensor
from ..torchlang import attention as ltorch_attention
from . import attention_products, torch_impls
from .attention_choice import empty_like_proxy
from .saved_statistics import _SDPA_ARGS, _SDPA_DEFAULTS, _bind, _dense_order, _flash_is_eagers, _new_proxy, \
    sdpa_flash_cpu_backward
from .torch_executor import impl_symbol


# ---------------------------------------------------------------------------
# Runtime functions (printed as ttex.<name> in traces)
# ---------------------------------------------------------------------------
def _laid_out(x, strides):
    """``x`` with the traced ``strides`` (the program's sizes are the traced ones): itself where it has them, else a
    copy."""
    if x.stride() == strides:
        return x
    return torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device).copy_(x)


def _padded(x, width):
    return torch.constant_pad_nd(x, (0, width - x.shape[-1]))  # zero columns on the right (F.pad's kernel, one call less)


def sdpa_flash_cpu_narrow_value(query, key, value, strides, is_causal, scale):
    """The attention (with the traced ``strides``), the flash kernel's padded output and its
    log-sum-exp, which the backward reads.  Whether flash may run is asked again at run time (the backend switches
    of ``torch.nn.attention.sdpa_kernel`` are process state): where not, eager's call runs and a 0-d log-sum-exp
    tells the backward to differentiate that call."""
    padded = _padded(value, key.shape[-1])
    if not _flash_is_eagers(query, key, padded, is_causal, scale):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale)
        return _laid_out(out, strides), out, query.new_empty(())
    out, lse = torch._scaled_dot_product_flash_attention_for_cpu(query, key, padded, 0.0, is_causal, scale=scale)[:2]
    return _laid_out(out[..., :value.shape[-1]], strides), out, lse


def sdpa_flash_cpu_narrow_value_backward(g, query, key, value, out, lse, is_causal, scale, which, strides):
    """The gradients for the arguments at ``which`` (each with its traced ``strides``)."""
    if lse.dim() == 0:  # the forward ran eager's call: its gradients by autograd
        grads = sdpa_flash_cpu_backward(g, query, key, value, out, lse, is_causal, scale, which)
        return tuple(_laid_out(x, st) for x, st in zip(grads, strides))
    width, narrow = key.shape[-1], value.shape[-1]
    # The incoming gradient padded with zero columns too: they meet v's zero columns only (dP = g vᵀ), so any finite
    # values would do, but not uninitialised memory (NaN * 0 is NaN).
    gp = _padded(g, width)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        gp, query, key, _padded(value, width), out, lse, 0.0, is_causal, scale=scale)
    grads = (grads[0], grads[1], grads[2][..., :narrow])
    return tuple(_laid_out(grads[i], st) for i, st in zip(which, strides))


# Small attention in a fused program: compiled whole as products (executors/attention_products.py), no padding.
sdpa_flash_cpu_narrow_value.whole_form = attention_products.when_small(attention_products.narrow_value_by_products, 0)
sdpa_flash_cpu_narrow_value_backward.whole_form = attention_products.when_small(  # after the incoming gradient
    attention_products.narrow_value_backward_by_products, 1)

for _f in (sdpa_flash_cpu_narrow_value, sdpa_flash_cpu_narrow_value_backward):
    _f.__module__ = torch_impls.__name__  # printed as ttex.<name>
    setattr(torch_impls, _f.__name__, _f)
    _f.aliases = ()  # the results share no memory with the arguments (executors/buffers.py)


# ---------------------------------------------------------------------------
# The rewrite of a forward/vjp pair
# ---------------------------------------------------------------------------
def _flash_takes_padded(q, k, v, is_causal, scale) -> bool:
    """Whether eager's selector picks the CPU flash kernel for q, k and v padded to k's width (a fresh, row-major
    tensor), asked on uninitialised tensors of the operands' sizes, strides and dtype."""
    query, key = empty_like_proxy(q), empty_like_proxy(k)
    if query is None or key is None:
        return False
    padded = torch.empty((*v._tt_shape[:-1], k._tt_shape[-1]), dtype=v._tt_dtype.torch)
    return _flash_is_eagers(query, key, padded, is_causal, scale)


def _traced_strides(t):
    """``t``'s traced strides where they lay it out densely (a copy into them is well defined), else None."""
    strides = getattr(t, "_tt_strides", None)
    if strides is None or not all(type(s) is int for s in strides) or t._tt_storage_offset != 0:
        return None
    return tuple(strides) if _dense_order(tuple(t._tt_shape), tuple(strides)) is not None else None


def narrow_value_pair(trc, fwd, vjp, positions):
    """The flash pair on v padded to the key's width, for a CPU attention with v narrower than q and k (same heads,
    no mask, no dropout, known sizes); None where it does not apply."""
    b = _bind(_SDPA_ARGS, _SDPA_DEFAULTS, fwd.args, fwd.kwargs)
    bv = _bind(_SDPA_ARGS, _SDPA_DEFAULTS, vjp.args[2:], vjp.kwargs)
    if b is None or bv is None or b["dropout_p"] != 0.0 or b["attn_mask"] is not None or b["enable_gqa"] is not False:
        return None
    if getattr(fwd.sym, "fn", None) is ltorch_attention.sdpa_math:
        return None  # eager's math kernel for a mask requiring grad (executors/attention_math.py)
    if type(b["is_causal"]) is not bool or not (b["scale"] is None or type(b["scale"]) is float):
        return None
    q, k, v = b["query"], b["key"], b["value"]
    if not all(type(t) is TensorProxy and t.ndim_ == 4 and t._tt_device.type == "cpu" for t in (q, k, v)):
        return None
    if not (q._tt_dtype is k._tt_dtype is v._tt_dtype) or q._tt_dtype not in (dtypes.float32, dtypes.float64, dtypes.bfloat16):
        return None
    shapes = [tuple(t._tt_shape) for t in (q, k, v)]
    if not all(type(s) is int for shape in shapes for s in shape):
        return None
    (bq, hq, _, eq), (bk, hk, lk, ek), (bv_, hv, lv, ev) = shapes
    if not (bq == bk == bv_ and hq == hk == hv and lk == lv and eq == ek and 0 < ev < ek):
        return None
    which = tuple(p[0] for p in positions)
    if any(len(p) != 1 or p[0] > 2 for p in positions) or len(set(which)) != len(which):
        return None
    grads = vjp.output if isinstance(vjp.output, (tuple, list)) else (vjp.output,)
    laid_out = tuple(_traced_strides(t) for t in (fwd.output, *grads))
    if len(grads) != len(which) or None in laid_out:
        return None
    if not _flash_takes_padded(q, k, v, b["is_causal"], b["scale"]):
        return None
    padded_shape = (bv_, hv, lv, ek)
    with torch._C.DisableTorchFunction(), torch.no_grad():  # the flash kernel's layouts, from its meta kernel
        mo, mlse = torch._scaled_dot_product_flash_attention_for_cpu(
            meta_tensor(q), meta_tensor(k), torch.empty(padded_shape, dtype=q._tt_dtype.torch, device="meta"), 0.0,
            b["is_causal"], scale=b["scale"])[:2]
    lse_dtype = dtypes.float64 if q._tt_dtype is dtypes.float64 else dtypes.float32
    out = _new_proxy(trc, "flash_out", padded_shape, q._tt_dtype, q._tt_device, strides=tuple(mo.stride()))
    lse = _new_proxy(trc, "lse", (bq, hq, shapes[0][2]), lse_dtype, q._tt_device, strides=tuple(mlse.stride()))
    new_fwd = fwd.replace(sym=impl_symbol(sdpa_flash_cpu_narrow_value), kwargs={}, output=(fwd.output, out, lse),
                          args=(q, k, v, laid_out[0], b["is_causal"], b["scale"]),
                          comment="flash on v padded to the key's width (a fused program: rounds as flash); keeps the "
                                  "padded output and log-sum-exp")
    new_vjp = vjp.replace(sym=impl_symbol(sdpa_flash_cpu_narrow_value_backward), kwargs={},
                          args=(vjp.args[0], bv["query"], bv["key"], bv["value"], out, lse, b["is_causal"], b["scale"],
                                which, laid_out[1:]))
    return new_fwd, new_vjp


# A fact of the op, registered here because the kernels are the torch executor's (``reuse_forward_statistics``).
ltorch_attention.scaled_dot_product_attention.torch_fused_program_pair = narrow_value_pair
