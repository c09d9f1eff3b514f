"""Lifetimes: executed traces free each intermediate after its last use.

A whole training step would otherwise keep every activation and gradient alive until it
returns (memory, and fresh pages on every step).  ``free_after_last_use`` runs on every
executed trace (computation, forward, backward); ``take_saved_as_list`` makes a backward
take its saved values and cotangents in one list that it empties, so that each is freed as
soon as the backward has used it (see ``compiler/autograd_function.py``).
"""
from __future__ import annotations

from ..codegen import Name
from ..proxies import TensorProxy, is_proxy
from ..pytree import tree_flatten
from ..symbols import BoundSymbol, Symbol
from ..trace import Trace


def _is_tensor(x) -> bool:
    return type(x) is TensorProxy


class _SourceOnly(Symbol):
    """A trace line with custom source and no semantics for passes (after lowering only)."""

    def __init__(self, name, format_lines):
        super().__init__(name, None, module="autograd", is_prim=True)
        self._format_lines = format_lines

    def format_lines(self, bsym, fmt):
        return self._format_lines(bsym, fmt)

    def codegen_globals(self) -> dict:
        return {}


def _unpack_lines(bsym, fmt):
    names = [fmt(p) for p in bsym.output]
    lines = [f"({', '.join(names)},) = saved" if len(names) == 1 else f"({', '.join(names)}) = saved"]
    lines.append("saved.clear()  # the names above now hold the only references")
    for p in bsym.output:
        lines.append(f"# {p._tt_name}: \"{p.type_string()}\"" if _is_tensor(p) else f"# {p.name}: {p.type_string()}")
    return lines


UNPACK_SAVED = _SourceOnly("unpack_saved", _unpack_lines)
# Its results are values handed in, as the program's inputs are: a saved parameter outlives the program, so the kept
# buffers' plan (executors/buffers.py) does not count them as freed at their last use.
UNPACK_SAVED.hands_in = True
DEL = _SourceOnly("del", lambda bsym, fmt: [f"del {', '.join(fmt(p) for p in bsym.args)}"])


def take_saved_as_list(trc, saved) -> Trace:
    """``backward(saved)``: the saved values, then the cotangents, arrive in one list the trace empties, so that each is
    freed after its last use (``ThunderFunction.backward`` keeps no other reference to the cotangents: an LM head's
    logits' gradient was held to the end of the backward, where eager frees it after the head's backward)."""
    new = trc.derive(trc.header)
    values = (*saved, *(a for a in trc.args if not any(a is s for s in saved)))
    new.args = [Name("saved")]
    if values:
        new.bound_symbols.append(BoundSymbol(UNPACK_SAVED, (), {}, values))
    new.bound_symbols.extend(trc.bound_symbols)
    return new


def free_after_last_use(trc, header=None) -> Trace:
    """Insert ``del`` after the last use of every tensor the trace does not return."""
    returned = {id(p) for p in tree_flatten(trc.output)[0] if is_proxy(p)}
    last: dict = {}
    for i, b in enumerate(trc.bound_symbols):
        for p in list(b.flat_args()) + list(b.flat_outputs()) if b.sym is not UNPACK_SAVED else b.flat_outputs():
            if _is_tensor(p):
                last[id(p)] = (i, p)
    for a in trc.args:
        if _is_tensor(a) and id(a) not in last:
            last[id(a)] = (-1, a)
    dead_at: dict = {}
    for i, p in last.values():
        if id(p) not in returned:
            dead_at.setdefault(i, []).append(p)
    new = trc.derive(header or trc.header)
    new.bound_symbols.extend(BoundSymbol(DEL, tuple(dead_at[-1]), {}, None) for _ in [0] if -1 in dead_at)
    for i, b in enumerate(trc.bound_symbols):
        new.bound_symbols.append(b)
        if i in dead_at:
            new.bound_symbols.append(BoundSymbol(DEL, tuple(dead_at[i]), {}, None))
    return new
