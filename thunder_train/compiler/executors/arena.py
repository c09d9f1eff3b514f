"""Placing kept values in one arena (executors/buffers.py ``plan`` decides which values are kept): each value at the
lowest offset free of the values whose storage lifetimes overlap its own.  A storage is ``[first line, last line,
bytes, value]`` (bytes rounded to the alignment ``buffers._storage_bytes`` gives its size)."""
from __future__ import annotations

import itertools
import operator

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


def pack(storages, kept, alive_with=None):
    """Offsets in one arena, largest values first, each at the lowest offset free of the values whose
    storage lifetimes overlap its own: close to the peak of the kept values' bytes, and one allocation.
    ``alive_with`` (``overlaps`` of a superset of ``kept``): which values' lifetimes overlap."""
    return Packing(storages, alive_with if alive_with is not None else overlaps(storages, kept)).pack(kept)


# The orders ``Packing`` tries when it packs a set of values anew, keeping the one whose arena is smallest: the
# largest values first (values alive together stack), or the values holding the most bytes over their lifetimes
# first.  Neither is best everywhere: where a step's backward sinks its lines (transforms/sinking.py) the gradients
# held to the optimizer and the forward's long-lived activations meet short values between them, and ModernBERT's
# fused zoo step packed its 70 candidates in 127 KB largest first, 121 KB by bytes over lifetimes (their stack at
# the fullest line: 109 KB); its plan then kept 64 values in 102 KB, or 69 in 114 KB, and the recomputation that
# had cost its step ~2 % cost nothing.
ORDERS = (lambda first, last, nbytes: (-nbytes, first),
          lambda first, last, nbytes: (-(last - first + 1) * nbytes, first))


class Packing:
    """``pack`` for the planner's rounds (executors/buffers.py ``plan``), each of which packs what it keeps again
    with one value fewer (~70 times over a T5 step's first two calls, ~200 over DeepSeek-V3's, ~150-350 values each
    time).  The same offsets as packing anew in the order chosen for the first set (of ``ORDERS``): the values keep
    that order, and a value is placed again only where a value overlapping it and placed before it was dropped or
    moved; the others keep their offsets (a value's lifetime overlaps ~10-15 % of the others')."""

    def __init__(self, storages, alive_with):
        self.storages, self.alive_with = storages, alive_with
        self.neighbours = {k: frozenset(v) for k, v in alive_with.items()}
        self.order, self.placed = [], {}  # the last packing's values in order, key -> (offset, end)

    def pack(self, kept):
        storages, before = self.storages, self.placed
        if before and set(kept) <= set(before):
            self.order = [k for k in self.order if k in kept]
            placed = self._again(before, set(before) - set(kept))
        else:
            orders = (sorted(kept, key=lambda k: order(*storages[k][:3])) for order in ORDERS)
            self.order, placed = min(((keys, _placed(keys, storages, self.alive_with)) for keys in orders),
                                     key=lambda packing: _arena_bytes(packing[1]))
        self.placed = placed
        return _arena_bytes(placed), {k: (offset, end - offset, storages[k][3]) for k, (offset, end) in placed.items()}

    def _again(self, before, changed):
        """The offsets of ``self.order`` packed anew, from ``before``'s: a value is placed again only where a value
        overlapping it and placed before it is in ``changed`` (dropped, then moved)."""
        placed = {}
        for key in self.order:
            old = before[key]
            if not changed.isdisjoint(self.neighbours[key]):
                offset = _lowest_free(key, self.storages[key][2], placed, self.alive_with)
                placed[key] = (offset, offset + self.storages[key][2])
                if placed[key] != old:
                    changed.add(key)
            else:
                placed[key] = old
        return placed


def _placed(keys, storages, alive_with) -> dict:
    """key -> (offset, end) of the values placed in the order of ``keys``, each at its lowest free offset."""
    placed = {}
    for k in keys:
        offset = _lowest_free(k, storages[k][2], placed, alive_with)
        placed[k] = (offset, offset + storages[k][2])
    return placed


def _arena_bytes(placed) -> int:
    """The arena a packing (key -> (offset, end)) needs."""
    return max(end for _, end in placed.values())


def overlaps(storages, keys) -> dict:
    """key -> the other keys whose storage lifetimes overlap its own (a sweep over the first lines)."""
    alive_with: dict = {k: [] for k in keys}
    active: list = []  # (last line, key) of the values whose lifetime has started, filtered as the sweep goes
    for key in sorted(keys, key=lambda k: storages[k][0]):
        first, last = storages[key][0], storages[key][1]
        active = [(end, k) for end, k in active if end >= first]
        mine = alive_with[key]
        for _, k in active:
            mine.append(k)
            alive_with[k].append(key)
        active.append((last, key))
    return alive_with


def _lowest_free(key, nbytes, placed, alive_with) -> int:
    """The lowest offset (aligned for ``nbytes``) where ``key``'s ``nbytes`` fit beside the values placed so far
    (``placed``: key -> (offset, end)) whose lifetimes overlap its own."""
    align = SMALL_ALIGN if nbytes < SMALL else ALIGN
    offset = 0
    # map/filter/sorted without a Python frame per neighbour: a packing asks this ~200 times over ~100 neighbours each
    for lo, hi in sorted(filter(None, map(placed.get, alive_with[key]))):
        if offset + nbytes <= lo:
            break
        if hi > offset:
            offset = -(-hi // align) * align
    return offset


def fill(storages, assigned, arena, dropped, others, limit, alive_with=None) -> int:
    """The values the rounds of ``buffers.plan`` dropped, placed (largest first) at the lowest offset free over their
    whole lifetime; returns the arena's bytes.  ``others``: the bytes the call allocates beside the arena at each line
    (updated here).  A value that fits in the arena as it is only takes bytes from the others; one that grows it is
    placed where the arena and the others' peak stay within ``limit`` (never with no ``limit``).  The rounds drop
    values one by one until the rule on the peak holds and may end far below what fits: GPT-2's zoo step with its
    cheap recomputation kept 34 of 87 candidates in 28.9 KB, which was what the recomputation cost its step (+8.6 %
    with kept buffers, +0.8 % without).  ``alive_with``: as for ``pack``, of a superset of both."""
    if alive_with is None:
        alive_with = overlaps(storages, set(assigned) | set(dropped))
    placed = {k: (offset, offset + nbytes) for k, (offset, nbytes, _) in assigned.items()}
    for key in sorted(dropped, key=lambda k: (-storages[k][2], storages[k][0])):
        first, end, nbytes, value = storages[key]
        offset = _lowest_free(key, nbytes, placed, alive_with)
        grown = max(arena, offset + nbytes)
        if grown > arena:
            if limit is None:
                continue
            peak = max(max(others[first:end + 1]) - nbytes, max(others[:first], default=0),
                       max(others[end + 1:], default=0))
            if grown + peak > limit:
                continue
        assigned[key] = (offset, nbytes, value)
        placed[key] = (offset, offset + nbytes)
        others[first:end + 1] = [o - nbytes for o in others[first:end + 1]]
        arena = grown
    return arena


def around_the_peak(storages, kept, without, budget, alive_with):
    """``(arena bytes, {key: (offset, bytes, value)})`` keeping the arena plus what the call allocates beside it
    within ``budget`` at every line, or None where this way finds nothing to keep.

    The arena is held for the whole call, so at the line where the call's memory peaks (``without``: the bytes alive
    at each line with no arena) every arena byte must hold a value alive there.  The candidates alive at that line are
    packed first, where they stack; the others go into their gaps, never above them.  What no kept buffer holds (the
    other allocations, and candidates left out) peaks elsewhere too: the arena is at most ``budget`` less that peak,
    so candidates alive at the peak line are left out, one at a time, until their stack fits under it; each one left
    out is chosen to raise that peak the least.  Where a value of the gaps does not fit, it is left out, and where
    that raises the other allocations' peak past what the arena leaves, the arena gives up the difference again."""
    n = len(without)
    peak_line = without.index(max(without))
    at_peak = sorted((k for k in kept if storages[k][0] <= peak_line <= storages[k][1]),
                     key=lambda k: (-storages[k][2], storages[k][0]))
    rest = sorted((k for k in kept if not storages[k][0] <= peak_line <= storages[k][1]),
                  key=lambda k: (-storages[k][2], storages[k][0]))
    others = [w - p for w, p in zip(without, live_bytes(storages, kept, n))]  # what no candidate holds

    def leave_out(k):
        first, last, nbytes, _ = storages[k]
        for i in range(first, last + 1):
            others[i] += nbytes

    stack = list(at_peak)
    for _ in range(len(kept) + 1):
        cap = budget - max(others)
        while stack and sum(storages[k][2] for k in stack) > cap:
            k = _least_raising(stack, storages, others)
            stack.remove(k)
            leave_out(k)
            cap = budget - max(others)
        if not stack or cap <= 0:
            return None
        placed = _placed(stack, storages, alive_with)
        arena = _arena_bytes(placed)
        if arena > cap:  # (values alive together at one line stack exactly; alignment may add a few bytes)
            k = stack.pop()
            leave_out(k)
            continue
        left = []
        for k in rest:
            offset = _lowest_free(k, storages[k][2], placed, alive_with)
            if offset + storages[k][2] <= arena:
                placed[k] = (offset, offset + storages[k][2])
            else:
                left.append(k)
        trial = list(map(operator.add, others, live_bytes(storages, left, n)))
        if arena + max(trial) <= budget:
            return arena, {k: (offset, end - offset, storages[k][3]) for k, (offset, end) in placed.items()}
        # The values of the gaps left out raise the other allocations' peak: the stack gives up one more value.
        k = _least_raising(stack, storages, trial)
        stack.remove(k)
        leave_out(k)
    return None


def _least_raising(keys, storages, curve):
    """Of ``keys``, the value whose bytes, added to ``curve`` (what no buffer holds) over its lifetime, raise its
    maximum there least (the larger one of a tie)."""
    return min(keys, key=lambda k: (max(curve[storages[k][0]: storages[k][1] + 1]) + storages[k][2], -storages[k][2]))


# ``in_a_band``'s search: arena sizes tried, from the largest the candidates allow down, and values given up to fit
# the packing of each.  Fixed counts (not a time): the same program gets the same plan.
BAND_LEVELS, BAND_REPAIRS = 12, 8


def in_a_band(storages, kept, without, budget, alive_with):
    """``(arena bytes, {key: (offset, bytes, value)})`` of the most values this search keeps within ``budget`` (the
    arena plus what the call allocates beside it, at every line), or None.

    An arena of K bytes bounds the kept bytes alive at each line from above (K) and, through the budget, from below
    (at a line where the call without buffers holds ``without[t]``, at least ``without[t] - (budget - K)`` must be
    kept).  For each K tried, ``_within_band`` drops values where the kept bytes are above K, the largest first
    (fewest values for the bytes), never below the floor; the packing's offsets may then need more than K, and the
    values placed highest, not alive where the other allocations peak, are given up until it fits.  Where the call's
    memory is high at several lines (a forward's end and the backward's peak), the rounds of ``buffers.plan`` and
    ``around_the_peak``, which aim at one line at a time, keep far fewer values (the fused zoo steps with their cheap
    recomputation: nn.TransformerEncoder's 24 of 52 candidates, 36 with this choice and ``fill``; BERT's 44 of 74, 57).
    A few milliseconds on the zoo's steps, ~35 ms on T5's (245 candidates, ~1,000 lines)."""
    n = len(without)
    order = sorted(kept, key=lambda k: (-storages[k][2], storages[k][0], k))
    everything = live_bytes(storages, kept, n)
    # (the largest arena that leaves room beside it for what no candidate holds; none where that is nothing)
    top = min(budget - max(map(operator.sub, without, everything), default=0), max(everything, default=0))
    if top <= 0:
        return None
    best, packing = None, Packing(storages, alive_with)
    for level in range(BAND_LEVELS):
        chosen = _within_band(storages, order, everything, without, budget, top * (BAND_LEVELS - level) // BAND_LEVELS)
        for _ in range(BAND_REPAIRS):
            if not chosen or (best is not None and len(chosen) <= len(best[1])):
                break
            arena, placed = packing.pack(chosen)
            others = list(map(operator.sub, without, live_bytes(storages, chosen, n)))
            over = arena + max(others) - budget
            if over <= 0:
                best = (arena, placed)
                break
            t = others.index(max(others))
            highest = [(offset + nbytes, k) for k, (offset, nbytes, _) in placed.items()
                       if offset + nbytes > arena - over and not storages[k][0] <= t <= storages[k][1]]
            if not highest:
                break
            chosen = chosen - {max(highest)[1]}
    return best


def _within_band(storages, order, everything, without, budget, k_bytes):
    """The values (of ``order``, largest first) kept with an arena of ``k_bytes``: see ``in_a_band``; None where the
    floor stops the kept bytes from coming down to ``k_bytes`` somewhere.  Among values of one size, those alive
    at more lines above ``k_bytes`` go first."""
    kept = list(everything)
    beside = budget - k_bytes  # what the call may hold beside the arena
    chosen = set(order)
    for nbytes, same in itertools.groupby(order, key=lambda k: storages[k][2]):
        # (map over C-level comparisons, not a generator: the search's time is these two lines)
        ranked = sorted(same, key=lambda k: -sum(map(k_bytes.__lt__, kept[storages[k][0]:storages[k][1] + 1])))
        for k in ranked:
            first, last = storages[k][0], storages[k][1]
            span = kept[first:last + 1]
            if max(span) <= k_bytes or min(map(operator.sub, span, without[first:last + 1])) < nbytes - beside:
                continue
            chosen.discard(k)
            kept[first:last + 1] = [x - nbytes for x in span]
    return chosen if max(kept, default=0) <= k_bytes else None
