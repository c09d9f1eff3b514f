"""Runs the compiler makes for itself leave the process's random generators as they were.

Fake and meta runs that ask torch about an op (its layout, what it saves, its ``grad_fn``'s name) can draw from
global generators: torch's meta kernels for collectives (``dist.all_reduce`` on meta tensors) number their fake
work with Python's ``random.randint``.  A user's step never draws there in eager, so a draw would move the user's
random stream (and be refused as the function's own draw by acquisition/global_state.py)."""
from __future__ import annotations

import contextlib
import random
import sys

import torch


@contextlib.contextmanager
def generators_kept():
    """Python's, numpy's (where imported) and torch's default CPU generator are put back on exit."""
    state = random.getstate()
    np = sys.modules.get("numpy")
    np_state = np.random.get_state(legacy=False) if np is not None else None
    cpu = torch.default_generator.get_state()
    try:
        yield
    finally:
        random.setstate(state)
        if np_state is not None:
            np.random.set_state(np_state)
        torch.default_generator.set_state(cpu)
