"""Small helpers the torch-language decompositions and gradient rules of several families share."""
from __future__ import annotations

from torch._prims_common import suggest_memory_format

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


def as_eager_allocates(result, input):
    """``result`` (a composed op's, written with torch calls) laid out as eager's kernel allocates it: in ``input``'s
    suggested memory format, channels_last (channels_last_3d) for a 4-d (5-d) batch laid out so, else row-major;
    the tensor itself where it already is (no line), else a copy.  Other ranks: ``result`` as it is."""
    if input.ndim not in (4, 5):
        return result
    return result.contiguous(memory_format=suggest_memory_format(input))
