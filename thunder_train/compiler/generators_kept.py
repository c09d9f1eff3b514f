"""Runs the compiler makes for itself leave the process's random generators as they were.

Fake and meta runs that ask torch about an op (its layout, what it saves, its ``grad_fn``'s name) can draw from
global generators: torch's meta kernels for collectives (``dist.all_reduce`` on meta tensors) number their fake
work with Python's ``random.randint``, and a probe on small real CPU tensors may run a random op (``bernoulli_``).
A user's step never draws there in eager, so a draw would move the user's random stream (and be refused as the
function's own draw by acquisition/global_state.py).  numpy's generator is not kept: no torch kernel draws from it,
and reading its state costs ~50 us, more than the fake run itself."""
from __future__ import annotations

import contextlib
import random

import torch


@contextlib.contextmanager
def generators_kept():
    """Python's generator and torch's default CPU generator are put back on exit (~15 us).  Through the generator's
    own methods: while a thread traces, ``torch.get_rng_state`` and ``fork_rng`` are lines of the program."""
    state = random.getstate()
    cpu = torch.default_generator.get_state()
    try:
        yield
    finally:
        random.setstate(state)
        torch.default_generator.set_state(cpu)
