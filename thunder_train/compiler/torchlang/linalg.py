"""Matrix products (mm, matmul, einsum, mv, tensordot, kron, multi_dot, matrix_power, ...), cross products
and matrix structure (trace, diag, diagflat, block_diag, vander)."""
from __future__ import annotations

import math

import torch

from .. import clang, prims
from .autocast import EINSUM, LOWER, PROMOTE  # autocast policies: see autocast.py
from .matmul_precision import precision_switches
from .elementwise_composed import _real
from ..proxies import TensorProxy, is_int
from ..opaque import meta_rule
from .registry import composed, torchsymbol


def _matmul(a, b):
    # Eager matmul does not promote: mixed dtypes are an error there too.
    if a._tt_dtype is not b._tt_dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {a._tt_dtype} != {b._tt_dtype}")
    return prims.matmul(a, b)


@torchsymbol(torch.matmul, methods=("matmul", "__matmul__"), tags=("layout_on_meta",), autocast={"cpu": LOWER, "cuda": LOWER})
def matmul(input, other):
    if _folds_the_matrix(_requires_grad_while_tracing, input, other):
        # Eager's product is one mm of the batch's rows (matmul_matrix_folded): so is the gradients' (its mm backward).
        k, n = other._tt_shape[-2:]
        rows = _matmul(clang.reshape(clang.transpose(other, -2, -1), (-1, k)), clang.transpose(input, 0, 1))
        out = clang.transpose(clang.reshape(rows, (*other._tt_shape[:-2], n, input._tt_shape[0])), -2, -1)
        return prims.clone(out, torch.contiguous_format)  # eager's result is contiguous
    return _matmul(input, other)


def _requires_grad_while_tracing(t) -> bool:
    from .. import context
    from .tensor_methods import requires_grad_of

    st = context.tracer_state()
    return st is not None and requires_grad_of(st, t)


def _folds_the_matrix(requires_grad, input, other) -> bool:
    """A matrix requiring grad times a batch of matrices, which eager folds into one mm (``matmul_matrix_folded``);
    ``requires_grad(t)``: eager's ``t.requires_grad``."""
    return (type(input) is TensorProxy and type(other) is TensorProxy and input.ndim_ == 2 and other.ndim_ >= 3
            and input._tt_dtype is other._tt_dtype
            and all(type(s) is int and s > 0 for s in (*input._tt_shape, *other._tt_shape)) and requires_grad(input))


def matmul_matrix_folded(input, other):
    """Eager's ``matmul`` of a matrix requiring grad by a batch of matrices (``W @ h``): the batch folded into the
    rows of one ``mm`` of ``otherᵀ`` by ``inputᵀ``, the result transposed back and made contiguous (ATen's
    ``should_fold``: it folds when the matrix requires grad, so that its gradient is one product).  Without grad,
    eager multiplies batch by batch, which rounds otherwise; the program runs under ``no_grad``, so the line names
    this form where eager's call had the matrix requiring grad (``Symbol.kernel_by_requires_grad``)."""
    k, n = other.shape[-2], other.shape[-1]
    rows = other.mT.reshape(-1, k).mm(input.t())
    return rows.view(*other.shape[:-2], n, input.shape[0]).mT.contiguous()


def _matmul_kernel_by_requires_grad(requires_grad, input, other):
    return matmul_matrix_folded if _folds_the_matrix(requires_grad, input, other) else None


matmul.kernel_by_requires_grad = _matmul_kernel_by_requires_grad
matmul_matrix_folded.kernel_of = matmul  # a line running it is a call of the op (layout_rules.set_layout)


@torchsymbol(methods=("__rmatmul__",), name="rmatmul", tags=("layout_on_meta",), autocast={"cpu": LOWER, "cuda": LOWER})
def rmatmul(input, other):
    return _matmul(other, input)


@torchsymbol(torch.mm, methods=("mm",), tags=("layout_on_meta",), autocast={"cpu": LOWER, "cuda": LOWER})
def mm(input, mat2):
    if input.ndim_ != 2 or mat2.ndim_ != 2:
        raise ValueError(f"mm: expected 2-D tensors, got {input.ndim_}-D and {mat2.ndim_}-D")
    return _matmul(input, mat2)


@torchsymbol(torch.bmm, methods=("bmm",), tags=("layout_on_meta",), autocast={"cpu": LOWER, "cuda": LOWER})
def bmm(input, mat2):
    if input.ndim_ != 3 or mat2.ndim_ != 3:
        raise ValueError(f"bmm: expected 3-D tensors, got {input.ndim_}-D and {mat2.ndim_}-D")
    return _matmul(input, mat2)


@torchsymbol(torch.addmm, methods=("addmm",), tags=("layout_on_meta",), autocast={"cpu": LOWER, "cuda": LOWER})
def addmm(input, mat1, mat2, *, beta=1, alpha=1):
    return _scaled_add(input, _matmul(mat1, mat2), beta, alpha)


# float32 matmul precision / TF32 switches the function sets around these are replayed (matmul_precision.py)
for _sym, _fn in ((matmul, torch.matmul), (mm, torch.mm), (bmm, torch.bmm), (addmm, torch.addmm)):
    _sym.kernel_switches = precision_switches(_fn)


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
    return _einsum_pair(a, sa, b, sb, out)


def _einsum_pair(a, sa, b, sb, out):
    """Eager's two-operand einsum (ATen's einsum and sumproduct_pair), step by step, so that the operands its bmm
    gets, and so the layouts its backward multiplies, are eager's (a plain (B, M, K) @ (B, K, N) with other
    layouts differs in the gradient's last bits): labels in the output's order, then the contracted ones in
    ASCII order; each operand permuted to that order, missing labels unsqueezed; contracted labels of size 1 on
    one side summed on the other; a (lro, lo, sum) by (lro, sum, ro) bmm, lo and ro swapped when every ro label
    comes before every lo label; the result viewed back and permuted."""
    order = list(out) + sorted({c for c in sa + sb if c not in out})
    ops = []
    for t, st in ((a, sa), (b, sb)):
        mine = [c for c in order if c in st]
        t = clang.permute(t, [st.index(c) for c in mine])
        for k, c in enumerate(order):
            if c not in st:
                t = clang.unsqueeze(t, k)
        ops.append(t)
    left, right = ops
    # a label summed away that only one operand has: summed there first (eager: before the pair)
    for k, c in enumerate(order):
        if c not in out and (c not in sa or c not in sb):
            left, right = (clang.sum(left, (k,), keepdim=True), right) if c in sa else (left, clang.sum(right, (k,), keepdim=True))
    sum_dims = [k for k, c in enumerate(order) if c not in out]
    if not sum_dims:  # nothing contracted: eager multiplies (broadcasting), no bmm
        return clang.mul(left, right)
    lro, lo, ro = [], [], []
    for k, c in enumerate(order):
        sl, sr = left._tt_shape[k] != 1, right._tt_shape[k] != 1
        if k in sum_dims:
            if sl and not sr:
                left = clang.sum(left, (k,), keepdim=True)
            elif sr and not sl:
                right = clang.sum(right, (k,), keepdim=True)
        elif sl and sr:
            lro.append(k)
        elif sl:
            lo.append(k)
        else:
            ro.append(k)
    if lo and ro and ro[-1] < lo[0]:
        left, right, lo, ro = right, left, ro, lo
    size = lambda t, dims: math.prod(t._tt_shape[k] for k in dims)  # noqa: E731
    l3 = clang.reshape(clang.permute(left, lro + lo + sum_dims + ro), (size(left, lro), size(left, lo), size(left, sum_dims)))
    r3 = clang.reshape(clang.permute(right, lro + sum_dims + ro + lo), (size(right, lro), size(right, sum_dims), size(right, ro)))
    r = _matmul(l3, r3)
    out_dims = lro + lo + sum_dims + ro
    shape = [left._tt_shape[k] for k in lro + lo] + [1] * len(sum_dims) + [right._tt_shape[k] for k in ro]
    r = clang.permute(clang.reshape(r, tuple(shape)), [out_dims.index(k) for k in range(len(order))])
    return clang.reshape(r, tuple(r._tt_shape[:len(out)]))


@torchsymbol(torch.baddbmm, methods=("baddbmm",), tags=("layout_on_meta",), autocast={"cpu": LOWER, "cuda": LOWER})
def baddbmm(input, batch1, batch2, *, beta=1, alpha=1):
    return _scaled_add(input, bmm(batch1, batch2), beta, alpha)


baddbmm.kernel_switches = precision_switches(torch.baddbmm)
einsum.kernel_switches = precision_switches(torch.einsum)


# ---------------------------------------------------------------------------
# Written as torch calls the torch language knows (registry.composed: traced as the user's own calls)
# ---------------------------------------------------------------------------
def trace(input):
    if input.ndim != 2:
        raise RuntimeError(f"trace: expected a matrix, but got tensor with dim {input.ndim}")
    n, m = input.shape
    k = min(n, m)
    out = input.reshape(-1)[: (k - 1) * (m + 1) + 1 : m + 1].sum() if k else input.sum()
    return out


composed("trace", trace, (torch.trace,), ("trace",))


def mv(input, vec):
    if input.ndim != 2 or vec.ndim != 1:
        raise RuntimeError("vector + matrix @ vector expected")
    return torch.matmul(input, vec)


composed("mv", mv, (torch.mv,), ("mv",))


def addmv(input, mat, vec, *, beta=1, alpha=1):
    if input.dtype is torch.bool:
        raise NotImplementedError("addmv of bool tensors is run by torch")
    if not (input.dtype.is_floating_point or input.dtype.is_complex):
        beta, alpha = int(beta), int(alpha)  # eager truncates the factors for integer results
    p = torch.mv(mat, vec)
    p = p if alpha == 1 else p * alpha
    return p + input if beta == 1 else (p + 0 * input if beta == 0 else p + beta * input)


composed("addmv", addmv, (torch.addmv,), ("addmv",))


def addr(input, vec1, vec2, *, beta=1, alpha=1):
    if input.dtype is torch.bool or not (beta == 1 and alpha == 1 or input.dtype.is_floating_point):
        raise NotImplementedError("addr with these dtypes and factors is run by torch")
    p = torch.outer(vec1, vec2)
    p = p if alpha == 1 else p * alpha
    # ``input`` first: eager's kernel lays the result out as ``input`` (the same sums: addition commutes exactly)
    return input + p if beta == 1 else (torch.zeros_like(input) + p if beta == 0 else beta * input + p)


composed("addr", addr, (torch.addr,), ("addr",))


def vdot(input, other):
    _real(input, "vdot")
    if input.ndim != 1 or other.ndim != 1:
        raise RuntimeError(f"1D tensors expected, but got {input.ndim}D and {other.ndim}D tensors")
    if input.dtype != other.dtype:
        raise RuntimeError(f"vdot : expected both vectors to have same dtype, but found {input.dtype} and {other.dtype}")
    return (input * other).sum()


composed("vdot", vdot, (torch.vdot,), ("vdot",))


def vecdot(x, y, *, dim=-1):
    _real(x, "linalg.vecdot")
    return (x * y).sum(dim)


composed("vecdot", vecdot, (torch.linalg.vecdot,))


def kron(input, other):
    n = max(input.ndim, other.ndim)
    a = input.reshape((1,) * (n - input.ndim) + tuple(input.shape))
    b = other.reshape((1,) * (n - other.ndim) + tuple(other.shape))
    shape = [s for pair in zip(a.shape, b.shape) for s in pair]
    ai = a.reshape([s for d in a.shape for s in (d, 1)])
    bi = b.reshape([s for d in b.shape for s in (1, d)])
    return (ai * bi).reshape([x * y for x, y in zip(a.shape, b.shape)]) if shape else ai * bi


composed("kron", kron, (torch.kron,), ("kron",))


def inner(input, other):
    if input.ndim == 0 or other.ndim == 0:
        return input * other
    return torch.tensordot(input, other, ([input.ndim - 1], [other.ndim - 1]))


composed("inner", inner, (torch.inner,), ("inner",))


def tensordot(a, b, dims=2, out=None):
    if out is not None:
        raise NotImplementedError("tensordot(out=) is run by torch")
    if isinstance(dims, torch.Tensor):
        raise NotImplementedError("tensordot with tensor dims is run by torch")
    if is_int(dims):
        da, db = list(range(a.ndim - dims, a.ndim)), list(range(dims))
    else:
        da, db = [d % a.ndim for d in dims[0]], [d % b.ndim for d in dims[1]]
    if any(a.shape[i] != b.shape[j] for i, j in zip(da, db)):
        raise NotImplementedError("tensordot over dims of different sizes (broadcast) is run by torch")
    fa = [d for d in range(a.ndim) if d not in da]
    fb = [d for d in range(b.ndim) if d not in db]
    k = math.prod(a.shape[d] for d in da)
    am = a.permute(fa + da).reshape(math.prod(a.shape[d] for d in fa), k)
    bm = b.permute(db + fb).reshape(k, math.prod(b.shape[d] for d in fb))
    return torch.mm(am, bm).reshape([a.shape[d] for d in fa] + [b.shape[d] for d in fb])


composed("tensordot", tensordot, (torch.tensordot,))


def block_diag(*tensors):
    ts = [t.reshape(1, -1) if t.ndim == 1 else (t.reshape(1, 1) if t.ndim == 0 else t) for t in tensors]
    if any(t.ndim != 2 for t in ts):
        raise RuntimeError("torch.block_diag: Input tensors must have 2 or fewer dimensions")
    dtype = ts[0].dtype
    for t in ts[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    rows, cols = sum(t.shape[0] for t in ts), sum(t.shape[1] for t in ts)
    parts, c = [], 0
    for t in ts:
        parts.append(torch.nn.functional.pad(t.to(dtype), (c, cols - c - t.shape[1])))
        c += t.shape[1]
    return torch.cat(parts, 0) if parts else torch.zeros(rows, cols, dtype=dtype)


composed("block_diag", block_diag, (torch.block_diag,))


def vander(x, *, N=None):
    x = x.reshape(1) if x.ndim == 0 else x
    n = x.shape[-1] if N is None else N
    if n < 0:
        raise RuntimeError("N must be non-negative.")
    if n == 0:
        return x.new_empty(tuple(x.shape) + (0,))
    if n == 1:
        return torch.ones_like(x).unsqueeze(-1)
    return torch.stack([torch.ones_like(x)] + [x ** i for i in range(1, n)], -1)


composed("vander", vander, (torch.linalg.vander,))


def multi_dot(tensors, *, out=None):
    if out is not None:
        raise NotImplementedError("multi_dot(out=) is run by torch")
    ts = list(tensors)
    if len(ts) < 2:
        raise RuntimeError("multi_dot(): expected at least 2 tensors but got " + str(len(ts)))
    first_1d, last_1d = ts[0].ndim == 1, ts[-1].ndim == 1
    if first_1d:
        ts[0] = ts[0].unsqueeze(0)
    if last_1d:
        ts[-1] = ts[-1].unsqueeze(-1)
    out = ts[0]
    for t in ts[1:]:
        out = torch.mm(out, t)
    if first_1d:
        out = out.squeeze(0)
    if last_1d:
        out = out.squeeze(-1)
    return out


composed("multi_dot", multi_dot, (torch.linalg.multi_dot,))


def matrix_power(A, n, *, out=None):
    if out is not None or n < 0:
        raise NotImplementedError("matrix_power with n < 0 or out= is run by torch")
    if A.shape[-1] != A.shape[-2]:
        raise RuntimeError("linalg.matrix_power: A must be batches of square matrices")
    if n == 0:
        eye = torch.eye(A.shape[-1], dtype=A.dtype).expand(A.shape)
        return torch.where(torch.zeros_like(A, dtype=torch.bool), A, eye)  # requires grad like eager's
    out = A
    for _ in range(n - 1):
        out = torch.matmul(out, A)
    return out if n > 1 else A.clone()


composed("matrix_power", matrix_power, (torch.linalg.matrix_power, torch.matrix_power), ("matrix_power",))


def linalg_cross(input, other, *, dim=-1):
    shape = torch.broadcast_shapes(input.shape, other.shape)
    a, b = input.expand(shape), other.expand(shape)
    if shape[dim] != 3:
        raise RuntimeError(f"linalg.cross: inputs dimension {dim} must have length 3. Got {input.shape[dim]} and {other.shape[dim]}")
    a0, a1, a2 = a.unbind(dim)
    b0, b1, b2 = b.unbind(dim)
    return torch.stack([a1 * b2 - a2 * b1, a2 * b0 - a0 * b2, a0 * b1 - a1 * b0], dim)


composed("linalg_cross", linalg_cross, (torch.linalg.cross,))


def cross(input, other, dim=None):
    if dim is None:
        shape = torch.broadcast_shapes(input.shape, other.shape)
        dim = next((i for i, s in enumerate(shape) if s == 3), None)
        if dim is None:
            raise RuntimeError("no dimension of size 3 in input")
    return linalg_cross(input, other, dim=dim)


composed("cross", cross, (torch.cross,), ("cross",))


# Diagonals (diag returns a new tensor, not a view)
def diag(input, diagonal=0):
    if input.ndim == 1:
        n = input.shape[0] + abs(diagonal)
        out = input.new_zeros(n * n)
        if input.shape[0]:
            start = diagonal if diagonal >= 0 else -diagonal * n
            out[start: start + (input.shape[0] - 1) * (n + 1) + 1: n + 1] = input
        return out.reshape(n, n)
    if input.ndim != 2:
        raise RuntimeError("diag(): Supports 1D or 2D tensors. Got " + f"{input.ndim}D")
    r, c = input.shape
    start = diagonal if diagonal >= 0 else -diagonal * c
    length = max(0, min(r, c - diagonal) if diagonal >= 0 else min(r + diagonal, c))
    if length == 0:
        return input.reshape(-1)[:0]
    return input.reshape(-1)[start: start + (length - 1) * (c + 1) + 1: c + 1].clone()


composed("diag", diag, (torch.diag,), ("diag",))


def diagflat(input, offset=0):
    return diag(input.reshape(-1), offset)


composed("diagflat", diagflat, (torch.diagflat,), ("diagflat",))


# ``torch.geqrf`` runs through torch (opaquely); eager has no meta kernel for it, so its outputs' metadata comes
# from this rule: the Householder matrix in LAPACK's column-major layout (each matrix of a batch transposed in
# memory) and ``tau`` of length min(m, n).
@meta_rule(torch.geqrf, torch.Tensor.geqrf)
def _geqrf_meta(input):
    if input.ndim < 2:
        raise RuntimeError(f"torch.geqrf: input must have at least 2 dimensions, got {input.ndim}")
    *batch, m, n = input.shape
    batch_strides = torch.empty(tuple(batch) + (m * n,), device="meta").stride()[:-1] if batch else ()
    a = torch.empty_strided(input.shape, batch_strides + (1, m), dtype=input.dtype, device="meta")
    tau = torch.empty(tuple(batch) + (min(m, n),), dtype=input.dtype, device="meta")
    return torch.return_types.geqrf((a, tau))
