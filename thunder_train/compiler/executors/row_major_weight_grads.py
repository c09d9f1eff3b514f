"""A weight used transposed gets its gradient as eager makes it: row-major, one matmul, no views (torch executor).

A weight read as ``x @ W.T`` (Falcon's linear layers) is the second operand of ``mm`` as a column-major matrix.
Eager's backward of ``mm`` computes the gradient of such an operand transposed (``gᵀ x``, row-major) and transposes
it; the gradient of ``W`` transposes it back: ``W.grad`` is ``gᵀ x`` itself.  The gradient rule does the same
(``prims/linalg.py`` ``matmul_vjp``: eager's sums, bitwise), which leaves two transposes on the product::

    c = matmul(gT, x)           # 2-d, read by the next line only
    d = permute(c, (1, 0))      # the operand's gradient, read by the next line only
    e = permute(d, (1, 0))      # W's gradient: c's memory, sizes and strides

Every reader of ``e`` reads ``c`` instead and the two lines go.  identity_views.py drops such chains too, but not
where the result is returned (its identity is the user's): here it is ``.grad``, and eager's is no view either.
Before the rule followed eager, the program made ``(xᵀ g)ᵀ`` and copied it into the weight's layout
(``grad_copy``): other bits on a 3-d activation, and eight copies a step on Falcon (~12 % of its fused step).
"""
from __future__ import annotations

import torch

from ..proxies import TensorProxy, is_proxy
from ..pytree import tree_flatten, tree_map
from .torch_executor import ImplSymbol


def _fn(b):
    return b.sym.fn if isinstance(b.sym, ImplSymbol) else None


def _from_a_rule(b) -> bool:
    """A line a gradient rule made (its source a prim), not a call of the user's, whose result keeps eager's identity."""
    return getattr(b.source, "module", None) == "prims"


def _is_transpose(b) -> bool:
    return _fn(b) is torch.permute and tuple(b.args[1]) == (1, 0) and not b.kwargs and _from_a_rule(b)


def row_major_weight_grads(trc, header=None):
    """The trace with each product transposed twice read as the product (see the module docstring)."""
    bsyms = list(trc.bound_symbols)
    made, reads = {}, {}
    for i, b in enumerate(bsyms):
        for o in b.flat_outputs():
            made[id(o)] = i
        for a in b.flat_args():
            if is_proxy(a):
                reads[id(a)] = reads.get(id(a), 0) + 1
    for p in tree_flatten(trc.output)[0]:
        if is_proxy(p):
            reads[id(p)] = reads.get(id(p), 0) + 1
    mapping, drop = {}, set()
    for i, e_line in enumerate(bsyms):
        if not _is_transpose(e_line) or type(e_line.output) is not TensorProxy:
            continue
        d = e_line.args[0]
        di = made.get(id(d))
        if di is None or not _is_transpose(bsyms[di]) or reads.get(id(d)) != 1:
            continue
        c = bsyms[di].args[0]
        ci = made.get(id(c))
        if ci is None or _fn(bsyms[ci]) is not torch.matmul or not _from_a_rule(bsyms[ci]) or reads.get(id(c)) != 1 \
                or type(c) is not TensorProxy \
                or tuple(c._tt_strides) != tuple(e_line.output._tt_strides):
            continue
        mapping[id(e_line.output)] = c
        drop.update((di, i))
    if not mapping:
        return trc
    out = trc.derive(header or trc.header)
    out.bound_symbols = [b.renamed(mapping) for j, b in enumerate(bsyms) if j not in drop]
    out.output = tree_map(lambda x: mapping.get(id(x), x) if is_proxy(x) else x, trc.output)
    return out
