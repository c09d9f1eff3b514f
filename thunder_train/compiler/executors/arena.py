"""Placing kept values in one arena (executors/buffers.py ``plan`` decides which values are kept): each value at the
lowest offset free of the values whose storage lifetimes overlap its own.  A storage is ``[first line, last line,
bytes, value]`` (bytes rounded to the alignment ``buffers._storage_bytes`` gives its size)."""
from __future__ import annotations

import bisect

ALIGN = 64
# Values under this many bytes are placed at 16-byte boundaries (any dtype's), not 64: ``pack`` places them after the
# larger ones (the largest first), whose offsets stay 64-byte aligned.  Their rounding is bytes the arena holds beyond
# what the values need, which a line where the call may peak cannot afford (executors/buffers.py ``plan``).
SMALL, SMALL_ALIGN = 1024, 16


def live_bytes(storages, keys, n, sizes=None) -> list:
    """Bytes of the given storages alive at each line (their ``sizes``, a dict by key, if given)."""
    delta = [0] * (n + 1)
    for k in keys:
        first, last, nbytes, _ = storages[k]
        nbytes = nbytes if sizes is None else sizes[k]
        delta[first] += nbytes
        delta[last + 1] -= nbytes
    live, cur = [], 0
    for d in delta[:n]:
        cur += d
        live.append(cur)
    return live


def pack(storages, kept):
    """Offsets in one arena, largest values first, each at the lowest offset free of the values whose
    storage lifetimes overlap its own: close to the peak of the kept values' bytes, and one allocation."""
    items = sorted(((storages[k][2], storages[k][0], storages[k][1], k) for k in kept), key=lambda t: (-t[0], t[1]))
    placed: list = []  # (offset, end, first line, last line), kept in order of offset (the planner calls this often)
    assigned: dict = {}
    for nbytes, first, end, key in items:
        offset = _first_fit(placed, nbytes, first, end)
        bisect.insort(placed, (offset, offset + nbytes, first, end))
        assigned[key] = (offset, nbytes, storages[key][3])
    return max(hi for _, hi, _, _ in placed), assigned


def _lowest_free(alive, nbytes) -> int:
    """The lowest offset (aligned for ``nbytes``) where ``nbytes`` fit beside the ``alive`` (offset, end) spans,
    given in order of offset."""
    align = SMALL_ALIGN if nbytes < SMALL else ALIGN
    offset = 0
    for lo, hi in alive:
        if offset + nbytes <= lo:
            break
        if hi > offset:
            offset = -(-hi // align) * align
    return offset


def _first_fit(placed, nbytes, first, end) -> int:
    """The lowest offset (aligned for ``nbytes``) where ``nbytes`` fit beside the ``placed`` values (offset, end,
    first line, last line; in order of offset) alive with them.  Those are picked by a comprehension first: most
    placed values are not alive with a given one (~10-15 % of pairs overlap on a T5 step, whose first call packs
    ~30 times, ~150-350 values each time; a loop skipping them one by one took most of the planner's time there)."""
    return _lowest_free([(lo, hi) for lo, hi, f, l in placed if f <= end and first <= l], nbytes)


def fill(storages, assigned, arena, dropped, others, limit) -> int:
    """The values the rounds of ``buffers.plan`` dropped, placed (largest first) at the lowest offset free over their
    whole lifetime; returns the arena's bytes.  ``others``: the bytes the call allocates beside the arena at each line
    (updated here).  A value that fits in the arena as it is only takes bytes from the others; one that grows it is
    placed where the arena and the others' peak stay within ``limit`` (never with no ``limit``).  The rounds drop
    values one by one until the rule on the peak holds and may end far below what fits: GPT-2's zoo step with its
    cheap recomputation kept 34 of 87 candidates in 28.9 KB, which was what the recomputation cost its step (+8.6 %
    with kept buffers, +0.8 % without)."""
    placed = sorted((offset, offset + nbytes, storages[k][0], storages[k][1])
                    for k, (offset, nbytes, _) in assigned.items())
    for key in sorted(dropped, key=lambda k: (-storages[k][2], storages[k][0])):
        first, end, nbytes, value = storages[key]
        offset = _first_fit(placed, nbytes, first, end)
        grown = max(arena, offset + nbytes)
        if grown > arena:
            if limit is None:
                continue
            peak = max(max(others[first:end + 1]) - nbytes, max(others[:first], default=0),
                       max(others[end + 1:], default=0))
            if grown + peak > limit:
                continue
        bisect.insort(placed, (offset, offset + nbytes, first, end))
        assigned[key] = (offset, nbytes, value)
        others[first:end + 1] = [o - nbytes for o in others[first:end + 1]]
        arena = grown
    return arena
