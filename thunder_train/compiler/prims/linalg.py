"""Matrix products and convolution.  Each prim's meta and gradient rule are declared together."""
from __future__ import annotations

import math

from ..grad_rules import register_vjp
from ..proxies import TensorProxy
from .core import check, common_device, is_tensor, prim, prims, reshape, sum_to, swap_last_two, unsqueeze


def _matmul_shape(sa, sb):
    check(len(sa) >= 1 and len(sb) >= 1, "matmul: both arguments need at least one dim")
    if len(sa) == 1 and len(sb) == 1:
        check(sa[0] == sb[0], f"matmul: size mismatch {sa} @ {sb}")
        return ()
    a = (1,) + tuple(sa) if len(sa) == 1 else tuple(sa)
    b = tuple(sb) + (1,) if len(sb) == 1 else tuple(sb)
    check(a[-1] == b[-2], lambda: f"matmul: shapes {tuple(sa)} and {tuple(sb)} cannot be multiplied ({a[-1]} != {b[-2]})")
    batch_a, batch_b = a[:-2], b[:-2]
    n = max(len(batch_a), len(batch_b))
    batch_a = (1,) * (n - len(batch_a)) + batch_a
    batch_b = (1,) * (n - len(batch_b)) + batch_b
    batch = []
    for x, y in zip(batch_a, batch_b):
        check(x == y or x == 1 or y == 1, f"matmul: batch dims {batch_a} and {batch_b} do not broadcast")
        batch.append(max(x, y) if min(x, y) != 0 else 0)
    out = tuple(batch) + (a[-2], b[-1])
    if len(sa) == 1:
        out = out[:-2] + out[-1:]
    if len(sb) == 1:
        out = out[:-1]
    return out


@prim(tags=("layout_on_meta",))
def matmul(a, b):
    """``torch.matmul`` semantics (batched, 1-D promotion); equal dtypes."""
    check(a._tt_dtype is b._tt_dtype, lambda: f"matmul: dtypes differ: {a._tt_dtype} and {b._tt_dtype}")
    return TensorProxy(shape=_matmul_shape(a._tt_shape, b._tt_shape), dtype=a._tt_dtype, device=common_device([a, b], "matmul"))


def column_major(x) -> bool:
    """A matrix laid out column-major (strides ``(1, rows)``, traced: eager's layout), which eager's backward of
    ``mm`` asks of each operand (``MmBackward0`` keeps their strides): for such an operand it computes the gradient's
    transpose, row-major, and transposes it (``mm_mat1_backward`` / ``mm_mat2_backward``), a product whose sums run
    in another order than the plain formula's.  A weight used as ``x @ W.T`` is one: ``W.grad = gᵀ x``, row-major."""
    strides = getattr(x, "_tt_strides", None)
    return (x.ndim_ == 2 and strides is not None and all(type(v) is int for v in (*strides, *x._tt_shape))
            and strides[0] == 1 and strides[1] == x._tt_shape[0])


def transposed(x):
    return prims.transpose(x, (1, 0))


@register_vjp(matmul)
def matmul_vjp(g, out, /, a, b):
    if a.ndim_ == 1 and b.ndim_ == 1:
        gs = prims.broadcast_in_dim(g, a._tt_shape, ())
        return {"a": prims.mul(gs, b), "b": prims.mul(gs, a)}
    # View vectors as matrices, so both products below are plain (batched) matmuls.
    A = unsqueeze(a, 0) if a.ndim_ == 1 else a
    B = unsqueeze(b, -1) if b.ndim_ == 1 else b
    G = unsqueeze(g, -2) if a.ndim_ == 1 else g
    G = unsqueeze(G, -1) if b.ndim_ == 1 else G
    ga = None
    if b.ndim_ == 2:
        # A 2-d second operand is mm's (eager folds a batch of first operands into its rows, and a vector is one row):
        # one (K, M·batch) @ (M·batch, N) product, or for a column-major operand its transpose computed row-major
        # (mm_mat2_backward); the folded first operand is column-major where it is a transposed matrix (or a batch of
        # one), whose gradient mm_mat1_backward computes transposed too.
        k, n = B._tt_shape
        rows_a, rows_g = (A, G) if A.ndim_ == 2 else (
            reshape(A, (math.prod(A._tt_shape[:-1]), k)), reshape(G, (math.prod(G._tt_shape[:-1]), n)))  # (k or n may be 0)
        gb = (transposed(prims.matmul(transposed(rows_g), rows_a)) if column_major(b)
              else prims.matmul(transposed(rows_a), rows_g))
        if a.ndim_ >= 2 and column_major(rows_a):
            ga = transposed(prims.matmul(b, transposed(rows_g)))
    else:
        gb = sum_to(prims.matmul(swap_last_two(A), G), B._tt_shape)
    if ga is None:
        ga = sum_to(prims.matmul(G, swap_last_two(B)), A._tt_shape)
    return {"a": reshape(ga, a._tt_shape), "b": reshape(gb, b._tt_shape)}


@prim
def convolution(a, weight, bias, stride, padding, dilation, groups):
    """N-d convolution (torch.nn.functional.conv{1,2,3}d semantics, no transposed)."""
    nd = len(a._tt_shape) - 2
    check(len(weight._tt_shape) == nd + 2, "convolution: weight rank must match input rank")
    n, c = a._tt_shape[0], a._tt_shape[1]
    check(c == weight._tt_shape[1] * groups, lambda: f"convolution: input has {c} channels, weight expects {weight._tt_shape[1] * groups}")
    spatial = []
    for i in range(nd):
        size = a._tt_shape[2 + i] + 2 * padding[i] - dilation[i] * (weight._tt_shape[2 + i] - 1) - 1
        spatial.append(size // stride[i] + 1)
    return TensorProxy(shape=(n, weight._tt_shape[0], *spatial), dtype=a._tt_dtype, device=a._tt_device)


@prim
def convolution_backward(g, a, weight, stride, padding, dilation, groups, output_mask):
    """The gradients of ``convolution``'s input, weight and bias for its output cotangent ``g`` (only backward traces
    use it), as eager's autograd asks the kernel: the bias's gradient is the kernel's, made after its scratch memory
    is freed (a sum of ``g`` made before the line was held through it: 16 bytes above eager's peak inside the second
    convolution's backward of tests/test_memory.py on an AVX-512 CPU).  ``output_mask``: (input's, weight's, bias's),
    which of the three it computes; the others are None.  The gradient rule asks for what the convolution has, and
    dead-code elimination clears the entry of one nobody reads (``narrowed`` below): the gradient of a network's first
    convolution's input, the batch, is as large as the batch and no one reads it.  It has no gradient rule of its
    own: a second derivative through a convolution raises."""
    wanted_input, wanted_weight, wanted_bias = output_mask
    return (
        TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device) if wanted_input else None,
        TensorProxy(shape=weight._tt_shape, dtype=weight._tt_dtype, device=weight._tt_device) if wanted_weight else None,
        TensorProxy(shape=(weight._tt_shape[0],), dtype=g._tt_dtype, device=g._tt_device) if wanted_bias else None,
    )


def _convolution_backward_of_read(bsym, is_read):
    """The line computing only the gradients read (``Symbol.narrowed``): eager's autograd asks the kernel so."""
    *head, _ = bsym.args
    outs = tuple(o if o is not None and is_read(o) else None for o in bsym.output)
    return bsym.replace(args=(*head, tuple(o is not None for o in outs)), output=outs)


convolution_backward.narrowed = _convolution_backward_of_read
convolution_backward.torch_unknown_scratch = True  # oneDNN's reorders and scratchpads, tens of times its activations


@register_vjp(convolution)
def convolution_vjp(g, out, /, a, weight, bias, stride, padding, dilation, groups):
    has_bias = is_tensor(bias)
    ga, gw, gb = prims.convolution_backward(g, a, weight, tuple(stride), tuple(padding), tuple(dilation), groups,
                                            (True, True, has_bias))
    grads = {"a": ga, "weight": gw}
    if has_bias:
        grads["bias"] = gb
    return grads
