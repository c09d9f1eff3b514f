"""``F.scaled_dot_product_attention``: its decomposition (masks, causal, grouped-query heads, dropout) and its direct
gradient rule (recorded as one ``scaled_dot_product_attention_vjp`` line); ``F.multi_head_attention_forward`` traced
through torch's own body."""
from __future__ import annotations

import math
import types

import torch.nn.functional as F

from .. import clang, dtypes, prims
from ..clang import downcast_like, is_tensor, upcast
from ..grad_rules import register_vjp
from ..prims.core import is_float as _float, sum_to
from ..proxies import TensorProxy, size_value
from .autocast import LOWER  # autocast policies: see autocast.py
from .dropout import dropout
from .helpers import upcast_and_dtype
from .registry import composed, torchsymbol


# Gradient rules are written with prims (the backward is an ordinary trace); see compiler/grad_rules.py.
_mul, _add, _sub = prims.mul, prims.add, prims.sub


# "vjp_layout_from_kernel": its backward kernel's gradients are not row-major (the CPU flash kernel's are laid out as
# (batch, seq, heads, dim)); the <name>_vjp line's layout comes from a fake run of it (executors/layout_rules.py).
@torchsymbol(F.scaled_dot_product_attention, tags=("fused_backward", "vjp_layout_from_kernel"), autocast={"cpu": LOWER, "cuda": LOWER})
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """softmax(q kᵀ · scale + mask) v, with causal masking and grouped-query attention."""
    q, dt = upcast_and_dtype(query)
    k = clang.maybe_convert(key, q._tt_dtype)
    v = clang.maybe_convert(value, q._tt_dtype)
    E = q._tt_shape[-1]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    if enable_gqa and k._tt_shape[-3] != q._tt_shape[-3]:
        rep = q._tt_shape[-3] // k._tt_shape[-3]
        k = _repeat_heads(k, rep)
        v = _repeat_heads(v, rep)
    scores = prims.mul(prims.matmul(q, clang.transpose(k, -2, -1)), scale)
    L, S = q._tt_shape[-2], k._tt_shape[-2]
    if is_causal:
        if attn_mask is not None:
            raise ValueError("scaled_dot_product_attention: pass either attn_mask or is_causal, not both")
        r = prims.broadcast_in_dim(prims.iota(L, start=0, step=1, device=q._tt_device, dtype=dtypes.int64), (L, S), (0,))
        c = prims.broadcast_in_dim(prims.iota(S, start=0, step=1, device=q._tt_device, dtype=dtypes.int64), (L, S), (1,))
        keep = prims.ge(r, c)
        scores = clang.where(clang.expand(keep, scores._tt_shape), scores, -math.inf)
    elif attn_mask is not None:
        if attn_mask._tt_dtype.is_bool:
            scores = clang.where(clang.expand(attn_mask, scores._tt_shape) if attn_mask._tt_shape != scores._tt_shape else attn_mask, scores, -math.inf)
        else:
            scores = clang.add(scores, clang.maybe_convert(attn_mask, scores._tt_dtype))
    p = clang.softmax(scores, -1)
    if dropout_p > 0.0:
        p = dropout(p, dropout_p, True)
    return clang.maybe_convert(prims.matmul(p, v), dt)


def _repeat_heads(x, rep):
    shape = x._tt_shape
    x = clang.unsqueeze(x, -3)
    x = clang.expand(x, shape[:-2] + (rep,) + shape[-2:])
    return clang.reshape(x, shape[:-3] + (shape[-3] * rep,) + shape[-2:])


def _sdpa_supported(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """No dropout (its mask exists only inside the forward: the decomposition, which keeps it, is used then).
    Heads: equal, grouped (``enable_gqa``), or one key/value head broadcast over the query heads (multi-query
    attention written without ``enable_gqa``, Falcon's: the same as one group of all heads)."""
    if dropout_p != 0.0 or not query.ndim_ == key.ndim_ == value.ndim_:
        return False
    hq, hk, hv = (t._tt_shape[-3:-2] for t in (query, key, value))
    if hq == hk == hv:
        return True
    if hk == hv == (1,) and query.ndim_ >= 3:
        return True
    return bool(enable_gqa) and hk == hv and hq[0] % hk[0] == 0


@register_vjp(scaled_dot_product_attention, supports=_sdpa_supported)
def _sdpa_vjp(g, out, /, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Attention probabilities are recomputed from q and k; nothing of size L×S is saved.

    Grouped-query attention (``enable_gqa``, fewer key/value heads): each kv
    head serves ``Hq / Hkv`` consecutive query heads, so it is repeated for the
    computation and its gradient is the sum over its group.
    """
    q, k, v, gu = upcast(query), upcast(key), upcast(value), upcast(g)
    rep = 1
    if q.ndim_ >= 3 and k._tt_shape[-3] != q._tt_shape[-3]:
        rep = q._tt_shape[-3] // k._tt_shape[-3]
        k, v = _repeat_heads(k, rep), _repeat_heads(v, rep)
    L, S = q._tt_shape[-2], k._tt_shape[-2]
    scale = 1.0 / math.sqrt(q._tt_shape[-1]) if scale is None else scale
    scores = _mul(prims.matmul(q, clang.transpose(k, -2, -1)), scale)
    if is_causal:
        r = prims.broadcast_in_dim(prims.iota(L, start=0, step=1, device=q._tt_device, dtype=dtypes.int64), (L, S), (0,))
        c = prims.broadcast_in_dim(prims.iota(S, start=0, step=1, device=q._tt_device, dtype=dtypes.int64), (L, S), (1,))
        scores = clang.where(clang.expand(prims.ge(r, c), scores._tt_shape), scores, -math.inf)
    elif is_tensor(attn_mask):
        if attn_mask._tt_dtype.is_bool:
            scores = clang.where(clang.expand(attn_mask, scores._tt_shape), scores, -math.inf)
        else:
            scores = clang.add(scores, clang.maybe_convert(attn_mask, scores._tt_dtype))
    p = clang.softmax(scores, -1)
    gv = prims.matmul(clang.transpose(p, -2, -1), gu)
    gp = prims.matmul(gu, clang.transpose(v, -2, -1))
    gs = _mul(p, _sub(gp, clang.expand(clang.sum(_mul(gp, p), -1, keepdim=True), p._tt_shape)))
    gk = _mul(prims.matmul(clang.transpose(gs, -2, -1), q), scale)
    if rep > 1:
        gk, gv = _sum_head_groups(gk, rep), _sum_head_groups(gv, rep)
    grads = {
        "query": downcast_like(sum_to(_mul(prims.matmul(gs, k), scale), query._tt_shape), query),
        "key": downcast_like(sum_to(gk, key._tt_shape), key),
        "value": downcast_like(sum_to(gv, value._tt_shape), value),
    }
    if _float(attn_mask) and not is_causal:
        grads["attn_mask"] = downcast_like(sum_to(gs, attn_mask._tt_shape), attn_mask)
    return grads


def _sum_head_groups(x, rep):
    """(..., H·rep, S, E) -> (..., H, S, E): the sum over each group of ``rep`` consecutive heads."""
    shape = x._tt_shape
    grouped = clang.reshape(x, shape[:-3] + (shape[-3] // rep, rep) + shape[-2:])
    return prims.sum(grouped, (len(shape) - 2,))


# The backend switches ``torch.nn.attention.sdpa_kernel`` sets (eager's kernel choice reads them), in the order of
# ``_sdpa_switch_names``; the priority order is part of them.
_sdpa_switch_names = ("flash", "mem_efficient", "math", "cudnn", "overrideable")


def _sdpa_switches() -> tuple:
    import torch
    flags = tuple(getattr(torch._C, f"_get_{n}_sdp_enabled", lambda: None)() for n in _sdpa_switch_names)
    order = getattr(torch._C, "_get_sdp_priority_order", lambda: ())()
    return flags, tuple(order)


_sdpa_runners: dict = {}


def _sdpa_under(switches):
    """``scaled_dot_product_attention`` run under ``switches`` (what ``sdpa_kernel`` set where the function called
    it), the caller's put back after; one function per setting, named after the backends it allows."""
    runner = _sdpa_runners.get(switches)
    if runner is not None:
        return runner
    import torch
    flags, order = switches
    allowed = [n for n, on in zip(_sdpa_switch_names, flags) if on]

    def run(*args, **kwargs):
        before = _sdpa_switches()
        _set_sdpa_switches(switches)
        try:
            return F.scaled_dot_product_attention(*args, **kwargs)
        finally:
            _set_sdpa_switches(before)

    run.__name__ = run.__qualname__ = "sdpa_with_" + ("_".join(allowed) or "no_backend")
    run.__doc__ = f"F.scaled_dot_product_attention with only these SDPA backends enabled: {allowed} (priority {list(order)})"
    run.__module__ = __name__
    _sdpa_runners[switches] = run
    return run


def _set_sdpa_switches(switches) -> None:
    import torch
    flags, order = switches
    for n, on in zip(_sdpa_switch_names, flags):
        setter = getattr(torch._C, f"_set_sdp_use_{n}", None)
        if setter is not None and on is not None:
            setter(on)
    if order and hasattr(torch._C, "_set_sdp_priority_order"):
        torch._C._set_sdp_priority_order(list(order))


scaled_dot_product_attention.kernel_switches = lambda: (_sdpa_switches, _sdpa_under)


# A float mask that requires grad (T5's relative position bias) rules the CPU flash kernel out: eager runs its math
# kernel (whatever the grad mode: its selector reads the flag only), whose output is row-major where flash's is laid
# out (batch, seq, heads, dim).  A program's values do not require grad, so ``F.scaled_dot_product_attention`` would
# run flash there: the line records the math kernel instead, so the layout question runs it (the trace records
# eager's layout), the forward line runs it (eager's values) and a ``TorchVJP`` line differentiates it (eager's
# autograd nodes); executors/attention_math.py pairs it with its backward by eager's formulas.
def sdpa_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Eager's math kernel, for an attention whose mask requires grad.  The backend switches are process state a
    caller may change after tracing: with the math kernel switched off, eager's own call (the mask requiring grad,
    as eager's does), which raises eager's error."""
    import torch

    if not torch._C._get_math_sdp_enabled():
        mask = attn_mask if attn_mask.requires_grad else attn_mask.detach().requires_grad_()
        return F.scaled_dot_product_attention(query, key, value, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return torch.ops.aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal, None,
                                                             scale=scale, enable_gqa=enable_gqa)[0]


sdpa_math.layout_on_meta = True  # a composite of matmuls and a softmax: the same layout on every device


def eager_backend(query, key, value, attn_mask, is_causal, scale, enable_gqa=False, mask_requires_grad=False, device="cpu"):
    """The kernel eager's ``scaled_dot_product_attention`` runs for this call without dropout (an
    ``SDPBackend`` value), asked of its own selector (``torch._fused_sdp_choice``, what eager calls) on empty tensors
    on ``device`` laid out as the operands (sizes at their traced values), so every condition it checks is eager's;
    None where it cannot be asked (no kernel for these operands: eager raises when it runs)."""
    import torch

    ts = [t for t in (query, key, value, attn_mask) if t is not None]
    if not all(type(t) is TensorProxy for t in ts):
        return None
    try:
        with torch._C.DisableTorchFunction():
            ops = [torch.empty_strided(tuple(size_value(s) for s in t._tt_shape), tuple(size_value(s) for s in t._tt_strides),
                                       dtype=t._tt_dtype.torch, device=device) for t in ts]
            mask = ops[3] if attn_mask is not None else None
            if mask_requires_grad:
                mask.requires_grad_()
            return torch._fused_sdp_choice(*ops[:3], mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
    except (TypeError, RuntimeError):
        return None


def eager_picks_math(query, key, value, attn_mask, scale, enable_gqa=False) -> bool:
    """Whether eager runs its math kernel for this CPU call whose float mask requires grad."""
    from torch.nn.attention import SDPBackend

    ts = (query, key, value, attn_mask)
    if not all(type(t) is TensorProxy and t._tt_device.type == "cpu" for t in ts) or not attn_mask._tt_dtype.is_float:
        return False
    return eager_backend(query, key, value, attn_mask, False, scale, enable_gqa, mask_requires_grad=True) == SDPBackend.MATH.value


def _sdpa_kernel_by_requires_grad(requires_grad, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                  scale=None, enable_gqa=False):
    """``sdpa_math`` where eager runs its math kernel because the mask requires grad; else None (the call's own)."""
    if attn_mask is None or dropout_p != 0.0 or is_causal is not False or type(enable_gqa) is not bool \
            or not (scale is None or type(scale) is float) or type(attn_mask) is not TensorProxy:
        return None
    if not requires_grad(attn_mask) or not eager_picks_math(query, key, value, attn_mask, scale, enable_gqa):
        return None
    return sdpa_math


scaled_dot_product_attention.kernel_by_requires_grad = _sdpa_kernel_by_requires_grad
# A line running it is a call of the op (its arguments, one of its kernels): passes pairing the op's forward and
# backward lines take it as one (executors/saved_statistics.py); the op's layout rule leaves its layout to its run
# (executors/layout_rules.py ``set_layout``).
sdpa_math.kernel_of = scaled_dot_product_attention


# ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``): torch's own Python
# body, traced as the user's code, so its projections, views and attention become torch-language lines (no opaque
# op differentiated by torch's autograd at run time).  The body starts by handing the call to ``__torch_function__``
# whenever a proxy or the tracer's mode is about, which would come straight back here: the copy below runs the same
# code object with ``has_torch_function`` answering no for that one check; every call inside it dispatches as usual.
def _without_override(fn):
    scope = dict(fn.__globals__, has_torch_function=lambda _ops: False)
    body = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    body.__kwdefaults__ = fn.__kwdefaults__
    return body


composed("multi_head_attention_forward", _without_override(F.multi_head_attention_forward),
         (F.multi_head_attention_forward,))
