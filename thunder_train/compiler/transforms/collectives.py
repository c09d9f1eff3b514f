"""Collectives overlap the work around them: each ``wait`` moves down to the first line that reads its result.

A collective of the sharded step (``prims.all_gather``, ``prims.reduce_scatter``) starts where the program needs
it and runs while later lines compute; its ``wait`` blocks only where the result is first used (a gradient's
reduce-scatter is waited for by the optimizer, after the rest of the backward).  The start lines stay where they
are, so every rank issues its collectives in the same order.  A wait reads the collective's input too
(``prims.wait(result, source)``), so lifetimes and kept buffers keep that memory intact until the wait.
"""
from __future__ import annotations

from .. import prims


def _is_wait(b) -> bool:
    return b.sym is prims.wait or getattr(b, "source", None) is prims.wait


def late_waits(trc, header=None):
    """``trc`` with every wait just before the first line reading its result (at the end if only returned)."""
    lines = trc.bound_symbols
    waits = [b for b in lines if _is_wait(b)]
    if not waits:
        return trc
    moved = {id(b) for b in waits}
    rest = [b for b in lines if id(b) not in moved]
    before: dict = {}  # id(line) -> the waits to put before it, in program order
    tail = []
    for w in waits:
        out = id(w.output)
        start = next(i for i, b in enumerate(lines) if b is w)
        user = next((b for b in lines[start + 1:] if id(b) not in moved and any(id(a) == out for a in b.flat_args())), None)
        # A wait whose result another wait reads (none today) stays in place relative to it by going to the end.
        if user is None:
            tail.append(w)
        else:
            before.setdefault(id(user), []).append(w)
    new = []
    for b in rest:
        new.extend(before.get(id(b), ()))
        new.append(b)
    new.extend(tail)
    out = trc.derive(header or trc.header)
    out.bound_symbols = new
    out.args, out.output = trc.args, trc.output
    return out
