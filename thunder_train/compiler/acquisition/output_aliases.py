"""Returned tensors that share memory with an input, as eager's do.

The program is functional: ``x.add_(1); return x[0]`` computes the new ``x`` as a fresh value, returns a row of
it, and copies the new value into ``x`` at the end.  Eager's row is a view of ``x``: a later
``row.add_(100)`` by the caller changes ``x``, and the compiled row did not (a silently different result).  The
same holds for ``p.detach()`` or ``p.data.t()`` after an update of ``p``, and for ``v`` after ``p.data = v``
(``data_assignment.py``: ``v`` is ``p``'s memory afterwards).  And an input returned as it is must be that
object: through the autograd node a returned parameter came back as a view of it.

Here each such result is rebuilt by the epilogue from the real input after the write-backs:

* an input returned itself: the input object;
* a view of an input the program writes (its base, in ``Buffers``), not requiring grad: ``base.as_strided`` with
  the traced layout (the offset taken relative to the base's own), or, for a tensor with a version counter of its
  own (``t.data``, ``v`` after ``t.data = v``), a tensor set to the base's storage at that layout.

A view that requires grad is left as the program's value (it comes out of the autograd node); a view in another
dtype or with sizes that vary between calls (``dynamic``), other than the whole input, is refused with what to do.
A view of an input the program does not write is already a view of it (the program computes it from the input).
A view whose traced layout is not eager's view of the input (``w[e]`` at a 0-d index, an opaque op's view such as
``x.t().diagonal(1)``, whose layout is read from the computed ``x.t()``) is left as the program's value: its values
are eager's, but it does not share the input's memory (rebuilt from the traced layout it would address other
elements).
"""
from __future__ import annotations

import torch

from ..proxies import TensorProxy
from ..errors import TracingError
from ..pytree import tree_flatten, tree_unflatten
from .python_effects import needs_grad


def rebuild_lines(st, out, names) -> list:
    """``(flat index, expression)`` for each result of ``out`` (the traced function's result) that is an input or
    a view sharing the memory of an input the program writes; ``names(obj, hint, leaf)`` names a call's object."""
    buffers, walker = st.buffers, st.walker
    written = {id(dst) for _, dst in buffers.final_writes(walker.input_proxies())}
    exprs = []
    for i, o in enumerate(tree_flatten(out)[0]):
        if type(o) is not TensorProxy:
            continue
        leaf = walker.leaf_of(o)
        if leaf is not None:
            if leaf.kind == "tensor":
                exprs.append((i, names(leaf.value, o._tt_name, leaf)))
            continue
        base = buffers.base_of(o)
        if base is None or id(base) not in written or id(base) in st.metadata_inputs or needs_grad(st, [o])[0]:
            continue
        if not buffers.layout_is_traced(o):  # traced layout not eager's: see the module docstring
            continue
        bleaf = walker.leaf_of(base)
        if bleaf is None or bleaf.kind != "tensor":
            continue
        own = buffers.counter_of(o) is o  # t.data, or v after t.data = v: eager's has a version counter of its own
        fn = names(_same_memory if own else _view, "same_memory" if own else "view_of")
        real = names(bleaf.value, base._tt_name, bleaf)
        whole = (o._tt_dtype is base._tt_dtype and tuple(o._tt_shape) == tuple(base._tt_shape)
                 and tuple(o._tt_strides) == tuple(base._tt_strides) and o._tt_storage_offset == base._tt_storage_offset)
        if whole:  # the whole input (detach(), .data, v after t.data = v): its layout read when the call runs
            exprs.append((i, f"{fn}({real}, None, None, 0)"))
            continue
        layout = (*o._tt_shape, *o._tt_strides, o._tt_storage_offset, base._tt_storage_offset)
        if o._tt_dtype is not base._tt_dtype or not all(type(n) is int for n in layout):
            raise TracingError(
                f"the compiled function returns a view of {bleaf.where} (in another dtype, or with sizes that vary "
                f"between calls) after updating {bleaf.where} in place: eager's result shares {bleaf.where}'s memory, "
                "so a later in-place write to it changes the input, which the compiled result would not follow. Return "
                "a copy (.clone()), or compile with dynamic=False.")
        exprs.append((i, f"{fn}({real}, {tuple(o._tt_shape)!r}, {tuple(o._tt_strides)!r}, "
                         f"{o._tt_storage_offset - base._tt_storage_offset})"))
    return exprs


def _view(base, shape, strides, offset):
    """A view of ``base`` that does not require grad (sharing its version counter, as eager's views and
    ``detach()`` do); ``shape`` None: the whole of it."""
    if shape is None:
        return base.detach()  # eager's detach() is no view (``_is_view()``) either
    return base.detach().as_strided(shape, strides, base.storage_offset() + offset)


def _same_memory(base, shape, strides, offset):
    """A tensor on ``base``'s memory with a version counter of its own (eager's ``t.data``); ``shape`` None: the
    whole of it."""
    if shape is None:
        shape, strides = base.shape, base.stride()
    with torch.no_grad():
        return torch.empty(0, dtype=base.dtype, device=base.device).set_(
            base.untyped_storage(), base.storage_offset() + offset, shape, strides)


def replace_results(result, replacements: dict):
    """``result`` with its flat items at the keys of ``replacements`` replaced by the values."""
    leaves, spec = tree_flatten(result)
    for i, v in replacements.items():
        leaves[i] = v
    return tree_unflatten(leaves, spec)
