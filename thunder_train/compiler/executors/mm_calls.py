"""A matmul of two matrices called as ``torch.mm``: the kernel ``torch.matmul`` would run, without its dispatch.

``torch.matmul`` is a composite op: for two 2-d tensors it checks the ranks and calls ``mm`` (``mm.out`` with
``out=``).  Without ``out=`` that costs ~1.8 us a call on small matrices (12x32 @ 32x64, one thread: 4.5 against
2.6 us); a zoo transformer's program has 4-25 such lines a step (gradient products the kept buffers do not hold,
the attention's projections in the backward).  The kernel is the same, so are the bits, and so is the autograd node
(``MmBackward0``) where a program runs with grad.  Lines of other ranks keep ``torch.matmul`` (its folding of a
batch into rows, and its broadcasting, are its own).
"""
from __future__ import annotations

import torch

from ..proxies import TensorProxy
from .torch_executor import impl_symbol, ImplSymbol


# The user's ``x @ w`` is called as the method; the gradient rules' products as the function.
_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)


def _matrix(p) -> bool:
    return type(p) is TensorProxy and p.ndim_ == 2


def matmuls_as_mm(trc):
    """The trace with each matmul line of two matrices calling ``torch.mm`` (see the docstring)."""
    lines, changed = [], False
    for b in trc.bound_symbols:
        if (type(b.sym) is ImplSymbol and any(b.sym.fn is f for f in _MATMULS) and len(b.args) == 2 and set(b.kwargs) <= {"out"}
                and _matrix(b.args[0]) and _matrix(b.args[1])):
            b = b.replace(sym=impl_symbol(torch.mm, side_effect="side_effect" in b.sym.tags))
            changed = True
        lines.append(b)
    return trc.with_lines(lines) if changed else trc
