"""The active trace and deterministic name generation.

While a trace is being built, calling a symbol records a bound symbol into
the innermost *scope* of the active trace.  Composite symbols open a nested
scope so that the symbols their decomposition calls become their subsymbols.
"""
from __future__ import annotations

import threading

_state = threading.local()


def get_trace():
    return getattr(_state, "trace", None)


class tracing:
    """Context manager: make ``trc`` the active trace."""

    def __init__(self, trc):
        self.trc = trc

    def __enter__(self):
        self.prev = getattr(_state, "trace", None)
        _state.trace = self.trc
        return self.trc

    def __exit__(self, *exc):
        _state.trace = self.prev
        return False


def fresh_name(prefix: str) -> str:
    trc = get_trace()
    if trc is None:
        # Proxies made outside a trace (rare: tests, metadata helpers) get unique names too.
        n = getattr(_state, "orphan_counter", 0)
        _state.orphan_counter = n + 1
        return f"_{prefix}{n}"
    return trc.make_name(prefix)
