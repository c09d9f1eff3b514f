"""Collectives overlap the work around them: each ``wait`` moves down, as far as the next collective of its kind.

A collective of the sharded step (``prims.all_gather``, ``prims.reduce_scatter``) starts where the program needs
it and runs while later lines compute.  Its ``wait`` moves down to the first line that reads the result, but no
further than just after the next collective of the same kind has started: a gradient's reduce-scatter runs while
the backward of the layer before computes, and at most two of them are in flight, so the full-size gradients they
read are freed as the backward goes (FSDP2 does the same).  The start lines stay where they are, so every rank
issues its collectives in the same order.  A wait reads the collective's input too (``prims.wait(result,
source)``), so lifetimes and kept buffers keep that memory intact until the wait.
"""
from __future__ import annotations

from .. import prims


def _kind(b):
    """``prims.wait``, ``prims.all_gather``, ``prims.reduce_scatter`` for their lines (claimed or not), else None."""
    for s in (b.sym, getattr(b, "source", None)):
        if s is prims.wait or s is prims.all_gather or s is prims.reduce_scatter:
            return s
    return None


def late_waits(trc, header=None):
    """``trc`` with every wait moved down as described above (at the end if only returned)."""
    lines = trc.bound_symbols
    if not any(_kind(b) is prims.wait for b in lines):
        return trc
    index = {id(b): i for i, b in enumerate(lines)}
    producer = {id(o): b for b in lines for o in b.flat_outputs()}
    waits = {id(b) for b in lines if _kind(b) is prims.wait}
    before: dict = {}  # index of a line -> the waits to put before it, in program order
    tail = []
    for i, w in enumerate(lines):
        if id(w) not in waits:
            continue
        out = id(w.output)
        target = next((j for j in range(i + 1, len(lines)) if id(lines[j]) not in waits
                       and any(id(a) == out for a in lines[j].flat_args())), None)
        start = producer.get(id(w.args[0]))
        if start is not None:
            kind = _kind(start)
            nxt = next((j for j in range(index[id(start)] + 1, len(lines)) if _kind(lines[j]) is kind), None)
            if nxt is not None:  # just after the next collective of this kind started
                after = next((j for j in range(nxt + 1, len(lines)) if id(lines[j]) not in waits), None)
                if after is not None and after > i and (target is None or after < target):
                    target = after
        if target is None or target <= i:
            (tail if target is None else before.setdefault(i + 1, [])).append(w)  # (never above its own line)
        else:
            before.setdefault(target, []).append(w)
    new = []
    for j, b in enumerate(lines):
        new.extend(before.get(j, ()))
        if id(b) not in waits:
            new.append(b)
    new.extend(before.get(len(lines), ()))
    new.extend(tail)
    out = trc.derive(header or trc.header)
    out.bound_symbols = new
    return out
