"""The memory plan of a whole step: what the backward recomputes instead of keeping (transforms/remat.py)."""
from __future__ import annotations

from .remat import recompute_checkpointed


def plan_memory(trc, traces: list):
    """Checkpoint regions recomputed in the backward; the new trace is appended to ``traces``."""
    new, report = recompute_checkpointed(trc)
    if new is not trc:
        traces.append(new)
    return new
