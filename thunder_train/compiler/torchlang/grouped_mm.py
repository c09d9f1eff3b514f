"""``torch._grouped_mm`` (the experts' products of transformers' mixture-of-experts layers): run opaquely, with its
gradient by eager's formula.

The op's group boundaries (``offs``) are values, so it is not decomposed: it runs as torch runs it.  Its output's
metadata comes from the operands' shapes (``_grouped_mm_meta``: torch's meta kernel accepts only bf16 operands, and
judges their strides' alignment by bf16's size, refusing float32 operands eager's CPU kernel takes).  On the gradient path it used to run inside torch's autograd (transforms/opaque_grad.py), whose
custom-Function entry and engine cost ~100 us a call on each side, ~0.5 ms of DeepSeek-V3's tiny zoo step.  Its
backward is two more grouped products (ATen's ``_grouped_mm_mat1_backward`` / ``_grouped_mm_mat2_backward``): an
operand laid out column-major in its last two dims gets its gradient computed transposed, as eager's autograd does,
so every gradient is eager's bitwise (tests/test_grouped_mm.py compares every layout with torch's autograd).
"""
from __future__ import annotations

import torch

from .. import clang
from ..opaque import call_opaque, direct_vjp, meta_rule, scratch_rule
from ..proxies import TensorProxy

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _grouped_mm_meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """The output torch's kernels make: row-major, of the shape its ranks give (torch's own rule for its meta
    kernel's output), with eager's dtype and ``requires_grad``."""
    if mat_a.dtype != mat_b.dtype:
        raise RuntimeError(f"grouped_mm: expected mat_a and mat_b of one dtype, got {mat_a.dtype} and {mat_b.dtype}")
    if mat_a.dim() not in (2, 3) or mat_b.dim() not in (2, 3):
        raise RuntimeError(f"grouped_mm: multiplicands must be 2D or 3D, got {mat_a.dim()}D and {mat_b.dim()}D")
    if (mat_a.dim() == 3 or mat_b.dim() == 3) and mat_a.shape[-1] != mat_b.shape[-2]:
        raise RuntimeError("grouped_mm: contraction dimension of mat_a and mat_b must match")
    groups = None if offs is None else offs.shape[0]
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        if groups is None:
            raise RuntimeError("grouped_mm: two 2D operands need offs")
        shape = (groups, mat_a.shape[0], mat_b.shape[1])
    elif mat_a.dim() == 2:
        if groups is not None and groups != mat_b.shape[0]:
            raise RuntimeError("grouped_mm: matrix batch sizes have to match")
        shape = (mat_a.shape[0], mat_b.shape[-1])
    elif mat_b.dim() == 2:
        if groups is not None and groups != mat_a.shape[0]:
            raise RuntimeError("grouped_mm: matrix batch sizes have to match")
        shape = (mat_a.shape[1], mat_b.shape[1])
    else:
        if mat_a.shape[0] != mat_b.shape[0]:
            raise RuntimeError("grouped_mm: batched dimension has to match")
        shape = (mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1])
    dtype = out_dtype or mat_a.dtype
    # Eager's layout: every kernel pads the output's rows to whole 16 bytes (its device kernels' alignment; torch's own
    # meta kernel pads only in CUDA builds, its CPU fallback pads everywhere)
    align = 16 // dtype.itemsize
    padded = -(-shape[-1] // align) * align
    strides = (padded, 1) if len(shape) == 2 else (shape[1] * padded, padded, 1)
    out = torch.empty_strided(shape, strides, dtype=dtype, device="meta")
    grad = mat_a.requires_grad or mat_b.requires_grad or (bias is not None and bias.requires_grad)
    return out.requires_grad_() if grad and out.dtype.is_floating_point else out


def _grouped_mm_scratch(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """0 for float32 operands on the CPU: the CPU kernel writes each group's product into its slice of the output
    with the BLAS product (``mm_out``), whose operands the op requires laid out as BLAS takes them (row- or
    column-major in the last two dims), so nothing is copied (measured: no byte beyond the output).  Unknown elsewhere
    (oneDNN's half-precision products, the device kernels)."""
    if type(mat_a) is TensorProxy and mat_a._tt_device.type == "cpu" and mat_a._tt_dtype.torch is torch.float32:
        return 0
    return None


if hasattr(torch, "_grouped_mm"):
    meta_rule(torch._grouped_mm)(_grouped_mm_meta)
    scratch_rule(torch._grouped_mm)(_grouped_mm_scratch)


def _arguments(args, kwargs):
    """(mat1, mat2, offs) of a call without bias and output dtype, else None."""
    names = ("self", "mat2", "offs", "bias", "out_dtype")
    if len(args) > len(names) or any(k not in names for k in kwargs):
        return None
    bound = dict(zip(names, args))
    if any(k in bound for k in kwargs):
        return None
    bound.update(kwargs)
    if bound.get("bias") is not None or bound.get("out_dtype") is not None:
        return None
    return bound.get("self"), bound.get("mat2"), bound.get("offs")


def _applies(args, kwargs, positions) -> bool:
    got = _arguments(args, kwargs)
    if got is None or len(args) < 2 or not set(positions) <= {0, 1}:  # (flat positions 0, 1: the two operands)
        return False
    a, b, offs = got
    return (all(type(t) is TensorProxy and t._tt_dtype.torch in _FLOATS and t.ndim_ in (2, 3)
                and all(type(n) is int for n in (*t._tt_shape, *t._tt_strides)) for t in (a, b))
            and a._tt_dtype is b._tt_dtype and (offs is None or type(offs) is TensorProxy))


def _column_major(t) -> bool:
    """ATen's test in the grouped product's backward: the last two dims laid out column-major."""
    shape, strides = t._tt_shape, t._tt_strides
    return strides[-2] == 1 and strides[-1] == shape[-2]


def _t(t):
    return clang.transpose(t, -2, -1)


def _grouped_mm_vjp(g, out, args, kwargs):
    a, b, offs = _arguments(args, kwargs)

    def product(x, y):
        # Differentiable lines, as eager's backward through ``create_graph=True`` (its products are differentiable):
        # a gradient a later backward should not see is cut where it is accumulated (traced_autograd.py).
        return call_opaque(torch._grouped_mm, (x, y), {"offs": offs}, strict=False, positions=(0, 1))

    gb = _t(product(_t(g), a)) if _column_major(b) else product(_t(a), g)
    ga = _t(product(b, _t(g))) if _column_major(a) else product(g, _t(b))
    return {0: ga, 1: gb}


if hasattr(torch, "_grouped_mm"):
    direct_vjp(torch._grouped_mm, applies=_applies)(_grouped_mm_vjp)
