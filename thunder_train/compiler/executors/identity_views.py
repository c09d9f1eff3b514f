"""View lines that give back the tensor their chain of views started from: dropped, their readers read that tensor.

A chain of views can end where it began: the backward of ``x @ w.T`` reads ``w`` as ``permute(permute(w))``, a
flattened gradient is reshaped back (``reshape(reshape(g, (2, 12, 64)), (24, 64))``), attention's output is
reshaped to its own shape.  Each such line costs a Python call and a dispatch per step for a tensor with the same
memory, sizes, strides, storage offset and dtype as the chain's start, which is therefore the same value for every
reader that only reads or writes its elements: the start is read instead.

Layouts are replayed on meta tensors from the traced layouts (eager's, checked for inputs by the prologue and the
thin checks; decided_layouts.py says why they hold), so a ``reshape`` that copies ends a chain.  Not dropped: a line
whose result is returned (its identity is the user's), read by a fused region or by a call that changes a tensor's
metadata in place (``resize_``, ``as_strided_``, ``t_``...), or with symbolic sizes.
"""
from __future__ import annotations

import torch

from ..proxies import TensorProxy, is_proxy, meta_tensor
from ..pytree import tree_flatten, tree_map
from .buffers import VIEW_FNS, plain_arg
from .torch_executor import ImplSymbol

# In-place calls that change a tensor's sizes, strides or storage rather than its elements.
_METADATA_WRITES = frozenset({"resize_", "resize_as_", "set_", "as_strided_", "t_", "transpose_", "squeeze_",
                              "unsqueeze_", "swapdims_", "swapaxes_", "detach_", "requires_grad_", "share_memory_"})


def _laid_out(p) -> bool:
    return (type(p) is TensorProxy and all(type(n) is int for n in p._tt_shape)
            and all(type(s) is int for s in p._tt_strides) and type(p._tt_storage_offset) is int)


def _view_fn(b):
    fn = b.sym.fn if isinstance(b.sym, ImplSymbol) else None
    try:
        return fn if fn in VIEW_FNS else None
    except TypeError:  # an unhashable callable
        return None


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset())


def _untouchable(trc) -> set:
    """ids of values a dropped view must not stand for or be replaced by: returned values, fused regions' operands,
    operands of calls that change metadata in place."""
    out = {id(o) for o in tree_flatten(trc.output)[0] if is_proxy(o)}
    for b in trc.bound_symbols:
        name = getattr(getattr(b.sym, "fn", None), "__name__", "")
        if not isinstance(b.sym, ImplSymbol) or name in _METADATA_WRITES:
            out.update(id(a) for a in b.flat_args() if is_proxy(a))
    return out


def drop_identity_views(trc, header=None):
    """The trace without its identity view lines (see the module docstring)."""
    untouchable = None
    start: dict = {}   # id(view result) -> the tensor its chain of views started from
    metas: dict = {}   # id(proxy) -> its meta tensor (a view result's: the replayed view of its start's)
    mapping: dict = {}  # id(dropped view result) -> its start
    new = trc.derive(header or trc.header)
    changed = False
    for b in trc.bound_symbols:
        if mapping:
            b = b.renamed(mapping)
        fn = _view_fn(b)
        x, out = (b.args[0] if b.args else None), b.output
        if (fn is None or type(out) is not TensorProxy or not _laid_out(x) or not _laid_out(out)
                or not plain_arg(b.args[1:]) or not plain_arg(tuple(b.kwargs.values()))):
            new.bound_symbols.append(b)
            continue
        root = start.get(id(x), x)
        if id(root) not in metas:
            metas[id(root)] = meta_tensor(root)
        base = metas[id(x)] if id(x) in metas else metas.setdefault(id(x), meta_tensor(x))
        try:
            with torch.no_grad():
                m = fn(base, *b.args[1:], **b.kwargs)
        except Exception:  # noqa: BLE001 - not a call this rule understands: the line stays
            m = None
        if type(m) is not torch.Tensor or not m._is_view() or tuple(m.shape) != tuple(out._tt_shape):
            new.bound_symbols.append(b)
            continue
        start[id(out)], metas[id(out)] = root, m
        if _same_layout(m, metas[id(root)]):
            untouchable = _untouchable(trc) if untouchable is None else untouchable
            if id(out) not in untouchable and id(root) not in untouchable:
                mapping[id(out)] = root
                changed = True
                continue
        new.bound_symbols.append(b)
    if not changed:
        return trc
    new.output = tree_map(lambda x: mapping.get(id(x), x) if is_proxy(x) else x, trc.output)
    return new
