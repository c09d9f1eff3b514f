"""A recomputed value held across the backward's peak is recomputed a second time after it instead.

Recomputation (``transforms/remat.py``) makes each copy once, right before its first backward reader, and the
copy lives until its last.  With per-block activation checkpointing, the block's attention is recomputed first
(the MLP's recomputation needs its output), but the attention's backward comes after the MLP's: its recomputed
query/key/value projection, output and layer-norm output are held through the MLP's backward, where the step's
memory peaks.  Eager's checkpoint does the same; a compiler can do better.

``recompute_again``: at the planned peak (``transforms/memory.py`` ``planned_peak``'s count), a recomputed value
(its memory and the views of it) that some line read before the peak and some line reads after it, but nothing
at it, is computed once more right before its first reader after the peak, from the same inputs (the lines of it
and of the views read later, cloned); the first copy dies before the peak.  Kept when the planned peak goes down,
undone otherwise; a few rounds.  Values do not change: the same ops on the same values (the copy's
``_tt_recomputed_of`` names the forward value, so backward kernels still pair with their forward's
statistics).  Cost: those lines run once more.  Runs where the program asks for memory (checkpoint regions or a
budget).
"""
from __future__ import annotations

from ..proxies import TensorProxy
from .remat import COMMENT, _clone
from .remat_policy import is_view, nbytes

_TRIES = 48  # candidate rewrites tried (each one counts the whole program once)
_NEAR_PEAK = 0.5  # only stretches whose memory is at least this fraction of the planned peak


def _origin(p):
    """The forward value ``p`` is (a recomputed copy's ``_tt_recomputed_of``), or ``p``."""
    o = getattr(p, "_tt_recomputed_of", None)
    return p if o is None else o


def _profile(lines, returned):
    """(live bytes after each line, root of each value, sorted reader positions of each root, bytes of each root,
    producer index of each value)."""
    root, size, first, readers, made = {}, {}, {}, {}, {}
    for i, b in enumerate(lines):
        args = [a for a in b.flat_args() if type(a) is TensorProxy]
        for a in b.all_reads():
            r = root.get(id(a))
            if r is not None:
                readers.setdefault(r, []).append(i)
        for o in b.flat_outputs():
            if type(o) is TensorProxy and id(o) not in root:
                made[id(o)] = i
                if is_view(b) and args:
                    root[id(o)] = root.get(id(args[0]), id(args[0]))
                else:
                    root[id(o)] = id(o)
                    size[id(o)] = nbytes(o)
                    first[id(o)] = i
    n = len(lines)
    delta = [0] * (n + 2)
    for r, nb in size.items():
        last = n if r in returned else max(readers.get(r, [first[r]]) + [first[r]])
        delta[first[r]] += nb
        delta[last + 1] -= nb
    live, cur = [], 0
    for i in range(n):
        cur += delta[i]
        live.append(cur)
    return live, root, readers, size, made


def _again(lines, v_root, peak_at, root, readers, made, make_name):
    """The lines with the reads after ``peak_at`` of the memory ``v_root`` (and its views) served by a second copy;
    None if those values are not all recomputed lines' results."""
    later = sorted({j for j in readers.get(v_root, []) if j > peak_at})
    if not later:
        return None
    j0 = later[0]
    # The values of that memory read after the peak, and the lines (recomputed ones only) that make them.
    wanted = [a for j in later for a in lines[j].all_reads() if root.get(id(a)) == v_root]
    chain, seen = set(), set()
    stack = list(wanted)
    while stack:
        a = stack.pop()
        if id(a) in seen:
            continue
        seen.add(id(a))
        k = made.get(id(a))
        if k is None or lines[k].comment != COMMENT or lines[k].draws_random:  # a draw is drawn again only in its replay
            return None
        chain.add(k)
        for x in lines[k].flat_args():
            if type(x) is TensorProxy and root.get(id(x)) == v_root:
                stack.append(x)
    # Other values the cloned lines read: the latest copy made after the peak where there is one (an earlier
    # round's second copy), so the first copies are not held across the peak again.
    latest: dict = {}
    for i in range(peak_at + 1, j0):
        for o in lines[i].flat_outputs():
            if type(o) is TensorProxy:
                latest[id(_origin(o))] = o
    mapping: dict = {}
    for k in chain:
        for x in lines[k].flat_args():
            if type(x) is TensorProxy and root.get(id(x)) != v_root and id(_origin(x)) in latest:
                mapping.setdefault(id(x), latest[id(_origin(x))])
    clones = [_clone(lines[k], mapping, make_name, comment=COMMENT) for k in sorted(chain)]
    out = []
    for i, b in enumerate(lines):
        if i == j0:
            out.extend(clones)
        out.append(b.renamed(mapping, inside=True) if i >= j0 and any(id(a) in mapping for a in b.all_reads()) else b)
    return out


def _gap(pos):
    """The widest stretch between two consecutive reads: (last read before it, first read after it)."""
    return max(zip(pos, pos[1:]), key=lambda ab: ab[1] - ab[0], default=None)


def recompute_again(trc, is_backward, returned, header="Recomputed values held across the peak recomputed again (transforms/recompute_again.py)"):
    lines = list(trc.bound_symbols)
    last = max((i for i, b in enumerate(lines) if is_backward(b)), default=-1)
    if last < 0:
        return trc
    head, tail = lines[: last + 1], lines[last + 1:]
    tried: set = set()
    changed = False
    budget = _TRIES
    while budget > 0:
        live, root, readers, size, made = _profile(head, returned)
        top = max(live, default=0)
        # Recomputed memories not read across a stretch of the backward near its peak, largest first.
        candidates = []
        for r, nb in size.items():
            gap = _gap(readers.get(r, []))
            if r in tried or r in returned or gap is None or gap[1] - gap[0] < 2 or not _recomputed(head, made, r):
                continue
            a, b = gap
            at = max(range(a + 1, b), key=live.__getitem__)
            if live[at] >= _NEAR_PEAK * top and nb * 100 >= top:
                candidates.append((nb, r, at, a, b))
        improved = False
        for nb, r, at, a, b in sorted(candidates, key=lambda c: -c[0]):
            if budget <= 0:
                break
            tried.add(r)
            budget -= 1
            new = _again(head, r, at, root, readers, made, trc.make_name)
            if new is None:
                continue
            new_live = _profile(new, returned)[0]
            # Lower where it was held, and no higher anywhere (lines before ``b`` keep their places).
            if max(new_live[a + 1:b]) < max(live[a + 1:b]) and max(new_live) <= top:
                head, improved, changed = new, True, True
                break
        if not improved:
            break
    if not changed:
        return trc
    out = trc.derive(header)
    out.bound_symbols = head + tail
    return out


def _recomputed(lines, made, r) -> bool:
    k = made.get(r)
    return k is not None and lines[k].comment == COMMENT
