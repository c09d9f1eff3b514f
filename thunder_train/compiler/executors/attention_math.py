"""Attention whose float mask needs a gradient (T5's relative position bias), as eager runs it (torch executor).

Eager's ``scaled_dot_product_attention`` takes its math kernel when the mask requires grad, and its autograd
differentiates that kernel op by op.  Tracing records such a call as that kernel (``torchlang.attention.sdpa_math``,
``Symbol.kernel_by_requires_grad``), so the trace holds eager's layouts.  Here the forward line runs the kernel's
own ops and keeps what eager's graph saves (the attention probabilities, the scaled q and kᵀ); the backward
computes the gradients with the formulas of eager's autograd nodes for that kernel (``BmmBackward0``,
``SafeSoftmaxBackward0``, ``MulBackward1``, the views' reshapes): the mask's is the gradient of the pre-softmax
scores summed over the mask's broadcast dimensions (``at::sum_to``, as the autograd engine reduces a broadcast
operand's gradient).  Bitwise eager's values, without running the forward again under autograd (``TorchVJP``)
or the autograd engine.  Used where the program keeps what eager's graph keeps (``reuse_forward_statistics``'s
``keep_graphs``: no checkpoint region, no memory budget); elsewhere the ``TorchVJP`` line of ``sdpa_math`` stays.
"""
from __future__ import annotations

import math

import torch

from .. import dtypes
from ..proxies import TensorProxy, meta_tensor
from ..torchlang.attention import eager_picks_math, sdpa_math
from . import torch_impls
from .torch_executor import impl_symbol

_MASK = 3  # the mask's position among the op's arguments (query, key, value, attn_mask, ...)


def sdpa_math_with_probs(query, key, value, attn_mask, scale):
    """Eager's math kernel (``_scaled_dot_product_attention_math``) by its own ops: the attention's output, and what
    eager's graph of it saves for the backward: the probabilities and the scaled q and kᵀ as its batched matmul read
    them ((batch, L, E) and (batch, E, S)).  Holding these instead of q and k, the backward makes no copies of them
    (they were 2 of T5's step peak's temporaries).  With the math kernel switched off after tracing (``sdpa_kernel``
    around the call), eager's own call, which raises eager's error."""
    if not torch._C._get_math_sdp_enabled():
        sdpa_math(query, key, value, attn_mask, scale=scale)
        raise RuntimeError("scaled_dot_product_attention: the math kernel is switched off and eager picked another "
                           "kernel for a mask requiring grad; call the compiled function under the switches it was "
                           "compiled under, or compile it again under these")
    r = _root_scale(query.shape, scale)
    L, E, S = query.shape[-2], query.shape[-1], key.shape[-2]
    q3 = (query * r).reshape(-1, L, E)  # at::matmul's reshape of the scaled q (a copy where it cannot be a view)
    kt3 = (key.transpose(-2, -1) * r).reshape(-1, E, S)
    scores = q3.bmm(kt3).view(*query.shape[:-1], S)
    scores.add_(attn_mask)
    probs = torch.ops.aten._safe_softmax(scores, -1)
    del scores  # (free before the output's matmul, which may copy the value: ``math_scratch_bytes``)
    return torch.matmul(probs, value), probs, q3, kt3


def _root_scale(query_shape, scale) -> float:
    """The factor the math kernel scales both q and k by: the square root of the softmax scale (in double, as
    aten's ``calculate_scale(...).sqrt()``; a negative scale takes another path there, not paired here)."""
    return math.sqrt(1.0 / math.sqrt(query_shape[-1]) if scale is None else scale)


def _sum_to(x, shape):
    """``at::sum_to``: the leading dimensions and those of size 1 in ``shape`` summed (keepdim), then viewed."""
    if len(shape) == 0:
        return x.sum()
    lead = x.dim() - len(shape)
    dims = list(range(lead)) + [i for i in range(lead, x.dim()) if shape[i - lead] == 1 and x.shape[i] != 1]
    if dims:
        x = x.sum(dims, keepdim=True)
    return x.view(shape) if lead > 0 else x


def sdpa_math_backward(g, q3, kt3, value, probs, query_shape, key_shape, mask_shape, scale, which):
    """The gradients of the arguments at positions ``which`` (0-2: query, key, value; 3: the mask, of shape
    ``mask_shape``), by eager's autograd formulas for the math kernel; ``probs``, ``q3``, ``kt3``: what
    ``sdpa_math_with_probs`` saved."""
    r = _root_scale(query_shape, scale)
    L, E, S, Ev = query_shape[-2], query_shape[-1], key_shape[-2], value.shape[-1]
    g3 = g.reshape(-1, L, Ev)
    p3 = probs.reshape(-1, L, S)
    grads = {}
    if 2 in which:
        grads[2] = p3.transpose(1, 2).bmm(g3).reshape(value.shape)
    gp = g3.bmm(value.reshape(-1, S, Ev).transpose(1, 2)).reshape(probs.shape)
    del g3  # (temporaries freed as soon as they are read: ``math_backward_scratch_bytes``)
    gs = torch._softmax_backward_data(gp, probs, -1, probs.dtype)
    del gp
    if _MASK in which:
        grads[_MASK] = _sum_to(gs, tuple(mask_shape))
    if 0 in which or 1 in which:
        gs3 = gs.reshape(-1, L, S)
        if 0 in which:
            grads[0] = gs3.bmm(kt3.transpose(1, 2)).reshape(query_shape).mul_(r)  # (scaled in place: no copy)
        if 1 in which:
            grads[1] = q3.transpose(1, 2).bmm(gs3).reshape(*key_shape[:-2], E, S).mul_(r).transpose(-2, -1)
    return tuple(grads[i] for i in which)


def _meta(t):
    return meta_tensor(t) if type(t) is TensorProxy else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _bytes(m) -> int:
    return m.numel() * m.element_size()


def _copied(m, shape) -> int:
    """The bytes ``reshape(shape)`` of the meta tensor ``m`` copies (0 where it is a view)."""
    return 0 if m.reshape(shape)._is_view() else _bytes(m)


# A few scalars the calls allocate besides (``mul_`` by a number, the softmax's -inf and 0)
_SCALARS = 16


def math_scratch_bytes(query, key, value, attn_mask, scale) -> int:
    """The bytes ``sdpa_math_with_probs`` allocates and frees inside its line, beyond its four results (checked
    against the allocator: tests/test_kept_buffers.py): the scores and aten's ``_safe_softmax`` temporaries
    (a bool per score, a bool per row) while the probabilities are made, before the output is; the value's copy
    where ``matmul`` cannot view it as (batch, S, Ev).  Counted at the line (executors/buffers.py), the kept
    buffers leave it room: T5's step, whose attention runs this kernel, peaked 10 KiB above its plan without it."""
    q, k, v = _meta(query), _meta(key), _meta(value)
    S, Ev = k.shape[-2], v.shape[-1]
    probs = q.numel() // q.shape[-1] * S  # elements
    itemsize = q.element_size()
    out = probs // S * Ev * itemsize
    softmax = probs * itemsize + probs + probs // S - out
    return max(softmax, _copied(v, (-1, S, Ev)), 0) + _SCALARS


def math_backward_scratch_bytes(g, q3, kt3, value, probs, query_shape, key_shape, mask_shape, scale, which) -> int:
    """The bytes ``sdpa_math_backward`` allocates and frees inside its line, beyond its results (as
    ``math_scratch_bytes``): the gradient of the probabilities and of the scores, alive together while the second
    is made; the incoming gradient's and the value's copies where they cannot be viewed as batches; the scores'
    gradient to the end where it is not the mask's gradient itself."""
    gm, v, pm = _meta(g), _meta(value), _meta(probs)
    L, S, Ev = query_shape[-2], key_shape[-2], v.shape[-1]
    p, itemsize = _bytes(pm), pm.element_size()
    sizes = {0: math.prod(query_shape), 1: math.prod(key_shape), 2: v.numel(), 3: math.prod(mask_shape)}
    results = sum(sizes[i] for i in which) * itemsize
    dv = _bytes(v) if 2 in which else 0
    scores_grad_returned = 3 in which and tuple(mask_shape) == tuple(pm.shape)
    phases = (_copied(gm, (-1, L, Ev)) + dv + _copied(v, (-1, S, Ev)) + p,  # the probabilities' gradient made
              2 * p + dv,  # the scores' made from it
              0 if scores_grad_returned else p + results)  # the scores' held while the others are made
    return max(max(phases) - results, 0) + _SCALARS


sdpa_math_with_probs.scratch_bytes = math_scratch_bytes
sdpa_math_backward.scratch_bytes = math_backward_scratch_bytes

for _f in (sdpa_math_with_probs, sdpa_math_backward):
    _f.__module__ = torch_impls.__name__  # printed as ttex.<name>
    setattr(torch_impls, _f.__name__, _f)
    _f.aliases = ()  # results share no memory with the arguments (executors/buffers.py)


# A fused program runs each of the two as one Inductor kernel (executors/whole_lines.py: ~4x faster for small heads,
# rounded as Inductor's softmax rounds); the torch program runs them op by op, bitwise eager's.
sdpa_math_with_probs.whole_form = lambda *args, **kwargs: sdpa_math_with_probs
sdpa_math_backward.whole_form = lambda *args, **kwargs: sdpa_math_backward
# Whether the math kernel is switched on is asked on each call (no check of the program's sees it): the forward's
# kernel runs while it is, else its own line, which raises eager's error.
sdpa_math_with_probs.whole_guard = torch._C._get_math_sdp_enabled


def _math_call(q, k, v, mask, scale) -> bool:
    """CPU float tensors of one dtype, static sizes, q/k/v with the same batch dimensions (broadcast batches and
    grouped heads keep the ``TorchVJP`` line), and eager's selector takes its math kernel."""
    ts = (q, k, v, mask)
    if not all(type(t) is TensorProxy and t._tt_device.type == "cpu" and t._tt_dtype is q._tt_dtype for t in ts) \
            or q._tt_dtype not in (dtypes.float32, dtypes.float64) or not (scale is None or type(scale) is float and scale > 0):
        return False
    if not all(type(s) is int for t in ts for s in t._tt_shape) or not q.ndim_ == k.ndim_ == v.ndim_ >= 3 \
            or not tuple(q._tt_shape[:-2]) == tuple(k._tt_shape[:-2]) == tuple(v._tt_shape[:-2]):
        return False
    return eager_picks_math(q, k, v, mask, scale)


def math_pair(trc, fwd, vjp, b, bv, which, as_traced):
    """The forward and backward lines of a CPU attention whose float mask requires grad (its forward line runs eager's
    math kernel, ``sdpa_math``), or None where another form applies.  ``b``, ``bv``: the arguments of the forward and
    backward lines by name; ``which``: the differentiated ones (0-3: query, key, value, mask); ``as_traced(trc, line,
    layouts)``: the line plus copies into the layouts the trace recorded (none: the forward's are the kernel's)."""
    if getattr(fwd.sym, "fn", None) is not sdpa_math or which is None or bv is None or type(bv["value"]) is not TensorProxy \
            or tuple(bv["value"]._tt_shape) != tuple(b["value"]._tt_shape) or bv["value"]._tt_strides != b["value"]._tt_strides:
        return None  # (the backward reads the forward's value, or a copy a memory plan recomputed, laid out alike)
    q, k, v, mask, scale = b["query"], b["key"], b["value"], b["attn_mask"], b["scale"]
    if b["is_causal"] is not False or b["enable_gqa"] is not False or not _math_call(q, k, v, mask, scale):
        return None
    layouts = _layouts(q, k, v, mask, scale, which)
    if layouts is None or layouts[0] != tuple(fwd.output._tt_strides):
        return None  # (the trace records the output as ``sdpa_math`` lays it out: a copy would hold two outputs at once)
    saved = [TensorProxy(trc.make_name(n), shape=shape, dtype=q._tt_dtype, device=q._tt_device, strides=strides)
             for n, shape, strides in zip(("probs", "scaled_q", "scaled_kt"), _saved_shapes(q, k), layouts[1:4])]
    new_fwd = fwd.replace(sym=impl_symbol(sdpa_math_with_probs), args=(q, k, v, mask, scale), kwargs={},
                          output=(fwd.output, *saved),
                          comment="eager's math kernel; forward also keeps what eager's graph saves")
    new_vjp = vjp.replace(sym=impl_symbol(sdpa_math_backward),
                          args=(vjp.args[0], saved[1], saved[2], bv["value"], saved[0], tuple(q._tt_shape),
                                tuple(k._tt_shape), tuple(mask._tt_shape), scale, tuple(which)),
                          kwargs={}, comment="eager's autograd formulas for the math kernel")
    return as_traced(trc, new_fwd, None), as_traced(trc, new_vjp, layouts[4])


def _saved_shapes(q, k):
    """The shapes of the probabilities, the scaled q and the scaled kᵀ (as the batched matmul reads them)."""
    *batch, L, E = q._tt_shape
    S, n = k._tt_shape[-2], math.prod(batch)
    return (*batch, L, S), (n, L, E), (n, E, S)


def _layouts(q, k, v, mask, scale, which):
    """The strides the kernels give the output, the probabilities, the scaled q and kᵀ, and (a list) the gradients
    (meta runs, ~3.5 ms; once per layout of the operands: a model's layers repeat them), or None."""
    key = (*((tuple(t._tt_shape), tuple(t._tt_strides), t._tt_storage_offset, t._tt_dtype) for t in (q, k, v, mask)),
           scale, tuple(which))
    if key not in _found:
        if len(_found) >= 10_000:  # (a process retracing for ever new sizes)
            _found.clear()
        _found[key] = _run_on_meta(q, k, v, mask, scale, which)
    return _found[key]


_found: dict = {}


def _run_on_meta(q, k, v, mask, scale, which):
    try:
        with torch._C.DisableTorchFunction(), torch.no_grad():
            out, probs, q3, kt3 = sdpa_math_with_probs(*(meta_tensor(t) for t in (q, k, v, mask)), scale)
            grads = sdpa_math_backward(torch.empty_like(out), q3, kt3, meta_tensor(v), probs, tuple(q._tt_shape),
                                       tuple(k._tt_shape), tuple(mask._tt_shape), scale, which)
    except Exception:  # noqa: BLE001 - no meta kernel: the TorchVJP line stays
        return None
    return (*(tuple(t.stride()) for t in (out, probs, q3, kt3)), [tuple(t.stride()) for t in grads])


_math_vjps: dict = {}


def math_vjp_kernels(b, which):
    """For an attention line's gradient (``b``: its arguments by name; ``which``: the differentiated ones, 0-3) that
    eager computes through its math kernel because the mask requires grad: a function of the line's arguments
    running the two functions above (on meta tensors: its layouts are eager's), else None."""
    q, k, v, mask, scale = b["query"], b["key"], b["value"], b["attn_mask"], b["scale"]
    if which is None or b["is_causal"] is not False or not _math_call(q, k, v, mask, scale):
        return None
    fn = _math_vjps.get(which)
    if fn is None:  # one per ``which``: the layout cache is keyed by the callable
        def fn(g, reads, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            _, probs, q3, kt3 = sdpa_math_with_probs(query, key, value, attn_mask, scale)
            return sdpa_math_backward(g, q3, kt3, value, probs, tuple(query.shape), tuple(key.shape),
                                      tuple(attn_mask.shape), scale, which)

        fn.layout_on_meta = True
        _math_vjps[which] = fn
    return fn
