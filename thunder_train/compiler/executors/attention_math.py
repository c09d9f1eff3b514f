"""Attention whose float mask needs a gradient (T5's relative position bias), as eager runs it (torch executor).

Eager's ``scaled_dot_product_attention`` takes its math kernel when the mask requires grad, and its autograd
differentiates that kernel op by op.  The program's forward runs the same kernel
(``_scaled_dot_product_attention_math``) and keeps its attention probabilities, as eager's graph does; the
backward computes the gradients with the formulas of eager's autograd nodes for that kernel (``BmmBackward0``,
``SafeSoftmaxBackward0``, ``MulBackward1``, the views' reshapes): the mask's is the gradient of the pre-softmax
scores summed over the mask's broadcast dimensions (``at::sum_to``, as the autograd engine reduces a broadcast
operand's gradient).  Bitwise eager's values, without running the forward again under autograd (``TorchVJP``)
or the autograd engine.  Used where the program keeps what eager's graph keeps (``reuse_forward_statistics``'s
``keep_graphs``: no checkpoint region, no memory budget); elsewhere the ``TorchVJP`` line stays.
"""
from __future__ import annotations

import math

import torch

from .. import dtypes
from ..proxies import TensorProxy, meta_tensor
from . import torch_impls
from .torch_executor import impl_symbol

_MASK = 3  # the mask's position among the op's arguments (query, key, value, attn_mask, ...)


def sdpa_math_with_probs(query, key, value, attn_mask, scale):
    """Eager's math kernel: the attention's output and its probabilities (what the backward reads)."""
    return torch.ops.aten._scaled_dot_product_attention_math(query, key, value, attn_mask, 0.0, False, None, scale=scale)


def _root_scale(query, scale) -> float:
    """The factor the math kernel scales both q and k by: the square root of the softmax scale (in double, as
    aten's ``calculate_scale(...).sqrt()``)."""
    return math.sqrt(1.0 / math.sqrt(query.shape[-1]) if scale is None else scale)


def _sum_to(x, shape):
    """``at::sum_to``: the leading dimensions and those of size 1 in ``shape`` summed (keepdim), then viewed."""
    if len(shape) == 0:
        return x.sum()
    lead = x.dim() - len(shape)
    dims = list(range(lead)) + [i for i in range(lead, x.dim()) if shape[i - lead] == 1 and x.shape[i] != 1]
    if dims:
        x = x.sum(dims, keepdim=True)
    return x.view(shape) if lead > 0 else x


def sdpa_math_backward(g, query, key, value, probs, mask_shape, scale, which):
    """The gradients of the arguments at positions ``which`` (0-2: query, key, value; 3: the mask, of shape
    ``mask_shape``), by eager's autograd formulas for the math kernel; ``probs``: its attention probabilities.
    The scaled q and kᵀ the kernel multiplied (saved by eager's graph) are made again by the same ops."""
    r = _root_scale(query, scale)
    L, E, S, Ev = query.shape[-2], query.shape[-1], key.shape[-2], value.shape[-1]
    g3 = g.reshape(-1, L, Ev)
    p3 = probs.reshape(-1, L, S)
    grads = {}
    if 2 in which:
        grads[2] = p3.transpose(1, 2).bmm(g3).reshape(value.shape)
    gp = g3.bmm(value.reshape(-1, S, Ev).transpose(1, 2)).reshape(probs.shape)
    gs = torch._softmax_backward_data(gp, probs, -1, probs.dtype)
    if _MASK in which:
        grads[_MASK] = _sum_to(gs, tuple(mask_shape))
    if 0 in which or 1 in which:
        gs3 = gs.reshape(-1, L, S)
        if 0 in which:
            kt = key.transpose(-2, -1) * r
            grads[0] = gs3.bmm(kt.reshape(-1, E, S).transpose(1, 2)).reshape(query.shape) * r
        if 1 in which:
            q = query * r
            grads[1] = (q.reshape(-1, L, E).transpose(1, 2).bmm(gs3).reshape(*key.shape[:-2], E, S) * r).transpose(-2, -1)
    return tuple(grads[i] for i in which)


for _f in (sdpa_math_with_probs, sdpa_math_backward):
    _f.__module__ = torch_impls.__name__  # printed as ttex.<name>
    setattr(torch_impls, _f.__name__, _f)
    _f.aliases = ()  # results share no memory with the arguments (executors/buffers.py)


def _eager_picks_math(q, k, v, mask, scale) -> bool:
    """Whether eager's selector (``torch._fused_sdp_choice``, on empty tensors laid out as the operands, the mask
    requiring grad) runs the math kernel for this call."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return False
    try:
        ops = [torch.empty_strided(tuple(t._tt_shape), tuple(t._tt_strides), dtype=t._tt_dtype.torch)
               for t in (q, k, v, mask)]
    except (TypeError, RuntimeError):  # symbolic sizes
        return False
    ops[3].requires_grad_()
    from torch.nn.attention import SDPBackend

    return choose(*ops[:3], ops[3], 0.0, False, scale=scale, enable_gqa=False) == SDPBackend.MATH.value


def _math_call(q, k, v, mask, scale) -> bool:
    """CPU float tensors of one dtype, static sizes, q/k/v with the same batch dimensions (broadcast batches and
    grouped heads keep the ``TorchVJP`` line), and eager's selector takes its math kernel."""
    ts = (q, k, v, mask)
    if not all(type(t) is TensorProxy and t._tt_device.type == "cpu" and t._tt_dtype is q._tt_dtype for t in ts) \
            or q._tt_dtype not in (dtypes.float32, dtypes.float64) or not (scale is None or type(scale) is float):
        return False
    if not all(type(s) is int for t in ts for s in t._tt_shape) or not q.ndim_ == k.ndim_ == v.ndim_ >= 3 \
            or not tuple(q._tt_shape[:-2]) == tuple(k._tt_shape[:-2]) == tuple(v._tt_shape[:-2]):
        return False
    return _eager_picks_math(q, k, v, mask, scale)


def math_pair(trc, fwd, vjp, b, bv, which, as_traced):
    """The forward and backward lines of a CPU attention whose float mask needs a gradient, or None where another
    kernel or form applies.  ``b``, ``bv``: the arguments of the forward and backward lines by name (the backward's
    q, k, v are the forward's or copies a memory plan recomputed); ``which``: the differentiated ones (0-3: query,
    key, value, mask; the mask among them); ``as_traced(trc, line, layouts)``: the line plus copies into the
    layouts the trace recorded."""
    if bv is None or any(type(bv[n]) is not TensorProxy or tuple(bv[n]._tt_shape) != tuple(b[n]._tt_shape)
                         or bv[n]._tt_strides != b[n]._tt_strides for n in ("query", "key", "value")):
        return None
    q, k, v, mask, scale = b["query"], b["key"], b["value"], b["attn_mask"], b["scale"]
    if _MASK not in which or b["is_causal"] is not False or b["enable_gqa"] is not False or not _math_call(q, k, v, mask, scale):
        return None
    probs = TensorProxy(trc.make_name("probs"), shape=q._tt_shape[:-1] + (k._tt_shape[-2],), dtype=q._tt_dtype,
                        device=q._tt_device)
    new_fwd = fwd.replace(sym=impl_symbol(sdpa_math_with_probs), args=(q, k, v, mask, scale), kwargs={},
                          output=(fwd.output, probs), comment="eager's math kernel; forward also keeps the probabilities")
    new_vjp = vjp.replace(sym=impl_symbol(sdpa_math_backward),
                          args=(vjp.args[0], bv["query"], bv["key"], bv["value"], probs, tuple(mask._tt_shape), scale,
                                tuple(which)),
                          kwargs={}, comment="eager's autograd formulas for the math kernel")
    fwd_layouts, vjp_layouts = _layouts(new_fwd, new_vjp)
    if vjp_layouts is None or fwd_layouts[0] != tuple(fwd.output._tt_strides):
        # The trace recorded the output laid out otherwise (as flash lays it out, T5's: the layout question does not
        # know the mask requires grad): a copy into that layout would hold two outputs at once, above eager's peak.
        return None
    return as_traced(trc, new_fwd, fwd_layouts), as_traced(trc, new_vjp, vjp_layouts)


def _layouts(fwd, vjp):
    """The strides the two lines' kernels give their results (meta runs), or ``(None, None)``."""
    try:
        with torch._C.DisableTorchFunction(), torch.no_grad():
            out, _ = sdpa_math_with_probs(*(meta_tensor(t) for t in fwd.args[:4]), fwd.args[4])
            grads = sdpa_math_backward(*(meta_tensor(t) for t in vjp.args[:5]), *vjp.args[5:])
    except Exception:  # noqa: BLE001 - no meta kernel: the TorchVJP line stays
        return None, None
    return [tuple(out.stride()), None], [tuple(t.stride()) for t in grads]


_math_vjps: dict = {}


def math_vjp_kernels(b, which):
    """For an attention line's gradient (``b``: its arguments by name; ``which``: the differentiated ones, 0-3) that
    eager computes through its math kernel because the mask needs a gradient: a function of the line's arguments
    running the two functions above (on meta tensors: its layouts are eager's), else None."""
    q, k, v, mask, scale = b["query"], b["key"], b["value"], b["attn_mask"], b["scale"]
    if which is None or _MASK not in which or b["is_causal"] is not False or not _math_call(q, k, v, mask, scale):
        return None
    fn = _math_vjps.get(which)
    if fn is None:  # one per ``which``: the layout cache is keyed by the callable
        def fn(g, reads, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            _, probs = sdpa_math_with_probs(query, key, value, attn_mask, scale)
            return sdpa_math_backward(g, query, key, value, probs, tuple(attn_mask.shape), scale, which)

        fn.layout_on_meta = True
        _math_vjps[which] = fn
    return fn
