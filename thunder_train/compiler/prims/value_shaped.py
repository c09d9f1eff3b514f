"""Prims whose output sizes depend on tensor values: ``nonzero``, ``unique``, ``unique_consecutive``, ``bincount``,
``repeat_index``.

Each output size that values decide is a *data-dependent size* (``proxies.unbacked_size``, printed ``u0``):
the program reads it from the op's result right after the op runs (``(u0, _) = prims.shape(t)``, recorded by
``torchlang/value_shaped.py``), later shapes use it symbolically, and a Python decision on it is a check of the
program (``acquisition/decisions.py``), since no prologue can compute it.  So one program serves every count:
a mixture-of-experts step routes a different number of tokens to each expert on every call without retracing.
The sizes' ``value`` is a stand-in (the largest count possible) for layout rules and memory estimates only.

``nonzero`` and ``repeat_index`` give integer positions, which carry no gradient; ``unique`` and ``bincount``
have none in eager either (its backward raises), so their rules raise eager's error (``NoGradientRuleError``: the
forward runs, the backward raises it, as eager's).
"""
from __future__ import annotations

from .. import dtypes
from ..errors import NoGradientRuleError
from ..grad_rules import register_vjp
from ..proxies import TensorProxy, size_value, unbacked_size
from .core import check, prim


def _count(bound):
    """A size between 0 and ``bound`` that the op's values decide: a plain 0 when nothing can be selected."""
    bound = size_value(bound)
    return 0 if bound == 0 else unbacked_size(bound)


@prim(tags=("non_differentiable",))
def nonzero(a):
    """The positions of ``a``'s nonzero entries, one row each: ``(u, a.ndim)`` int64, column-major as eager's."""
    numel = 1
    for s in a._tt_shape:
        numel *= size_value(s)
    u = _count(numel)
    out = TensorProxy(shape=(u, len(a._tt_shape)), dtype=dtypes.int64, device=a._tt_device)
    out._tt_strides, out._tt_rowmajor = (1, u), False  # column-major, as eager's (no comparison of sizes)
    return out


@prim
def unique(a, sorted, return_inverse, return_counts):
    """``torch.unique(a)`` (flattened): the distinct values ``(u,)``, each entry's position among them (``a``'s
    shape, int64) and each value's count ``(u,)``; the last two only when asked (else None)."""
    numel = 1
    for s in a._tt_shape:
        numel *= size_value(s)
    u = _count(numel)
    values = TensorProxy(shape=(u,), dtype=a._tt_dtype, device=a._tt_device)
    inverse = TensorProxy(shape=a._tt_shape, dtype=dtypes.int64, device=a._tt_device) if return_inverse else None
    counts = TensorProxy(shape=(u,), dtype=dtypes.int64, device=a._tt_device) if return_counts else None
    return values, inverse, counts


@register_vjp(unique)
def unique_vjp(g, out, /, a, sorted, return_inverse, return_counts):
    raise NoGradientRuleError("the derivative for '_unique2' is not implemented.")


@prim
def unique_consecutive(a, return_inverse, return_counts):
    """``torch.unique_consecutive(a)`` (flattened): each run of equal values once, as ``unique``'s results."""
    return unique.fn(a, False, return_inverse, return_counts)


@register_vjp(unique_consecutive)
def unique_consecutive_vjp(g, out, /, a, return_inverse, return_counts):
    raise NoGradientRuleError("the derivative for 'unique_consecutive' is not implemented.")


@prim(tags=("fallible",))  # eager refuses other zero-sized dims at run time
def unique_dim(a, dim, consecutive, return_inverse, return_counts):
    """``torch.unique(a, dim=dim)`` (sorted), or ``unique_consecutive`` when ``consecutive``: the distinct slices
    along ``dim`` (``a``'s shape with ``u`` there), each slice's position among them (``(a.shape[dim],)``) and each
    distinct slice's count ``(u,)``; the last two only when asked (else None)."""
    check(0 <= dim < len(a._tt_shape), lambda: f"unique: dim {dim} out of range for a {len(a._tt_shape)}-d tensor")
    u = _count(a._tt_shape[dim])
    shape = tuple(u if i == dim else s for i, s in enumerate(a._tt_shape))
    values = TensorProxy(shape=shape, dtype=a._tt_dtype, device=a._tt_device)
    inverse = TensorProxy(shape=(a._tt_shape[dim],), dtype=dtypes.int64, device=a._tt_device) if return_inverse else None
    counts = TensorProxy(shape=(u,), dtype=dtypes.int64, device=a._tt_device) if return_counts else None
    return values, inverse, counts


@register_vjp(unique_dim)
def unique_dim_vjp(g, out, /, a, dim, consecutive, return_inverse, return_counts):
    raise NoGradientRuleError(f"the derivative for '{'unique_consecutive' if consecutive else 'unique_dim'}' is not implemented.")


@prim(tags=("fallible",))  # a negative value raises at run time
def bincount(a, weights, minlength):
    """Counts of each value of the 1-d non-negative integer ``a`` (summed ``weights`` where given): ``(u,)`` with
    ``u = max(a.max() + 1, minlength)``; int64, or float32/float64 as eager's with weights."""
    check(len(a._tt_shape) == 1 and a._tt_dtype.is_int and not a._tt_dtype.is_bool,
          "bincount only supports 1-d non-negative integral inputs.")
    if weights is None:
        dt = dtypes.int64
    else:
        dt = weights._tt_dtype if weights._tt_dtype in (dtypes.float32, dtypes.float64) else dtypes.float64
        check(weights._tt_shape == a._tt_shape, "weights should be 1-d and have the same length as input")
    u = unbacked_size(max(size_value(a._tt_shape[0]), size_value(minlength), 2))
    return TensorProxy(shape=(u,), dtype=dt, device=a._tt_device)


@register_vjp(bincount)
def bincount_vjp(g, out, /, a, weights, minlength):
    raise NoGradientRuleError("derivative for aten::bincount is not implemented")


@prim(tags=("non_differentiable", "fallible"))  # a negative repeat raises at run time
def repeat_index(repeats):
    """``torch.repeat_interleave(repeats)``: ``i`` repeated ``repeats[i]`` times, ``(u,)`` int64 with
    ``u = repeats.sum()``."""
    check(len(repeats._tt_shape) == 1 and repeats._tt_dtype.is_int, "repeat_interleave: repeats must be 1-d integers")
    n = size_value(repeats._tt_shape[0])
    return TensorProxy(shape=(0 if n == 0 else unbacked_size(max(n, 2)),), dtype=dtypes.int64, device=repeats._tt_device)
