"""The memory plan of a whole step: what the backward recomputes instead of keeping.

Two steps, both done by ``transforms/remat.py`` ``recompute``: checkpoint regions first (the user asked for
them), then the values ``transforms/remat_policy.py`` picks (cheap values by default).
"""
from __future__ import annotations

from ..proxies import is_proxy
from ..pytree import tree_flatten
from .remat import BACKWARD, recompute, recompute_checkpointed
from .remat_policy import Saved, cheap_values


def plan_memory(trc, traces: list):
    """Checkpoint regions and cheap values recomputed in the backward; new traces are appended to ``traces``."""
    new, report = recompute_checkpointed(trc)
    if new is not trc:
        traces.append(new)
    is_backward = lambda b: b.region is BACKWARD  # noqa: E731
    returned = {id(p) for p in tree_flatten(new.output)[0] if is_proxy(p)}
    saved = Saved(new.bound_symbols, is_backward, returned, {id(a) for a in new.args})
    chosen = cheap_values(saved)
    lines, more = recompute(new.bound_symbols, is_backward, chosen, new.make_name,
                            reasons={k: "cheap" for k in chosen})
    if more.lines:
        cheap = new.derive("Cheap values recomputed in the backward (transforms/remat_policy.py)")
        cheap.bound_symbols = lines
        traces.append(cheap)
        new = cheap
    return new
