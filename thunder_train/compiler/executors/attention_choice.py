"""Which kernel eager's ``scaled_dot_product_attention`` runs on the CPU, asked of torch's own selector.

The torch executor's attention rewrites (executors/saved_statistics.py, executors/narrow_value_attention.py) call the
CPU flash kernel directly only where eager would, keep eager's autograd graph elsewhere, and tell the memory plan
where that graph holds what the plan does not count.  Each function takes the call's arguments bound by name
(``query``, ``key``, ``value``, ``attn_mask``, ``dropout_p``, ``is_causal``, ``scale``, ``enable_gqa``).
"""
from __future__ import annotations

import torch

from ..proxies import TensorProxy, size_value


def empty_like_proxy(t):
    """An uninitialised CPU tensor with ``t``'s sizes (their traced values where symbolic: the kernel's choice is
    asked again at run time, ``sdpa_flash_cpu``), strides and dtype (None if they are not known)."""
    shape, strides = tuple(size_value(s) for s in t._tt_shape), getattr(t, "_tt_strides", None)
    if strides is None or not all(type(s) is int for s in (*shape, *strides)):
        return None
    return torch.empty_strided(shape, strides, dtype=t._tt_dtype.torch, device="cpu")


def eager_picks_cpu_flash(q, k, v, is_causal, scale, attn_mask=None, enable_gqa=False) -> bool:
    """Whether eager's ``scaled_dot_product_attention`` runs the CPU flash kernel on these operands.

    Asked of torch's own selector (``torch._fused_sdp_choice``, what eager calls) on uninitialised tensors with
    the operands' sizes, strides and dtype, so every condition it checks (layout, dtype, sizes, the backend
    switches of ``torch.nn.attention.sdpa_kernel``) is eager's.  The rewritten line calls that kernel directly
    and must not where eager would not (strided last dimensions, from views of a packed projection, take the
    math kernel: values differ).
    """
    choose = getattr(torch, "_fused_sdp_choice", None)
    operands = [empty_like_proxy(t) for t in (q, k, v, *([attn_mask] if attn_mask is not None else []))]
    if choose is None or any(t is None for t in operands):
        return False
    from torch.nn.attention import SDPBackend

    mask = operands[3] if attn_mask is not None else None
    return choose(*operands[:3], mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa) == SDPBackend.FLASH_ATTENTION.value


def _askable(b) -> bool:
    """The call's other arguments are ones ``eager_picks_cpu_flash`` can ask torch's selector about."""
    mask, scale = b["attn_mask"], b["scale"]
    return (b["dropout_p"] == 0.0 and type(b["is_causal"]) is bool and type(b["enable_gqa"]) is bool
            and (mask is None or type(mask) is TensorProxy) and (scale is None or type(scale) is float))


def eager_runs_math_on_cpu(b) -> bool:
    """Whether eager's ``scaled_dot_product_attention`` call with these bound arguments surely runs the CPU math kernel."""
    q, k, v = b["query"], b["key"], b["value"]
    return (all(type(t) is TensorProxy and t._tt_device.type == "cpu" for t in (q, k, v)) and _askable(b)
            and not eager_picks_cpu_flash(q, k, v, b["is_causal"], b["scale"], b["attn_mask"], b["enable_gqa"]))


def outside_the_flash_pair(b) -> bool:
    """Whether eager runs this CPU attention with a kernel other than flash (executors/saved_statistics.py
    ``_sdpa_keeps_its_graph`` then keeps its graph, holding the math kernel's attention probabilities: 8 MiB a layer of
    the zoo's DeepSeek-V3 at batch 32 and 128 tokens), which the memory plan counts as flash's output and log-sum-exp.
    Unknown (arguments not bound, or not askable): taken as outside."""
    if b is None:
        return True
    q, k, v = b["query"], b["key"], b["value"]
    if not all(type(t) is TensorProxy for t in (q, k, v)) or q._tt_device.type != "cpu":
        return False
    if not _askable(b):
        return True
    # (one key/value head over several query heads runs the flash pair as one group, as ``_rewrite_sdpa`` asks)
    one_kv = not b["enable_gqa"] and q.ndim_ == k.ndim_ == 4 and k._tt_shape[1] == 1 and q._tt_shape[1] != 1
    return not eager_picks_cpu_flash(q, k, v, b["is_causal"], b["scale"], b["attn_mask"], b["enable_gqa"] or one_kv)
