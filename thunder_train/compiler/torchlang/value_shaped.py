"""Ops whose output shape depends on tensor values: ``nonzero``, ``argwhere``, ``torch.where(cond)``,
``masked_select``, boolean-mask indexing (``x[mask]``, ``x[mask] = v``), ``unique``, ``bincount``,
``repeat_interleave`` with tensor repeats; and ``combinations`` and ``linalg.lstsq``, whose eager kernels
have no meta form.

The count a value decides is a data-dependent size (``prims/value_shaped.py``): each op runs at the top level
of the program and the line after it reads its sizes (``(u0, _) = prims.shape(t)``), so later lines use the
count of this call, whatever it is: one program for every count, no retrace when it changes.  A Python
decision on a count (``if n == 0:``, ``range(n)``) is checked by the program (``acquisition/decisions.py``).
Selections are written as ``index_select``/index arithmetic on the positions ``nonzero`` gives, so their
gradients are the index ops' (eager's values: each position is selected once).
"""
from __future__ import annotations

import itertools

import torch

from .. import context, prims
from ..proxies import TensorProxy, is_unbacked
from ..symbols import BoundSymbol
from .registry import composed, direct


def _earlier_nonzero(trc, a):
    """The positions an earlier ``nonzero`` of the same value gave, where still in scope: ``x[mask]`` and
    ``labels[mask]`` then share one count, as their sizes are equal in eager (a loss may combine them)."""
    st = context.tracer_state()
    if st is not None and st.buffers is not None and type(a) is TensorProxy:
        a = st.buffers.read(a)
    for scope in reversed(trc._scopes):
        for b in reversed(scope):
            if b.sym is prims.nonzero and b.args and b.args[0] is a:
                return b.output
    return None


def _run_sized(sym, *args):
    """``sym(*args)`` at the top of the program, then the line that reads its data-dependent sizes."""
    trc = context.get_trace()
    if sym is prims.nonzero:
        earlier = _earlier_nonzero(trc, args[0])
        if earlier is not None:
            return earlier
    out = direct(sym, *args)
    for t in out if isinstance(out, tuple) else (out,):
        if type(t) is TensorProxy and any(is_unbacked(s) for s in t._tt_shape):
            trc.add(BoundSymbol(prims.shape, (t,), {}, tuple(t._tt_shape)))
            break  # the outputs share their sizes
    return out


def nonzero(input, *, as_tuple=False):
    if as_tuple and input.ndim == 0:
        input = input.unsqueeze(0)  # eager's: a 0-d tensor counts as one entry
    out = _run_sized(prims.nonzero, input)
    return out.unbind(1) if as_tuple else out


def argwhere(input):
    return nonzero(input)


def where_positions(condition):
    """``torch.where(condition)``: ``nonzero(condition, as_tuple=True)``."""
    return nonzero(condition, as_tuple=True)


def _flat_positions(mask):
    """Flat positions where ``mask`` is true, in order (``(u,)``)."""
    return nonzero(mask.reshape(-1))[:, 0]


def masked_select(input, mask):
    if mask.dtype is not torch.bool:
        raise RuntimeError(f"masked_select: expected BoolTensor for mask, got {mask.dtype}")
    input, mask = torch.broadcast_tensors(input, mask)
    return torch.index_select(input.reshape(-1), 0, _flat_positions(mask))


def mask_keys(x, key, probe=False):
    """An indexing key with its boolean masks replaced by the integer positions ``nonzero`` gives (eager's
    rule for ``x[mask]`` and ``x[mask] = v``); None when the key has no mask.  A mask must match the sizes of
    the dims it indexes, as in eager."""
    keys = key if isinstance(key, tuple) else (key,)
    masks = [type(k) is TensorProxy and k.dtype in (torch.bool, torch.uint8) and k.ndim > 0 for k in keys]
    if not any(masks) or probe:
        return True if any(masks) else None
    used = sum(k.ndim if m else 0 if k is None or k is Ellipsis else 1 for k, m in zip(keys, masks))
    out, dim = [], 0
    for k, m in zip(keys, masks):
        if k is Ellipsis:
            dim += x.ndim - used
        elif m:
            for j in range(k.ndim):
                if dim + j >= x.ndim or k.shape[j] != x.shape[dim + j]:
                    size = x.shape[dim + j] if dim + j < x.ndim else "?"
                    raise IndexError(f"The shape of the mask {list(k.shape)} at index {j} does not match the shape "
                                     f"of the indexed tensor {list(x.shape)} at index {dim + j}")
            out.extend(nonzero(k if k.dtype is torch.bool else k.bool(), as_tuple=True))
            dim += k.ndim
            continue
        elif k is not None:
            dim += 1
        out.append(k)
    return tuple(out)


def _unique_dim(input, dim, consecutive, return_inverse, return_counts):
    if input.ndim == 0:
        raise NotImplementedError("unique(dim=...) of a 0-d tensor is run by torch")
    d = dim + input.ndim if dim < 0 else dim
    if not 0 <= d < input.ndim:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-input.ndim}, {input.ndim - 1}], "
                         f"but got {dim})")
    return _run_sized(prims.unique_dim, input, d, consecutive, return_inverse, return_counts)


def unique_consecutive(input, return_inverse=False, return_counts=False, dim=None):
    if dim is not None:
        values, inverse, counts = _unique_dim(input, dim, True, return_inverse, return_counts)
    else:
        values, inverse, counts = _run_sized(prims.unique_consecutive, input, return_inverse, return_counts)
    out = (values,) + ((inverse,) if return_inverse else ()) + ((counts,) if return_counts else ())
    return out[0] if len(out) == 1 else out


def repeat_positions(repeats):
    """``torch.repeat_interleave(repeats)``: each position ``i`` repeated ``repeats[i]`` times."""
    return _run_sized(prims.repeat_index, repeats)


def bincount(input, weights=None, minlength=0):
    if input.ndim != 1 or input.dtype.is_floating_point or input.dtype.is_complex or input.dtype is torch.bool:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    if minlength < 0:
        raise RuntimeError("minlength should be >= 0")
    if weights is not None and weights.shape != input.shape:
        raise RuntimeError("weights should be 1-d and have the same length as input")
    return _run_sized(prims.bincount, input, weights, minlength)


def unique(input, sorted=True, return_inverse=False, return_counts=False, dim=None):
    if dim is not None:
        values, inverse, counts = _unique_dim(input, dim, False, return_inverse, return_counts)
    else:
        values, inverse, counts = _run_sized(prims.unique, input, sorted, return_inverse, return_counts)
    out = (values,) + ((inverse,) if return_inverse else ()) + ((counts,) if return_counts else ())
    return out[0] if len(out) == 1 else out


def combinations(input, r=2, with_replacement=False):
    if input.ndim != 1:
        raise RuntimeError(f"Expect a 1D vector, but got shape {list(input.shape)}")
    if r < 0:
        raise RuntimeError(f"Expect a non-negative number, but got {r}")
    if r == 0:
        return input[:0]  # empty, and derived from input (requires grad like eager's)
    pick = itertools.combinations_with_replacement if with_replacement else itertools.combinations
    combos = list(pick(range(input.shape[0]), r))  # the positions are a function of the shape only
    if not combos:
        return input[:0].reshape(0, r)
    return input[torch.tensor([i for c in combos for i in c])].reshape(len(combos), r)


def lstsq(A, B, rcond=None, *, driver=None):
    """Least squares through the pseudo-inverse: the minimum-norm solution LAPACK's gelsy, gelsd and gelss
    drivers return (gels too, for full-rank problems); the auxiliary outputs follow the driver, as eager's do.
    gelsd/gelss treat singular values up to ``rcond * s_max`` as zero (``pinv``'s ``rtol``; eager's gradient
    is the untruncated one's all the same); gelsy's own pivoted-QR truncation with an explicit ``rcond`` is left
    to torch."""
    if driver not in ("gels", "gelsy", "gelsd", "gelss", None):
        raise NotImplementedError(f"linalg.lstsq with driver={driver!r} is run by torch (eager checks it)")
    svd_driver = driver in ("gelsd", "gelss")
    if rcond is not None and (driver in ("gelsy", None) or rcond < 0):
        raise NotImplementedError("linalg.lstsq with driver gelsy and rcond=, or a negative rcond, is run by torch")
    if A.dtype.is_complex or A.ndim < 2:
        raise NotImplementedError("complex or 1-d linalg.lstsq is run by torch")
    m, n = A.shape[-2], A.shape[-1]
    vector = B.ndim == A.ndim - 1
    Bm = B.unsqueeze(-1) if vector else B
    rtol = rcond if rcond is not None else torch.finfo(A.dtype).eps * max(m, n)
    X = torch.matmul(torch.linalg.pinv(A), Bm)
    if svd_driver and rcond is not None:
        # the truncated solution's value with eager's gradient, which is the untruncated pinv's
        X = X + (torch.matmul(torch.linalg.pinv(A, rtol=rtol), Bm) - X).detach()
    empty = A.reshape(-1)[:0]  # derived from A: requires grad like eager's empty outputs
    singular_values = A.new_empty(0)  # eager's: no gradient
    if driver == "gels":
        rank = torch.zeros(0, dtype=torch.int64)
        with_residuals = m > n
    elif svd_driver:
        singular_values = torch.linalg.svdvals(A.detach())
        rank = (singular_values > rtol * singular_values.amax(-1, keepdim=True)).sum(-1)
        # eager computes them only when every matrix has full column rank: a decision on A's values
        with_residuals = m > n and bool((rank == n).all())
    else:
        rank = torch.linalg.matrix_rank(A)
        with_residuals = False
    residuals = ((torch.matmul(A, X) - Bm) ** 2).sum(-2) if with_residuals else empty
    if vector:
        X = X.squeeze(-1)  # eager keeps the residuals' last dim (size 1)
    return torch.return_types.linalg_lstsq((X, residuals, rank, singular_values))


composed("nonzero", nonzero, (torch.nonzero,), ("nonzero",))
composed("unique", unique, (torch.unique, torch.functional.unique), ("unique",))
composed("unique_consecutive", unique_consecutive, (torch.unique_consecutive, torch.functional.unique_consecutive),
         ("unique_consecutive",))
composed("argwhere", argwhere, (torch.argwhere,), ("argwhere",))
composed("masked_select", masked_select, (torch.masked_select,), ("masked_select",))
composed("bincount", bincount, (torch.bincount,), ("bincount",))
composed("combinations", combinations, (torch.combinations,), ())
composed("lstsq", lstsq, (torch.linalg.lstsq, torch._C._linalg.linalg_lstsq), ())
