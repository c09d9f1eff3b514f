"""Sizes that recur: a symbolic entry runs a program specialised for each size its calls come back to often.

A symbolic program (automatic dynamic shapes, ``dynamic=True``) serves every length, but it has no fused
regions and keeps buffers only for values of constant size (docs/dynamic_shapes.md).  When lengths come from a
few buckets (``pad_to_multiple_of=16``, fixed bucket lengths) each of them recurs, and a program traced for that
size has both: kept buffers for every value (executors/buffers.py) and a background fusion build with its pay-back
rule (background.py).

``RecurringSizes`` belongs to a symbolic entry's slot (slot.py) and wraps what the slot runs, so the full path and
the thin binding go through the same dispatch: the key of a call is the shape and strides of its inputs with
symbolic sizes (what a program traced for fixed sizes checks of them; the entry's own checks cover the rest), one
dict lookup.  When to trace a size's program is a rent-or-buy choice: the trace costs about what the symbolic
entry's own trace cost (``price``), and would save a fraction of each call of that size, estimated at
``ASSUMED_GAIN`` (kept buffers measured 0-15 % on the CPU zoo steps, docs/dynamic_shapes.md).  A size's program is
traced once the calls of that size have spent so much in the symbolic program that the saving would have paid for
the trace (``ASSUMED_GAIN * seconds spent >= price``), and at least ``MIN_CALLS`` of them ran: whatever follows,
at most twice the best choice's cost in hindsight.  Dynamic padding (a new length nearly every step) rarely gets
there; a bucket length that keeps coming back does.  The first program's calls are then timed against the symbolic
program's at that size (``_judge``): no faster, it is released and the entry traces no more; faster, the gain
measured replaces the assumed one.  At most ``limit`` programs (the compiled function's
``cache_limit``) are kept, the least recently used released with its buffers and fusion build.  Tracing needs the call's arguments, which only the callers have: the dispatch raises ``SizeRecurred``
before running anything, and ``cache.py``/``binding.py`` trace the program (``add``) and run the call again.

Memory: each program holds its kept buffers between calls.  So that the sizes' arenas never add up, a call that
runs another program than the previous one frees the previous one's buffers first: what is held is one program's
arena, within that program's peak without it (the plan's guarantee).
"""
from __future__ import annotations

import collections
import time
from operator import itemgetter

from ..compiler.acquisition.provenance import path_str
from ..compiler.errors import DecisionMismatch
from ..compiler.executors.buffers import drop_kept_sets
from ..compiler.prologue import is_symbolic

MIN_CALLS = 4  # calls of one size before its program is traced
ASSUMED_GAIN = 0.1  # the fraction of a call's time a program with fixed sizes is taken to save, until measured
JUDGE_CALLS = 8  # timed calls of a size's program (after its first) before it is compared with the symbolic one


class SizeRecurred(DecisionMismatch):
    """Raised by the dispatch before running anything: this call's size is due for its own program."""

    def __init__(self):
        Exception.__init__(self, "a size recurred: its program is traced by the caller (tt.compile catches this)")
        self.index, self.value = -1, None


class RecurringSizes:
    """The programs of a symbolic entry specialised per recurring size (see the module docstring)."""

    def __init__(self, entry, limit, note, price: float):
        self.entry = entry
        self.price = price  # seconds a trace of this step costs (the symbolic entry's own)
        leaf_pos = {}
        for p, i in enumerate(entry.input_idx):
            leaf_pos.setdefault(i, p)
        self.leaf_pos = leaf_pos  # leaf index -> position among the computation's arguments
        self.positions = tuple(leaf_pos[i] for i, leaf in enumerate(entry.leaves) if is_symbolic(leaf) and i in leaf_pos)
        self.limit = limit
        self.note = note
        self.counts: dict = {}  # key -> calls the symbolic program ran at that size
        self.spent: dict = {}  # key -> seconds they took
        self.programs: collections.OrderedDict = collections.OrderedDict()  # key -> (Entry, argument picker)
        self.tried: set = set()  # keys whose program was traced or refused: never due again
        self.trial: dict = {}  # key -> [calls, seconds] of its program, until judged
        self.gain = None  # measured by the first program judged (None: ASSUMED_GAIN)
        self.enabled = True  # False once a size's program was measured no faster than the symbolic one
        self.held = None  # the traces whose kept buffers the last call left held

    @staticmethod
    def usable(entry) -> bool:
        """Every input with symbolic sizes is an argument of the program (the key reads it from there)."""
        taken = set(entry.input_idx)
        symbolic = [i for i, leaf in enumerate(entry.leaves) if is_symbolic(leaf)]
        return bool(symbolic) and all(i in taken for i in symbolic)

    def key(self, inputs) -> tuple:
        return tuple((inputs[p].shape, inputs[p].stride()) for p in self.positions)

    def wrap(self, run, slot):
        """``run`` (the symbolic program) behind the dispatch on sizes."""
        def dispatch(*inputs):
            k = self.key(inputs)
            found = self.programs.get(k)
            if found is not None:
                self.programs.move_to_end(k)
                spec, pick = found
                self._hold(spec.slot)
                trial = self.trial.get(k)
                if trial is None:
                    return spec.slot.run(*pick(inputs))
                spec.slot.settle()  # a size that recurs: its steady program now, not inside a timed call
                t0 = time.perf_counter()
                out = spec.slot.run(*pick(inputs))
                self._judge(k, trial, time.perf_counter() - t0)
                return out
            if not self.enabled and not self.programs:
                return run(*inputs)  # sizes' programs measured no faster, none left: nothing more to count or time
            n = self.counts.get(k, 0)
            gain = ASSUMED_GAIN if self.gain is None else self.gain
            if n >= MIN_CALLS and self.enabled and gain * self.spent[k] >= self.price and k not in self.tried:
                self.tried.add(k)
                raise SizeRecurred()  # the caller traces this size's program, then runs the call through here
            self._hold(slot)
            t0 = time.perf_counter()
            out = run(*inputs)
            self.counts[k] = n + 1
            self.spent[k] = self.spent.get(k, 0.0) + time.perf_counter() - t0
            return out

        return dispatch

    def _judge(self, k, trial, seconds) -> None:
        """Time the first calls of ``k``'s program against the symbolic program's at that size: a program no faster
        is released, and this entry traces no more (what it saves is measured, not assumed, from then on)."""
        trial[0] += 1
        if trial[0] == 1:
            return  # its first call allocates what later calls keep
        trial[1] += seconds
        if trial[0] <= JUDGE_CALLS:
            return
        del self.trial[k]
        own, symbolic = trial[1] / (trial[0] - 1), self.spent[k] / self.counts[k]
        line = f"sizes {_sizes(k)}: {1e3 * own:.2f} ms a call against {1e3 * symbolic:.2f} ms with the symbolic program"
        if own < symbolic:
            self.gain = 1 - own / symbolic
            self.note(line + ": kept")
            return
        self.enabled = False
        spec, _ = self.programs.pop(k)
        self._forget(spec)
        self.note(line + ": released; no more programs per size for this entry")

    def _hold(self, slot) -> None:
        """``slot``'s program runs now: the previous program's kept buffers go back to the allocator."""
        if self.held is not slot:
            if self.held is not None:
                drop_kept_sets(self.held.traces + list(self.held.backward_traces or ()))
            self.held = slot

    def add(self, inputs, spec) -> str | None:
        """Run ``spec`` (traced for the sizes of ``inputs``) for calls of its size; the reason when it cannot."""
        e = self.entry
        if len(spec.leaves) != len(e.leaves) or any(
                a.kind != b.kind or path_str(a.path) != path_str(b.path) for a, b in zip(spec.leaves, e.leaves)):
            return "its program reads other inputs than the symbolic one"
        if spec.checked:
            return "its program checks decisions on intermediate values"
        if any(i not in self.leaf_pos for i in spec.input_idx):
            return "its program takes an input the symbolic one does not"
        positions = [self.leaf_pos[i] for i in spec.input_idx]
        pick = (lambda inputs: ()) if not positions else (
            (lambda inputs, g=itemgetter(*positions): (g(inputs),)) if len(positions) == 1 else itemgetter(*positions))
        k = self.key(inputs)
        self.programs[k] = (spec, pick)
        if k in self.counts:
            self.trial[k] = [0, 0.0]
        if self.limit is not None and len(self.programs) > self.limit:
            old_key, (old, _) = self.programs.popitem(last=False)
            self.tried.discard(old_key)
            self.counts.pop(old_key, None)
            self.spent.pop(old_key, None)
            self.trial.pop(old_key, None)
            self._forget(old)
            self.note(f"recurring sizes: the program for {_sizes(old_key)} released: more than {self.limit} sizes (cache_limit)")
        return None

    def _forget(self, spec) -> None:
        if self.held is spec.slot:
            self.held = None
        spec.slot.release()

    def release(self) -> None:
        for spec, _ in self.programs.values():
            self._forget(spec)
        self.programs.clear()


def _sizes(key) -> str:
    return ", ".join(str(tuple(shape)) for shape, _ in key)
