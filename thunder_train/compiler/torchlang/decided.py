"""Torch calls whose result depends on tensor values through a Python value: ``torch.equal``,
``torch.allclose``, ``narrow``/``tensor_split`` with tensor positions, ``one_hot`` without
``num_classes``, ``linspace`` with tensor ends.

The Python value is taken at the top level of the user's call (``int(start)``, ``bool(...)``), so it is
a *decision* (``acquisition/decisions.py``): computed from per-call inputs by the prologue on every call
and specialised on, or a ``DataDependentError`` naming the line when it depends on anything else.  The
op itself then runs as its symbol with Python arguments.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..clang import is_tensor
from . import factories, nn, shapes  # noqa: F401 - their entries are registered first
from .registry import by_torch_fn, composed, direct


def equal(input, other):
    """True when the shapes and all values are equal (eager: any dtypes)."""
    if tuple(input.shape) != tuple(other.shape):
        return False
    return bool(torch.eq(input, other).all())


def allclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    return bool(torch.isclose(input, other, rtol=rtol, atol=atol, equal_nan=equal_nan).all())


def _int(v):
    return int(v) if is_tensor(v) else v


def narrow(input, dim, start, length):
    if is_tensor(start) or is_tensor(length):  # again through the dispatcher, which gives eager's result objects
        return torch.narrow(input, dim, _int(start), _int(length))
    return direct(shapes.narrow, input, dim, start, length)


def tensor_split(input, indices_or_sections, dim=0):
    v = indices_or_sections
    if is_tensor(v):
        v = int(v) if v.ndim == 0 else tuple(int(v[i]) for i in range(v.shape[0]))
        return torch.tensor_split(input, v, dim)
    return direct(shapes.tensor_split, input, v, dim)


def one_hot(tensor, num_classes=-1):
    if num_classes < 0 and is_tensor(tensor):
        num_classes = int(tensor.max()) + 1 if tensor.numel() else 0
    if num_classes == 0:
        raise RuntimeError("Can not infer total number of classes from empty tensor.")
    return direct(nn.one_hot, tensor, num_classes)


_linspace_entry = by_torch_fn[torch.linspace]  # the factory (records its dtype/device)


def linspace(start, end, steps, **kwargs):
    # float(tensor) is a decision (a value of the per-call inputs), not a runtime number
    return direct(_linspace_entry, float(start) if is_tensor(start) else start, float(end) if is_tensor(end) else end, _int(steps), **kwargs)


composed("equal", equal, (torch.equal,), ("equal",))
composed("allclose", allclose, (torch.allclose,), ("allclose",))
composed("narrow", narrow, (torch.narrow,), ("narrow",), sym=shapes.narrow)
composed("tensor_split", tensor_split, (torch.tensor_split,), ("tensor_split",), sym=shapes.tensor_split)
composed("one_hot", one_hot, (F.one_hot,), sym=nn.one_hot)
composed("linspace", linspace, (torch.linspace,), sym=_linspace_entry.sym)
