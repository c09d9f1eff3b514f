"""What every prim family module shares: the ``prim`` decorator and registry, input checks, and the
helpers gradient rules are written with.

``prims`` is the namespace of every prim defined so far, filled by ``@prim`` as the family modules
are imported; gradient rules call other prims through it (``prims.sum``), so the family modules
need no imports among themselves (a rule runs only when a backward is recorded, long after all of
them are loaded).
"""
from __future__ import annotations

import types

from ..proxies import TensorProxy, size_value
from ..symbols import Symbol

_all: dict = {}
prims = types.SimpleNamespace()


def prim(fn=None, *, name=None, tags=()):
    """Define a prim whose meta function is the decorated function (its name without a leading ``_``)."""

    def deco(f):
        sym = Symbol(name or f.__name__.lstrip("_").removesuffix("_meta"), f, module="prims", is_prim=True, tags=tags)
        if sym.name in _all:
            raise ValueError(f"prims.{sym.name} is defined twice")
        _all[sym.name] = sym
        setattr(prims, sym.name, sym)
        return sym

    return deco(fn) if fn is not None else deco


def all_prims() -> dict:
    return dict(_all)


def add_tags(sym, *tags):
    sym.tags = sym.tags | frozenset(tags)


def remove_tags(sym, *tags):
    sym.tags = sym.tags - frozenset(tags)


class PrimError(ValueError):
    """An input a prim cannot accept; the message says which and why."""


def check(cond, msg):
    if not cond:
        raise PrimError(msg() if callable(msg) else msg)


def tensor_args(args):
    return [a for a in args if type(a) is TensorProxy]


def common_device(tensors, opname):
    dev = tensors[0]._tt_device
    for t in tensors[1:]:
        check(t._tt_device == dev, lambda: f"{opname}: expected all tensors on {dev}, got one on {t._tt_device}")
    return dev


number_value = size_value  # the example value of a number (None for an item() result)


def like(a, *, shape=None, dtype=None):
    """A new output proxy shaped like ``a`` (or ``shape``), of its dtype (or ``dtype``), on its device."""
    return TensorProxy(shape=a._tt_shape if shape is None else shape, dtype=a._tt_dtype if dtype is None else dtype,
                       device=a._tt_device)


# ---------------------------------------------------------------------------
# Helpers of gradient rules (they record prims)
# ---------------------------------------------------------------------------
def is_tensor(x) -> bool:
    return type(x) is TensorProxy


def is_float(x) -> bool:
    return is_tensor(x) and x._tt_dtype.is_float


def zeros_like(a):
    return prims.full(a._tt_shape, 0.0, device=a._tt_device, dtype=a._tt_dtype)


def reshape(x, shape):
    """``x`` in ``shape`` (all sizes known); ``x`` itself when it already has it."""
    shape = tuple(shape)
    return x if tuple(x._tt_shape) == shape else prims.reshape(x, shape)


def restore_reduced(g, shape, dims):
    """Broadcast a reduction's result (``dims`` removed) back to ``shape``."""
    shape = tuple(shape)
    return prims.broadcast_in_dim(g, shape, tuple(i for i in range(len(shape)) if i not in dims))


def sum_to(x, shape):
    """Sum ``x`` down to ``shape`` (the inverse of broadcasting ``shape`` to x's shape)."""
    shape = tuple(shape)
    if x._tt_shape == shape:
        return x
    lead = x.ndim_ - len(shape)
    dims = list(range(lead)) + [lead + i for i, s in enumerate(shape) if s == 1 and x._tt_shape[lead + i] != 1]
    if dims:
        x = prims.sum(x, tuple(dims))
    return reshape(x, shape)


def unsqueeze(x, dim):
    """``x`` with a new size-1 dim at ``dim`` (0 <= dim <= x.ndim_, or negative from the end)."""
    nd = x.ndim_ + 1
    dim = dim % nd
    shape = list(x._tt_shape)
    shape.insert(dim, 1)
    return prims.broadcast_in_dim(x, tuple(shape), tuple(i for i in range(nd) if i != dim))


def swap_last_two(x):
    """``x`` with its last two dims swapped."""
    perm = list(range(x.ndim_))
    perm[-1], perm[-2] = perm[-2], perm[-1]
    return prims.transpose(x, tuple(perm))


def slice_in_dim(x, start, stop, dim):
    """``x[..., start:stop, ...]`` along ``dim``; ``x`` itself when that is all of it."""
    if start == 0 and stop == x._tt_shape[dim]:
        return x
    lo, hi = [0] * x.ndim_, list(x._tt_shape)
    lo[dim], hi[dim] = start, stop
    return prims.slice(x, tuple(lo), tuple(hi), (1,) * x.ndim_)


def square(x):
    return prims.mul(x, x)
