"""Translate torch objects (dtypes, devices, sizes) into compiler ones."""
from __future__ import annotations

import torch

from .. import context, dtypes, devices
from ..proxies import TensorProxy, NumberProxy, size_arg


def to_dtype(d):
    if d is None:
        return None
    if isinstance(d, dtypes.DType):
        return d
    if d is float:
        return dtypes.default_float()
    if d is int:
        return dtypes.int64
    if d is bool:
        return dtypes.bool8
    return dtypes.from_torch(d)


def to_device(d):
    return None if d is None else devices.from_torch(d)


def size_args(shape) -> tuple:
    """Accept ``f(2, 3)``, ``f((2, 3))``, ``f([2, 3])`` or ``f(torch.Size(...))``."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = shape[0]
    out = []
    for s in shape:
        if type(s) is TensorProxy:
            s = _known_size(s)
        out.append(size_arg(s) if isinstance(s, NumberProxy) else int(s))
    return tuple(out)


def _known_size(proxy) -> int:
    """The value of a tensor made from Python numbers while tracing (acquisition/known_values.py), else an error."""
    st = context.tracer_state()
    found = st.known_sizes.get(id(proxy)) if st is not None else None
    if found is None:
        raise TypeError("a tensor cannot be used as a size while tracing (its value is data-dependent)")
    return found[1]


def default_device():
    if hasattr(torch, "get_default_device"):
        return devices.from_torch(torch.get_default_device())
    return devices.cpu
