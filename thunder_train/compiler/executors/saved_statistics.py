"""Backward kernels that reuse what their forward computed (torch executor, whole-step programs).

An ``<op>_vjp`` line run by ``TorchVJP`` re-runs its op's forward to get the values
PyTorch's backward kernel needs.  When the same program also contains that forward —
a training step with ``loss.backward()`` inside — the forward can produce them once:

* ``scaled_dot_product_attention`` on CPU → ``_scaled_dot_product_flash_attention_for_cpu``
  returns the output and the log-sum-exp, and its backward kernel reads both;
* ``cross_entropy`` with class-index targets → ``log_softmax`` + ``nll_loss_forward`` give the
  loss, the log-probabilities and the total weight that ``nll_loss_backward`` and
  ``_log_softmax_backward_data`` read;
* ``layer_norm`` → ``native_layer_norm`` returns the mean and reciprocal std that
  ``native_layer_norm_backward`` reads;
* ``batch_norm`` (CPU) → ``native_batch_norm`` returns the batch mean and inverse std that
  ``native_batch_norm_backward`` reads (in evaluation mode it reads the running statistics);
* ``group_norm`` (CPU, row-major input) → ``native_group_norm`` returns the per-group mean
  and reciprocal std that ``native_group_norm_backward`` reads.

Attention eager runs with another kernel (the math one: q/k/v with a strided last dimension), and every attention on
CUDA, keeps the autograd graph of eager's own call from the forward line to the backward line
(``sdpa_keeping_graph``), unless the program asks for memory (checkpoint regions, a budget); one whose mask
requires grad (T5's), recorded as eager's math kernel
(``sdpa_math``), keeps what that graph saves and runs its backward by eager's formulas (attention_math.py).  Falcon's single key/value head broadcast over the query heads
(no ``enable_gqa``; eager runs the math kernel) takes the flash pair instead, as one group of all query heads
(``one_kv_head``): kept graphs made its step 10 % slower than the decomposition, the flash pair cuts about forty
calls a layer; its values round as flash's, not the math kernel's (as the decomposition's did not either).
In a fused program, attention with value heads narrower than the key's runs flash on the padded value instead
(executors/narrow_value_attention.py).

Except that one, these are the kernels eager PyTorch runs for the same calls, so values are bitwise
equal (cross-entropy's backward writes into the log-probabilities, which nothing reads
after it: less memory, same kernels); the pass only rewrites a forward/vjp pair it fully understands and leaves everything else alone.
"""
from __future__ import annotations

import math

import torch

from .. import dtypes
from . import attention_math, torch_impls
from .attention_choice import eager_picks_cpu_flash, eager_runs_math_on_cpu, outside_the_flash_pair
from .kept_graphs import graph_saved_arguments, sdpa_graph_backward, sdpa_keeping_graph
from .torch_executor import impl_symbol
from ..proxies import TensorProxy, size_value
from ..symbols import BoundSymbol
from ..torchlang import attention as ltorch_attention, losses as ltorch_losses, normalization as ltorch_normalization
from ..pytree import tree_flatten

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
_CE_ARGS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
_CE_DEFAULTS = {"weight": None, "size_average": None, "ignore_index": -100, "reduce": None, "reduction": "mean", "label_smoothing": 0.0}
_REDUCTION = {"none": 0, "mean": 1, "sum": 2}


def _bind(names, defaults, args, kwargs):
    if len(args) > len(names) or any(k not in names for k in kwargs):
        return None
    bound = dict(defaults)
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


# ---------------------------------------------------------------------------
# Runtime functions (printed as ttex.<name> in traces)
# ---------------------------------------------------------------------------
def _flash_is_eagers(query, key, value, is_causal, scale, attn_mask=None, enable_gqa=False, one_kv_head=False) -> bool:
    """``one_kv_head``: the call broadcasts one key/value head over the query heads without ``enable_gqa``, which
    eager runs with its math kernel; the flash kernel takes that head as one group of all query heads (what
    eager runs for the same call written with ``enable_gqa=True``), so it is asked as that call."""
    from torch.nn.attention import SDPBackend

    choice = torch._fused_sdp_choice(query, key, value, attn_mask, 0.0, is_causal, scale=scale,
                                     enable_gqa=enable_gqa or one_kv_head)
    return choice == SDPBackend.FLASH_ATTENTION.value


def _additive_mask(attn_mask, dtype):
    """The mask as the flash kernel reads it: eager's conversion of a boolean mask (``convert_boolean_attn_mask``
    in aten's attention.cpp: 0 where attending, -inf elsewhere); an additive mask as it is."""
    if attn_mask is None or attn_mask.dtype is not torch.bool:
        return attn_mask
    return torch.where(attn_mask.logical_not(), float("-inf"), torch.zeros((), dtype=dtype, device=attn_mask.device))


def sdpa_flash_cpu(query, key, value, is_causal, scale, enable_gqa=False, one_kv_head=False):
    """Attention output and log-sum-exp (what the backward kernel reads).

    Eager's choice is asked again at run time (a few microseconds): the backend switches
    (``torch.nn.attention.sdpa_kernel``) are process state a call may change after tracing, and a program with
    symbolic sizes was rewritten for the traced sizes.  Where eager would not run flash, this runs eager's call
    and returns a 0-d log-sum-exp, which tells the backward to differentiate that call instead.  ``enable_gqa``:
    fewer key/value heads than query heads (grouped-query attention), which the CPU flash kernels take as they are
    (eager calls them so); ``one_kv_head``: one key/value head broadcast over the query heads (``_flash_is_eagers``).
    """
    if not _flash_is_eagers(query, key, value, is_causal, scale, enable_gqa=enable_gqa, one_kv_head=one_kv_head):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale,
                                                               enable_gqa=enable_gqa)
        return out, query.new_empty(())
    return torch._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal, scale=scale)[:2]


def sdpa_flash_cpu_masked(query, key, value, scale, attn_mask, enable_gqa=False, one_kv_head=False):
    """``sdpa_flash_cpu`` with an additive mask (of the operands' dtype), as eager passes it to the kernel."""
    if not _flash_is_eagers(query, key, value, False, scale, attn_mask, enable_gqa, one_kv_head):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale,
                                                               enable_gqa=enable_gqa)
        return out, query.new_empty(())
    return torch._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, False, attn_mask=attn_mask, scale=scale)[:2]


def additive_attn_mask(attn_mask, dtype):
    """A boolean attention mask as the flash kernel reads it (eager's conversion, a new tensor): its own line, so
    that a mask built from sizes alone (a causal or sliding-window mask) is converted once (executors/constants.py)."""
    return _additive_mask(attn_mask, dtype)


def sdpa_flash_cpu_bool_masked(query, key, value, scale, attn_mask, mask, enable_gqa=False, one_kv_head=False):
    """``sdpa_flash_cpu`` with a boolean mask (a padded batch's), given also as the kernel reads it (``mask``:
    ``additive_attn_mask``), which the backward reads as eager's autograd node keeps it."""
    if not _flash_is_eagers(query, key, value, False, scale, attn_mask, enable_gqa, one_kv_head):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale,
                                                               enable_gqa=enable_gqa)
        return out, query.new_empty(())
    return torch._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, False, attn_mask=mask, scale=scale)[:2]


def sdpa_flash_cpu_backward(g, query, key, value, out, lse, is_causal, scale, which, attn_mask=None, enable_gqa=False):
    # One key/value head broadcast over the query heads (``one_kv_head`` forwards): the flash backward kernel takes
    # it as it is and returns its gradient summed over the query heads.
    # ``attn_mask``: the additive mask ``sdpa_flash_cpu_masked`` returned (the same values as the user's mask).
    if lse.dim() == 0:  # the forward ran eager's call (not flash): its gradients by autograd, as eager's
        with torch.enable_grad():
            qkv = [t.detach().requires_grad_(i in which) for i, t in enumerate((query, key, value))]
            o = torch.nn.functional.scaled_dot_product_attention(*qkv, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                                                 enable_gqa=enable_gqa)
            return torch.autograd.grad(o, [qkv[i] for i in which], g)
    # ``g`` as autograd would pass it: the kernel makes its own copy where its layout needs one (a
    # ``.contiguous()`` here cost a copy and then, not matching ``out``'s layout, a second one inside).
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g, query, key, value, out, lse, 0.0, is_causal, attn_mask=attn_mask, scale=scale)
    return tuple(grads[i] for i in which)


def laid_out_as(x, order):
    """A copy of ``x`` laid out densely with its dimensions in ``order`` (outermost first): the layout the trace
    recorded, at this call's sizes (a program with symbolic sizes runs at other sizes than the traced ones, so the
    traced strides themselves would be wrong there)."""
    strides, step = [0] * x.dim(), 1
    for d in reversed(order):
        strides[d] = step
        step *= max(x.shape[d], 1)
    return torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device).copy_(x)


def _dense_order(shape, strides):
    """The dimension order (outermost first) in which ``strides`` lay out ``shape`` densely, or None where they do
    not (overlapping, gaps)."""
    order = sorted(range(len(shape)), key=lambda d: (-strides[d], -d))
    step = 1
    for d in reversed(order):
        if shape[d] != 1 and strides[d] != step:
            return None
        step *= max(shape[d], 1)
    return tuple(order)


def cross_entropy_with_stats(input, target, ignore_index, reduction):
    """The loss plus the log-probabilities and total weight its backward reads (eager's own two kernels)."""
    logp = torch.log_softmax(input, 1)
    loss, total_weight = torch.ops.aten.nll_loss_forward(logp, target, None, reduction, ignore_index)
    return loss, logp, total_weight


def cross_entropy_with_stats_out(input, target, ignore_index, reduction, *, out):
    """The same kernels into ``out`` (executors/buffers.py); None entries are allocated."""
    loss, logp, total_weight = (o if o is not None else input.new_empty(0) for o in out)
    torch.ops.aten._log_softmax.out(input, 1, False, out=logp)
    torch.ops.aten.nll_loss_forward.output(logp, target, None, reduction, ignore_index, output=loss, total_weight=total_weight)
    return loss, logp, total_weight


cross_entropy_with_stats.out = cross_entropy_with_stats_out


# Cross-entropy's log-probabilities and their gradient are logits-sized (vocabulary x tokens: the largest arrays of
# a language model's step).  Both kernels eager runs (``_log_softmax``, ``_log_softmax_backward_data``) compute
# each row from that row alone, so running them on blocks of rows gives eager's values bitwise
# (tests/test_memory.py checks it) while the temporaries are one block, not one more logits-sized array.
_ROW_BLOCK_BYTES = 1 << 18  # one block is all the backward below allocates (kept buffers do not see it); the forward none


def _row_blocks(x):
    """``(start, stop)`` of blocks of ``x``'s rows of about ``_ROW_BLOCK_BYTES`` each (one block off the CPU)."""
    n = x.shape[0]
    if x.device.type != "cpu" or n == 0 or x.numel() * x.element_size() <= _ROW_BLOCK_BYTES:
        return [(0, n)]
    rows = max(1, _ROW_BLOCK_BYTES // max(1, math.prod(x.shape[1:]) * x.element_size()))
    return [(a, min(n, a + rows)) for a in range(0, n, rows)]


def _block_buffer(x, blocks):
    """One uninitialised block of ``x``'s rows, reused by every block (the kernels below write all of it)."""
    a, b = blocks[0]
    return torch.empty((b - a, *x.shape[1:]), dtype=x.dtype, device=x.device)


def cross_entropy_into_logits(input, target, ignore_index, reduction):
    """``cross_entropy_with_stats`` writing the log-probabilities over the logits, which nothing reads after this line
    (``_overwrite_dead_logits``): eager's ``_log_softmax`` kernel on blocks of rows, each written over itself (the
    kernel reads a row whole, for its maximum and its sum, before it writes any element of it: bitwise the values it
    writes aside, tests/test_memory.py; no block computed aside and copied back, ~1.5 ms of a GPT step's 64 blocks)."""
    # (The kernels through torch's own bindings, ``torch._log_softmax(..., out=)``: ~2 us a call less than ``torch.ops``.)
    for a, b in _row_blocks(input):
        rows = input[a:b] if (a, b) != (0, input.shape[0]) else input  # one block (small logits): not sliced
        torch._log_softmax(rows, 1, False, out=rows)
    loss, total_weight = torch.ops.aten.nll_loss_forward(input, target, None, reduction, ignore_index)
    return loss, input, total_weight


def cross_entropy_backward_into_logp(g, logp, target, total_weight, ignore_index, reduction):
    """Cross-entropy's gradient, written into ``logp`` (which ``_rewrite_cross_entropy`` made for the backward
    alone): eager's two kernels, ``nll_loss_backward`` then ``_log_softmax_backward_data``, block of rows by block,
    so the gradient of the log-probabilities is one block at a time, not a logits-sized array (eager's peak holds
    it).  ``nll_loss_backward`` zeroes its result and writes ``-g / total_weight`` (or ``-g``) at each row's target
    whatever the block; the second kernel reads each element of its block before it writes it."""
    blocks = _row_blocks(logp)
    if len(blocks) == 1:  # one block: the same kernels on the whole tensors, without slicing them
        g_nll = torch.ops.aten.nll_loss_backward(g, logp, target, None, reduction, ignore_index, total_weight)
        torch._log_softmax_backward_data(g_nll, logp, 1, logp.dtype, out=logp)
        return (logp,)
    buf = _block_buffer(logp, blocks)
    for a, b in blocks:
        gb = g[a:b] if g.dim() else g  # reduction="none": one incoming gradient per row
        g_nll = torch.ops.aten.nll_loss_backward.grad_input(gb, logp[a:b], target[a:b], None, reduction, ignore_index,
                                                            total_weight, grad_input=buf[: b - a])
        torch._log_softmax_backward_data(g_nll, logp[a:b], 1, logp.dtype, out=logp[a:b])
    return (logp,)


def layer_norm_with_stats(input, normalized_shape, weight, bias, eps):
    """Layer norm's output plus the mean and reciprocal std its backward kernel reads."""
    return torch.native_layer_norm(input, normalized_shape, weight, bias, eps)


def layer_norm_backward(g, input, normalized_shape, mean, rstd, weight, bias, which):
    mask = [0 in which, 1 in which, 2 in which]
    grads = torch.ops.aten.native_layer_norm_backward(g, input, normalized_shape, mean, rstd, weight, bias, mask)
    return tuple(grads[i] for i in which)


def batch_norm_with_stats(input, weight, bias, running_mean, running_var, training, eps):
    """Batch norm's output plus the mean and inverse std its backward kernel reads (empty in evaluation mode).
    Training-mode lines come without running statistics: their updates are separate lines of the program."""
    return torch.native_batch_norm(input, weight, bias, running_mean, running_var, training, 0.0, eps)


def batch_norm_backward(g, input, weight, running_mean, running_var, save_mean, save_invstd, training, eps, which):
    mask = [0 in which, 1 in which, 2 in which]
    grads = torch.ops.aten.native_batch_norm_backward(g, input, weight, running_mean, running_var, save_mean, save_invstd,
                                                      training, eps, mask)
    return tuple(grads[i] for i in which)


def group_norm_with_stats(input, weight, bias, num_groups, eps):
    """Group norm's output plus the per-(sample, group) mean and reciprocal std its backward kernel reads."""
    n, c = input.shape[:2]
    return torch.native_group_norm(input, weight, bias, n, c, math.prod(input.shape[2:]), num_groups, eps)


def group_norm_backward(g, input, mean, rstd, weight, num_groups, which):
    mask = [0 in which, 1 in which, 2 in which]
    n, c = input.shape[:2]
    grads = torch.ops.aten.native_group_norm_backward(g, input, mean, rstd, weight, n, c, math.prod(input.shape[2:]), num_groups, mask)
    return tuple(grads[i] for i in which)


for _f in (sdpa_flash_cpu, sdpa_flash_cpu_masked, additive_attn_mask, sdpa_flash_cpu_bool_masked, sdpa_flash_cpu_backward,
           laid_out_as, sdpa_keeping_graph, sdpa_graph_backward, cross_entropy_with_stats,
           cross_entropy_with_stats_out, cross_entropy_into_logits, cross_entropy_backward_into_logp,
           layer_norm_with_stats, layer_norm_backward, batch_norm_with_stats, batch_norm_backward,
           group_norm_with_stats, group_norm_backward):
    _f.__module__ = torch_impls.__name__  # printed as ttex.<name>
    setattr(torch_impls, _f.__name__, _f)  # results share no argument's memory but the one a line writes into
    _f.aliases = {cross_entropy_backward_into_logp: (1,), cross_entropy_into_logits: (0,)}.get(_f, ())
cross_entropy_into_logits.aliasing_results = (1,)  # the log-probabilities; the loss and total weight are new memory


# ---------------------------------------------------------------------------
# The pass
# ---------------------------------------------------------------------------
def _vjp_of(bsym):
    fn = getattr(bsym.sym, "fn", None)
    return fn if isinstance(fn, torch_impls.TorchVJP) else None


def _same_value(x, y, recomputed_ok) -> bool:
    """``y`` is ``x``, or (``recomputed_ok``) a copy of ``x`` the backward recomputed, or both are copies of one
    forward value (transforms/remat.py, transforms/recompute_again.py: the same ops on the same values).  The pass
    pairs a backward line with the nearest such forward line."""
    if x is y:
        return True
    if not recomputed_ok:
        return False
    ox, oy = getattr(x, "_tt_recomputed_of", None), getattr(y, "_tt_recomputed_of", None)
    return oy is not None and oy is (x if ox is None else ox)


def _same_argument(x, y, recomputed_ok) -> bool:
    """``_same_value`` for tensors; equal values for the rest, a tuple or list item by item (a line that reads a
    recomputed copy has its arguments rebuilt: ``layer_norm``'s ``(32,)`` is another tuple of the same sizes)."""
    if type(x) is TensorProxy or type(y) is TensorProxy:
        return _same_value(x, y, recomputed_ok)
    if type(x) in (tuple, list) and type(y) is type(x):
        return len(x) == len(y) and all(_same_argument(u, v, recomputed_ok) for u, v in zip(x, y))
    return x is y or (type(x) is type(y) and type(x) in (int, float, bool, str) and x == y)


def _same_call(fwd, vjp, recomputed_ok=False) -> bool:
    a, b = fwd.args, vjp.args[2:]
    return len(a) == len(b) and all(_same_argument(x, y, recomputed_ok) for x, y in zip(a, b)) and fwd.kwargs.keys() == vjp.kwargs.keys() and all(
        _same_value(fwd.kwargs[k], vjp.kwargs[k], recomputed_ok) or fwd.kwargs[k] == vjp.kwargs[k] for k in fwd.kwargs if type(fwd.kwargs[k]) is not TensorProxy
    ) and all(_same_value(fwd.kwargs[k], vjp.kwargs[k], recomputed_ok) for k in fwd.kwargs if type(fwd.kwargs[k]) is TensorProxy)


def _as_call(vjp):
    """A ``<op>_vjp`` line's arguments as its op's call: ``(g, (), *args)`` -> ``args`` (same keywords)."""
    return vjp.replace(args=vjp.args[2:])


def _new_proxy(trc, prefix, shape, dtype, device, strides=None):
    return TensorProxy(trc.make_name(prefix), shape=shape, dtype=dtype, device=device, strides=strides)


def _flash_lse_strides(q, k, v, is_causal, scale):
    """The strides of the CPU flash kernel's log-sum-exp (heads innermost: ``(B*H*L, 1, H)`` for ``(B, H, L)``),
    from its meta kernel; None where it cannot tell (symbolic sizes)."""
    from ..proxies import meta_tensor

    try:
        with torch._C.DisableTorchFunction(), torch.no_grad():
            lse = torch._scaled_dot_product_flash_attention_for_cpu(
                *(meta_tensor(t) for t in (q, k, v)), 0.0, is_causal, scale=scale)[1]
    except Exception:  # noqa: BLE001 - symbolic sizes or no meta kernel: recorded row-major
        return None
    return tuple(lse.stride())


def _sdpa_keeps_its_graph(trc, fwd, vjp, positions):
    """An attention the CPU flash pair does not cover (on the CPU: eager runs another kernel, the math one for q/k/v
    with a strided last dimension; on CUDA: every attention, whichever kernel eager picks there, cuDNN's or flash's
    saving their log-sum-exp): the forward keeps eager's autograd graph and the backward runs it, instead of the
    backward running the forward again (on an H200, GPT-2's step ran each attention forward twice: 0.55 ms a step).
    The graph holds what eager's holds (the math kernel's attention probabilities; cuDNN's and flash's output and
    log-sum-exp), so only where the program does not ask for memory (no checkpoint region, no budget: the pass is
    told), where the backward reads the forward's own operands (not copies a memory plan recomputed), and without dropout."""
    b = _bind(_SDPA_ARGS, _SDPA_DEFAULTS, fwd.args, fwd.kwargs)
    if b is None or b["dropout_p"] != 0.0:
        return None
    q, k, v, mask = b["query"], b["key"], b["value"], b["attn_mask"]
    differentiated = _which(fwd, positions, (q, k, v, mask))
    if getattr(fwd.sym, "fn", None) is attention_math.sdpa_math or (differentiated and 3 in differentiated):
        # A mask requiring grad: eager's math kernel (``sdpa_math``) and its backward by formulas, else TorchVJP.
        return attention_math.math_pair(trc, fwd, vjp, b, _bind(_SDPA_ARGS, _SDPA_DEFAULTS, vjp.args[2:], vjp.kwargs),
                                        differentiated, lambda t, line, layouts: _as_traced(t, line, layouts, always=True))
    if not _same_call(fwd, vjp) or not all(type(t) is TensorProxy and t._tt_device.type in ("cpu", "cuda") for t in (q, k, v)):
        return None
    if mask is not None and type(mask) is not TensorProxy:
        return None
    which = []
    for pos in positions:
        if len(pos) != 1 or pos[0] > 2 or pos[0] >= len(fwd.args) or pos[0] in which:
            return None
        which.append(pos[0])
    kwargs = {n: b[n] for n in ("attn_mask", "is_causal", "scale", "enable_gqa") if b[n] is not _SDPA_DEFAULTS[n]}
    new_fwd = fwd.replace(sym=impl_symbol(sdpa_keeping_graph), args=(q, k, v, tuple(which)), kwargs=kwargs,
                          comment="forward keeps eager's autograd graph, which its backward runs")
    reads = (q, k, v) + ((mask,) if mask is not None else ())
    if eager_runs_math_on_cpu(b):
        # Eager's math kernel on the CPU saves the value and scaled copies of the query and key: the backward line reads
        # only what the graph saved, so the query and key are freed after the forward (the zoo's DeepSeek-V3 at batch
        # 32 and 128 tokens held 4 MiB of them where its step peaks).  (Found on meta tensors, which run the math
        # kernel too; where eager picks flash, its graph saves all three.)
        saved = {id(t) for t in graph_saved_arguments(sdpa_keeping_graph, q, k, v, tuple(which), **kwargs)}
        reads = tuple(t for t in reads if id(t) in saved)
    new_vjp = vjp.replace(sym=impl_symbol(sdpa_graph_backward), args=(vjp.args[0], fwd.output, *reads), kwargs={})
    return new_fwd, new_vjp


def _rewrite_sdpa(trc, fwd, vjp, positions):
    b = _bind(_SDPA_ARGS, _SDPA_DEFAULTS, fwd.args, fwd.kwargs)
    if b is None or b["dropout_p"] != 0.0 or type(b["enable_gqa"]) is not bool or getattr(fwd.sym, "fn", None) is attention_math.sdpa_math:
        return None  # (``sdpa_math``: eager's math kernel for a mask requiring grad, not flash)
    gqa = b["enable_gqa"]
    q, k, v, mask = b["query"], b["key"], b["value"], b["attn_mask"]
    if mask is not None:
        # A mask the flash kernel takes as eager passes it: boolean (converted as eager converts it) or additive of
        # the operands' dtype, on the CPU; the vjp line must read the forward's own mask (its gradient is not asked).
        vb = _bind(_SDPA_ARGS, _SDPA_DEFAULTS, vjp.args[2:], vjp.kwargs)
        if type(mask) is not TensorProxy or vb is None or vb["attn_mask"] is not mask or mask._tt_device.type != "cpu":
            return None
        if mask._tt_dtype is not dtypes.bool8 and mask._tt_dtype is not q._tt_dtype:
            return None
        if b["is_causal"] is not False:
            return None
    if not all(type(t) is TensorProxy and t.ndim_ == 4 and t._tt_device.type == "cpu" for t in (q, k, v)):
        return None
    if not (q._tt_dtype is k._tt_dtype is v._tt_dtype) or q._tt_dtype not in (dtypes.float32, dtypes.float64, dtypes.bfloat16):
        return None
    heads, kv_heads = q._tt_shape[1], k._tt_shape[1]
    if v._tt_shape[1] != kv_heads or not all(type(n) is int for n in (heads, kv_heads)):
        return None
    # One key/value head broadcast over the query heads without ``enable_gqa`` (multi-query attention, Falcon's):
    # eager runs its math kernel; the flash kernels take that head as one group of all query heads, forward and
    # backward (its gradient summed over the heads), which rounds differently from the math kernel (as the
    # decomposition did) and costs two calls instead of about forty.
    one_kv = not gqa and kv_heads == 1 and heads > 1 and q._tt_shape[0] == k._tt_shape[0] == v._tt_shape[0]
    if kv_heads != heads and not one_kv and not (gqa and kv_heads > 0 and heads % kv_heads == 0):
        return None
    which = []
    for pos in positions:
        if len(pos) != 1 or pos[0] > 2 or pos[0] >= len(fwd.args):
            return None
        which.append(pos[0])
    if type(b["is_causal"]) is not bool or not (b["scale"] is None or type(b["scale"]) is float):
        return None
    if not eager_picks_cpu_flash(q, k, v, b["is_causal"], b["scale"], mask, gqa or one_kv):
        return None  # eager runs another kernel (the math one for q/k/v whose last dimension is strided)
    lse_dtype = dtypes.float64 if q._tt_dtype is dtypes.float64 else dtypes.float32
    lse = _new_proxy(trc, "lse", q._tt_shape[:3], lse_dtype, q._tt_device,
                     strides=_flash_lse_strides(q, k, v, b["is_causal"], b["scale"]))
    more = {"enable_gqa": True} if gqa else {}  # grouped-query attention (printed only when on)
    heads_kw = {**more, **({"one_kv_head": True} if one_kv else {})}
    if mask is None:
        new_fwd = fwd.replace(sym=impl_symbol(sdpa_flash_cpu), args=(q, k, v, b["is_causal"], b["scale"]), kwargs=heads_kw,
                              output=(fwd.output, lse), comment="forward also keeps the log-sum-exp its backward reads")
        masked = ()
    elif mask._tt_dtype is not dtypes.bool8:
        new_fwd = fwd.replace(sym=impl_symbol(sdpa_flash_cpu_masked), args=(q, k, v, b["scale"], mask), kwargs=heads_kw,
                              output=(fwd.output, lse), comment="forward also keeps the log-sum-exp its backward reads")
        masked = (mask,)
    else:
        additive = _new_proxy(trc, "mask", mask._tt_shape, q._tt_dtype, mask._tt_device)
        convert = BoundSymbol(impl_symbol(additive_attn_mask), (mask, q._tt_dtype.torch), {}, additive,
                              comment="the boolean mask as the flash kernel reads it (forward and backward)")
        new_fwd = (convert, fwd.replace(sym=impl_symbol(sdpa_flash_cpu_bool_masked), args=(q, k, v, b["scale"], mask, additive),
                                        kwargs=heads_kw, output=(fwd.output, lse),
                                        comment="forward also keeps the log-sum-exp its backward reads"))
        masked = (additive,)
    # The backward reads its own q, k, v: the forward's, or copies the backward recomputed (a memory budget).
    bv = _bind(_SDPA_ARGS, _SDPA_DEFAULTS, vjp.args[2:], vjp.kwargs)
    new_vjp = vjp.replace(sym=impl_symbol(sdpa_flash_cpu_backward),
                          args=(vjp.args[0], bv["query"], bv["key"], bv["value"], fwd.output, lse, b["is_causal"], b["scale"],
                                tuple(which), *masked),
                          kwargs=more)
    fwd_layouts, vjp_layouts = _flash_layouts(trc, fwd, new_vjp, b["is_causal"], b["scale"], masked)
    *convert, new_fwd = new_fwd if isinstance(new_fwd, tuple) else (new_fwd,)
    fwd_lines = _as_traced(trc, new_fwd, fwd_layouts, always=one_kv)
    raw_out = fwd_lines[0].output[0]
    if raw_out is not fwd.output:  # the backward kernel reads its forward's own result, not the copy
        new_vjp = new_vjp.replace(args=tuple(raw_out if a is fwd.output else a for a in new_vjp.args))
    return (*convert, *fwd_lines), _as_traced(trc, new_vjp, vjp_layouts)


def _flash_layouts(trc, fwd, vjp, is_causal, scale, masked):
    """The CPU flash kernels' output layouts for this pair: ``(forward's, backward's)`` strides per output (the
    log-sum-exp: None), from their meta kernels; ``(None, None)`` where they cannot tell (symbolic sizes)."""
    from ..proxies import meta_tensor

    g, q, k, v, out, lse = (vjp.args[0], *vjp.args[1:6])
    try:
        with torch._C.DisableTorchFunction(), torch.no_grad():
            mask = meta_tensor(masked[0]) if masked else None
            fq, fk, fv = (meta_tensor(t) for t in fwd.args[:3])
            fo = torch._scaled_dot_product_flash_attention_for_cpu(fq, fk, fv, 0.0, is_causal, attn_mask=mask, scale=scale)[0]
            grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                *(meta_tensor(t) for t in (g, q, k, v, out)),
                meta_tensor(lse), 0.0, is_causal,
                attn_mask=mask, scale=scale)
            return [tuple(fo.stride()), None], [tuple(grads[i].stride()) for i in vjp.args[8]]
    except Exception:  # noqa: BLE001 - symbolic sizes or no meta kernel: the traced layouts stand
        return None, None


def sdpa_vjp_kernels(vjp):
    """For a CPU ``scaled_dot_product_attention_vjp`` line: a function of its arguments running the kernels the program
    runs for it, whose run on meta tensors gives the gradients' layouts (executors/layout_rules.py; ~1 ms, a fake run
    of ``TorchVJP``, forward and backward under autograd, ~40 ms): the math kernel and its formulas where the mask requires
    grad (``sdpa_math``, executors/attention_math.py), else flash's where the program runs it (``_rewrite_sdpa``; for one
    key/value head eager runs math, but the program flash, whose layout spares a fused reader copies).  Else None."""
    if getattr(vjp.sym, "forward_symbol", None) is not ltorch_attention.scaled_dot_product_attention:
        return None
    b = _bind(_SDPA_ARGS, _SDPA_DEFAULTS, vjp.args[2:], vjp.kwargs)
    if b is None or any(n not in b for n in ("query", "key", "value")) or b["dropout_p"] != 0.0 \
            or b["enable_gqa"] is not False or type(b["is_causal"]) is not bool:
        return None
    wanted = vjp.torch_fn[1] if vjp.torch_fn else None
    if not isinstance(wanted, tuple) or not wanted or any(len(p) != 1 for p in wanted):
        return None
    if vjp.torch_fn[0] is attention_math.sdpa_math:  # eager's math kernel for a mask requiring grad: its formulas
        return attention_math.math_vjp_kernels(b, _which(_as_call(vjp), wanted, (b["query"], b["key"], b["value"], b["attn_mask"])))
    q, k, v, mask = b["query"], b["key"], b["value"], b["attn_mask"]
    if not all(type(t) is TensorProxy and t.ndim_ == 4 and t._tt_device.type == "cpu" for t in (q, k, v)):
        return None
    if not (q._tt_dtype is k._tt_dtype is v._tt_dtype) or q._tt_dtype not in (dtypes.float32, dtypes.float64, dtypes.bfloat16):
        return None
    heads, kv_heads = q._tt_shape[1], k._tt_shape[1]
    if not (q._tt_shape[0] == k._tt_shape[0] == v._tt_shape[0] and type(heads) is int and v._tt_shape[1] == kv_heads):
        return None
    one_kv = kv_heads == 1 and heads > 1
    if not one_kv and kv_heads != heads:
        return None
    if mask is not None and (type(mask) is not TensorProxy or mask._tt_device.type != "cpu" or b["is_causal"]
                             or mask._tt_dtype not in (dtypes.bool8, q._tt_dtype)):
        return None
    if not (b["scale"] is None or type(b["scale"]) is float) or not eager_picks_cpu_flash(q, k, v, b["is_causal"], b["scale"], mask, one_kv):
        return None
    if any(p[0] > 2 for p in wanted):
        return None
    fn = _flash_vjps.get(wanted)
    if fn is None:  # one per ``wanted``: the layout cache is keyed by the callable
        def fn(g, reads, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            additive = _additive_mask(attn_mask, query.dtype)
            out, lse = torch._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, 0.0, is_causal, attn_mask=additive, scale=scale)[:2]
            grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                g, query, key, value, out, lse, 0.0, is_causal, attn_mask=additive, scale=scale)
            return tuple(grads[p[0]] for p in wanted)

        fn.layout_on_meta = True  # the CPU kernels' meta functions lay the results out as the kernels do
        _flash_vjps[wanted] = fn
    return fn


_flash_vjps: dict = {}


def _as_traced(trc, line, layouts, always=False):
    """``line``, or it and copies: where an output the trace recorded (eager's kernel's layout: for one key/value
    head the math kernel's, row-major) is laid out otherwise than the flash kernel gives it, the kernel's result is
    copied into the recorded layout first: for one key/value head (``always``) every time, so that every value the
    program computes has its recorded layout (the decisions taken from them, kept buffers, fused regions' stride
    checks, the layouts of what reads it, are right: tests/test_recorded_layouts.py), as eager's math kernel lays it
    out; otherwise where a fused region compiled for the recorded layout reads it (its stride check would fail on
    every call and run its torch ops)."""
    outs = list(line.output)
    if layouts is None or len(layouts) != len(outs):
        return (line,)
    fused_reads = {id(a) for b in trc.bound_symbols if getattr(b.sym, "module", None) in ("inductor", "nvfuser")
                   for a in b.flat_args() if type(a) is TensorProxy}
    copies = []
    for i, (value, strides) in enumerate(zip(outs, layouts)):
        if strides is None or strides == tuple(value._tt_strides) or not (always or id(value) in fused_reads) \
                or value._tt_storage_offset != 0:
            continue
        order = _dense_order(tuple(map(size_value, value._tt_shape)), tuple(map(size_value, value._tt_strides)))
        if order is None:
            continue
        raw = TensorProxy(trc.make_name("flash_out"), shape=value._tt_shape, dtype=value._tt_dtype, device=value._tt_device,
                          strides=strides)
        outs[i] = raw
        copies.append(BoundSymbol(impl_symbol(laid_out_as), (raw, order), {}, value,
                                  comment="laid out as traced" + ("" if always else ", as a fused kernel reads it")))
    return (line.replace(output=tuple(outs)), *copies) if copies else (line,)


# The backward kernel reads the op's inputs and the forward's results: inputs the backward recomputed do as well.
_rewrite_sdpa.recomputed_inputs_ok = True


def _rewrite_cross_entropy(trc, fwd, vjp, positions):
    b = _bind(_CE_ARGS, _CE_DEFAULTS, fwd.args, fwd.kwargs)
    if b is None or b["weight"] is not None or b["size_average"] is not None or b["reduce"] is not None:
        return None
    if b["label_smoothing"] != 0.0 or b["reduction"] not in _REDUCTION or type(b["ignore_index"]) is not int:
        return None
    x, y = b["input"], b["target"]
    if type(x) is not TensorProxy or type(y) is not TensorProxy or x.ndim_ != 2 or y.ndim_ != 1 or not x._tt_dtype.is_float:
        return None
    if y._tt_dtype is not dtypes.int64 or positions != ((0,),):
        return None
    red = _REDUCTION[b["reduction"]]
    logp = _new_proxy(trc, "logp", x._tt_shape, x._tt_dtype, x._tt_device)
    total = _new_proxy(trc, "total_weight", (), x._tt_dtype, x._tt_device)
    new_fwd = fwd.replace(sym=impl_symbol(cross_entropy_with_stats), args=(x, y, b["ignore_index"], red), kwargs={},
                          output=(fwd.output, logp, total), comment="forward also keeps the log-probabilities its backward reads")
    # ``logp`` is read by the backward line alone, which overwrites it (``cross_entropy_backward_into_logp``).
    new_vjp = vjp.replace(sym=impl_symbol(cross_entropy_backward_into_logp),
                          args=(vjp.args[0], logp, y, total, b["ignore_index"], red), kwargs={},
                          comment="cross-entropy's backward: eager's two kernels, by blocks of rows, into logp")
    return new_fwd, new_vjp


_LN_ARGS = ("input", "normalized_shape", "weight", "bias", "eps")
_LN_DEFAULTS = {"weight": None, "bias": None, "eps": 1e-5}


def _rewrite_layer_norm(trc, fwd, vjp, positions):
    b = _bind(_LN_ARGS, _LN_DEFAULTS, fwd.args, fwd.kwargs)
    if b is None or type(b["eps"]) is not float:
        return None
    x, w, bias = b["input"], b["weight"], b["bias"]
    shape = tuple(b["normalized_shape"]) if isinstance(b["normalized_shape"], (tuple, list)) else (b["normalized_shape"],)
    if type(x) is not TensorProxy or not all(type(s) is int for s in shape):
        return None
    if not all(t is None or (type(t) is TensorProxy and t._tt_dtype is x._tt_dtype) for t in (w, bias)):
        return None
    bv = _bind(_LN_ARGS, _LN_DEFAULTS, vjp.args[2:], vjp.kwargs)  # its own x, w, b: the forward's, or recomputed copies
    xv, wv, biasv = bv["input"], bv["weight"], bv["bias"]
    which = _which(_as_call(vjp), positions, (xv, wv, biasv))
    if which is None:
        return None
    stat_shape = tuple(x._tt_shape[: x.ndim_ - len(shape)]) + (1,) * len(shape)
    stat_dtype = dtypes.float32 if x._tt_dtype in (dtypes.bfloat16, dtypes.float16) else x._tt_dtype
    mean = _new_proxy(trc, "ln_mean", stat_shape, stat_dtype, x._tt_device)
    rstd = _new_proxy(trc, "ln_rstd", stat_shape, stat_dtype, x._tt_device)
    new_fwd = fwd.replace(sym=impl_symbol(layer_norm_with_stats), args=(x, shape, w, bias, b["eps"]), kwargs={},
                          output=(fwd.output, mean, rstd), comment="forward also keeps the mean and rstd its backward reads")
    new_vjp = vjp.replace(sym=impl_symbol(layer_norm_backward),
                          args=(vjp.args[0], xv, shape, mean, rstd, wv, biasv, which), kwargs={})
    return new_fwd, new_vjp


_rewrite_layer_norm.recomputed_inputs_ok = True


def _which(fwd, positions, tensors):
    """For each differentiated argument position of the vjp line, its index in ``tensors``; None if one is not
    there (or appears twice)."""
    leaves = tree_flatten((fwd.args, fwd.kwargs))[0]
    which = []
    for pos in positions:
        i = next((i for i, t in enumerate(tensors) if t is not None and t is leaves[pos[0]]), None)
        if i is None or len(pos) != 1 or i in which:
            return None
        which.append(i)
    return tuple(which)


def _cpu_float_like(x, *others) -> bool:
    """A CPU float32/float64 tensor, and each other argument None or a tensor of its dtype on its device."""
    if type(x) is not TensorProxy or x._tt_device.type != "cpu" or x._tt_dtype not in (dtypes.float32, dtypes.float64):
        return False
    return all(t is None or (type(t) is TensorProxy and t._tt_dtype is x._tt_dtype and t._tt_device == x._tt_device) for t in others)


_BN_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
_BN_DEFAULTS = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}


def _rewrite_batch_norm(trc, fwd, vjp, positions):
    b = _bind(_BN_ARGS, _BN_DEFAULTS, fwd.args, fwd.kwargs)
    if b is None or type(b["training"]) is not bool or type(b["eps"]) is not float:
        return None
    x, w, bias, rm, rv, training = b["input"], b["weight"], b["bias"], b["running_mean"], b["running_var"], b["training"]
    # Training lines carry no running statistics (their updates are lines of their own); evaluation needs both.
    stats_ok = rm is None and rv is None if training else type(rm) is TensorProxy and type(rv) is TensorProxy
    if not stats_ok or not _cpu_float_like(x, w, bias, rm, rv) or x.ndim_ < 2:
        return None
    if not all(type(s) is int for s in x._tt_shape) or 0 in x._tt_shape:
        return None  # eager's batch_norm does not call native_batch_norm on an empty batch
    which = _which(fwd, positions, (x, w, bias))
    if which is None:
        return None
    n_stats = x._tt_shape[1] if training else 0
    mean = _new_proxy(trc, "bn_mean", (n_stats,), x._tt_dtype, x._tt_device)
    invstd = _new_proxy(trc, "bn_invstd", (n_stats,), x._tt_dtype, x._tt_device)
    new_fwd = fwd.replace(sym=impl_symbol(batch_norm_with_stats), args=(x, w, bias, rm, rv, training, b["eps"]), kwargs={},
                          output=(fwd.output, mean, invstd), comment="forward also keeps the mean and inverse std its backward reads")
    new_vjp = vjp.replace(sym=impl_symbol(batch_norm_backward),
                          args=(vjp.args[0], x, w, rm, rv, mean, invstd, training, b["eps"], which), kwargs={})
    return new_fwd, new_vjp


_GN_ARGS = ("input", "num_groups", "weight", "bias", "eps")
_GN_DEFAULTS = {"weight": None, "bias": None, "eps": 1e-5}


def _rewrite_group_norm(trc, fwd, vjp, positions):
    b = _bind(_GN_ARGS, _GN_DEFAULTS, fwd.args, fwd.kwargs)
    if b is None or type(b["num_groups"]) is not int or type(b["eps"]) is not float:
        return None
    x, w, bias = b["input"], b["weight"], b["bias"]
    # Row-major input: eager's group_norm hands the kernel a contiguous copy in the input's memory format.
    if not _cpu_float_like(x, w, bias) or x.ndim_ < 2 or not x._tt_rowmajor or not all(type(s) is int for s in x._tt_shape):
        return None
    which = _which(fwd, positions, (x, w, bias))
    if which is None:
        return None
    stat_shape = (x._tt_shape[0], b["num_groups"])
    mean = _new_proxy(trc, "gn_mean", stat_shape, x._tt_dtype, x._tt_device)
    rstd = _new_proxy(trc, "gn_rstd", stat_shape, x._tt_dtype, x._tt_device)
    new_fwd = fwd.replace(sym=impl_symbol(group_norm_with_stats), args=(x, w, bias, b["num_groups"], b["eps"]), kwargs={},
                          output=(fwd.output, mean, rstd), comment="forward also keeps the mean and rstd its backward reads")
    new_vjp = vjp.replace(sym=impl_symbol(group_norm_backward),
                          args=(vjp.args[0], x, mean, rstd, w, b["num_groups"], which), kwargs={})
    return new_fwd, new_vjp


# Which forward statistics an op's backward reuses: a fact of the op (``Symbol.torch_saved_statistics``),
# registered here because the kernels are the torch executor's.
ltorch_attention.scaled_dot_product_attention.torch_saved_statistics = _rewrite_sdpa
ltorch_attention.scaled_dot_product_attention.torch_saved_statistics_bytes = torch_impls.flash_attention_kept_bytes
ltorch_attention.scaled_dot_product_attention.torch_holds_unplanned = \
    lambda fwd: outside_the_flash_pair(_bind(_SDPA_ARGS, _SDPA_DEFAULTS, fwd.args, fwd.kwargs))
# Where no kernel pair above applies: the forward keeps eager's autograd graph for the backward line.
ltorch_attention.scaled_dot_product_attention.torch_kept_graph = _sdpa_keeps_its_graph
ltorch_losses.cross_entropy.torch_saved_statistics = _rewrite_cross_entropy
ltorch_normalization.layer_norm.torch_saved_statistics = _rewrite_layer_norm
ltorch_normalization.batch_norm.torch_saved_statistics = _rewrite_batch_norm
ltorch_normalization.group_norm.torch_saved_statistics = _rewrite_group_norm


def _overwrite_dead_logits(trc, bsyms) -> list:
    """``cross_entropy_with_stats`` lines whose logits nothing reads afterwards write the log-probabilities over them
    (``cross_entropy_into_logits``): one logits-sized array less at the end of the forward.  Only for a CPU
    row-major intermediate of the program: not an input, not returned, not handed to an op that may keep a
    reference, and no value that may share its memory read by a later line."""
    from .buffers import overwritable  # a sibling pass's alias facts

    may_alias, off_limits = overwritable(trc, bsyms)
    out = list(bsyms)
    for i, b in enumerate(bsyms):
        if getattr(b.sym, "fn", None) is not cross_entropy_with_stats:
            continue
        x = b.args[0]
        if type(x) is not TensorProxy or x._tt_device.type != "cpu" or not x._tt_rowmajor or id(x) in off_limits:
            continue
        mine = may_alias.get(id(x), set())
        if not mine or mine & off_limits:
            continue
        if any(may_alias.get(id(a), set()) & mine for later in bsyms[i + 1:] for a in later.flat_args() if type(a) is TensorProxy):
            continue
        out[i] = b.replace(sym=impl_symbol(cross_entropy_into_logits),
                           comment="forward also keeps the log-probabilities its backward reads, written over the logits")
    return out


def reuse_forward_statistics(trc, header="Backward kernels read the statistics their forward kept", keep_graphs=True, fused=False):
    """``keep_graphs``: a forward no kernel pair covers may keep eager's autograd graph for its backward
    (``Symbol.torch_kept_graph``), in a ``fused`` program first another kernel pair (``torch_fused_program_pair``:
    executors/narrow_value_attention.py); False where the program asks for memory (a checkpoint region, a budget)."""
    bsyms = list(trc.bound_symbols)
    changed = False
    for j, vb in enumerate(bsyms):
        vjp = _vjp_of(vb)
        op = getattr(vb.source, "forward_symbol", None)  # the op whose <name>_vjp line this is
        rewrite = getattr(op, "torch_saved_statistics", None)
        if vjp is None or rewrite is None or (vjp.fn is not op.torch_impl and getattr(vjp.fn, "kernel_of", None) is not op):
            continue
        for i in range(j - 1, -1, -1):
            fb = bsyms[i]
            if isinstance(fb, tuple):  # lines a rewrite made: no forward line of another vjp
                continue
            if getattr(fb.sym, "fn", None) is vjp.fn and _same_call(fb, vb, getattr(rewrite, "recomputed_inputs_ok", False)):
                pair = rewrite(trc, fb, vb, vjp.wanted)
                for other in ((op.torch_fused_program_pair if fused else None, op.torch_kept_graph) if keep_graphs else ()):
                    if pair is None and other is not None:
                        pair = other(trc, fb, vb, vjp.wanted)
                if pair is not None:
                    bsyms[i], bsyms[j] = pair
                    changed = True
                break
    if not changed:
        return trc
    new = trc.derive(header)
    new.bound_symbols = _overwrite_dead_logits(trc, [line for b in bsyms for line in (b if isinstance(b, tuple) else (b,))])
    return new
