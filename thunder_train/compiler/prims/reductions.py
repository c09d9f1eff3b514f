"""Reductions and scans: ``dims`` is a sorted tuple of non-negative ints, reduced dims are removed.
Each prim's meta and gradient rule are declared together."""
from __future__ import annotations

import math

from .. import dtypes
from ..grad_rules import register_vjp
from ..proxies import TensorProxy
from .core import check, prim, prims, restore_reduced, zeros_like


def _reduced_shape(a, dims, opname):
    nd = len(a._tt_shape)
    for d in dims:
        check(isinstance(d, int) and 0 <= d < nd, lambda: f"{opname}: invalid dim {d} for rank {nd}")
    return tuple(s for i, s in enumerate(a._tt_shape) if i not in dims)


def _make_reduction(name, tags=("reduction", "fusible")):
    def meta(a, dims):
        shape = _reduced_shape(a, dims, name)
        return TensorProxy(shape=shape, dtype=a._tt_dtype, device=a._tt_device)

    meta.__name__ = name
    meta.__doc__ = f"Reduce ``a`` with {name} over ``dims``; reduced dims are removed."
    return prim(meta, name=name, tags=tags)


sum = _make_reduction("sum")
prod = _make_reduction("prod", tags=("reduction",))
amax = _make_reduction("amax")
amin = _make_reduction("amin")


@register_vjp(sum)
def sum_vjp(g, out, /, a, dims):
    return {"a": restore_reduced(g, a._tt_shape, dims)}


@register_vjp(amax, amin)
def extremum_vjp(g, out, /, a, dims):
    # Every position equal to the result shares the gradient evenly (torch's amax/amin: ``mask * (g / count)``).
    # A NaN result equals no position: the count is 0 and, as in eager, the whole slice's gradient is NaN.
    hit = prims.convert_element_type(prims.eq(a, restore_reduced(out, a._tt_shape, dims)), a._tt_dtype)
    share = restore_reduced(prims.div(g, prims.sum(hit, dims)), a._tt_shape, dims)
    return {"a": prims.mul(share, hit)}


@register_vjp(prod)
def prod_vjp(g, out, /, a, dims):
    """The product of the other elements, zeros included (torch's ``prod_backward``).

    Without a zero in the reduced slice it is ``out / a``.  With exactly one zero,
    only that position gets a gradient: the product of the others.  With two or
    more, every gradient is 0.
    """
    if not dims:
        return {"a": g}
    shape = a._tt_shape
    is_zero = prims.eq(a, 0.0)
    safe = prims.where(is_zero, 1.0, a)
    gb = restore_reduced(g, shape, dims)
    no_zero = prims.mul(gb, prims.div(restore_reduced(out, shape, dims), safe))
    zeros_in_slice = restore_reduced(prims.sum(prims.convert_element_type(is_zero, dtypes.int64), dims), shape, dims)
    one_zero = prims.where(is_zero, prims.mul(gb, restore_reduced(prims.prod(safe, dims), shape, dims)), 0.0)
    grad = prims.where(prims.eq(zeros_in_slice, 0), no_zero, prims.where(prims.eq(zeros_in_slice, 1), one_zero, 0.0))
    return {"a": grad}


@prim(tags=("reduction",))
def var(a, dims, correction):
    """Variance over ``dims`` with Bessel-style ``correction``."""
    shape = _reduced_shape(a, dims, "var")
    return TensorProxy(shape=shape, dtype=dtypes.to_real(a._tt_dtype), device=a._tt_device)


@register_vjp(var)
def var_vjp(g, out, /, a, dims, correction):
    n = math.prod(a._tt_shape[d] for d in dims)
    mean = restore_reduced(prims.div(prims.sum(a, dims), float(n)), a._tt_shape, dims)
    centred = prims.sub(a, mean)
    gb = restore_reduced(g, a._tt_shape, dims)
    return {"a": prims.div(prims.mul(prims.mul(gb, centred), 2.0), float(n - correction))}


@prim(tags=("reduction", "non_differentiable"))
def argmax(a, dim):
    """Index of the maximum along ``dim`` (removed)."""
    return TensorProxy(shape=_reduced_shape(a, (dim,), "argmax"), dtype=dtypes.int64, device=a._tt_device)


@prim(tags=("reduction", "non_differentiable"))
def argmin(a, dim):
    """Index of the minimum along ``dim`` (removed)."""
    return TensorProxy(shape=_reduced_shape(a, (dim,), "argmin"), dtype=dtypes.int64, device=a._tt_device)


@prim
def cumsum(a, dim):
    """Inclusive prefix sum along ``dim``."""
    return TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device)


@register_vjp(cumsum)
def cumsum_vjp(g, out, /, a, dim):
    return {"a": prims.flip(prims.cumsum(prims.flip(g, (dim,)), dim), (dim,))}


@prim
def topk(a, k, dim, largest, sorted):
    """The ``k`` largest (or smallest) values along ``dim`` and their int64 indices."""
    shape = list(a._tt_shape)
    check(0 <= k <= shape[dim], lambda: f"topk: k={k} out of range for size {shape[dim]}")
    shape[dim] = k
    return (
        TensorProxy(shape=shape, dtype=a._tt_dtype, device=a._tt_device),
        TensorProxy(shape=shape, dtype=dtypes.int64, device=a._tt_device),
    )


@prim
def sort(a, dim, descending, stable):
    """Sorted values along ``dim`` and their int64 indices."""
    return (
        TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device),
        TensorProxy(shape=a._tt_shape, dtype=dtypes.int64, device=a._tt_device),
    )


def _values_indices_vjp(g, out, a, dim):
    return {"a": prims.scatter_add(zeros_like(a), out[1], g[0], dim)}


@register_vjp(topk)
def topk_vjp(g, out, /, a, k, dim, largest, sorted):
    return _values_indices_vjp(g, out, a, dim)


@register_vjp(sort)
def sort_vjp(g, out, /, a, dim, descending, stable):
    return _values_indices_vjp(g, out, a, dim)
