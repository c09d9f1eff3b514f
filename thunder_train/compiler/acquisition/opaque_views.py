"""Ops run opaquely whose eager result is a view of their first argument (``diagonal``, ``unfold``,
``as_strided``, ...): the view relation is recorded, so an in-place update through the view reaches the
base and a read of the view after the base changed sees the change, as in eager.

Which results are views is read from running the op on meta tensors (torch's own rule: the meta result's
``_base``).  An ``as_strided`` view addresses its base's storage, which a functionalized base does not
keep unless it is row-major; updates through such a view of any other base are refused.
"""
from __future__ import annotations

import torch

from ..errors import TracingError
from ..opaque import run_on_meta
from ..proxies import TensorProxy, size_value
from ..pytree import tree_flatten, tree_map

_STORAGE_VIEWS = {"as_strided"}


def _meta(x):
    if type(x) is TensorProxy:
        return torch.empty_strided(tuple(size_value(s) for s in x._tt_shape), tuple(int(s) for s in x._tt_strides),
                                   dtype=x._tt_dtype.torch, device="meta")
    return x


def view_outputs(func, args, kwargs) -> list:
    """``(position, meta result)`` (in the flattened output) of the results that are views of ``args[0]``: the meta
    result has eager's layout relative to ``args[0]``'s memory (storage offset relative to its own)."""
    return eager_view_outputs(func, args, kwargs) or []


def eager_view_outputs(func, args, kwargs) -> list | None:
    """``view_outputs``, or None where torch's meta rule gives no answer."""
    try:
        margs, mkwargs = tree_map(_meta, (args, kwargs))
        out = run_on_meta(func, margs, mkwargs)
    except Exception:  # noqa: BLE001 - no meta answer (an opaque op's result is then taken as fresh)
        return None
    base = margs[0]
    return [(i, o) for i, o in enumerate(tree_flatten(out)[0]) if isinstance(o, torch.Tensor) and _is_view_of(o, base)]


def _is_view_of(o, base) -> bool:
    """Whether eager's ``o`` shares ``base``'s memory: a view (``_base``), or a tensor on the same storage that torch
    does not mark as a view (``x.view(torch.int32)``)."""
    if o._is_view() and (o._base is base or o._base is base._base and base._base is not None):
        return True
    return o is not base and o.untyped_storage()._cdata == base.untyped_storage()._cdata


def record_opaque_views(st, func, orig_args, args, kwargs, out, run_opaque):
    source = orig_args[0] if orig_args else None
    if type(source) is not TensorProxy:
        return
    positions = view_outputs(func, args, kwargs)
    if not positions:
        return
    name = getattr(func, "__name__", "op")
    storage = name in _STORAGE_VIEWS and not args[0]._tt_rowmajor
    flat = tree_flatten(out)[0]
    for i, meta in positions:
        def make(v, i=i):
            if storage:
                raise TracingError(
                    f"{name} of a tensor that is not row-major, then updated in place (through the view or its base): "
                    "thunder_train cannot express that storage aliasing. Make the tensor contiguous first, or use "
                    "out-of-place operations.")
            return tree_flatten(run_opaque(func, (v,) + tuple(args[1:]), kwargs))[0][i]

        # view_as_real of a complex tensor: the whole tensor as floats, written back as view_as_complex
        # (complex parameters under torch.optim, which updates them through this view)
        unmake = None
        if func is torch.view_as_real and len(flat) == 1:
            unmake = lambda v: run_opaque(torch.view_as_complex, (v.contiguous(),), {})  # noqa: E731
        # The traced result's layout comes from the op run on the value the program holds (x.t() computed, not
        # x's memory seen through it), so it can differ from eager's view of the input (x.t().diagonal(1): offset 1
        # against eager's 4): such a view is written back by positions, and returned as eager's calls replayed on
        # the input (output_aliases), never from its traced layout, which would address other elements.
        steps = ((func, tuple(args[1:]), dict(kwargs)),) + (() if isinstance(out, torch.Tensor) else ((flat_item, (i,), {}),))
        st.buffers.add_view(flat[i], source, make, unmake, by_positions=not _layout_is_eagers(flat[i], source, meta),
                            steps=steps)


def _layout_is_eagers(view, source, meta) -> bool:
    if type(view) is not TensorProxy:
        return False
    layout = (*view._tt_strides, view._tt_storage_offset, source._tt_storage_offset)
    if not all(type(n) is int for n in layout):
        return False
    return (tuple(view._tt_strides) == tuple(meta.stride())
            and view._tt_storage_offset - source._tt_storage_offset == meta.storage_offset())


def flat_item(out, i):
    """The ``i``-th tensor of an op's result (flattened)."""
    return tree_flatten(out)[0][i]
