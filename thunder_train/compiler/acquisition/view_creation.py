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
    """``out`` (a view or a tuple of views of ``source``, made by ``sym``) keeps how eager marks it."""
    made = st.view_creation
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if not torch.is_grad_enabled():
        kind = ("no_grad", None, None)
    elif isinstance(out, (tuple, list)) and sym.name in _MULTI_OUTPUT:
        kind = ("multi", _MULTI_OUTPUT[sym.name], None)
    else:
        kind = made.get(id(source), (None, None, None, None, None))[1:4]  # a view of such a view is one too
        if kind[0] is None:
            return
    for i, o in enumerate(outs):
        if type(o) is TensorProxy and o is not source:
            made[id(o)] = (o, kind[0], kind[1], i if kind[0] == "multi" else kind[2], source)


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
