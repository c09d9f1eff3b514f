"""Gradient sums of scattered gradients without extra arrays: a gradient scattered into zeros and then added to a
sum is scattered into the sum, and a ``scatter_add`` whose first operand dies there is written into it.

The backward sums the gradient contributions of a value read by several lines (``Cotangents.add`` in
transforms/autograd.py: ``add(prev, g)``).  In a mixture-of-experts layer whose experts are one stacked weight
(``experts.gate_up_proj[e]``, Mixtral in the zoo) every expert's contribution is the gradient of ``weight[e]``:
zeros of the stacked weight's size with ``g`` scattered in.  Out of place that is the zeros, the scattered copy, the
partial sum and the new sum alive together, where eager's ``select_backward`` writes into its zeros and autograd
adds them into one buffer: these sums were the step's peak.

``scatters_into_sums`` (before fusion, functional): see its docstring.  ``sums_in_place`` (after fusion, on the
final lines): ``scatter_add_`` is ``scatter_add``'s kernel without the copy of its first operand, so the values are
the same.  Only where the operand ``a`` is an intermediate of the program (not an input, not returned, not handed to
an op that may keep a reference), no later line reads its old value (itself or a value made before the line that
may share its memory), the result has ``a``'s shape, dtype and row-major layout, and the other tensor arguments
share no memory with it and (floating) have its dtype.  Plain ``add`` lines are left out of place: written into
their operand they lengthen the lives of the kept buffers' slots (executors/buffers.py), which raised BLOOM's and
Qwen2's zoo peaks.  Both run on whole steps with their backward (pipeline.py step 4).
"""
from __future__ import annotations

import torch

from ..proxies import TensorProxy
from . import torch_impls
from .torch_executor import impl_symbol


def scatter_add_into_first(a, dim, index, src):
    """``torch.scatter_add(a, dim, index, src)`` written into ``a``."""
    return a.scatter_add_(dim, index, src)


_INTO_FIRST = {torch.scatter_add: scatter_add_into_first, torch.Tensor.scatter_add: scatter_add_into_first}
for _fn in (scatter_add_into_first,):
    _fn.__module__ = torch_impls.__name__  # printed as ttex.<name>
    setattr(torch_impls, _fn.__name__, _fn)
    _fn.aliases = (0,)  # the result is the first argument's memory (executors/buffers.py)


def sums_in_place(trc, header="Final computation (scatter_add written into its dead first operand)"):
    from .buffers import overwritable  # a sibling pass's alias facts

    bsyms = list(trc.bound_symbols)
    if not any(_into_first(b) is not None for b in bsyms):
        return trc  # most programs: no scatter_add (the alias facts below cost 0.4 s on a 12-layer GPT's step)
    may_alias, off_limits = overwritable(trc, bsyms)
    made_at = {id(o): i for i, b in enumerate(bsyms) for o in b.flat_outputs() if type(o) is TensorProxy}
    reads: dict = {}  # storage id -> [(line, line that made the value it reads)] for the values that may share it
    for i, b in enumerate(bsyms):
        for a in b.flat_args():
            if type(a) is TensorProxy:
                for s in may_alias.get(id(a), ()):
                    reads.setdefault(s, []).append((i, made_at.get(id(a), -1)))
    changed = False
    for i, b in enumerate(bsyms):
        into = _into_first(b)
        if into is None:
            continue
        a, out = b.args[0], b.output
        others = [v for v in b.args[1:] if type(v) is TensorProxy]
        if type(a) is not TensorProxy or type(out) is not TensorProxy or id(a) in off_limits:
            continue
        if tuple(out._tt_shape) != tuple(a._tt_shape) or not (a._tt_rowmajor and out._tt_rowmajor):
            continue
        if a._tt_dtype is not out._tt_dtype or any(v._tt_dtype.is_float and v._tt_dtype is not a._tt_dtype for v in others):
            continue
        mine = may_alias.get(id(a), set())
        if not mine or mine & off_limits or any(mine & may_alias.get(id(v), set()) for v in others):
            continue
        # the old value is read later through a value made before this line (one made from its result is the result)
        if any(j > i and made < i for s in mine for j, made in reads.get(s, ())):
            continue
        bsyms[i] = b.replace(sym=impl_symbol(into), comment="written into its dead first operand")
        changed = True
    if not changed:
        return trc
    new = trc.derive(header)
    new.bound_symbols = bsyms
    return new


def _into_first(b):
    """The kernel writing the line's result into its first argument, for a call without keywords, or None."""
    try:
        into = _INTO_FIRST.get(getattr(b.sym, "fn", None))
    except TypeError:  # an unhashable callable
        return None
    return into if into is not None and not b.kwargs and len(b.args) >= 2 else None


def _is_zeros(b) -> bool:
    return getattr(b.sym, "fn", None) is torch.full and len(b.args) == 2 and b.args[1] == 0 and type(b.args[1]) in (int, float)


def scatters_into_sums(trc, header="Gradients scattered into zeros and added to a sum: scattered into the sum"):
    """``z = full(0); x = scatter_add(z, d, i, s); t = add(acc, x)`` becomes ``t = scatter_add(acc, d, i, s)`` when
    ``z`` and ``x`` are read there only, ``i`` has size 1 along ``d`` (each element of the result receives at most one
    element of ``s``: ``acc + (0 + s)`` is ``acc + s``, as eager's accumulation of ``select_backward``'s result) and
    the shapes and dtypes agree.  The zeros of the gradient of ``weight[e]`` are then never made: each expert's
    contribution is scattered into the running sum.  Functional (``sums_in_place`` decides later whether ``acc`` may
    be overwritten), so it runs before fusion, which would otherwise take the ``add`` into a region."""
    bsyms = trc.bound_symbols
    producer = {id(o): i for i, b in enumerate(bsyms) for o in b.flat_outputs() if type(o) is TensorProxy}
    n_reads: dict = {}
    for b in bsyms:
        for a in b.flat_args():
            if type(a) is TensorProxy:
                n_reads[id(a)] = n_reads.get(id(a), 0) + 1
    drop, new = set(), {}
    for i, b in enumerate(bsyms):
        if getattr(b.sym, "fn", None) not in (torch.add, torch.Tensor.add) or len(b.args) != 2 or b.kwargs:
            continue
        acc, x = b.args
        k = producer.get(id(x))
        if type(acc) is not TensorProxy or type(x) is not TensorProxy or k is None or n_reads.get(id(x)) != 1:
            continue
        sc = bsyms[k]
        if getattr(sc.sym, "fn", None) not in (torch.scatter_add, torch.Tensor.scatter_add) or len(sc.args) != 4 or sc.kwargs:
            continue
        z, d, index, src = sc.args
        kz = producer.get(id(z))
        if kz is None or not _is_zeros(bsyms[kz]) or n_reads.get(id(z)) != 1 or type(d) is not int:
            continue
        if type(index) is not TensorProxy or index._tt_shape[d] != 1:
            continue
        if not (tuple(acc._tt_shape) == tuple(x._tt_shape) == tuple(b.output._tt_shape)):
            continue
        if not (acc._tt_dtype is x._tt_dtype is b.output._tt_dtype is src._tt_dtype):
            continue
        new[i] = sc.replace(args=(acc, d, index, src), output=b.output, comment="scattered into the sum it was added to")
        drop.update((k, kz))
    if not new:
        return trc
    out = trc.derive(header)
    out.bound_symbols = [new.get(i, b) for i, b in enumerate(bsyms) if i not in drop]
    return out
