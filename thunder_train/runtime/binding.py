"""Thin mode's binding: when a compiled function binds an entry, what its calls check, and when it lets go.

Once the same entry validated on two consecutive full-path calls, ``_after_validation`` generates ``thin_call``
(thin_checks.py) and makes it the compiled function's ``__call__``; the entry's slot (slot.py) then says what
``thin_call`` runs (the bound inputs as defaults, thin_args.py; a CUDA graph, cuda_graphs.py).  The handlers
below are what ``thin_call`` falls back to: a changed assumption re-validates (``_thin_changed``), a per-call
input that does not match raises ``ThinModeError`` (``_thin_mismatch``), ``check_every`` runs the full prologue
(``_thin_periodic``), a decision that went the other way runs the entry for it (``_thin_decided``).
See docs/thin_mode.md.
"""
from __future__ import annotations

import torch

from ..compiler.errors import DecisionMismatch, GuardFailure
from ..compiler.prologue import GLOBAL_LABELS, current_global_state, describe_diffs
from . import cuda_graphs as graphs, hook_guard, thin
from .cache_keys import describe_struct_diff, struct_key
from .cache import _STRUCTURE_ERRORS
from .thin import ThinBinding


class ThinPath:
    """The thin path of a compiled function (see the module docstring)."""

    def _init_thin_path(self) -> None:
        self._prev_validated = None  # (entry, leaf values) of the previous full-path call
        self._binding: ThinBinding | None = None
        self._thin_decided_at = -1  # stats.calls of the last thin call whose program went another way

    def _after_validation(self, entry, vals):
        """Bind once the same entry validated on two consecutive calls (the steady state)."""
        prev = self._prev_validated
        self._prev_validated = (entry, vals)
        if self._binding is not None or prev is None or prev[0] is not entry:
            return
        thin.watch(v for leaf, v in zip(entry.leaves, vals) if leaf.kind == "module")
        binding = ThinBinding(entry, vals, (), None, self.stats.calls, self.check_every or 0, self.check_every or 0,
                              entry.struct_key[2], thin.epoch())
        handlers = {"changed": self._thin_changed, "mismatch": self._thin_mismatch, "periodic": self._thin_periodic,
                    "failed": self._thin_failed, "decided": self._thin_decided}
        graphed = None
        if self.cuda_graphs:
            why = graphs.obstacle(entry)
            if why is not None:
                self._graph_note(f"cuda_graphs: not captured: {why}; the program runs uncaptured")
            else:
                graphed = graphs.GraphedProgram(entry, binding, self._graph_note, self.stats)
        try:
            fn, static_idx, adapt = thin.build_thin_call(
                entry, vals, prev[1], nargs=len(entry.struct_key[0]),
                kwnames=tuple(k for k, _ in entry.struct_key[1]), global_state=entry.struct_key[2],
                handlers=handlers, stats=self.stats, binding_holder=binding, check_every=self.check_every,
                graphed=graphed is not None)
        except thin.CannotBind as why:
            if str(why) not in self.stats.thin_bind_failures[-1:]:
                self.stats.thin_bind_failures.append(str(why))
            return
        binding.fn, binding.static_idx = fn, static_idx
        self._binding = binding
        entry.slot.bind_thin(adapt, graphed)  # from now on the slot says what thin_call runs
        self._call = fn.fn
        if entry.updates_parameters and torch._C._is_any_autocast_enabled():
            # Bound under autocast (a change of autocast state unbinds): each call probes the region first.
            probe, thin_fn = self._autocast_region.check, fn.fn

            def call_in_region(*args, **kwargs):
                probe()
                return thin_fn(*args, **kwargs)

            self._call = call_in_region
        self.stats.thin_binds += 1

    def _graph_note(self, line: str) -> None:
        if line not in self.stats.cuda_graph_notes[-1:]:
            self.stats.cuda_graph_notes.append(line)

    def _unbind(self, reason: str | None):
        if self._binding is not None and reason is not None:
            self.stats.thin_invalidations.append(reason)
        if self._binding is not None:
            slot = self._binding.entry.slot
            if slot.graphed is not None and slot.graphed.graph is not None:
                self._graph_note(f"cuda_graphs: graph dropped with the thin binding ({reason}); the next binding captures again")
            slot.unbind_thin()
        self._binding = None
        self._prev_validated = None
        self._call = self._full_call

    def _thin_changed(self, args, kwargs):
        b = self._binding
        g = current_global_state()
        diffs = describe_diffs(GLOBAL_LABELS, b.global_state, g)
        if not diffs:
            try:
                diffs = describe_diffs(b.entry.prologue.labels, b.entry.key, b.entry.prologue.key_of(args, kwargs))
            except _STRUCTURE_ERRORS:
                diffs = []
        if not diffs and thin.epoch() != b.epoch:
            diffs = [f"a bound module changed: {thin._Epoch.why}"]
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
        if self._thin_decided_at == self.stats.calls - 1:
            text, expected = entry.checked[mismatch.index]
            self._unbind(f"{text} was {expected!r}, now {mismatch.value!r} on two calls in a row")
        self._thin_decided_at = self.stats.calls
        return self._redispatch(args, kwargs, struct_key(args, kwargs, self.arg_key), entry, mismatch)

    def _thin_mismatch(self, args, kwargs):
        b = self._binding
        raise thin.mismatch_error(b.entry, b.entry.prologue, args, kwargs, self._arg_names, describe_struct_diff)

    def _thin_periodic(self, args, kwargs):
        b = self._binding
        b.countdown = b.check_every
        try:
            vals = thin.periodic_check(b, b.entry.prologue, b.entry.leaves, args, kwargs, self._arg_names)
        except GuardFailure:
            self._unbind("check_every found a change")
            raise
        self.stats.validations += 1
        try:
            return b.entry.slot.run(*b.entry.select(vals))
        except DecisionMismatch as mismatch:
            return self._redispatch(args, kwargs, struct_key(args, kwargs, self.arg_key), b.entry, mismatch)

    def revalidate(self) -> None:
        """Drop the thin binding: the next calls run the full prologue (and retrace if needed) and bind again.

        Call it after changing what thin mode bound: ``model.to(...)``,
        ``model.half()``, replacing parameters or optimizer state, changing
        grad mode, autocast or the default dtype for good.  Hooks are read again too (also ones edited into a
        hook dict directly, which no version counter sees).
        """
        hook_guard.recheck(e for probes in self._cache.values() for probe in probes for e in probe.entries.values())
        self._unbind("revalidate()")

    @property
    def is_thin_bound(self) -> bool:
        return self._binding is not None
