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

from .. import context
from ..proxies import TensorProxy
from ..pytree import tree_flatten, tree_map
from . import factories, nn, shapes  # noqa: F401 - their entries are registered first
from .registry import bind, by_torch_fn


class _Decided:
    """Dispatch entry: ``fn`` runs at the top level (its torch calls are traced as the user's own).
    With a ``target`` symbol (what ``fn`` ends in), the entry answers for that symbol's facts."""

    tags = frozenset()
    traces_torch_calls = True  # the dispatcher traces fn's torch calls (factories included)

    def __init__(self, name, fn, target=None):
        self.name, self.fn = name, fn
        if target is not None:
            self.sym = target

    def __call__(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        st = context.tracer_state()
        if st is None or st.buffers is None:
            return out
        # A tensor ``fn`` made and then updated in place (``out = x.clone(); out[i] = v``) is returned as its
        # current value, so a caller that binds the result (an in-place form, out=) gets the update; an
        # argument returned (``inplace=True``) stays that object.
        mine = {id(a) for a in tree_flatten((args, kwargs))[0] if type(a) is TensorProxy}
        return tree_map(lambda t: st.buffers.read(t) if type(t) is TensorProxy and id(t) not in mine else t, out)

    def __getattr__(self, name):
        target = self.__dict__.get("sym")
        if target is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(target, name)


def direct(sym, *args, **kwargs):
    """Call a torch-language symbol from an entry: without the torch-function mode the dispatcher put back
    for the entry's torch calls (the symbol's own passes run torch on fake tensors, which must not be traced)."""
    st = context.tracer_state()
    if st is not None and st.buffers is not None:  # the entry got the user's objects: their current values
        args, kwargs = tree_map(lambda t: st.buffers.read(t) if type(t) is TensorProxy else t, (args, kwargs))
    if torch._C._len_torch_function_stack() == 0:
        return sym(*args, **kwargs)
    with torch.overrides._pop_mode_temporarily():
        return sym(*args, **kwargs)


def _register(name, fn, torch_fns=(), methods=(), sym=None):
    entry = _Decided(name, fn, sym)
    bind(entry, torch_fns, methods)
    return entry


def _t(x):
    return type(x) is TensorProxy


def equal(input, other):
    """True when the shapes and all values are equal (eager: any dtypes)."""
    if tuple(input.shape) != tuple(other.shape):
        return False
    return bool(torch.eq(input, other).all())


def allclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    return bool(torch.isclose(input, other, rtol=rtol, atol=atol, equal_nan=equal_nan).all())


def _int(v):
    return int(v) if _t(v) else v


def narrow(input, dim, start, length):
    if _t(start) or _t(length):  # again through the dispatcher, which gives eager's result objects
        return torch.narrow(input, dim, _int(start), _int(length))
    return direct(shapes.narrow, input, dim, start, length)


def tensor_split(input, indices_or_sections, dim=0):
    v = indices_or_sections
    if _t(v):
        v = int(v) if v.ndim == 0 else tuple(int(v[i]) for i in range(v.shape[0]))
        return torch.tensor_split(input, v, dim)
    return direct(shapes.tensor_split, input, v, dim)


def one_hot(tensor, num_classes=-1):
    if num_classes < 0 and _t(tensor):
        num_classes = int(tensor.max()) + 1 if tensor.numel() else 0
    if num_classes == 0:
        raise RuntimeError("Can not infer total number of classes from empty tensor.")
    return direct(nn.one_hot, tensor, num_classes)


_linspace_entry = by_torch_fn[torch.linspace]  # the factory (records its dtype/device)


def linspace(start, end, steps, **kwargs):
    # float(tensor) is a decision (a value of the per-call inputs), not a runtime number
    return direct(_linspace_entry, float(start) if _t(start) else start, float(end) if _t(end) else end, _int(steps), **kwargs)


_register("equal", equal, (torch.equal,), ("equal",))
_register("allclose", allclose, (torch.allclose,), ("allclose",))
_register("narrow", narrow, (torch.narrow,), ("narrow",), sym=shapes.narrow)
_register("tensor_split", tensor_split, (torch.tensor_split,), ("tensor_split",), sym=shapes.tensor_split)
_register("one_hot", one_hot, (F.one_hot,), sym=nn.one_hot)
_register("linspace", linspace, (torch.linspace,), sym=_linspace_entry.sym)
