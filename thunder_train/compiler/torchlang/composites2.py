"""More torch ops written as compositions of torch calls the torch language knows (see composites.py):
``*_copy`` forms of views, index and scatter forms, products, small factories, sorting helpers."""
from __future__ import annotations

import math

import torch

from .decided import _register


def _fresh(t):
    """A contiguous copy (what the ``*_copy`` ops return: never a view of their input)."""
    return t.clone(memory_format=torch.contiguous_format)


def _copy_of(view_fn):
    def fn(input, *args, **kwargs):
        out = view_fn(input, *args, **kwargs)
        if isinstance(out, (tuple, list)):
            return type(out)(_fresh(o) for o in out)
        return _fresh(out)

    return fn


_COPIES = [
    ("expand_copy", lambda x, size, *, implicit=False: x.expand(size), torch.expand_copy),
    ("alias_copy", lambda x: x, torch.alias_copy),
    ("view_copy", lambda x, size: x.view(size), torch.view_copy),
    ("permute_copy", lambda x, dims: x.permute(dims), torch.permute_copy),
    ("squeeze_copy", lambda x, *dim: x.squeeze(*dim), torch.squeeze_copy),
    ("unsqueeze_copy", lambda x, dim: x.unsqueeze(dim), torch.unsqueeze_copy),
    ("t_copy", lambda x: x.t(), torch.t_copy),
    ("transpose_copy", lambda x, d0, d1: x.transpose(d0, d1), torch.transpose_copy),
    ("narrow_copy", lambda x, dim, start, length: torch.narrow(x, dim, start, length), torch.narrow_copy),
    ("split_with_sizes_copy", lambda x, sizes, dim=0: torch.split(x, list(sizes), dim), torch.split_with_sizes_copy),
    ("unbind_copy", lambda x, dim=0: torch.unbind(x, dim), torch.unbind_copy),
]


# ---- indexing ----
def take(input, index):
    return input.reshape(-1)[index]


def _index_key(dim, ndim, index):
    d = dim % ndim if ndim else 0
    return (slice(None),) * d + (index,)


def index_fill(input, dim, index, value):
    if input.ndim == 0:
        return index_fill(input.reshape(1), dim, index, value).reshape(())
    if isinstance(value, torch.Tensor) and value.ndim != 0:
        raise RuntimeError("index_fill_ only supports a 0-dimensional value tensor")
    out = input.clone()
    out[_index_key(dim, input.ndim, index)] = value
    return out


def index_copy(input, dim, index, source):
    if input.ndim == 0:
        return index_copy(input.reshape(1), dim, index, source.reshape(1)).reshape(())
    out = input.clone()
    out[_index_key(dim, input.ndim, index)] = source
    return out


def select_scatter(input, src, dim, index):
    out = input.clone()
    out[_index_key(dim, input.ndim, index)] = src
    return out


def slice_scatter(input, src, dim=0, start=None, end=None, step=1):
    out = input.clone()
    out[_index_key(dim, input.ndim, slice(start, end, step))] = src
    return out


# ---- products ----
def float_power(input, exponent):
    if (isinstance(input, torch.Tensor) and input.dtype.is_complex) or (isinstance(exponent, torch.Tensor) and exponent.dtype.is_complex):
        raise NotImplementedError("complex float_power is run by torch")
    a = input.to(torch.float64) if isinstance(input, torch.Tensor) else float(input)
    b = exponent.to(torch.float64) if isinstance(exponent, torch.Tensor) else float(exponent)
    return torch.pow(a, b)


def dist(input, other, p=2):
    return torch.linalg.vector_norm(input - other, p)


def kron(input, other):
    n = max(input.ndim, other.ndim)
    a = input.reshape((1,) * (n - input.ndim) + tuple(input.shape))
    b = other.reshape((1,) * (n - other.ndim) + tuple(other.shape))
    shape = [s for pair in zip(a.shape, b.shape) for s in pair]
    ai = a.reshape([s for d in a.shape for s in (d, 1)])
    bi = b.reshape([s for d in b.shape for s in (1, d)])
    return (ai * bi).reshape([x * y for x, y in zip(a.shape, b.shape)]) if shape else ai * bi


def inner(input, other):
    if input.ndim == 0 or other.ndim == 0:
        return input * other
    return torch.tensordot(input, other, ([input.ndim - 1], [other.ndim - 1]))


def tensordot(a, b, dims=2, out=None):
    if out is not None:
        raise NotImplementedError("tensordot(out=) is run by torch")
    if isinstance(dims, torch.Tensor):
        raise NotImplementedError("tensordot with tensor dims is run by torch")
    if isinstance(dims, int):
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


def meshgrid(*tensors, indexing=None):
    ts = list(tensors[0]) if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)) else list(tensors)
    if any(t.ndim > 1 for t in ts):
        raise RuntimeError("torch.meshgrid: Expected 0D or 1D tensor in the tensor list")
    ts = [t.reshape(-1) for t in ts]
    xy = indexing == "xy" and len(ts) >= 2
    if xy:
        ts[0], ts[1] = ts[1], ts[0]
    shape = [t.shape[0] for t in ts]
    out = [t.reshape([-1 if i == k else 1 for i in range(len(ts))]).expand(shape) for k, t in enumerate(ts)]
    if xy:
        out[0], out[1] = out[1].transpose(0, 1), out[0].transpose(0, 1)
    return tuple(out)


def cartesian_prod(*tensors):
    if len(tensors) == 1:
        return tensors[0]
    grids = meshgrid(*tensors, indexing="ij")
    return torch.stack([g.reshape(-1) for g in grids], 1)


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


def linalg_cross(input, other, *, dim=-1):
    shape = torch.broadcast_shapes(input.shape, other.shape)
    a, b = input.expand(shape), other.expand(shape)
    if shape[dim] != 3:
        raise RuntimeError(f"linalg.cross: inputs dimension {dim} must have length 3. Got {input.shape[dim]} and {other.shape[dim]}")
    a0, a1, a2 = a.unbind(dim)
    b0, b1, b2 = b.unbind(dim)
    return torch.stack([a1 * b2 - a2 * b1, a2 * b0 - a0 * b2, a0 * b1 - a1 * b0], dim)


def cross(input, other, dim=None):
    if dim is None:
        shape = torch.broadcast_shapes(input.shape, other.shape)
        dim = next((i for i, s in enumerate(shape) if s == 3), None)
        if dim is None:
            raise RuntimeError("no dimension of size 3 in input")
    return linalg_cross(input, other, dim=dim)


def rot90(input, k=1, dims=(0, 1)):
    d0, d1 = dims
    k %= 4
    if k == 1:
        return input.flip(d1).transpose(d0, d1)
    if k == 2:
        return input.flip((d0, d1))
    if k == 3:
        return input.flip(d0).transpose(d0, d1)
    return input.clone()


def ldexp(input, other):
    return input * torch.pow(2.0, other)


def isin(elements, test_elements, *, assume_unique=False, invert=False):
    if not isinstance(elements, torch.Tensor) or not isinstance(test_elements, torch.Tensor):
        raise NotImplementedError("isin with a number argument is run by torch")
    hit = (elements.unsqueeze(-1) == test_elements.reshape(-1)).any(-1)
    return ~hit if invert else hit


# ---- sorting ----
def msort(input):
    return torch.sort(input, 0).values


def argsort(input, dim=-1, descending=False, stable=False):
    return torch.sort(input, dim=dim, descending=descending, stable=stable).indices


def renorm(input, p, dim, maxnorm):
    d = dim % input.ndim
    others = [i for i in range(input.ndim) if i != d]
    norm = torch.linalg.vector_norm(input, p, others, keepdim=True)
    factor = torch.where(norm > maxnorm, maxnorm / (norm + 1e-7), torch.ones_like(norm))
    return input * factor


def sum_to_size(input, *size):
    size = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else tuple(size)
    if not size and input.ndim == 0:
        return input.sum()  # eager sums a 0-d tensor (bool -> int64)
    lead = input.ndim - len(size)
    dims = list(range(lead)) + [lead + i for i, s in enumerate(size) if s == 1 and input.shape[lead + i] != 1]
    out = input.sum(dims, keepdim=True) if dims else input
    return out.reshape(size)


def unravel_index(indices, shape):
    if indices.dtype.is_floating_point or indices.dtype is torch.bool:
        raise TypeError("expected 'indices' to be integer dtype")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    out, rest = [], indices
    for s in reversed(shape):
        out.append(torch.remainder(rest, s))
        rest = torch.div(rest, s, rounding_mode="floor")
    return tuple(reversed(out))


def _trapz_parts(y, x, dx, dim):
    n = y.shape[dim]
    left, right = y.narrow(dim, 0, n - 1), y.narrow(dim, 1, n - 1)
    if x is None:
        return (left + right) * (dx / 2)
    if x.ndim == 1:
        shape = [1] * y.ndim
        shape[dim] = n - 1
        d = (x[1:] - x[:-1]).reshape(shape)
    else:
        d = x.narrow(dim, 1, n - 1) - x.narrow(dim, 0, n - 1)
    return (left + right) * d / 2


def trapezoid(y, x=None, *, dx=None, dim=-1):
    if isinstance(x, (int, float)):
        x, dx = None, x
    dx = 1 if dx is None else dx
    if y.shape[dim] == 0:
        return y.sum(dim)
    return _trapz_parts(y, x, dx, dim).sum(dim)


def trapz(y, x=None, *, dx=None, dim=-1):
    return trapezoid(y, x, dx=dx, dim=dim)


def cumulative_trapezoid(y, x=None, *, dx=None, dim=-1):
    if isinstance(x, (int, float)):
        x, dx = None, x
    dx = 1 if dx is None else dx
    if y.shape[dim] == 0:
        return y.clone()
    return torch.cumsum(_trapz_parts(y, x, dx, dim), dim)


# ---- factories ----
def eye(n, m=None, *, dtype=None, layout=None, device=None, requires_grad=False, pin_memory=False, out=None):
    if out is not None or layout not in (None, torch.strided) or pin_memory or requires_grad:
        raise NotImplementedError("eye with out=/layout/pin_memory/requires_grad is run by torch")
    m = n if m is None else m
    dtype = dtype or torch.get_default_dtype()
    return (torch.arange(n, device=device).unsqueeze(1) == torch.arange(m, device=device)).to(dtype)


def logspace(start, end, steps, base=10.0, *, dtype=None, layout=None, device=None, requires_grad=False, pin_memory=False, out=None):
    if out is not None or requires_grad or isinstance(start, torch.Tensor) or isinstance(end, torch.Tensor):
        raise NotImplementedError("logspace with tensor ends or out= is run by torch")
    dtype = dtype or torch.get_default_dtype()
    if not dtype.is_floating_point:
        raise NotImplementedError("integer logspace is run by torch")
    exps = torch.linspace(start, end, steps, dtype=torch.float64 if dtype is torch.float64 else torch.float32, device=device)
    return torch.pow(float(base), exps).to(dtype)


def _tri_indices(upper):
    def fn(row, col, offset=0, *, dtype=torch.int64, device=None, layout=torch.strided, pin_memory=False):
        pairs = [(i, j) for i in range(row) for j in range(col) if (j - i >= offset if upper else j - i <= offset)]
        if not pairs:
            return torch.zeros((2, 0), dtype=dtype, device=device)
        return torch.tensor([[i for i, _ in pairs], [j for _, j in pairs]], dtype=dtype, device=device)

    return fn


def fill(input, value):
    if isinstance(value, torch.Tensor):
        if value.ndim != 0:
            raise RuntimeError(f"fill only supports 0-dimension value tensor but got tensor with {value.ndim} dimensions.")
        value = value.to(input.dtype)
    # where() keeps input in the graph: the result requires grad like eager's (its gradient into input is zero)
    return torch.where(torch.ones_like(input, dtype=torch.bool), value, input)


_ALL = [(n, _copy_of(f), (t,), ("narrow_copy",) if n == "narrow_copy" else ()) for n, f, t in _COPIES] + [
    ("take", take, (torch.take,), ("take",)),
    ("index_fill", index_fill, (torch.index_fill,), ("index_fill",)),
    ("index_copy", index_copy, (torch.index_copy,), ("index_copy",)),
    ("select_scatter", select_scatter, (torch.select_scatter,), ("select_scatter",)),
    ("slice_scatter", slice_scatter, (torch.slice_scatter,), ("slice_scatter",)),
    ("float_power", float_power, (torch.float_power,), ("float_power",)),
    ("dist", dist, (torch.dist,), ("dist",)),
    ("kron", kron, (torch.kron,), ("kron",)),
    ("inner", inner, (torch.inner,), ("inner",)),
    ("tensordot", tensordot, (torch.tensordot,), ()),
    ("meshgrid", meshgrid, (torch.meshgrid,), ()),
    ("cartesian_prod", cartesian_prod, (torch.cartesian_prod,), ()),
    ("block_diag", block_diag, (torch.block_diag,), ()),
    ("vander", vander, (torch.linalg.vander,), ()),
    ("multi_dot", multi_dot, (torch.linalg.multi_dot,), ()),
    ("matrix_power", matrix_power, (torch.linalg.matrix_power, torch.matrix_power), ("matrix_power",)),
    ("linalg_cross", linalg_cross, (torch.linalg.cross,), ()),
    ("cross", cross, (torch.cross,), ("cross",)),
    ("rot90", rot90, (torch.rot90,), ("rot90",)),
    ("ldexp", ldexp, (torch.ldexp,), ("ldexp",)),
    ("isin", isin, (torch.isin,), ()),
    ("msort", msort, (torch.msort,), ("msort",)),
    ("argsort", argsort, (torch.argsort,), ("argsort",)),
    ("renorm", renorm, (torch.renorm,), ("renorm",)),
    ("sum_to_size", sum_to_size, (), ("sum_to_size",)),
    ("unravel_index", unravel_index, (torch.unravel_index,), ()),
    ("trapezoid", trapezoid, (torch.trapezoid,), ()),
    ("trapz", trapz, (torch.trapz,), ()),
    ("cumulative_trapezoid", cumulative_trapezoid, (torch.cumulative_trapezoid,), ()),
    ("eye", eye, (torch.eye,), ()),
    ("logspace", logspace, (torch.logspace,), ()),
    ("triu_indices", _tri_indices(True), (torch.triu_indices,), ()),
    ("tril_indices", _tri_indices(False), (torch.tril_indices,), ()),
    ("fill", fill, (torch.fill,), ()),
]
for _name, _fn, _fns, _methods in _ALL:
    _register(_name, _fn, _fns, _methods)
