"""Helpers the torch executor calls for prims that are not one torch call.

Generated code refers to them as ``ttex.<name>``.  Arguments are already
torch objects (the executor translated compiler dtypes and devices when it
claimed the symbol).
"""
from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

from .. import codegen
from ..errors import DecisionMismatch
from ..torchlang import activations as ltorch_activations, nn as ltorch_nn, normalization as ltorch_normalization, optim as ltorch_optim
from ..torchlang import reductions as ltorch_reductions
from ..torchlang.convert import to_dtype


def broadcast_in_dim(a, view_shape, shape):
    return a.reshape(view_shape).expand(shape)


def sum_none(a):
    """A reduction over no dims is the identity (torch would reduce everything)."""
    return a.clone()


def prod(a, dims):
    if len(dims) == 1:
        return torch.prod(a, dims[0])
    keep = [d for d in range(a.ndim) if d not in dims]
    x = a.permute(*keep, *dims)
    x = x.reshape(*[a.shape[d] for d in keep], -1)
    return torch.prod(x, -1)


def argmax(a, dim):
    return torch.argmax(a, dim)


def iota_int(length, start, step, device, dtype):
    return torch.arange(start, start + length * step, step, device=device, dtype=dtype)


def iota_float(length, start, step, device, dtype):
    return (torch.arange(length, device=device, dtype=torch.float64) * step + start).to(dtype)


def uniform(shape, minval, maxval, device, dtype):
    return torch.empty(shape, device=device, dtype=dtype).uniform_(minval, maxval)


def get_rng_state(device):
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device.index)


def set_rng_state(state, device):
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device.index)


def manual_seed(seed, scope):
    {"all": torch.manual_seed, "cuda": torch.cuda.manual_seed, "cuda_all": torch.cuda.manual_seed_all}[scope](seed)


def bernoulli(a, p):
    """0/1 draws with probability ``p`` in ``a``'s shape and dtype — the same draws eager dropout makes on CPU."""
    return torch.empty_like(a).bernoulli_(p)


def bernoulli_out(a, p, *, out):
    """``bernoulli`` drawn into ``out`` (a kept buffer of the result's layout): the same draws in the same order."""
    return out.bernoulli_(p)


bernoulli.out = bernoulli_out
# A new tensor, never ``a``'s memory: undeclared, the kept-buffer plan took the draws for ``a``'s bytes and counted
# none of their own (a dropout MLP's step peaked 1.16x eager's; executors/buffers.py).
bernoulli.aliases = ()


def copy_(src, dst):
    """A write-back into an input buffer (a parameter too): never part of an autograd graph."""
    if dst.requires_grad:
        with torch.no_grad():
            return dst.copy_(src)
    return dst.copy_(src)


def shape(a):
    return tuple(a.shape)


def unique(a, sorted, return_inverse, return_counts):
    """``torch.unique`` with the prim's three results (None for those not asked for, as the trace has them)."""
    values, inverse, counts = torch._unique2(a, sorted, return_inverse, return_counts)
    return values, inverse if return_inverse else None, counts if return_counts else None


def unique_consecutive(a, return_inverse, return_counts):
    """``torch.unique_consecutive`` with the prim's three results (None for those not asked for)."""
    values, inverse, counts = torch.unique_consecutive(a, return_inverse=True, return_counts=True)
    return values, inverse if return_inverse else None, counts if return_counts else None


def unique_dim(a, dim, consecutive, return_inverse, return_counts):
    """``torch.unique(dim=)`` / ``torch.unique_consecutive(dim=)`` with the prim's three results."""
    if consecutive:
        values, inverse, counts = torch.unique_consecutive(a, return_inverse=True, return_counts=True, dim=dim)
    else:
        values, inverse, counts = torch.unique(a, sorted=True, return_inverse=True, return_counts=True, dim=dim)
    return values, inverse if return_inverse else None, counts if return_counts else None


def pad(a, value, config):
    """Constant pad with (lo, hi, interior) per dim; negative lo/hi crop."""
    if any(interior for _, _, interior in config):
        # Interior padding: scatter the input into a strided view of a filled buffer.
        out_shape = [lo + hi + s + max(s - 1, 0) * it for s, (lo, hi, it) in zip(a.shape, config)]
        big = [s + max(s - 1, 0) * it for s, (_, _, it) in zip(a.shape, config)]
        buf = torch.full(big, value, dtype=a.dtype, device=a.device)
        buf[tuple(slice(None, None, it + 1) for _, _, it in config)] = a
        return pad(buf, value, [(lo, hi, 0) for lo, hi, _ in config]) if out_shape else buf
    flat = []
    for lo, hi, _ in reversed(config):
        flat += [lo, hi]
    # F.pad's constant mode is this kernel (at::pad calls constant_pad_nd); calling it directly skips F.pad's
    # Python checks, about 2 us a call (the rotary backward pads 4 slices a layer)
    return torch.constant_pad_nd(a, flat, value)


def rsub(a, b):
    """``a - b`` where ``a`` is a number and ``b`` a tensor."""
    return torch.rsub(b, a)


def rdiv(a, b):
    return b.__rtruediv__(a)


class ScalarWrapper:
    """A binary torch op called with a Python number on one side, made a tensor first (``ttex.<op>_scalar_first``)."""

    def __init__(self, op, name, first):
        self.op, self.first = op, first
        self.__name__ = self.__qualname__ = name
        self.__module__ = __name__

    def __call__(self, a, b):
        return self.op(torch.full_like(b, a), b) if self.first else self.op(a, torch.full_like(a, b))


def _named_wrapper(op, suffix, first):
    """Build (once) a wrapper of ``op`` and publish it in this module, so the
    generated code can refer to it as ``ttex.<name>``."""
    name = f"{op.__name__}_{suffix}"
    fn = globals().get(name)
    if fn is None:
        fn = globals()[name] = ScalarWrapper(op, name, first)
    return fn


def scalar_first(op):
    """Wrap a binary torch op so a Python number may come first."""
    return _named_wrapper(op, "scalar_first", True)


def scalar_second(op):
    """Wrap a binary torch op that needs tensors on both sides."""
    return _named_wrapper(op, "scalar_second", False)


def where(pred, a, b):
    return torch.where(pred, a, b)


def trunc_div(a, b):
    return torch.div(a, b, rounding_mode="trunc")


def convolution(a, weight, bias, stride, padding, dilation, groups):
    return torch.convolution(a, weight, bias, stride, padding, dilation, False, [0] * len(stride), groups)


def convolution_backward(g, a, weight, stride, padding, dilation, groups, output_mask):
    """``prims.convolution_backward``: the input's, the weight's and the bias's gradients (those ``output_mask`` asks
    for, the others None), by PyTorch's kernel."""
    return torch.ops.aten.convolution_backward(
        g, a, weight, [weight.shape[0]] if output_mask[2] else None, list(stride), list(padding), list(dilation), False,
        [0] * len(stride), groups, list(output_mask)
    )


def index_put(a, indices, values, accumulate):
    return torch.index_put(a, tuple(indices), values, accumulate)


class TorchVJP:
    """The backward of one torch function, computed by PyTorch's autograd (its fused kernels).

    ``TorchVJP(F.layer_norm, wanted)(g, *args, **kwargs)`` re-runs the function on
    the inputs listed in ``wanted`` (positions in the flattened arguments; a tuple
    when one tensor appears twice) made to require grad, and returns their
    gradients for the cotangent ``g``.  The re-run forward costs one forward of
    the op; the backward kernels (layer norm, GELU, flash attention, log-softmax
    + NLL) are what make this faster than the op-by-op formula.
    """

    def __init__(self, fn, wanted):
        self.fn = fn
        self.wanted = wanted
        # One name per (function, inputs needing grad): two of them in one trace must not clash.
        self.__name__ = self.__qualname__ = f"vjp_{getattr(fn, '__name__', 'op')}_" + "_".join(str(p[0]) for p in wanted)
        self.__module__ = "thunder_train.vjp"  # printed as a named global, not as ttex.<name>

    def __call__(self, g, reads, *args, **kwargs):
        # ``reads``: values only the rule's decomposition needs (kept alive for it); unused here.
        from ..pytree import tree_flatten, tree_unflatten

        flat, spec = tree_flatten((args, kwargs))
        with torch.enable_grad():
            leaves = []
            for positions in self.wanted:
                leaf = flat[positions[0]].detach().requires_grad_()
                for i in positions:
                    flat[i] = leaf
                leaves.append(leaf)
            a, k = tree_unflatten(flat, spec)
            out = self.fn(*a, **k)
            return torch.autograd.grad(out, leaves, g)


# Backwards that need no forward recomputation (``Symbol.torch_direct_vjp``; used when only the gradients they compute are wanted: ``input``'s, or those their ``.wanted`` names).
def gelu_vjp(g, reads, input, approximate="none"):
    """GELU's gradient from its input alone: PyTorch's backward kernel, no forward recomputation."""
    return (torch.ops.aten.gelu_backward(g, input, approximate=approximate),)


def silu_vjp(g, reads, input, inplace=False):
    return (torch.ops.aten.silu_backward(g, input),)


def embedding_vjp(g, reads, input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False):
    """The weight's gradient by eager's own backward kernel (``embedding_dense_backward``, what eager's autograd
    calls), without running the forward again under autograd."""
    n = weight.shape[0]
    pad = -1 if padding_idx is None else padding_idx % n  # F.embedding's normalisation of a negative index
    return (torch.ops.aten.embedding_dense_backward(g, input, n, pad, scale_grad_by_freq),)


embedding_vjp.wanted = ((1,),)  # the gradient of ``weight`` (positional argument 1) only


def softmax_vjp(g, reads, input, dim=None, _stacklevel=3, dtype=None):
    """(Log-)softmax's gradient from its output (``reads``: the value its rule reads, the forward's output) by eager's
    backward kernel, without running the forward again under autograd."""
    return (torch._softmax_backward_data(g, reads[0], dim, input.dtype),)


def log_softmax_vjp(g, reads, input, dim=None, _stacklevel=3, dtype=None):
    return (torch._log_softmax_backward_data(g, reads[0], dim, input.dtype),)


def _output_read(reads, input, dim=None, _stacklevel=3, dtype=None) -> bool:
    """The kernel eager's autograd runs for the call is the one above: an int ``dim``, ``dtype`` absent or the
    input's (else eager converts first and differentiates the conversion too), and the rule reading one value of
    the input's metadata (the output)."""
    if type(dim) is not int or not input._tt_dtype.is_float or (dtype is not None and to_dtype(dtype) is not input._tt_dtype):
        return False
    return len(reads) == 1 and reads[0]._tt_dtype is input._tt_dtype and tuple(reads[0]._tt_shape) == tuple(input._tt_shape)


def softmax_vjp_out(g, reads, input, dim=None, _stacklevel=3, dtype=None, *, out):
    return (torch.ops.aten._softmax_backward_data.out(g, reads[0], dim, input.dtype, grad_input=out[0]),)


def log_softmax_vjp_out(g, reads, input, dim=None, _stacklevel=3, dtype=None, *, out):
    return (torch.ops.aten._log_softmax_backward_data.out(g, reads[0], dim, input.dtype, out=out[0]),)


def _output_for_input(g, reads, input, *rest, **kwargs):
    """The kernels read the input's dtype only, which ``_output_read`` checked is the output's: the output is given in
    the input's place, so the line does not hold the input's memory to the backward (eager's ``SoftmaxBackward0``
    saves the result only; BLOOM's attention scores were held through the layers' backward, 4.5 KiB of its peak)."""
    return (g, reads, reads[0], *rest), kwargs


softmax_vjp.applies = log_softmax_vjp.applies = _output_read
softmax_vjp.arguments = log_softmax_vjp.arguments = _output_for_input
softmax_vjp.out, log_softmax_vjp.out = softmax_vjp_out, log_softmax_vjp_out


def batch_norm_running_stats(input, running_mean, running_var, momentum):
    """The running statistics' new values, from eager's own training-mode batch norm kernel (bitwise eager's update).
    An empty batch leaves them as they are: eager's batch_norm does not call the kernel for one (it would raise)."""
    if input.numel() == 0:
        return running_mean.clone(), running_var.clone()
    out = torch.ops.aten._native_batch_norm_legit_functional(input, None, None, running_mean, running_var, True, momentum, 0.0)
    return out[3], out[4]


ltorch_normalization.batch_norm_running_stats.torch_impl = batch_norm_running_stats


# Out forms (executors/buffers.py): the same kernels as the functions they stand for, writing into ``out``.
def relu_out(input, inplace=False, *, out):
    """``relu`` into ``out``: aten's ``relu`` is ``clamp_min(input, 0)`` (its CPU and CUDA kernels), whose out
    overload writes the same values.  Never for ``inplace=True`` (that call writes ``input``: out_forms.out_form)."""
    if inplace:
        raise ValueError("relu_out: an inplace relu has no out form")
    return torch.clamp_min(input, 0, out=out)


def silu_out(input, inplace=False, *, out):
    """``F.silu`` into ``out`` (aten's ``silu.out``, the structured kernel the functional call runs).  Never for
    ``inplace=True`` (out_forms.out_form)."""
    if inplace:
        raise ValueError("silu_out: an inplace silu has no out form")
    return torch._C._nn.silu(input, out=out)


def linear_out(input, weight, bias=None, *, out):
    """``F.linear`` into ``out`` by the kernels functional ``linear`` picks, so the values are bitwise the same:
    ``addmm`` for a 1-d bias and a 2-d or row-major input (flattened to 2-d), functional ``linear`` copied into
    ``out`` for another input of 3 or more dims, else ``matmul`` then ``add_``.  (aten's own ``linear.out`` is that for a 2-d input, but ``matmul`` then ``add_`` for a 3-d one.)"""
    if bias is not None and bias.dim() == 1:
        if input.dim() == 2:
            return torch._C._nn.linear(input, weight, bias, out=out)
        if input.is_contiguous():
            return linear_rows_out(input, weight, bias, out=out)
    if input.dim() >= 3 and not input.is_contiguous():
        # A non-contiguous input of 3 or more dims (nn.TransformerEncoder's in-projection reads a transposed view):
        # functional linear itself, copied into ``out``; ``matmul(..., out=)`` then ``add_`` gave other sums there.
        return out.copy_(torch._C._nn.linear(input, weight, bias))
    torch.matmul(input, weight.t(), out=out)
    if bias is not None:
        out.add_(bias)
    return out


def linear_rows_out(input, weight, bias, *, out):
    """``F.linear`` of a row-major input of 2 or more dims and a 1-d bias into a row-major ``out``: aten's 2-d
    ``linear.out`` (``addmm``) over the rows, the kernel functional ``linear`` runs on such an input, bitwise.
    ``linear_out`` checks which branch to take on every call; a line picks this form from its traced layout
    (out_forms ``_linear_for_line``): two views and the product (~3 us a call less on a 2x12x32 input)."""
    _linear(input.view(-1, input.shape[-1]), weight, bias, out=out.view(-1, out.shape[-1]))
    return out


_linear = torch._C._nn.linear
# Forms that run Python between the line and its kernel, slower than the allocation a kept buffer saves
# (buffers._worth_their_forms)
linear_rows_out.python_between = linear_out.python_between = True


def gelu_vjp_out(g, reads, input, approximate="none", *, out):
    return (torch.ops.aten.gelu_backward.grad_input(g, input, approximate=approximate, grad_input=out[0]),)


gelu_vjp.out = gelu_vjp_out


def silu_vjp_out(g, reads, input, inplace=False, *, out):
    return (torch.ops.aten.silu_backward.grad_input(g, input, grad_input=out[0]),)


silu_vjp.out = silu_vjp_out


def embedding_out(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                  sparse=False, *, out):
    """``F.embedding`` into a row-major ``out``: aten's embedding is ``index_select`` of the weight's rows by the
    flattened indices (the same kernel, the same values); ``padding_idx`` and ``scale_grad_by_freq`` only change the
    gradient.  With ``max_norm`` (which renormalises rows of the weight in place first) functional embedding itself,
    copied into ``out``."""
    if max_norm is not None or weight.dim() != 2:
        return out.copy_(torch.nn.functional.embedding(input, weight, padding_idx, max_norm, norm_type,
                                                       scale_grad_by_freq, sparse))
    torch.index_select(weight, 0, input.reshape(-1), out=out.view(-1, weight.shape[1]))
    return out
# The arguments whose memory a function's results may share (executors/buffers.py; undeclared: all of them).
for _f in (gelu_vjp, silu_vjp, embedding_vjp, softmax_vjp, log_softmax_vjp, convolution, convolution_backward,
           batch_norm_running_stats):
    _f.aliases = ()
ltorch_activations.gelu.torch_direct_vjp = gelu_vjp
ltorch_activations.silu.torch_direct_vjp = silu_vjp
ltorch_nn.embedding.torch_direct_vjp = embedding_vjp
ltorch_reductions.softmax.torch_direct_vjp = softmax_vjp
ltorch_reductions.log_softmax.torch_direct_vjp = log_softmax_vjp


def obeys_layout(g, param) -> bool:
    """Whether ``g`` may become ``param``'s ``.grad`` as it is (``grad_layout`` returns it unchanged).  Also
    decided before the program runs, on meta tensors with the traced layouts (executors/decided_layouts.py)."""
    if param.is_contiguous():
        return g.is_contiguous()
    from ..dense import is_non_overlapping_and_dense

    if not is_non_overlapping_and_dense(param):
        return g.is_contiguous()
    return all(gs == ps if n != 1 else gs != 0 for n, gs, ps in zip(g.shape, g.stride(), param.stride()))


def grad_layout(g, param):
    """A new ``.grad`` laid out as eager's AccumulateGrad would (torch's gradient layout contract,
    ``obeys_layout_contract``/``clone_obey_contract`` in torch/csrc/autograd/functions/accumulate_grad.h):
    ``g`` itself when it already obeys, else a copy with the parameter's strides (dense parameter) or row-major."""
    if obeys_layout(g, param):
        return g
    from ..dense import is_non_overlapping_and_dense

    if not param.is_contiguous() and not is_non_overlapping_and_dense(param):
        return g.contiguous()
    return torch.empty_strided(param.shape, param.stride(), dtype=g.dtype, device=g.device).copy_(g)


grad_layout.aliases = (0,)  # g itself, or a copy

def unseen_write(value, old):
    """``prims.unseen_write``: the values are ``value``'s (the gradient's route is the backward's business)."""
    return value


unseen_write.aliases = (0,)


def numbered_objects(name):
    """``(register, lookup)`` for objects a printed program names by number (``ttex.kept_buffers(3)``), so that a
    printed trace runs by hand in the process that compiled it.  Held weakly: the program's globals hold them.
    ``lookup`` is this module's ``name`` (printed as ``ttex.<name>``)."""
    import itertools
    import weakref

    objects: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    keys = itertools.count()

    def register(obj) -> int:
        key = next(keys)
        objects[key] = obj
        return key

    def lookup(key):
        return objects[key]

    lookup.__name__ = lookup.__qualname__ = name
    lookup.__module__ = __name__
    globals()[name] = lookup
    return register, lookup

# Tests set this before compiling: lines whose layout was decided from the traced layouts check it when they run
# (executors/decided_layouts.py).  Off, they run nothing for it.
VERIFY_DECIDED_LAYOUTS = False


class LayoutDecisionError(AssertionError):
    """A layout decided from the traced layouts is not the one the program met (a layout rule is wrong)."""


def grad_layout_decided(g, param):
    """``grad_layout`` decided to be the identity from the traced layouts, kept as a checking line (tests)."""
    if not obeys_layout(g, param):
        raise LayoutDecisionError(f"gradient of strides {g.stride()} was decided to obey a parameter of strides "
                                  f"{param.stride()} (shape {tuple(param.shape)})")
    return g


grad_layout_decided.aliases = (0,)


def grad_copy(g, shape, strides):
    """``grad_layout`` decided from the traced layouts to copy ``g`` (it does not obey its parameter's dense layout:
    a weight used as ``W.T`` gets its gradient transposed): the copy with the parameter's traced ``strides``, what
    ``grad_layout`` makes, without asking the layouts on every call."""
    if VERIFY_DECIDED_LAYOUTS and g.stride() == tuple(strides):
        raise LayoutDecisionError(f"gradient of strides {g.stride()} was decided to need a copy into strides {strides}")
    return torch.empty_strided(shape, strides, dtype=g.dtype, device=g.device).copy_(g)


grad_copy.aliases = ()  # a new tensor


def transposed_copy_scratch(shape, strides, src) -> int:
    """Bytes aten's ``copy_`` allocates and frees inside itself to copy ``src`` into a tensor of ``shape`` and
    ``strides`` (proxies or tensors): a 2-d column-major ``src`` (a transposed row-major one) into a row-major tensor
    of at least 60 x 60 elements is copied by blocks through a 60 x 60 buffer (120 x 120 for bytes).  Kept buffers
    count it at the line (executors/buffers.py: the copy of a transposed weight's gradient at the end of a backward,
    where a step often peaks, held 14,400 bytes the plan did not see)."""
    from ..proxies import is_proxy

    src_shape, src_strides = (src._tt_shape, src._tt_strides) if is_proxy(src) else (src.shape, src.stride())
    dims = (*shape, *strides, *src_shape, *src_strides)
    if len(shape) != 2 or len(src_shape) != 2 or not all(type(n) is int for n in dims):
        return 0
    rows, cols = shape
    if tuple(src_shape) != tuple(shape) or rows * cols < 60 * 60 or tuple(strides) != (cols, 1) \
            or tuple(src_strides) != (1, rows):
        return 0
    dtype = src._tt_dtype.torch if is_proxy(src) else src.dtype
    block = 120 if dtype == torch.uint8 else 60
    return block * block * dtype.itemsize


grad_copy.scratch_bytes = lambda g, shape, strides: transposed_copy_scratch(shape, strides, g)
copy_.scratch_bytes = lambda src, dst: transposed_copy_scratch(dst._tt_shape, dst._tt_strides, src)
# (``grad_layout`` copies only a gradient that does not obey its parameter's layout: a column-major one of a row-major
# parameter is such a gradient)
grad_layout.scratch_bytes = lambda g, param: transposed_copy_scratch(param._tt_shape, param._tt_strides, g)


def flash_attention_kept_bytes(fwd) -> int:
    """What the CPU flash pair (executors/saved_statistics.py) keeps from an attention's forward line to its backward
    line: the output and its float32 log-sum-exp (one per query row and head), which the flash backward reads."""
    from ..proxies import TensorProxy, size_value

    out = fwd.output
    if type(out) is not TensorProxy or not out._tt_shape:
        return 0
    rows = math.prod(size_value(s) for s in out._tt_shape[:-1])  # (sizes at their traced values)
    return rows * (size_value(out._tt_shape[-1]) * out._tt_dtype.torch.itemsize + 4)


unlike_layouts = ltorch_optim.unlike_layouts  # indices whose tensors do not share one dense layout


def _fused(kernel, lists, written, *rest, odd=None, **hyper):
    """Call a fused multi-tensor optimizer kernel on tensors it supports.

    The fused kernels walk each parameter's memory together with its gradient's and state's
    as flat arrays, so all of them must share one dense layout; eager's AccumulateGrad and
    ``zeros_like`` state usually give them that, but not for a non-dense parameter (a strided
    slice) or a gradient assigned by hand.  Such a parameter's tensors run on row-major copies,
    written back into the tensors the kernel updates (``written``: indices into ``lists``).
    ``odd``: those indices as decided from the traced layouts (executors/decided_layouts.py: the prologue and
    thin mode's checks hold every input to them), else None (decided here, every call).
    """
    if odd is None:
        odd = unlike_layouts(lists)
    elif VERIFY_DECIDED_LAYOUTS and unlike_layouts(lists) != odd:
        raise LayoutDecisionError(f"optimizer tensors of unlike layouts {unlike_layouts(lists)} were decided to be {odd}")
    if not odd:
        kernel(*lists, *rest, **hyper)
        return
    sub = [list(ts) for ts in lists]
    for ts in sub:
        for i in odd:
            if i < len(ts):
                ts[i] = ts[i].contiguous()
    kernel(*sub, *rest, **hyper)
    for k in written:
        for i in odd:
            if i < len(lists[k]) and sub[k][i] is not lists[k][i]:
                lists[k][i].copy_(sub[k][i])


# Optimizer updates (torchlang/optim.py) on torch's fused kernels.  The functional forms update
# copies; re-inplacing (executors/reinplace.py) switches to the in-place forms, which write into
# the parameters and state themselves, where nothing reads their old values.
def adam_update_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, decoupled_weight_decay, **hyper):
    kernel = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
    _fused(kernel, (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs), (0, 2, 3, 4), state_steps, **hyper)
    return params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs


def adam_update(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, **kwargs):
    p, m, v, vmax = ([t.clone() for t in ts] for ts in (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs))
    return adam_update_(p, grads, m, v, vmax, state_steps, **kwargs)


def sgd_update_(params, grads, momentum_buffers, **hyper):
    _fused(torch._fused_sgd_, (params, grads, momentum_buffers), (0, 2), **hyper)
    return params, momentum_buffers


def sgd_update(params, grads, momentum_buffers, **kwargs):
    return sgd_update_([p.clone() for p in params], grads, [b.clone() for b in momentum_buffers], **kwargs)


def adagrad_update_(params, grads, state_sums, state_steps, **hyper):
    _fused(torch._fused_adagrad_, (params, grads, state_sums), (0, 2), state_steps, **hyper)
    return params, state_sums


def adagrad_update(params, grads, state_sums, state_steps, **kwargs):
    return adagrad_update_([p.clone() for p in params], grads, [s.clone() for s in state_sums], state_steps, **kwargs)


def foreach_add_(tensors, other):
    """``torch._foreach_add_`` returning its list (the re-inplaced form of ``(a, b) = _foreach_add([a, b], 1)``)."""
    torch._foreach_add_(tensors, other)
    return tensors


_ADDENDS: dict = {}  # (number, dtype) -> a 0-d CPU tensor of it (foreach_add_same_)


def foreach_add_same_(tensors, other, dtype):
    """``foreach_add_(tensors, other)`` for CPU tensors of one floating ``dtype`` and an integral ``other`` that
    ``dtype`` holds exactly, as decided from the traced tensors (executors/decided_layouts.py): the tensor-list
    overload with one 0-d tensor of ``other``, about 3x faster on the CPU than the number overload (which wraps
    the number into a tensor for each tensor of the list).  The same values: the number is exact in ``dtype``
    and each sum is computed in ``dtype``'s arithmetic either way (optimizers' step counters)."""
    addend = _ADDENDS.get((other, dtype))
    if addend is None:
        addend = _ADDENDS[(other, dtype)] = torch.tensor(other, dtype=dtype)
    torch._foreach_add_(tensors, [addend] * len(tensors))
    return tensors


# (functional form, output position -> the argument position its in-place form overwrites)
adam_update.inplace, adam_update.overwrites = adam_update_, ((0, 0), (1, 2), (2, 3), (3, 4))
sgd_update.inplace, sgd_update.overwrites = sgd_update_, ((0, 0), (1, 2))
adagrad_update.inplace, adagrad_update.overwrites = adagrad_update_, ((0, 0), (1, 2))
# How many leading arguments are the per-parameter lists ``_fused`` compares (executors/decided_layouts.py).
for _f, _n in ((adam_update, 5), (adam_update_, 5), (sgd_update, 3), (sgd_update_, 3), (adagrad_update, 3), (adagrad_update_, 3)):
    _f.layout_lists = _n

# The torch-language optimizer updates (torchlang/optim.py) have no torch function of their own: these kernels.
ltorch_optim.adam_update.torch_impl = adam_update
ltorch_optim.sgd_update.torch_impl = sgd_update
ltorch_optim.adagrad_update.torch_impl = adagrad_update


def all_reduce_mean(tensors):
    """Each tensor divided by the world size, then summed over the ranks (as DDP's default hook does)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    out = [t / world for t in tensors]
    works = [dist.all_reduce(o, async_op=True) for o in out]
    for w in works:
        w.wait()
    return out


def wait_collective(result, source):
    """``torch.ops._c10d_functional.wait_tensor(result)``; ``source``, the collective's input, is an argument only so
    that it stays alive (and its memory unused) until here."""
    return torch.ops._c10d_functional.wait_tensor(result)


wait_collective.aliases = (0,)  # the result itself (``source`` is read only to keep it alive)


def check_finite(a, message):
    if not bool(torch.isfinite(a).all()):
        raise RuntimeError(message)


def _as_list(v):
    return v.tolist() if isinstance(v, torch.Tensor) else v


# How Python turned a value into a decision (``bool(t)``, ``int(t)``, ``t.tolist()``, ...): the tracer's
# conversion of the example value and the program's check at run time are the same function.
DECISION_CONVERT = {
    "bool": bool,
    "int": int,
    "float": float,
    "index": lambda v: v.__index__(),
    "list": _as_list,
}


def decision_key(v):
    """A decided value as a hashable key: NaN equals itself (``if x != x`` decided on a NaN still hits), a
    ``tolist()`` is a tuple."""
    if type(v) is list:
        return tuple(decision_key(e) for e in v)
    return "nan" if type(v) is float and v != v else v


def check_decision(value, convert, expected, index, text):
    got = decision_key(DECISION_CONVERT[convert](value))
    if got != expected:
        raise DecisionMismatch(index, got, text)


codegen.register_namespace("ttex", sys.modules[__name__])  # printed traces call these as ``ttex.<name>``
