"""View lines that give back the tensor their chain of views started from: dropped, their readers read that tensor;
a reshape of a reshape read by nothing else: one reshape.

A chain of views can end where it began: the backward of ``x @ w.T`` reads ``w`` as ``permute(permute(w))``, a
flattened gradient is reshaped back (``reshape(reshape(g, (2, 12, 64)), (24, 64))``), attention's output is
reshaped to its own shape.  Each such line costs a Python call and a dispatch per step for a tensor with the same
memory, sizes, strides, storage offset and dtype as the chain's start, which is therefore the same value for every
reader that only reads or writes its elements: the start is read instead.

Layouts are replayed on meta tensors from the traced layouts (eager's, checked for inputs by the prologue and the
thin checks; decided_layouts.py says why they hold), so a ``reshape`` that copies ends a chain.  Not dropped: a line
whose result is returned (its identity is the user's), read by a fused region or by a call that changes a tensor's
metadata in place (``resize_``, ``as_strided_``, ``t_``...), or with symbolic sizes.

A gradient is often reshaped twice in a row (``reshape(reshape(g, (2, 12, 16)), (24, 16))``: one rule's reshape back
to the activation's shape, the next rule's flattening).  Where the first result is read by the second line alone, the
second line reshapes the first's argument itself: the same elements in the same order, and where the meta replay
says that is a view of the same layout, the same tensor; one line less a call wherever the value is not kept
(executors/buffers.py hoists the views of kept ones: the zoo's Llama step with its cheap recomputation, 4-6 lines).
"""
from __future__ import annotations

import torch

from ..proxies import TensorProxy, is_proxy, meta_tensor
from ..pytree import tree_flatten, tree_map
from .buffers import VIEW_FNS, plain_arg
from .torch_executor import ImplSymbol, impl_symbol

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


# Views whose result holds its argument's elements in the same (row-major) order: any chain of them is one reshape.
_ORDER_KEEPING_VIEWS = frozenset({torch.reshape, torch.Tensor.reshape, torch.Tensor.view, torch.flatten,
                                  torch.Tensor.flatten, torch.Tensor.unflatten, torch.unsqueeze, torch.Tensor.unsqueeze,
                                  torch.squeeze, torch.Tensor.squeeze})
_RESHAPE_SYMBOL = impl_symbol(torch.reshape)


def drop_identity_views(trc, header=None):
    """The trace without its identity view lines, and with its reshapes of reshapes made one (see the module
    docstring)."""
    return _reshape_chains(_drop_identity_views(trc, header), header)


def _drop_identity_views(trc, header=None):
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


def _reshape_chains(trc, header=None):
    """Each reshape (``_ORDER_KEEPING_VIEWS``) of a reshape result that nothing else reads, rewritten as one reshape of the first
    one's argument where that is, replayed on meta tensors, a view of the same layout; the first line dropped."""
    readers: dict = {}
    for b in trc.bound_symbols:
        for a in b.flat_args():
            if is_proxy(a):
                readers[id(a)] = readers.get(id(a), 0) + 1
    untouchable = None
    made: dict = {}  # id(reshape result) -> (index in ``lines``, its argument) of the line making it
    lines, dropped = [], set()
    for b in trc.bound_symbols:
        fn = _view_fn(b)
        x, out = (b.args[0] if b.args else None), b.output
        if (fn not in _ORDER_KEEPING_VIEWS or type(out) is not TensorProxy or not _laid_out(x) or not _laid_out(out)
                or not plain_arg(b.args[1:]) or not plain_arg(tuple(b.kwargs.values()))):
            lines.append(b)
            continue
        first = made.get(id(x))
        if first is not None and readers.get(id(x)) == 1:
            untouchable = _untouchable(trc) if untouchable is None else untouchable
            k, root = first
            if id(x) not in untouchable and _same_view(root, out):
                b = b.replace(sym=_RESHAPE_SYMBOL, args=(root, tuple(out._tt_shape)), kwargs={})
                dropped.add(k)
                x = root
        made[id(out)] = (len(lines), x)
        lines.append(b)
    if not dropped:
        return trc
    new = trc.derive(header or trc.header)
    new.bound_symbols = [b for k, b in enumerate(lines) if k not in dropped]
    return new


def _same_view(root, out) -> bool:
    """Whether ``torch.reshape(root, out's shape)`` is, on meta tensors of the traced layouts, a view laid out as ``out``."""
    try:
        with torch.no_grad():
            m = torch.reshape(meta_tensor(root), tuple(out._tt_shape))
    except Exception:  # noqa: BLE001
        return False
    return m._is_view() and _same_layout(m, meta_tensor(out))
