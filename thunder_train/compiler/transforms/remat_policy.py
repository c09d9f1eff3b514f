"""Which forward values the backward recomputes without being asked (transforms/remat.py does it).

Default (``cheap_values``): a value the backward reads is recomputed when its line is cheap (elementwise
prims, views, casts, masks, constants: no reduction, no matmul, nothing random) and every tensor it is
computed from is kept for the backward anyway (or is an input of the program).  The saved set then only
shrinks: the recomputed value's memory is freed after its last forward use, and nothing new is kept.
Matmuls, attention and reductions are kept.

``memory_budget`` (``budget_values``): the values the default keeps are also recomputed, the cheapest
first per byte saved, until the bytes kept for the backward are at most the budget.
"""
from __future__ import annotations

from ..proxies import TensorProxy, is_proxy
from .remat import recomputable

_CHEAP_PRIM_TAGS = frozenset({"elementwise", "shape_only", "cheap_to_recompute"})


def cheap(b) -> bool:
    """Elementwise, view, cast or constant all the way down (its decomposition too)."""
    if b.sym.is_prim:
        return bool(b.sym.tags & _CHEAP_PRIM_TAGS) and "random" not in b.sym.tags
    return bool(b.subsymbols) and all(cheap(s) for s in b.subsymbols)


def is_view(b) -> bool:
    """A line whose result may share its argument's memory: recomputing it frees nothing."""
    if "view" in b.sym.tags:
        return True
    if b.sym.is_prim:
        return "shape_only" in b.sym.tags
    return bool(b.subsymbols) and all(is_view(s) for s in b.subsymbols)


def nbytes(p) -> int:
    if type(p) is not TensorProxy:
        return 0
    n = 1
    for s in p._tt_shape:
        n *= int(s)
    return n * p._tt_dtype.torch.itemsize


def _reads(b) -> list:
    out = [a for a in b.flat_args() if is_proxy(a)]
    for s in b.subsymbols:
        out.extend(_reads(s))
    return out


class Saved:
    """The forward values a joint program's backward reads, with their producers."""

    def __init__(self, lines, is_backward, returned_ids, input_ids):
        self.producer = {}
        self.read = {}  # id -> proxy, in first backward read order
        self.inputs = set(input_ids)
        alive = set(returned_ids)  # values kept after the backward starts anyway
        seen_backward = False
        for b in lines:
            if is_backward(b):
                seen_backward = True
                for a in _reads(b):
                    if id(a) in self.producer and type(a) is TensorProxy:
                        self.read.setdefault(id(a), a)
                continue
            if seen_backward:
                alive.update(id(a) for a in _reads(b))
            for o in b.flat_outputs():
                if is_proxy(o):
                    self.producer[id(o)] = b
        self.alive = alive
        # Storage roots: a view's is its argument's (the values sharing one stay alive while any of them is read).
        self.root = {}
        for b in lines:
            if is_backward(b):
                continue
            args = [a for a in b.flat_args() if type(a) is TensorProxy]
            for o in b.flat_outputs():
                if type(o) is TensorProxy:
                    self.root[id(o)] = self.root.get(id(args[0]), id(args[0])) if is_view(b) and args else id(o)
        self.sharing = {}  # root -> ids of the read values on it
        for k in self.read:
            self.sharing.setdefault(self.root.get(k, k), set()).add(k)

    def shares_memory(self, k) -> bool:
        """Another value the backward reads shares k's memory."""
        return len(self.sharing.get(self.root.get(k, k), ())) > 1

    def bytes(self, excluded=()) -> int:
        return sum(nbytes(p) for k, p in self.read.items() if k not in excluded)


def cheap_values(saved: Saved, chosen: dict | None = None) -> dict:
    """id -> proxy of the values recomputed by default (see the module docstring)."""
    chosen = dict(chosen or {})
    available = lambda a: id(a) in saved.inputs or id(a) in saved.read or id(a) in chosen  # noqa: E731
    changed = True
    while changed:
        changed = False
        for k, p in saved.read.items():
            b = saved.producer[k]
            if k in chosen or k in saved.alive or not cheap(b) or not recomputable(b) or is_view(b) or saved.shares_memory(k):
                continue
            if all(available(a) for a in b.flat_args() if type(a) is TensorProxy):
                chosen[k] = p
                changed = True
    return chosen
