"""A computation that computes its own gradients runs without PyTorch autograd.

After ``loss.backward()`` inside the traced function, gradients are values of
the trace; PyTorch recording an autograd graph while the computation runs
(its inputs are parameters that require grad) would only cost time and
memory.  So the computation gets ``@torch.no_grad()``, and the
``prims.stop_gradient`` markers that ``torch.no_grad()`` regions left in the
trace — meaningful only to the autograd transform, which has already run —
are removed.
"""
from __future__ import annotations

from .. import prims
from ..pytree import tree_map


def without_autograd(trc, header="Gradients computed in the trace: no PyTorch autograd at runtime"):
    mapping: dict = {}
    new = trc.derive(header)
    for bsym in trc.bound_symbols:
        if bsym.sym is prims.stop_gradient:
            src = bsym.args[0]
            mapping[id(bsym.output)] = mapping.get(id(src), src)
            continue
        new.bound_symbols.append(bsym.renamed(mapping, inside=True) if mapping else bsym)
    new.output = tree_map(lambda x: mapping.get(id(x), x), trc.output)
    if "@torch.no_grad()" not in new.decorators:
        new.decorators.append("@torch.no_grad()")
    return new
