"""torch.nn.functional's layers with weights: linear, bilinear, embedding, convolution; and one_hot.

The other families are their own modules: activations.py, normalization.py, attention.py, dropout.py,
padding.py, pooling.py, distances.py, losses.py.  Each op's gradient rule, where it has a direct one, follows
its definition."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import clang, dtypes, prims
from ..clang import downcast_like, is_tensor
from ..grad_rules import register_vjp
from ..prims.core import zeros_like
from ..prims.linalg import column_major, transposed
from .autocast import LOWER  # autocast policies: see autocast.py
from .matmul_precision import precision_switches
from ..opaque import device_layout_rule
from ..proxies import TensorProxy
from .helpers import ntuple
from .registry import composed, torchsymbol


@torchsymbol(F.linear, autocast={"cpu": LOWER, "cuda": LOWER})
def linear(input, weight, bias=None):
    out = prims.matmul(input, clang.transpose(weight, 0, 1) if weight.ndim_ == 2 else weight)
    if bias is not None:
        out = clang.add(out, bias)
    return out


@register_vjp(linear, supports=lambda input, weight, bias=None: weight.ndim_ == 2 and input._tt_dtype is weight._tt_dtype)
def _linear_vjp(g, out, /, input, weight, bias=None):
    # Eager's linear is mm(x, Wᵀ) on the input's rows: an operand laid out column-major (a transposed input, a weight
    # stored transposed) gets its gradient computed transposed, as eager's mm backward does (prims/linalg.py).
    n_out, n_in = weight._tt_shape
    g2 = clang.reshape(g, (-1, n_out))
    x2 = clang.reshape(input, (-1, n_in))
    gx = transposed(prims.matmul(transposed(weight), transposed(g2))) if column_major(x2) else prims.matmul(g2, weight)
    gw = transposed(prims.matmul(transposed(x2), g2)) if column_major(weight) else prims.matmul(transposed(g2), x2)
    grads = {"input": clang.reshape(gx, input._tt_shape), "weight": gw}
    if is_tensor(bias):
        grads["bias"] = downcast_like(prims.sum(g2, (0,)), bias)
    return grads


@torchsymbol(F.embedding, tags=("fused_backward", "fallible", "layout_on_meta"))
def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False):
    if max_norm is not None:
        _refuse_renorm_with_grad(weight)
        # Without a gradient the call runs opaquely, as torch: it renormalises the looked-up rows in place.
        raise NotImplementedError("embedding(max_norm=...) renormalises the weight in place; not supported")
    flat = clang.reshape(input, (-1,))
    out = prims.take(weight, flat, 0)
    return clang.reshape(out, input._tt_shape + (weight._tt_shape[1],))


def _refuse_renorm_with_grad(weight):
    """``max_norm`` on a weight that requires grad: torch writes the renormalised rows into the weight in place
    before the lookup, which the opaque call, run through torch's autograd on a view of the weight, cannot do
    (torch's error named an internal node).  Refused with what to do."""
    from .. import context
    from ..errors import UnsupportedOpError
    from .tensor_methods import requires_grad_of

    st = context.tracer_state()
    if st is not None and torch.is_grad_enabled() and requires_grad_of(st, weight):
        raise UnsupportedOpError(
            "embedding(max_norm=...) on a weight that requires grad is not supported inside a compiled function: "
            "torch renormalises the looked-up rows of the weight in place at every call. Renormalise before the "
            "compiled call (with torch.no_grad(): torch.embedding_renorm_(emb.weight, ids, max_norm, norm_type)) "
            "and build the embedding without max_norm, or run the embedding outside the compiled function")


@register_vjp(embedding)  # every call: padding_idx, scale_grad_by_freq and sparse change only the gradient
def _embedding_vjp(g, out, /, input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False):
    # Rows are accumulated with index_put; the padding row gets no gradient (torch semantics).  The flags act on
    # the gradient alone, so differentiating the forward's decomposition (a take) would ignore them: this rule
    # handles every call (the torch executor runs eager's embedding_dense_backward, executors/torch_impls.py).
    if sparse:
        raise NotImplementedError(
            "embedding(sparse=True): sparse gradients are not supported by thunder_train; use sparse=False "
            "(a dense gradient, the same values), or run this embedding outside the compiled function")
    idx = clang.reshape(input, (-1,))
    rows = clang.reshape(g, (-1, weight._tt_shape[1]))
    if scale_grad_by_freq:  # each row divided by how often its index occurs in the batch (before accumulating)
        n, m = weight._tt_shape[0], idx._tt_shape[0]
        ones = clang.full((m,), 1.0, device=weight._tt_device, dtype=rows._tt_dtype)
        counts = prims.index_put(clang.full((n,), 0.0, device=weight._tt_device, dtype=rows._tt_dtype), (idx,), ones, True)
        scale = prims.broadcast_in_dim(prims.div(ones, prims.take(counts, idx, 0)), rows._tt_shape, (0,))
        rows = prims.mul(rows, scale)
    if padding_idx is not None:
        pad = padding_idx % weight._tt_shape[0]
        is_pad = prims.broadcast_in_dim(prims.eq(idx, pad), rows._tt_shape, (0,))
        rows = prims.where(is_pad, 0.0, rows)
    return {"weight": prims.index_put(zeros_like(weight), (idx,), rows, True)}


def _conv(input, weight, bias, stride, padding, dilation, groups, nd):
    if isinstance(padding, str):
        if padding == "valid":
            padding = 0
        elif padding == "same":
            padding = tuple((dilation_i * (k - 1)) // 2 for dilation_i, k in zip(ntuple(dilation, nd), weight._tt_shape[2:]))
            if any((d * (k - 1)) % 2 for d, k in zip(ntuple(dilation, nd), weight._tt_shape[2:])):
                raise NotImplementedError("padding='same' with an even effective kernel size is not supported")
        else:
            raise ValueError(f"invalid padding string {padding!r}")
    unbatched = input.ndim_ == nd + 1
    x = clang.unsqueeze(input, 0) if unbatched else input
    # The bias inside the convolution, as eager's kernel adds it: its gradient is the convolution backward's own
    # (prims.convolution_backward), not a sum of the output's gradient made before that line.
    out = prims.convolution(x, weight, bias, ntuple(stride, nd), ntuple(padding, nd), ntuple(dilation, nd), groups)
    return clang.squeeze(out, (0,)) if unbatched else out


@torchsymbol(F.conv1d, torch.conv1d, autocast={"cpu": LOWER, "cuda": LOWER})
def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return _conv(input, weight, bias, stride, padding, dilation, groups, 1)


@torchsymbol(F.conv2d, torch.conv2d, autocast={"cpu": LOWER, "cuda": LOWER})
def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return _conv(input, weight, bias, stride, padding, dilation, groups, 2)


@device_layout_rule(F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)
def _conv_transpose_layout(device, args, kwargs, meta_out):
    """A transposed convolution (run opaquely) on the CPU: its kernel lays the result out in the memory format eager's
    convolution picks for the operands (channels_last for a channels_last input), where the meta kernel's is
    row-major; asked of torch's own choice (``_select_conv_backend``, ``_conv_determine_backend_memory_format``) on
    empty CPU tensors laid out as the operands."""
    names = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
    b = {"bias": None, "stride": 1, "padding": 0, "output_padding": 0, "groups": 1, "dilation": 1}
    b.update(zip(names, args))
    b.update(kwargs)
    x, w, bias = b["input"], b["weight"], b["bias"]
    tensors = [t for t in (x, w, bias) if t is not None]
    if device.type != "cpu" or not all(type(t) is TensorProxy and t._tt_device.type == "cpu" for t in tensors) \
            or not all(type(n) is int for t in tensors for n in (*t._tt_shape, *t._tt_strides)):
        return None
    nd = len(w._tt_shape) - 2
    per_dim = [[v] * nd if isinstance(v, int) else list(v) for v in (b["stride"], b["padding"], b["dilation"], b["output_padding"])]
    if any(len(v) != nd or not all(type(i) is int for i in v) for v in per_dim) or type(b["groups"]) is not int:
        return None
    with torch._C.DisableTorchFunction():
        ops = [torch.empty_strided(tuple(t._tt_shape), tuple(t._tt_strides), dtype=t._tt_dtype.torch) for t in tensors]
        xe, we, be = ops[0], ops[1], (ops[2] if bias is not None else None)
        unbatched = len(xe.shape) == nd + 1
        if unbatched:  # eager adds the batch dimension, and removes it from the result
            xe = xe.unsqueeze(0)
        if nd == 1:  # eager runs a 1-d convolution as a 2-d one of height 1 on its input made contiguous (the
            xe, we = xe.contiguous().unsqueeze(2), we.unsqueeze(2)  # memory format decided there, by the weight's)
            per_dim = [[first] + v for first, v in zip((1, 0, 1, 0), per_dim)]
        try:
            backend = torch._C._select_conv_backend(xe, we, be, per_dim[0], per_dim[1], per_dim[2], True, per_dim[3],
                                                    b["groups"], None)
            fmt = torch._C._conv_determine_backend_memory_format(xe, we, backend)
        except (RuntimeError, TypeError, AttributeError):
            return None
        shape = list(meta_out.shape)
        if len(shape) != nd + 1 + (not unbatched):
            return None
        if unbatched:
            shape.insert(0, 1)
        if nd == 1:
            shape.insert(2, 1)
        strides = list(torch.empty(tuple(shape), memory_format=fmt, device="meta").stride())
        if nd == 1:
            del strides[2]
        return tuple(strides[1:] if unbatched else strides)


# float32 matmul precision / TF32 switches the function sets around these are replayed (matmul_precision.py)
linear.kernel_switches = precision_switches(F.linear)
conv1d.kernel_switches = precision_switches(F.conv1d)
conv2d.kernel_switches = precision_switches(F.conv2d)


@torchsymbol(F.one_hot, tags=("fallible",))
def one_hot(tensor, num_classes=-1):
    if num_classes < 0:
        raise NotImplementedError("one_hot needs num_classes inside a compiled function (inferring it reads tensor values)")
    classes = prims.iota(num_classes, start=0, step=1, device=tensor._tt_device, dtype=dtypes.int64)
    shape = tensor._tt_shape + (num_classes,)
    eq = prims.eq(clang.expand(clang.unsqueeze(tensor, -1), shape), prims.broadcast_in_dim(classes, shape, (len(shape) - 1,)))
    return prims.convert_element_type(eq, dtypes.int64)


# ---------------------------------------------------------------------------
# Written as torch calls the torch language knows (registry.composed: traced as the user's own calls)
# ---------------------------------------------------------------------------
def bilinear(input1, input2, weight, bias=None):
    o, i, j = weight.shape
    lead = input1.shape[:-1]
    t = torch.matmul(input1.reshape(-1, i), weight.permute(1, 0, 2).reshape(i, o * j)).reshape(-1, o, j)
    out = (t * input2.reshape(-1, 1, j)).sum(-1).reshape(tuple(lead) + (o,))
    return out + bias if bias is not None else out


composed("bilinear", bilinear, (F.bilinear, torch.bilinear))
