"""Thin mode's binding: when a compiled function binds an entry, what its calls check, and when it lets go.

Once the same entry validated on two full-path calls, ``_after_validation`` generates ``thin_call``
(thin_checks.py) and makes it the compiled function's ``__call__``; the entry's slot (slot.py) then says what
``thin_call`` runs (the bound inputs as defaults, thin_args.py; a CUDA graph, cuda_graphs.py, one per size when
sizes are symbolic, graphs_per_size.py).  Each entry keeps its binding while it is valid (``_bindings``): a call
its binding does not accept leaves it parked with its entry and takes another's.  The handlers below are what
``thin_call`` falls back to: a changed assumption re-validates (``_thin_changed``), a per-call input that does
not match (a new size, dtype or value) switches to another entry's binding or takes the full path
(``_thin_mismatch``), ``check_every`` runs the full prologue (``_thin_periodic``), a decision that went the
other way runs the entry for it (``_thin_decided``).
See docs/thin_mode.md.
"""
from __future__ import annotations

import torch

from ..compiler.errors import DecisionMismatch, GuardFailure
from ..compiler.acquisition import ambient
from ..compiler.prologue import GLOBAL_LABELS, current_global_state, describe_diffs, is_symbolic
from . import cuda_graphs as graphs, hook_guard, thin
from .cache import _STRUCTURE_ERRORS, _per_call_input_differs
from .graphs_per_size import GraphsPerSize
from .recurring_sizes import SizeRecurred
from .thin import ThinBinding

_SWITCH_TRIES = 4  # bindings of other entries a thin call that its binding does not accept tries before the full path


class _NotThisOne(Exception):
    """A binding tried for a call its own binding did not accept does not accept it either."""


class ThinPath:
    """The thin path of a compiled function (see the module docstring)."""

    def _init_thin_path(self) -> None:
        self._seen: dict = {}  # id(entry) -> leaf values of its latest validated call (thin mode binds on the second)
        self._bindings: dict = {}  # id(entry) -> its ThinBinding, kept while valid (most recently bound last)
        self._switching = False  # a thin call is trying the bindings of other entries (_thin_mismatch)
        self._binding: ThinBinding | None = None
        self._thin_decided_at = -1  # stats.calls of the last thin call whose program went another way

    def _after_validation(self, entry, vals):
        """Bind once the same entry validated on two calls (the steady state); an entry bound before (another
        size or value, left by a call its program did not accept) gets its binding back at once."""
        if self._binding is not None:
            return
        parked = self._bindings.get(id(entry))
        if parked is not None:
            self._activate(parked)
            return
        prev = self._seen.get(id(entry))
        self._seen[id(entry)] = vals
        if prev is None:
            return
        thin.watch(v for leaf, v in zip(entry.leaves, vals) if leaf.kind == "module")
        binding = ThinBinding(entry, vals, (), None, self.stats.calls, self.check_every or 0, self.check_every or 0,
                              entry.struct_key[2], thin.epoch(), ambient.mode_stacks())
        handlers = {"changed": self._thin_changed, "mismatch": self._thin_mismatch, "periodic": self._thin_periodic,
                    "failed": self._thin_failed, "decided": self._thin_decided}
        # The entry's second call: its steady program (slot.py ``settle``) is the one the binding and a CUDA graph run
        entry.slot.settle()
        graphed = None
        if self.cuda_graphs:
            why = graphs.obstacle(entry)
            if why is not None:
                self._graph_note(f"cuda_graphs: not captured: {why}; the program runs uncaptured")
            else:
                graphed = graphs.GraphedProgram(entry, binding, self._graph_note, self.stats)
                if any(is_symbolic(leaf) for leaf in entry.leaves):  # one graph per size (graphs_per_size.py)
                    graphed = GraphsPerSize(
                        lambda: graphs.GraphedProgram(entry, binding, self._graph_note, self.stats),
                        lambda: [j for j, i in enumerate(entry.input_idx) if i in set(binding.static_idx)],
                        self._lru.limit, self._graph_note)
        try:
            fn, static_idx, adapt = thin.build_thin_call(
                entry, vals, prev, nargs=len(entry.struct_key[0]),
                kwnames=tuple(k for k, _ in entry.struct_key[1]), global_state=entry.struct_key[2],
                handlers=handlers, stats=self.stats, binding_holder=binding, check_every=self.check_every,
                graphed=graphed is not None)
        except thin.CannotBind as why:
            if str(why) not in self.stats.thin_bind_failures[-1:]:
                self.stats.thin_bind_failures.append(str(why))
            return
        binding.fn, binding.static_idx = fn, static_idx
        entry.slot.bind_thin(adapt, graphed)  # from now on the slot says what thin_call runs
        self._activate(binding)
        self.stats.thin_binds += 1

    def _activate(self, binding, touch=True):
        """Calls go to ``binding``'s ``thin_call`` from now on (it checks every assumption it makes on each call)."""
        entry, fn = binding.entry, binding.fn
        self._binding = binding
        self._bindings.pop(id(entry), None)
        self._bindings[id(entry)] = binding  # the most recently bound last: tried first on a mismatch
        if touch:
            self._lru.touch(entry)
        self._call = fn.fn
        if entry.updates_parameters and torch._C._is_any_autocast_enabled():
            # Bound under autocast (a change of autocast state unbinds): each call probes the region first.
            probe, thin_fn = self._autocast_region.check, fn.fn

            def call_in_region(*args, **kwargs):
                probe()
                return thin_fn(*args, **kwargs)

            self._call = call_in_region

    def _park(self):
        """Calls take the full path again; the binding stays with its entry (and its slot bound) for when that
        entry is selected again."""
        self._binding = None
        self._call = self._full_call

    def _drop_parked(self, entry=None):
        """Forget the parked binding of ``entry`` (None: of every entry): its slot lets go of its argument order
        and CUDA graph."""
        current = self._binding.entry if self._binding is not None else None
        for k in ([id(entry)] if entry is not None else list(self._bindings)):
            b = self._bindings.pop(k, None)
            if b is not None and b.entry is not current:
                b.entry.slot.unbind_thin()

    def _forget_binding(self, entry, reason):
        """``entry`` leaves the cache (cache.py ``_evict``): its binding goes, the current one with ``reason``."""
        if self._binding is not None and self._binding.entry is entry:
            self._unbind(reason)
        self._drop_parked(entry)
        self._seen.pop(id(entry), None)

    def _graph_note(self, line: str) -> None:
        if line not in self.stats.cuda_graph_notes[-1:]:
            self.stats.cuda_graph_notes.append(line)

    def _unbind(self, reason: str | None):
        if self._binding is not None and reason is not None:
            self.stats.thin_invalidations.append(reason)
        if self._binding is not None:
            self._bindings.pop(id(self._binding.entry), None)
            slot = self._binding.entry.slot
            if slot.graphed is not None and slot.graphed.graph is not None:
                self._graph_note(f"cuda_graphs: graph dropped with the thin binding ({reason}); the next binding captures again")
            slot.unbind_thin()
        self._binding = None
        self._seen.clear()
        self._call = self._full_call

    def _thin_changed(self, args, kwargs):
        b = self._binding
        ambient.refuse_at_call(b.entry.has_backward)  # the binding stays for calls made without them
        g = current_global_state()
        if g == b.global_state and thin.epoch() == b.epoch and _per_call_input_differs(b.entry, args, kwargs, self._dims):
            # A decision on a size or a per-call value went another way: another entry's call, not a change of
            # what this binding assumed (it keeps checking that on every call it runs).
            return self._thin_mismatch(args, kwargs)
        diffs = describe_diffs(GLOBAL_LABELS, b.global_state, g)
        if not diffs:
            try:
                diffs = describe_diffs(b.entry.prologue.labels, b.entry.key, b.entry.prologue.key_of(args, kwargs))
            except _STRUCTURE_ERRORS:
                diffs = []
        if not diffs and thin.epoch() != b.epoch:
            diffs = [f"a bound module changed: {thin._Epoch.why}"]
        modes = ambient.mode_stacks()
        if not diffs and modes != b.modes:
            diffs = [f"the modes around the call changed (function, dispatch modes: {b.modes} → {modes}; "
                     "torch.set_default_device sets one)"]
        self._unbind("; ".join(diffs) or "something the binding assumed changed (optimizer state, .grad, requires_grad, storage)")
        return self._run_full(args, kwargs)

    def _thin_failed(self, args, kwargs, exc):
        """The computation raised: if the inputs no longer match what thin mode bound, say so (else re-raise)."""
        raise_if_stale = thin.stale_binding_error(self._binding, args, kwargs, self._arg_names, exc)
        if raise_if_stale is not None:
            self._unbind("the computation raised on inputs that changed since binding")
            raise raise_if_stale from exc

    def _thin_decided(self, args, kwargs, mismatch):
        """The bound program found a decision going the other way (nothing was written): this call runs the
        entry for the value observed.  The binding stays for the next call, unless the previous call also went
        the other way: then the decision changed for good and the full path binds the other entry."""
        b = self._binding
        self.stats.full_calls += 1
        self.stats.validations += 1
        entry = b.entry
        if isinstance(mismatch, SizeRecurred):  # not a decision: this size gets its program (recurring_sizes.py)
            try:
                return self._specialise_size(args, kwargs, entry, entry.prologue.extract.fn(*args, **kwargs))
            except DecisionMismatch as decided:  # the symbolic program ran it (no program for the size) and decided
                mismatch = decided
        if self._thin_decided_at == self.stats.calls - 1:
            text, expected = entry.checked[mismatch.index]
            self._unbind(f"{text} was {expected!r}, now {mismatch.value!r} on two calls in a row")
        self._thin_decided_at = self.stats.calls
        return self._redispatch(args, kwargs, self._dims.key(args, kwargs), entry, mismatch)

    def _thin_mismatch(self, args, kwargs):
        """A per-call input the bound program does not accept (a new size, dtype or value): another entry's binding
        that accepts it runs the call (a flag's other value), else the full path finds or builds the entry for it
        and binds that.  This binding stays with its entry for when its inputs come back."""
        if self._switching:
            raise _NotThisOne
        current = self._binding
        self._park()
        tried = 0
        for b in reversed(list(self._bindings.values())):
            if b is current or tried == _SWITCH_TRIES:
                continue
            tried += 1
            self._activate(b, touch=False)
            self._switching = True
            self.stats.calls -= 1  # the same call, counted again by the thin_call tried
            try:
                out = self._call(*args, **kwargs)  # its thin_call (autocast probe first, if bound so) checks the call
            except _NotThisOne:
                self._park()
                continue
            finally:
                self._switching = False
            self._lru.touch(b.entry)
            return out
        self.stats.thin_fallbacks += 1
        return self._run_full(args, kwargs)

    def _thin_periodic(self, args, kwargs):
        b = self._binding
        b.countdown = b.check_every
        if _per_call_input_differs(b.entry, args, kwargs, self._dims):
            return self._thin_mismatch(args, kwargs)  # a new batch size or value: not a change of what was bound
        try:
            vals = thin.periodic_check(b, b.entry.prologue, b.entry.leaves, args, kwargs, self._arg_names)
        except GuardFailure:
            self._unbind("check_every found a change")
            raise
        self.stats.validations += 1
        try:
            return self._run_entry(args, kwargs, b.entry, vals)
        except DecisionMismatch as mismatch:
            return self._redispatch(args, kwargs, self._dims.key(args, kwargs), b.entry, mismatch)

    def revalidate(self) -> None:
        """Drop the thin binding: the next calls run the full prologue (and retrace if needed) and bind again.

        Call it after changing what thin mode bound: ``model.to(...)``,
        ``model.half()``, replacing parameters or optimizer state, changing
        grad mode, autocast or the default dtype for good.  Hooks are read again too (also ones edited into a
        hook dict directly, which no version counter sees).
        """
        hook_guard.recheck(e for probes in self._cache.values() for probe in probes for e in probe.entries.values())
        self._unbind("revalidate()")
        self._drop_parked()

    @property
    def is_thin_bound(self) -> bool:
        return self._binding is not None
