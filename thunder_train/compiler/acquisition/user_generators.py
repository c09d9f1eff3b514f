"""Random generators the user's code owns (``random.Random(seed)``, numpy's ``default_rng()`` and ``RandomState``):
a draw from one while tracing would be a constant of the program.

Python's and numpy's global generators are checked by global_state.py.  A generator object the function reaches
(an argument, a global or closure cell, an attribute of an object, an item of a container, an object a module holds
and the function reads: ``self.rng.random() < self.p`` in a layer-drop module) is noted with its state when first
reached (walker.py, instance_reads.py); once the function has run, one whose state moved was drawn from: its state is
put back and the call refused with what to do, as for the global ones.  A failed trace puts every noted generator's
state back too.  Before, each such draw was traced once and replayed as the same number on every call (a layer
dropped always or never, an augmentation's one scale), silently.
"""
from __future__ import annotations

import pickle
import random
import sys

from ..errors import TracingError


def _numpy_random():
    return sys.modules.get("numpy.random")


def is_generator(x) -> bool:
    """A generator object of the user's (not the process-wide ones: global_state.py checks those)."""
    if isinstance(x, random.Random):
        return x is not getattr(random, "_inst", None)
    npr = _numpy_random()
    if npr is None or not isinstance(x, (npr.Generator, npr.RandomState, npr.BitGenerator)):
        return False
    return x is not getattr(getattr(npr, "mtrand", None), "_rand", None)


def _state(x):
    if isinstance(x, random.Random):
        return x.getstate()
    npr = _numpy_random()
    if isinstance(x, npr.Generator):
        return x.bit_generator.state
    if isinstance(x, npr.RandomState):
        return x.get_state(legacy=False)
    return x.state


def _set_state(x, state) -> None:
    if isinstance(x, random.Random):
        x.setstate(state)
        return
    npr = _numpy_random()
    if isinstance(x, npr.Generator):
        x.bit_generator.state = state
    elif isinstance(x, npr.RandomState):
        x.set_state(state)
    else:
        x.state = state


def note(noted: dict, x, where: str) -> None:
    """Remember ``x``'s state at its first sight in this trace (``noted``: id -> (where, generator, state bytes))."""
    if id(x) not in noted:
        state = _state(x)
        noted[id(x)] = (where, x, state, pickle.dumps(state))


def _moved(noted: dict) -> list:
    return [(where, x, state) for where, x, state, taken in noted.values() if pickle.dumps(_state(x)) != taken]


def put_back(noted: dict) -> None:
    """After a failed trace: every noted generator as it was."""
    for _, x, state in _moved(noted):
        _set_state(x, state)


def check(noted: dict) -> None:
    """After the function ran: a generator drawn from is put back and the call refused."""
    moved = _moved(noted)
    for _, x, state in moved:
        _set_state(x, state)
    if moved:
        names = ", ".join(f"{where} ({type(x).__module__}.{type(x).__name__})" for where, x, _ in moved)
        raise TracingError(
            f"the compiled function drew from {names} while tracing: the program would use the numbers drawn then as "
            "constants on every call, where eager draws new ones. Draw them outside the compiled function and pass "
            "them in as tensors, or draw with torch inside (torch.rand, torch.randperm, torch.bernoulli), which the "
            "program draws on every call. The generator was put back as it was.")
