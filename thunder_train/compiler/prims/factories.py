"""Factories and random values.  Their outputs carry no gradient (tag ``"non_differentiable"``);
``"random"`` marks the prims whose values differ from call to call (decisions refuse them)."""
from __future__ import annotations

from ..proxies import NumberProxy, TensorProxy, is_int, size_arg, size_value
from .core import check, prim


def _factory_shape(shape):
    shape = tuple(_size(s) for s in shape)
    for s in shape:
        check(is_int(s) and size_value(s) >= 0, lambda: f"invalid size {s} in {shape}")
    return shape


def _size(s):
    """A size argument: symbolic sizes (dynamic=True) stay symbolic, other runtime numbers (``item()``) are
    specialised on their value (a decision, acquisition/decisions.py)."""
    return size_arg(s) if isinstance(s, NumberProxy) else s


# "cheap_to_recompute": the backward recomputes a constant rather than saving it (transforms/autograd.py).
@prim(tags=("non_differentiable", "cheap_to_recompute"))
def full(shape, fill_value, *, device, dtype):
    """A tensor of ``shape`` filled with ``fill_value``."""
    return TensorProxy(shape=_factory_shape(shape), dtype=dtype, device=device)


@prim(tags=("non_differentiable",))
def empty(shape, *, device, dtype):
    """Uninitialised tensor; differs from ``full`` only at execution."""
    return TensorProxy(shape=_factory_shape(shape), dtype=dtype, device=device)


@prim(tags=("non_differentiable", "cheap_to_recompute"))
def iota(length, *, start, step, device, dtype):
    """``start, start + step, ...`` (``length`` values)."""
    return TensorProxy(shape=(_size(length),), dtype=dtype, device=device)


@prim(tags=("random", "non_differentiable"))
def uniform(shape, minval, maxval, *, device, dtype):
    """Uniform random values in [minval, maxval)."""
    return TensorProxy(shape=_factory_shape(shape), dtype=dtype, device=device)


@prim(tags=("random", "non_differentiable"))
def randn(shape, *, device, dtype):
    """Standard normal random values."""
    return TensorProxy(shape=_factory_shape(shape), dtype=dtype, device=device)


@prim(tags=("random", "non_differentiable"))
def bernoulli(a, p):
    """1 with probability ``p`` else 0, in ``a``'s shape and dtype."""
    return TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device)
