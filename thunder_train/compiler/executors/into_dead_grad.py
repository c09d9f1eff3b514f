"""GELU's backward writes its result into the incoming gradient when nothing reads that gradient afterwards.

``gelu_backward(g, x)`` is elementwise: each element of the result depends on the same element of ``g`` and ``x``,
so the kernel may write over ``g`` (the same memory, the same layout) and gives the values it gives into a new
array.  In an MLP's backward ``g`` (the gradient of the GELU's output) is ``(tokens, 4 d)``: writing over it keeps
one such array fewer alive (with activation checkpointing the block's recomputed pre-activation, ``g`` and the
result were the three largest values of the step's peak).  Only where ``g`` is an intermediate of the program
(not an input, not returned, not handed to an op that may keep a reference), row-major like the result, on the
CPU, and no later line reads it or a value that may share its memory.  Runs where the program asks for memory
(checkpoint regions or a budget), with the other memory rewrites (pipeline.py step 5a).
"""
from __future__ import annotations

import torch

from ..proxies import TensorProxy
from . import torch_impls
from .torch_executor import impl_symbol


def gelu_vjp_into_grad(g, reads, input, approximate="none"):
    """``torch_impls.gelu_vjp`` written over ``g`` (eager's ``gelu_backward`` kernel, elementwise)."""
    return (torch.ops.aten.gelu_backward.grad_input(g, input, approximate=approximate, grad_input=g),)


gelu_vjp_into_grad.__module__ = torch_impls.__name__  # printed as ttex.<name>
setattr(torch_impls, gelu_vjp_into_grad.__name__, gelu_vjp_into_grad)
gelu_vjp_into_grad.aliases = (0,)  # the result is ``g``'s memory (executors/buffers.py)


def gelu_grad_in_place(trc, header="Final computation (GELU's gradient written over its dead incoming gradient)"):
    from .buffers import overwritable  # a sibling pass's alias facts

    bsyms = list(trc.bound_symbols)
    may_alias, off_limits = overwritable(trc, bsyms)
    last_read: dict = {}  # storage id -> last line reading a value that may share it
    for i, b in enumerate(bsyms):
        for a in b.flat_args():
            if type(a) is TensorProxy:
                for s in may_alias.get(id(a), ()):
                    last_read[s] = i
    changed = False
    for i, b in enumerate(bsyms):
        if getattr(b.sym, "fn", None) is not torch_impls.gelu_vjp or len(b.args) < 3:
            continue
        g, out = b.args[0], b.output[0] if isinstance(b.output, (tuple, list)) and len(b.output) == 1 else None
        if type(g) is not TensorProxy or type(out) is not TensorProxy or id(g) in off_limits:
            continue
        if g._tt_device.type != "cpu" or not (g._tt_rowmajor and out._tt_rowmajor) or tuple(g._tt_shape) != tuple(out._tt_shape):
            continue
        if g._tt_dtype is not out._tt_dtype or b.args[2] is g:
            continue
        mine = may_alias.get(id(g), set())
        if not mine or mine & off_limits or any(last_read.get(s, -1) > i for s in mine):
            continue
        bsyms[i] = b.replace(sym=impl_symbol(gelu_vjp_into_grad), comment="GELU's gradient, written over its incoming gradient")
        changed = True
    if not changed:
        return trc
    new = trc.derive(header)
    new.bound_symbols = bsyms
    return new
