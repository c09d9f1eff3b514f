"""Small helpers the torch-language decompositions and gradient rules of several families share."""
from __future__ import annotations

from .. import clang, prims


def upcast_and_dtype(a):
    """Upcast low-precision floats for a decomposition; returns (value, original dtype)."""
    return clang.upcast(a), a._tt_dtype


def square(x):
    return prims.mul(x, x)


def ntuple(x, n):
    """``x`` as an ``n``-tuple; a number or a one-element sequence repeats (as eager's pools and convolutions)."""
    if isinstance(x, (tuple, list)):
        return tuple(x) * n if len(x) == 1 else tuple(x)
    return (x,) * n
