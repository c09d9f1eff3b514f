"""Matrix products."""
from __future__ import annotations

import torch

from .. import clang, prims
from .autocast import EINSUM, LOWER, PROMOTE  # autocast policies: see autocast.py
from .registry import torchsymbol


def _matmul(a, b):
    # Eager matmul does not promote: mixed dtypes are an error there too.
    if a._tt_dtype is not b._tt_dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {a._tt_dtype} != {b._tt_dtype}")
    return prims.matmul(a, b)


@torchsymbol(torch.matmul, methods=("matmul", "__matmul__"), autocast={"cpu": LOWER, "cuda": LOWER})
def matmul(input, other):
    return _matmul(input, other)


@torchsymbol(methods=("__rmatmul__",), name="rmatmul", autocast={"cpu": LOWER, "cuda": LOWER})
def rmatmul(input, other):
    return _matmul(other, input)


@torchsymbol(torch.mm, methods=("mm",), autocast={"cpu": LOWER, "cuda": LOWER})
def mm(input, mat2):
    if input.ndim_ != 2 or mat2.ndim_ != 2:
        raise ValueError(f"mm: expected 2-D tensors, got {input.ndim_}-D and {mat2.ndim_}-D")
    return _matmul(input, mat2)


@torchsymbol(torch.bmm, methods=("bmm",), autocast={"cpu": LOWER, "cuda": LOWER})
def bmm(input, mat2):
    if input.ndim_ != 3 or mat2.ndim_ != 3:
        raise ValueError(f"bmm: expected 3-D tensors, got {input.ndim_}-D and {mat2.ndim_}-D")
    return _matmul(input, mat2)


@torchsymbol(torch.addmm, methods=("addmm",), autocast={"cpu": LOWER, "cuda": LOWER})
def addmm(input, mat1, mat2, *, beta=1, alpha=1):
    return _scaled_add(input, _matmul(mat1, mat2), beta, alpha)


def _scaled_add(input, product, beta, alpha):
    """``beta * input + alpha * product`` (addmm, baddbmm); integer results truncate the factors, and
    ``beta == 0`` ignores ``input`` (its NaNs too), as eager does."""
    if not (product._tt_dtype.is_float or product._tt_dtype.is_complex):
        beta, alpha = int(beta), int(alpha)
    if beta == 0:
        input = clang.full_like(input, 0)
        beta = 1
    if alpha != 1:
        product = clang.mul(product, alpha)
    return clang.add(clang.mul(input, beta) if beta != 1 else input, product)


@torchsymbol(torch.outer, torch.ger, methods=("outer",))
def outer(input, vec2):
    return clang.mul(clang.unsqueeze(input, 1), clang.unsqueeze(vec2, 0))


@torchsymbol(torch.dot, methods=("dot",), autocast={"cuda": PROMOTE})
def dot(input, other):
    return _matmul(input, other)


@torchsymbol(torch.einsum, autocast={"cpu": EINSUM, "cuda": LOWER})
def einsum(equation, *operands):
    """Two-operand and one-operand einsum via permute/reshape/matmul; other forms fall back to torch."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    eq = equation.replace(" ", "")
    if "..." in eq or "->" not in eq:
        raise NotImplementedError("einsum: only explicit '->' equations without '...' are supported")
    lhs, out = eq.split("->")
    ins = lhs.split(",")
    if len(ins) != len(operands):
        raise ValueError("einsum: number of operands does not match the equation")
    if any(len(set(s)) != len(s) for s in ins):
        raise NotImplementedError("einsum: repeated indices within one operand (diagonals, traces) are not supported")
    if len(ins) == 1:
        (a,), (sa,) = operands, ins
        summed = tuple(i for i, c in enumerate(sa) if c not in out)
        x = clang.sum(a, summed) if summed else a
        rem = [c for c in sa if c in out]
        return clang.permute(x, [rem.index(c) for c in out])
    if len(ins) != 2:
        raise NotImplementedError("einsum: at most two operands are supported")
    a, b = operands
    sa, sb = ins
    if len(set(sa)) != len(sa) or len(set(sb)) != len(sb):
        raise NotImplementedError("einsum: repeated indices within one operand are not supported")
    size = {}
    for s, t in ((sa, a), (sb, b)):
        for c, n in zip(s, t._tt_shape):
            size[c] = max(size.get(c, 1), n)
    batch = [c for c in sa if c in sb and c in out]
    contract = [c for c in sa if c in sb and c not in out]
    only_a = [c for c in sa if c not in sb]
    only_b = [c for c in sb if c not in sa]
    # Indices summed away in just one operand are reduced first.
    a_sum = [c for c in only_a if c not in out]
    b_sum = [c for c in only_b if c not in out]
    if a_sum:
        a = clang.sum(a, tuple(sa.index(c) for c in a_sum))
        sa = "".join(c for c in sa if c not in a_sum)
    if b_sum:
        b = clang.sum(b, tuple(sb.index(c) for c in b_sum))
        sb = "".join(c for c in sb if c not in b_sum)
    m_idx = [c for c in sa if c not in sb]
    n_idx = [c for c in sb if c not in sa]
    a = clang.permute(a, [sa.index(c) for c in batch + m_idx + contract])
    b = clang.permute(b, [sb.index(c) for c in batch + contract + n_idx])
    import math

    B = tuple(size[c] for c in batch)
    M = math.prod(size[c] for c in m_idx)
    K = math.prod(size[c] for c in contract)
    N = math.prod(size[c] for c in n_idx)
    a = clang.reshape(clang.expand(a, B + a._tt_shape[len(B):]), B + (M, K))
    b = clang.reshape(clang.expand(b, B + b._tt_shape[len(B):]), B + (K, N))
    r = _matmul(a, b)
    r = clang.reshape(r, B + tuple(size[c] for c in m_idx) + tuple(size[c] for c in n_idx))
    cur = batch + m_idx + n_idx
    return clang.permute(r, [cur.index(c) for c in out])


@torchsymbol(torch.baddbmm, methods=("baddbmm",), autocast={"cpu": LOWER, "cuda": LOWER})
def baddbmm(input, batch1, batch2, *, beta=1, alpha=1):
    return _scaled_add(input, bmm(batch1, batch2), beta, alpha)
