"""The bounded cache: at most ``limit`` entries per leaf structure, least recently used evicted first.

A function whose inputs keep changing in what its programs are specialised on (a new sequence length every
step with ``dynamic=False``, a Python number that takes many values) would otherwise keep every program it
traced, with its kept buffers and fused kernels.  ``EntryLRU`` counts entries per leaf structure (entries
sharing a prologue: the same inputs read, specialised on different values) and, when one more would exceed
``limit``, evicts the least recently used one: it leaves the cache and its slot lets go of what it holds
(``Slot.release``, slot.py: its thin binding and CUDA graphs, its kept buffers; a fusion build not started yet
is cancelled and one in flight frees what it built instead of installing it).  The
first eviction warns once, naming what varies (the latest retrace reasons) and what to do.

``DEFAULT_LIMIT`` (8) is ``tt.compile``'s ``cache_limit``; ``None`` means unbounded.
"""
from __future__ import annotations

import collections

DEFAULT_LIMIT = 8


class EntryLRU:
    """Use order of a function's cache entries, grouped by leaf structure (their prologue)."""

    def __init__(self, limit: int | None = DEFAULT_LIMIT):
        self.limit = limit
        self.order: collections.OrderedDict = collections.OrderedDict()  # id(entry) -> entry, oldest first
        self.evicted = 0

    def touch(self, entry) -> None:
        """``entry`` ran (or was bound): it is the most recently used."""
        order = self.order
        k = id(entry)
        if k in order:
            order.move_to_end(k)

    def add(self, entry) -> list:
        """File a new entry; return the entries to evict (the least recently used of its leaf structure)."""
        self.order[id(entry)] = entry
        if self.limit is None:
            return []
        same = [e for e in self.order.values() if e.prologue is entry.prologue]
        out = same[:max(0, len(same) - self.limit)]
        for e in out:
            self.forget(e)
        self.evicted += len(out)
        return out

    def forget(self, entry) -> None:
        self.order.pop(id(entry), None)

    def __len__(self):
        return len(self.order)


def remove(cache: dict, entry) -> None:
    """Take ``entry`` out of ``FullPath._cache`` (structural key -> [probe]); drop empty probes and buckets."""
    probes = cache.get(entry.struct_key)
    if not probes:
        return
    for probe in list(probes):
        for k in [k for k, e in probe.entries.items() if e is entry]:
            del probe.entries[k]
        for k in [k for k, e in probe.paths.items() if e is entry]:
            del probe.paths[k]
        if not probe.entries and not probe.paths:
            probes.remove(probe)
    if not probes:
        del cache[entry.struct_key]


def limit_warning(name: str, limit: int, reasons: list, symbolic: list) -> str:
    """What the first eviction says: what varies, and what to do."""
    varies = " | ".join(reasons[-3:]) or "the inputs' sizes or values"
    sym = f" (sizes already symbolic: {', '.join(symbolic)})" if symbolic else ""
    return (f"{name}: more than {limit} programs for the same inputs were traced{sym}; the least recently used is "
            f"evicted and will be traced again if needed. What varies, from the latest retraces: {varies}. Results "
            "stay right, but each new value pays a trace: pass a varying Python number as a tensor, pad sequences to a "
            "few bucket lengths or compile with dynamic=True (symbolic sizes), or raise tt.compile(..., cache_limit=N) "
            "(None: unbounded).")
