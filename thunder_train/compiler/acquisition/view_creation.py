"""Views eager forbids writing into in place: the outputs of a function that returns several views, and views made
under ``torch.no_grad()``.

Eager's autograd records how each view was made (c10's creation meta).  An in-place op in grad mode whose result
requires grad raises there on a view made by ``unbind`` / ``split`` / ``chunk`` / ``split_with_sizes`` (iterating a
tensor is ``unbind``), or on a view made while grad mode was off, and on every view made from such a view
(``unsafe_split``, ``tensor_split``, ``hsplit`` and the like make ordinary views).  The functional form the tracer
records has no such rule, so without this the compiled function ran what eager refuses.  ``record`` notes the kind
when ``inplace.record_views`` records the view; ``check_write`` raises as eager does, before anything is written.
"""
from __future__ import annotations

import torch

from ..proxies import TensorProxy

# The torch-language ops whose eager call returns several views that autograd marks as one multi-output node.
_MULTI_OUTPUT = {"split": "Split", "chunk": "Split", "unbind": "Unbind"}


def record(st, sym, source, out) -> None:
    """``out`` (a view or a tuple of views of ``source``, made by ``sym``) keeps how eager marks it, with the tensor
    whose ``requires_grad`` the view's follows (eager's view of a view is a view of the first one's base)."""
    made = st.view_creation
    outs = out if isinstance(out, (tuple, list)) else (out,)
    parent = made.get(id(source))
    parent = parent if parent is not None and parent[0] is source else None
    if not torch.is_grad_enabled():
        marks = [("no_grad", None, None, source)] * len(outs)
    elif isinstance(out, (tuple, list)) and sym.name in _MULTI_OUTPUT:
        marks = [("multi", _MULTI_OUTPUT[sym.name], i, source) for i in range(len(outs))]
    elif parent is not None:  # a view of such a view is one too
        marks = [parent[1:]] * len(outs)
    else:
        return
    for o, mark in zip(outs, marks):
        if type(o) is TensorProxy and o is not source:
            made[id(o)] = (o, *mark)


def carry(st, view, detached) -> None:
    """``detached`` stands for ``view`` (made under no_grad: ``inplace.no_grad_region``): it is marked as ``view`` is."""
    found = st.view_creation.get(id(view))
    if found is not None and found[0] is view:
        st.view_creation[id(detached)] = (detached,) + found[1:]


def check_write(st, dst, requires_grad, args) -> None:
    """Raise as eager does for an in-place op on ``dst`` (with tensor arguments ``args``) in grad mode whose result
    requires grad (``requires_grad(proxy)``): eager's view of a tensor that requires grad requires grad, also one
    made under no_grad."""
    found = st.view_creation.get(id(dst))
    if found is None or found[0] is not dst or not torch.is_grad_enabled():
        return
    _, kind, node, index, source = found
    if not (requires_grad(dst) or requires_grad(source) or any(requires_grad(a) for a in args)):
        return
    if kind == "multi":
        raise RuntimeError(
            f"Output {index} of {node} is a view and is being modified inplace. This view is the output of a function "
            "that returns multiple views (unbind, split, chunk, iterating over a tensor), which eager PyTorch's "
            "autograd does not allow to be modified inplace; eager PyTorch raises this error too. Replace the inplace "
            "operation by an out-of-place one, or use unsafe_split/unsafe_chunk.")
    raise RuntimeError(
        "A view was created in no_grad mode and is being modified inplace with grad mode enabled; eager PyTorch "
        "raises this error too. Make the view and the inplace operation both inside the no_grad block (if the "
        "inplace operation should not be tracked) or both outside it.")
