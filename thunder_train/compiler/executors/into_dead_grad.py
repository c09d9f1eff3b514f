"""GELU's backward writes its result into the incoming gradient when nothing reads that gradient afterwards; so does
a fused region computing it (or any region of pointwise ops), over a dead input laid out as its result.

``gelu_backward(g, x)`` is elementwise: each element of the result depends on the same element of ``g`` and ``x``,
so the kernel may write over ``g`` (the same memory, the same layout) and gives the values it gives into a new
array.  In an MLP's backward ``g`` (the gradient of the GELU's output) is ``(tokens, 4 d)``: writing over it keeps
one such array fewer alive (with activation checkpointing the block's recomputed pre-activation, ``g`` and the
result were the three largest values of the step's peak).  Only where ``g`` is an intermediate of the program
(not an input, not returned, not handed to an op that may keep a reference), row-major like the result, on the
CPU, and no later line reads it or a value that may share its memory.  Runs where the program asks for memory
(checkpoint regions or a budget), with the other memory rewrites (pipeline.py step 5a).

In the fused program (``fusion="background"``'s, the default's) Inductor takes that line into a region, whose kernel
wrote into a new buffer: with checkpointing the GPT step's peak (the last block's MLP backward) was 4 MiB above the
torch program's.  ``regions_into_dead_inputs`` gives such a region one of its inputs as its output buffer, under the
same conditions, when every ATen op the region runs is pointwise (``torch.Tag.pointwise``, asked on meta tensors) and
the input has the result's shape and strides: each element of the result then depends on the same element of the
input alone, which a kernel reads before writing it (Inductor itself reuses a pointwise input's buffer so).  The
values are the kernel's either way.
"""
from __future__ import annotations

import torch

from torch.utils._python_dispatch import TorchDispatchMode

from ..dense import dense_layout
from ..proxies import TensorProxy, meta_tensor
from ..pytree import tree_map
from . import torch_impls
from .regions import FusionSymbol, fusion_form
from .torch_executor import impl_symbol


def gelu_vjp_into_grad(g, reads, input, approximate="none"):
    """``torch_impls.gelu_vjp`` written over ``g`` (eager's ``gelu_backward`` kernel, elementwise)."""
    return (torch.ops.aten.gelu_backward.grad_input(g, input, approximate=approximate, grad_input=g),)


gelu_vjp_into_grad.__module__ = torch_impls.__name__  # printed as ttex.<name>
setattr(torch_impls, gelu_vjp_into_grad.__name__, gelu_vjp_into_grad)
gelu_vjp_into_grad.aliases = (0,)  # the result is ``g``'s memory (executors/buffers.py)


def _dead_after(trc, bsyms):
    """``dead(g, i)``: whether line ``i`` may write over ``g``: an intermediate of the program (not an input, not
    returned, not handed to a line that may keep a reference) whose memory no later line reads."""
    from .buffers import overwritable  # a sibling pass's alias facts

    may_alias, off_limits = overwritable(trc, bsyms)
    last_read: dict = {}  # storage id -> last line reading a value that may share it
    for i, b in enumerate(bsyms):
        for a in b.flat_args():
            if type(a) is TensorProxy:
                for s in may_alias.get(id(a), ()):
                    last_read[s] = i

    def dead(g, i) -> bool:
        mine = may_alias.get(id(g), set())
        return (id(g) not in off_limits and bool(mine) and not mine & off_limits
                and not any(last_read.get(s, -1) > i for s in mine))

    return dead


def gelu_grad_in_place(trc, header="Final computation (GELU's gradient written over its dead incoming gradient)"):
    bsyms = list(trc.bound_symbols)
    dead = _dead_after(trc, bsyms)
    changed = False
    for i, b in enumerate(bsyms):
        if getattr(b.sym, "fn", None) is not torch_impls.gelu_vjp or len(b.args) < 3:
            continue
        g, out = b.args[0], b.output[0] if isinstance(b.output, (tuple, list)) and len(b.output) == 1 else None
        if type(g) is not TensorProxy or type(out) is not TensorProxy:
            continue
        if g._tt_device.type != "cpu" or not (g._tt_rowmajor and out._tt_rowmajor) or tuple(g._tt_shape) != tuple(out._tt_shape):
            continue
        if g._tt_dtype is not out._tt_dtype or b.args[2] is g:
            continue
        if not dead(g, i):
            continue
        bsyms[i] = b.replace(sym=impl_symbol(gelu_vjp_into_grad), comment="GELU's gradient, written over its incoming gradient")
        changed = True
    if not changed:
        return trc
    new = trc.derive(header)
    new.bound_symbols = bsyms
    return new


class _AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _pointwise(region_lines) -> bool:
    """Whether every ATen op the region's lines run (their fusion forms, as the kernel computes them) is pointwise,
    asked on meta tensors of the lines' layouts."""
    rec = _AtenOps()
    to_meta = lambda x: meta_tensor(x) if type(x) is TensorProxy else x  # noqa: E731
    try:
        for b in region_lines:
            fn, args, kwargs = fusion_form(b) or b.sym.fn, tree_map(to_meta, b.args), tree_map(to_meta, b.kwargs)
            with rec:
                fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a line that does not run on meta tensors: not known to be pointwise
        return False
    return bool(rec.ops) and all(torch.Tag.pointwise in op.tags for op in rec.ops)


def _computing(region_lines, out) -> list:
    """The region's lines ``out`` is computed from (not the views of it the region hands out too)."""
    wanted, lines = {id(out)}, []
    for b in reversed(region_lines):
        if any(id(o) in wanted for o in b.flat_outputs()):
            lines.append(b)
            wanted |= {id(a) for a in b.flat_args() if type(a) is TensorProxy}
    return lines[::-1]


def _same_memory_layout(g, out) -> bool:
    return (g._tt_device.type == "cpu" and g._tt_dtype is out._tt_dtype and tuple(g._tt_shape) == tuple(out._tt_shape)
            and tuple(g._tt_strides) == tuple(out._tt_strides) and g._tt_storage_offset == 0
            and all(type(n) is int for n in g._tt_shape) and dense_layout(g._tt_shape, g._tt_strides))


def _into_input(runner, k: int):
    """The region's call writing its one result over its ``k``-th argument (its out form with that buffer)."""
    def run(*args):
        return runner.out(*args, out=args[k])

    run.aliases = (k,)  # the result is argument k's memory (executors/buffers.py)
    run.fallbacks = runner.fallbacks  # compile_stats' count of calls that ran the region's torch ops
    return run


def regions_into_dead_inputs(trc, header="Final computation (fused regions written over a dead input)"):
    """Each fused region of pointwise ops with one result is given, as its output buffer, an input that dies there
    and has the result's layout (module docstring)."""
    bsyms = list(trc.bound_symbols)
    dead = _dead_after(trc, bsyms)
    changed = False
    for i, b in enumerate(bsyms):
        runner = getattr(b.sym, "runner", None)
        if not isinstance(b.sym, FusionSymbol) or b.sym.into or getattr(runner, "out", None) is None:
            continue
        out = b.output
        if type(out) is not TensorProxy:
            continue
        k = next((k for k, g in enumerate(b.args) if type(g) is TensorProxy and g is not out
                  and _same_memory_layout(g, out) and dead(g, i)), None)
        if k is None or not _pointwise(_computing(b.subsymbols, out)):
            continue
        sym = FusionSymbol(b.sym.name, _into_input(runner, k), owner=b.sym.owner)
        bsyms[i] = b.replace(sym=sym, comment=f"{b.comment}; written over its dead input {b.args[k].name}")
        changed = True
    if not changed:
        return trc
    new = trc.derive(header)
    new.bound_symbols = bsyms
    return new
