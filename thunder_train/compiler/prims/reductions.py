"""Reductions and scans: ``dims`` is a sorted tuple of non-negative ints, reduced dims are removed.
Each prim's meta and gradient rule are declared together."""
from __future__ import annotations

import math

from .. import dtypes
from ..grad_rules import register_vjp
from ..proxies import TensorProxy, as_divisor, is_int
from .core import check, prim, prims, restore_reduced, zeros_like


def _reduced_shape(a, dims, opname):
    nd = len(a._tt_shape)
    for d in dims:
        check(is_int(d) and 0 <= d < nd, lambda: f"{opname}: invalid dim {d} for rank {nd}")
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

    Without a zero in the whole tensor it is ``out / a``.  Otherwise each position gets the product of
    the others, as eager's exclusive products compute it: for the only zero, the product of the rest; for
    a position whose others include a zero, 0, or NaN when they also include an infinity or a NaN
    (``0 * inf``); in a slice without zeros, ``out / a``, except at an infinite or NaN entry, whose others'
    product is finite or infinite, not ``inf / inf``.
    """
    if not dims:
        return {"a": g}
    shape = a._tt_shape

    def count(mask):  # per position: how many of its slice's elements are in mask
        return restore_reduced(prims.sum(prims.convert_element_type(mask, dtypes.int64), dims), shape, dims)

    is_zero = prims.eq(a, 0.0)
    not_finite = prims.bitwise_not(prims.isfinite(a))
    safe = prims.where(is_zero, 1.0, a)
    gb = restore_reduced(g, shape, dims)
    no_zero = prims.mul(gb, prims.div(restore_reduced(out, shape, dims), safe))
    zeros_in_slice = count(is_zero)
    others_have_zero = prims.gt(prims.sub(zeros_in_slice, prims.convert_element_type(is_zero, dtypes.int64)), 0)
    others_not_finite = prims.gt(prims.sub(count(not_finite), prims.convert_element_type(not_finite, dtypes.int64)), 0)
    only_zero = prims.mul(gb, restore_reduced(prims.prod(safe, dims), shape, dims))
    times_zero = prims.where(others_not_finite, math.nan, prims.mul(gb, 0.0))
    # A zero-free slice next to a zero elsewhere: eager's exclusive products differ from out / a at non-finite entries.
    is_nan = prims.isnan(a)
    others_nan = prims.gt(prims.sub(count(is_nan), prims.convert_element_type(is_nan, dtypes.int64)), 0)
    others_inf = prims.gt(prims.sub(count(prims.isinf(a)), prims.convert_element_type(prims.isinf(a), dtypes.int64)), 0)
    signs = prims.sign(prims.where(is_nan, 1.0, a))
    others_sign = prims.mul(restore_reduced(prims.prod(signs, dims), shape, dims), signs)
    finite_rest = restore_reduced(prims.prod(prims.where(not_finite, 1.0, a), dims), shape, dims)
    others = prims.where(others_nan, math.nan, prims.where(others_inf, prims.mul(others_sign, math.inf), finite_rest))
    exclusive = prims.where(not_finite, prims.mul(gb, others), no_zero)
    any_zero = prims.broadcast_in_dim(prims.gt(prims.sum(prims.convert_element_type(is_zero, dtypes.int64), tuple(range(a.ndim_))), 0), shape, ())
    zero_free = prims.where(any_zero, exclusive, no_zero)
    grad = prims.where(prims.eq(zeros_in_slice, 0), zero_free, prims.where(others_have_zero, times_zero, only_zero))
    return {"a": grad}


@prim(tags=("reduction",))
def var(a, dims, correction):
    """Variance over ``dims`` with Bessel-style ``correction``."""
    shape = _reduced_shape(a, dims, "var")
    return TensorProxy(shape=shape, dtype=dtypes.to_real(a._tt_dtype), device=a._tt_device)


@register_vjp(var)
def var_vjp(g, out, /, a, dims, correction):
    n = math.prod(a._tt_shape[d] for d in dims)
    mean = restore_reduced(prims.div(prims.sum(a, dims), as_divisor(n)), a._tt_shape, dims)
    centred = prims.sub(a, mean)
    gb = restore_reduced(g, a._tt_shape, dims)
    return {"a": prims.div(prims.mul(prims.mul(gb, centred), 2.0), as_divisor(n - correction))}


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
