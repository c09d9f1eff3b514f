"""A weight used transposed gets its gradient computed in its own layout, as eager computes it (torch executor).

A weight read as ``x @ W.T`` (Falcon's linear layers) is the second operand of a matmul as a column-major matrix.
The gradient rule gives ``(xᵀ g)ᵀ``: a row-major product transposed, column-major, which the program copied into
the parameter's row-major layout (``ttex.grad_copy``).  Eager's backward of ``mm`` looks at that operand's layout
(``MmBackward0`` keeps its strides) and, for a column-major one, computes ``gᵀ x`` instead: the same matrix,
row-major, one matmul, no copy.  Its sums run in another order than ``xᵀ g``'s, so the copied program was not
eager's bits (a 3-d activation's step differed in the last bit) and cost Falcon eight copies a step (its fused step
ran ~12 % faster without them).  Here the program computes what eager computes, in both programs.

The pattern, on the final trace once the layouts are decided (executors/decided_layouts.py made ``grad_copy``)::

    aT = permute(a, (1, 0))       # optional: otherwise aᵀ is taken in the new line
    c = matmul(aT, b)             # 2-d, read by the next line only
    d = permute(c, (1, 0))        # read by the copy only
    w_grad = grad_copy(d, shape, row-major strides)

becomes ``bT = permute(b, (1, 0)); w_grad = matmul(bT, a)`` where ``c`` stood (eager's ``grad.t().mm(mat1)``).
"""
from __future__ import annotations

import torch

from ..proxies import TensorProxy, is_proxy
from ..pytree import tree_flatten
from . import torch_impls
from .torch_executor import ImplSymbol


def _fn(b):
    return b.sym.fn if isinstance(b.sym, ImplSymbol) else None


def _is_transpose(b) -> bool:
    return _fn(b) is torch.permute and tuple(b.args[1]) == (1, 0) and not b.kwargs


def _matrix(p) -> bool:
    return type(p) is TensorProxy and p.ndim_ == 2 and all(type(n) is int for n in p._tt_shape)


def _transposed(trc, p):
    """A proxy for ``p``'s transpose (a view: its strides swapped)."""
    s = tuple(p._tt_strides)
    return TensorProxy(trc.make_name("wt"), shape=tuple(reversed(p._tt_shape)), dtype=p._tt_dtype, device=p._tt_device,
                       strides=(s[1], s[0]))


def row_major_weight_grads(trc, header=None):
    """The trace with each transposed weight gradient computed row-major (see the module docstring)."""
    bsyms = list(trc.bound_symbols)
    made = {}  # id(value) -> index of the line that made it
    reads: dict = {}
    for i, b in enumerate(bsyms):
        for o in b.flat_outputs():
            made[id(o)] = i
        for a in b.flat_args():
            if is_proxy(a):
                reads[id(a)] = reads.get(id(a), 0) + 1
    for p in tree_flatten(trc.output)[0]:
        if is_proxy(p):
            reads[id(p)] = reads.get(id(p), 0) + 1
    only_read_once = lambda p: reads.get(id(p), 0) == 1  # noqa: E731
    replace, drop = {}, set()
    for i, b in enumerate(bsyms):
        if _fn(b) is not torch_impls.grad_copy or not _matrix(b.output):
            continue
        d, shape, strides = b.args
        rows, cols = shape
        if tuple(strides) != (cols, 1) or tuple(b.output._tt_strides) != (cols, 1) or not only_read_once(d):
            continue
        di = made.get(id(d))
        if di is None or not _is_transpose(bsyms[di]) or not only_read_once(bsyms[di].args[0]):
            continue
        ci = made.get(id(bsyms[di].args[0]))
        c_line = bsyms[ci] if ci is not None else None
        if c_line is None or _fn(c_line) is not torch.matmul or c_line.kwargs or len(c_line.args) != 2:
            continue
        a_t, rhs = c_line.args
        if not (_matrix(a_t) and _matrix(rhs)) or a_t._tt_dtype is not rhs._tt_dtype:
            continue
        ai = made.get(id(a_t))
        folded = ai is not None and _is_transpose(bsyms[ai]) and only_read_once(a_t)
        new = []
        if folded:
            a = bsyms[ai].args[0]
            drop.add(ai)
        else:
            a = _transposed(trc, a_t)
            new.append(bsyms[di].replace(args=(a_t, (1, 0)), output=a, comment=None))
        rhs_t = _transposed(trc, rhs)
        new.append(bsyms[di].replace(args=(rhs, (1, 0)), output=rhs_t, comment=None))
        new.append(c_line.replace(args=(rhs_t, a), output=b.output,
                                  comment="the transposed weight's gradient row-major, as eager makes it (gᵀ x, no copy)"))
        replace[ci] = new
        drop.update((di, i))
    if not replace:
        return trc
    out = trc.derive(header or trc.header)
    out.bound_symbols = [x for j, b in enumerate(bsyms) if j not in drop for x in replace.get(j, (b,))]
    return out
