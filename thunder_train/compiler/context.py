"""The active trace, the active tracer state, and deterministic name generation.

While a trace is being built, calling a symbol records a bound symbol into
the innermost *scope* of the active trace.  Composite symbols open a nested
scope so that the symbols their decomposition calls become their subsymbols.
While a function is acquired, ``tracer_state()`` is its ``TracerState``
(``acquisition/state.py``); it is None while other passes build traces.
"""
from __future__ import annotations

import threading

_state = threading.local()
# thread ident -> (thread name, depth) of the threads acquiring a function now; read only to word an error
_acquiring: dict = {}


def get_trace():
    return getattr(_state, "trace", None)


def tracer_state():
    """The acquisition state of the active trace, or None (no trace, or a trace a pass builds)."""
    return getattr(_state, "tracer", None)


class tracing:
    """Context manager: make ``trc`` the active trace (and ``state`` its tracer state)."""

    def __init__(self, trc, state=None):
        self.trc = trc
        self.state = state

    def __enter__(self):
        self.prev = getattr(_state, "trace", None), getattr(_state, "tracer", None)
        _state.trace = self.trc
        _state.tracer = self.state
        if self.state is not None:
            me = threading.current_thread()
            _acquiring[me.ident] = (me.name, _acquiring.get(me.ident, ("", 0))[1] + 1)
        return self.trc

    def __exit__(self, *exc):
        _state.trace, _state.tracer = self.prev
        if self.state is not None:
            me = threading.get_ident()
            name, depth = _acquiring.pop(me)
            if depth > 1:
                _acquiring[me] = (name, depth - 1)
        return False


def other_threads_acquiring() -> list:
    """The names of the other threads acquiring a function now."""
    me = threading.get_ident()
    return [name for ident, (name, _) in list(_acquiring.items()) if ident != me]


def fresh_name(prefix: str) -> str:
    trc = get_trace()
    if trc is None:
        # Proxies made outside a trace (rare: tests, metadata helpers) get unique names too.
        n = getattr(_state, "orphan_counter", 0)
        _state.orphan_counter = n + 1
        return f"_{prefix}{n}"
    return trc.make_name(prefix)


class own_hooks:
    """Context manager: the hooks registered inside are the compiler's own (``ThunderFunction``'s pre-hook on its
    node), not part of what a program assumes: the hook guard (runtime/hook_guard.py) does not count them."""

    def __enter__(self):
        _state.own_hooks = getattr(_state, "own_hooks", 0) + 1

    def __exit__(self, *exc):
        _state.own_hooks -= 1
        return False


def making_own_hooks() -> bool:
    return getattr(_state, "own_hooks", 0) > 0
