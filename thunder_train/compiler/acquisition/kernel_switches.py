"""Process-wide switches that pick an op's kernel, set by the traced function itself: replayed on every call.

Eager's ``scaled_dot_product_attention`` picks its kernel (flash, memory-efficient, math, ...) from switches
that ``torch.nn.attention.sdpa_kernel`` sets.  A compiled program runs under the switches of the calling
context, as eager does, so switches set *outside* the function apply on every call.  Switches the function
sets itself (``with sdpa_kernel(SDPBackend.MATH):`` inside a model's forward) were in force only while
tracing; later calls would run under the caller's.  So an op whose symbol declares ``kernel_switches`` and
that is called under switches other than those in force when the call began is recorded as a call of a torch
callable that sets the switches it was traced under, runs the op and puts them back (differentiable as an
opaque op: its backward runs torch's autograd of the same call, under the same switches, as eager's does).

Not seen: switches set inside the function to the very values the caller had (nothing differs while tracing);
later calls then follow the caller's switches.
"""
from __future__ import annotations

from ..torchlang import registry


def runner_if_switched(st, sym):
    """The torch callable to record instead of ``sym``'s line when its switches differ from the call's start."""
    fact = getattr(sym, "kernel_switches", None)
    if fact is None or st is None or st.walker is None:
        return None
    reader, runner = fact()
    start = st.kernel_switches.get(sym)
    now = reader()
    if start is None or start == now:
        return None
    return runner(now)


def remember_start(st) -> None:
    """At the start of acquisition: every declared op's switches (only symbols that declare them)."""
    for sym in registry.all_symbols.values():
        if sym.kernel_switches is not None:
            st.kernel_switches[sym] = sym.kernel_switches()[0]()
