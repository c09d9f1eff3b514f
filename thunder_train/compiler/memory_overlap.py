"""Which inputs share memory: the bytes two tensors can touch, not just their storage.

An input the program updates in place must share no memory with another input (the functional program reads
every input's old value).  Tensors of one storage that touch disjoint bytes (``vector_to_parameters`` makes every
parameter a slice of one vector) are independent and allowed; tensors whose byte ranges meet are refused, also
when their strides interleave without sharing an element (a conservative answer, never a wrong one).
"""
from __future__ import annotations

import torch


def _byte_range(t):
    """``(first, end)`` of the bytes ``t`` can touch, or None when it touches none."""
    if t.numel() == 0 or not t.untyped_storage().nbytes():
        return None
    span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + span * t.element_size()


def _parts(t) -> tuple:
    """The strided tensors holding ``t``'s memory: itself, or a sparse tensor's indices and values."""
    if t.layout == torch.strided:
        return (t,)
    if t.layout == torch.sparse_coo:
        return (t._indices(), t._values())
    return (t.crow_indices() if t.layout == torch.sparse_csr else t.ccol_indices(),
            t.col_indices() if t.layout == torch.sparse_csr else t.row_indices(), t.values())


def overlapping_pairs(written, others) -> tuple:
    """Pairs ``(i, j)``: the tensor ``written[i]`` shares bytes with ``others[j]``, a different object.

    Grouped by storage first (one dict pass), so the common case (every storage its own) costs one storage read
    per tensor; a storage held by several tensors is swept in address order."""
    groups: dict = {}
    for side, tensors in ((0, written), (1, others)):
        for k, whole in enumerate(tensors):
            for t in _parts(whole):
                if not t.untyped_storage().nbytes():
                    continue  # an empty storage (data pointer 0) shares no memory
                entry = groups.setdefault(t.untyped_storage().data_ptr(), {}).setdefault(id(whole), [t, None, None])
                if entry[1 + side] is None:
                    entry[1 + side] = k
    out = []
    for members in groups.values():
        if len(members) < 2:
            continue
        spans = sorted(((r, w, o) for t, w, o in members.values() if (r := _byte_range(t)) is not None),
                       key=lambda x: x[0][0])
        reach = [(-1, None), (-1, None)]  # the furthest end so far of a written tensor and of an other one
        for (start, end), w, o in spans:
            if o is not None and reach[0][0] > start:
                out.append((reach[0][1], o))
            elif w is not None and reach[1][0] > start:
                out.append((w, reach[1][1]))
            if w is not None and end > reach[0][0]:
                reach[0] = (end, w)
            if o is not None and end > reach[1][0]:
                reach[1] = (end, o)
    return tuple(out)
