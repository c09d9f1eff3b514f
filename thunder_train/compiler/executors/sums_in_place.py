"""A sum whose first operand dies there is written into that operand: ``t = add(a, b)`` becomes ``a.add_(b)``.

The backward sums the gradient contributions of a value read by several lines (``Cotangents.add`` in
transforms/autograd.py: ``add(prev, g)``).  Each sum is a new array while the partial sum it replaces and the new
contribution are still alive: three arrays of the value's size at once.  Eager's autograd adds a contribution into
its buffer in place (two).  In a mixture-of-experts layer whose experts are one stacked weight
(``experts.gate_up_proj[e]``) every expert's contribution is the whole stacked weight's size, so the sum is the
step's peak (Mixtral in the zoo).  The same holds for any ``add`` whose first operand is a dead intermediate.

``add_`` is the same elementwise kernel as ``add``, so the values are the same.  Only where ``a`` is an
intermediate of the program (not an input, not returned, not handed to an op that may keep a reference), no later
line reads it or a value that may share its memory, the result has ``a``'s shape, dtype and row-major layout,
``b`` has ``a``'s dtype and shares no memory with it.  Whole steps with their backward (pipeline.py step 5).
"""
from __future__ import annotations

import torch

from ..proxies import TensorProxy
from ..pytree import tree_flatten
from . import torch_impls
from .torch_executor import impl_symbol

_ADDS = (torch.add, torch.Tensor.add)


def add_into_first(a, b):
    """``torch.add(a, b)`` written into ``a``."""
    return a.add_(b)


add_into_first.__module__ = torch_impls.__name__  # printed as ttex.<name>
setattr(torch_impls, add_into_first.__name__, add_into_first)
add_into_first.aliases = (0,)  # the result is ``a``'s memory (executors/buffers.py)


def sums_in_place(trc, header="Final computation (sums written into their dead first operand)"):
    from .buffers import storage_sets  # a sibling pass's alias facts

    bsyms = list(trc.bound_symbols)
    may_alias, escaped = storage_sets(bsyms, trc.args)
    inputs = {id(a) for a in trc.args}
    kept = set().union(*(may_alias.get(id(p), set()) for p in tree_flatten(trc.output)[0] if type(p) is TensorProxy))
    last_read: dict = {}  # storage id -> last line reading a value that may share it
    for i, b in enumerate(bsyms):
        for a in b.flat_args():
            if type(a) is TensorProxy:
                for s in may_alias.get(id(a), ()):
                    last_read[s] = i
    changed = False
    for i, b in enumerate(bsyms):
        if getattr(b.sym, "fn", None) not in _ADDS or len(b.args) != 2 or b.kwargs:
            continue
        a, other, out = b.args[0], b.args[1], b.output
        if not all(type(v) is TensorProxy for v in (a, other, out)) or id(a) in inputs:
            continue
        if tuple(out._tt_shape) != tuple(a._tt_shape) or not (a._tt_rowmajor and out._tt_rowmajor):
            continue
        if not (a._tt_dtype is out._tt_dtype is other._tt_dtype):
            continue
        mine = may_alias.get(id(a), set())
        if not mine or mine & (inputs | escaped | kept | may_alias.get(id(other), set())):
            continue
        if any(last_read.get(s, -1) > i for s in mine):
            continue
        bsyms[i] = b.replace(sym=impl_symbol(add_into_first), comment="the sum written into its dead first operand")
        changed = True
    if not changed:
        return trc
    new = trc.derive(header)
    new.bound_symbols = bsyms
    return new
