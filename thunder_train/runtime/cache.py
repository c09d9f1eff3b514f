"""The cache: from a call's arguments to the entry that runs it (dispatch), compiling on a miss.

A structural key of the arguments and global state (``cache_keys.py``) selects a bucket; in it, one ``_Probe``
per leaf structure holds its prologue (generated ``extract`` and ``guard_key``, compiler/prologue.py) and its
entries by guard key: a lookup is one ``extract``, one ``guard_key`` and one dict access however many entries
exist.  A miss runs the pipeline (compiler/pipeline.py), wraps its frozen product in an ``Entry`` with the
``Slot`` that says what it runs (slot.py), files it, and records why it missed (``retrace_reasons``, naming the
input and both values).  A program that finds a decision it checks going the other way raises
``DecisionMismatch`` before writing anything; ``_redispatch`` runs the entry for the observed value
(``_Probe.paths``), tracing it if there is none.

``FullPath`` is the full path of ``CompiledFunction`` (compiled.py); ``binding.py`` its thin path.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import sys
import time
import warnings

from ..compiler.acquisition import ambient
from ..compiler.acquisition.provenance import CAPTURED_ROOTS, per_call_mask
from ..compiler.errors import DecisionMismatch, UninitializedLazyModule
from ..compiler.pipeline import Options, compile_entry
from ..compiler.prologue import Prologue, count_diffs, describe_diffs
from . import background, bounded_cache, hook_guard
from .autocast_region import RegionProbe
from .cache_keys import arg_key, struct_diffs, struct_key
from .recurring_sizes import RecurringSizes, SizeRecurred
from .slot import Entry, Slot
from .symbolic_dims import SymbolicDims, is_symbolic_trace, symbolic_fusion_decision


@dataclasses.dataclass
class _Probe:
    """One leaf structure within a structural-key bucket: its prologue and entries by guard key."""

    prologue: Prologue
    entries: dict
    # (guard key, (text, value) of the first checked decisions) -> an entry whose program decides so
    # (compiler/acquisition/decisions.py); entries[guard key] is the one a call runs first.
    paths: dict = dataclasses.field(default_factory=dict)


def _user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel naming the user's line that called into thunder_train."""
    f, level = sys._getframe(2), 2  # the caller of the function that warns
    while f is not None and f.f_code.co_filename.startswith((_PACKAGE_DIR, "<thunder_train ")):
        f, level = f.f_back, level + 1
    return level


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # thunder_train/
_RETRACE_STORM = 8  # consecutive cache misses after which a self-inflicted retrace storm is reported

_STRUCTURE_ERRORS = (LookupError, AttributeError, TypeError)


def _per_call_input_differs(entry, args, kwargs, dims) -> bool:
    """The call's structure or a per-call input (the batch, a Python flag) differs from what ``entry`` was traced for."""
    pro = entry.prologue
    try:
        key = pro.key_of(args, kwargs)
    except _STRUCTURE_ERRORS:
        # The prologue cannot read this call: per-call when the arguments' own structure differs; otherwise captured
        # state changed shape (a global rebound to a new optimizer with no state yet), a change of what was bound.
        return dims.key(args, kwargs) != entry.struct_key
    # Globals and closure cells are state the caller rebinds (a change of what was bound), not the call's inputs.
    per_call = [p and leaf.path[0].kind not in CAPTURED_ROOTS for p, leaf in zip(per_call_mask(entry.leaves), entry.leaves)]
    return any(a != e and per_call[pro.label_leaf[j]] for j, (a, e) in enumerate(zip(key, entry.key)))


def _probe_key(probe, args, kwargs):
    """``(leaf values, guard key)`` of this call under ``probe``'s prologue, or None when its structure differs."""
    pro = probe.prologue
    try:
        vals = pro.extract.fn(*args, **kwargs)
        return vals, pro.guard_key_fn.fn(*vals)
    except _STRUCTURE_ERRORS:
        return None


@contextlib.contextmanager
def _no_cyclic_gc():
    """Python's cyclic garbage collector off while a program is compiled (on again after, if it was on).

    A trace allocates many objects that are short-lived but alive across several collections, so the collector
    scans them over and over and moves them to the oldest generation; once that has grown by a quarter since the
    last full collection, a full collection runs, scanning every object of the process (0.4-0.9 s under load with
    three copies of a model and transformers loaded, in the middle of the second trace of
    benchmarks/dynamic_shapes.py).  With the collector off, what the trace frees is freed by reference counting as
    before; only what it leaves alive (the entry: ~20,000 objects for that Llama step) counts towards the next
    collection.  Garbage cycles made while compiling wait for that one."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class FullPath:
    """The full path of a compiled function: lookup, compile on a miss, decision re-dispatch.

    A base of ``CompiledFunction`` (compiled.py), which holds the function, its compile options and ``stats``;
    ``ThinPath`` (binding.py) is the other base, and the two call each other's entry points
    (``_after_validation`` after a validated call; ``_run_full`` and ``_redispatch`` from thin mode's handlers).
    """

    def _init_full_path(self, dynamic, cache_limit) -> None:
        self._dims = SymbolicDims(dynamic)  # which argument sizes are symbolic (symbolic_dims.py)
        self._lru = bounded_cache.EntryLRU(cache_limit)  # at most cache_limit entries per leaf structure
        self._cache: dict = {}  # structural key -> [_Probe]
        self._prologues: dict = {}  # generated source -> Prologue (shared across buckets)
        self._last: Entry | None = None  # the entry the last call ran
        self._call = self._full_call  # what cf(...) calls (binding.py puts thin_call here)
        self._autocast_region = RegionProbe()  # eager's autocast weight cache across calls (autocast_region.py)
        self._misses_in_a_row = 0  # a function that changes what it is specialised on retraces every call
        self._warned_forward_hooks = False  # hook_guard.forward_hooks_note said once per function

    def _full_call(self, *args, **kwargs):
        self.stats.calls += 1
        return self._run_full(args, kwargs)

    def _run_full(self, args, kwargs):
        ambient.refuse_at_call(False)  # modes and saved-tensor hooks around the call (acquisition/ambient.py)
        st = self.stats
        st.full_calls += 1
        st.validations += 1
        skey = self._dims.key(args, kwargs)
        probes = self._cache.get(skey)
        entry = None
        tried = []
        if probes is not None:
            for probe in probes:
                found = _probe_key(probe, args, kwargs)
                if found is None:
                    continue
                vals, gkey = found
                entry = probe.entries.get(gkey)
                if entry is not None:
                    break
                tried.append((probe, gkey))
        hit = entry is not None
        hooks_changed = entry.hooks.changed(entry.leaves, vals) if hit and entry.hooks is not None else None
        if hooks_changed is not None:  # hooks added or removed since tracing: retrace (the new entry replaces it)
            hit, entry = False, None
        if entry is None:
            try:
                entry, vals = self._compile_for_call(args, kwargs, skey, hooks_changed or self._miss_reason(skey, tried))
            except UninitializedLazyModule as why:
                return self._run_eagerly(args, kwargs, why)
            skey = entry.struct_key  # sizes that became symbolic for this call (symbolic_dims.py)
            self._note_forward_hooks(entry, vals)
        else:
            st.cache_hits += 1
            self._lru.touch(entry)
        self._last = entry
        if entry.has_backward:
            ambient.refuse_anomaly_at_backward()  # (a new entry's trace refused it at its backward already)
        if entry.updates_parameters:
            self._autocast_region.check()
        if self.thin:
            self._after_validation(entry, vals)
        try:
            out = self._run_entry(args, kwargs, entry, vals)
        except DecisionMismatch as mismatch:
            return self._redispatch(args, kwargs, skey, entry, mismatch)
        if hit:
            self._misses_in_a_row = 0  # a call that traced nothing ends a run of retraces
        return out

    def _run_eagerly(self, args, kwargs, why):
        """The call reaches a lazy module not initialised yet, whose forward picks its parameters' sizes and changes
        their class: it runs as eager runs it (the walk refused it before anything changed), and a later call traces
        the initialised module.  One the function never calls stays uninitialised: said once, every call is eager."""
        self.stats.eager_calls += 1
        if self.stats.eager_calls == 2:
            warnings.warn(f"thunder_train: a second call ran eagerly, uncompiled: {str(why).split(', whose')[0]} and "
                          "the call did not initialise it; every call runs eagerly until it is initialised (call it "
                          "once, or remove it from the model)", stacklevel=_user_stacklevel())
        return self.fn(*args, **kwargs)

    def _run_entry(self, args, kwargs, entry, vals):
        """Run ``entry`` for this call; a size that recurs gets its program first (recurring_sizes.py)."""
        try:
            return entry.slot.run(*entry.select(vals))
        except SizeRecurred:
            return self._specialise_size(args, kwargs, entry, vals)

    def _specialise_size(self, args, kwargs, entry, vals):
        """``entry``'s dispatch found a size that recurs (recurring_sizes.py): trace a program with every size of this
        call fixed (kept buffers for every value, background fusion), give it to the dispatch, and run the call."""
        inputs = entry.select(vals)
        t0 = time.perf_counter()
        sizes = entry.slot.sizes
        what = ", ".join(str(tuple(inputs[p].shape)) for p in sizes.positions)
        try:
            compiled, _ = self._trace(args, kwargs, struct_key(args, kwargs, arg_key), (), fixed_sizes=True)
        except Exception as e:  # noqa: BLE001 - the symbolic program runs this size, as before
            why = f"tracing it failed ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]})"
        else:
            spec = Entry(compiled, self._slot(compiled))
            why = sizes.add(inputs, spec)
            if why is not None:
                spec.slot.release()
        dt = time.perf_counter() - t0
        self.stats.total_trace_seconds += dt
        self.stats.recurring_sizes.append(
            f"sizes {what}: " + (f"own program ({dt:.2f} s to trace)" if why is None else f"the symbolic program stays: {why}"))
        return entry.slot.run(*inputs)

    # ---- decisions the program checks (compiler/acquisition/decisions.py) ----
    def _redispatch(self, args, kwargs, skey, entry, mismatch):
        """``entry``'s program found a decision going the other way and stopped before writing anything: run
        the entry traced for the value observed, tracing it (with that value) if there is none yet."""
        self.stats.decision_mismatches += 1
        tried = {id(entry)}
        while True:
            text, expected = entry.checked[mismatch.index]
            observed = entry.checked[:mismatch.index] + ((text, mismatch.value),)
            found = self._entry_for(skey, args, kwargs, observed)
            if found is None:
                entry, vals = self._compile_for_call(args, kwargs, skey, f"{text} was {expected!r}, now {mismatch.value!r}",
                                                     forced_decisions=observed)
            else:
                probe, gkey, entry, vals = found  # its calls are counted by its computation (pay-back rule)
            if id(entry) in tried or len(tried) > 2 * len(observed) + 2:
                raise RuntimeError(
                    f"thunder_train: the decisions the program checks do not settle ({text}: the program traced for "
                    f"{mismatch.value!r} decides otherwise when it runs); the value is not a deterministic function "
                    "of the inputs. Move the decision outside the compiled function and pass its result in.")
            tried.add(id(entry))
            self._last = entry
            if entry.updates_parameters:
                self._autocast_region.check()
            try:
                result = self._run_entry(args, kwargs, entry, vals)
            except DecisionMismatch as again:
                mismatch = again
                continue
            if found is not None:
                self._prefer(skey, probe, gkey, entry)
                self._misses_in_a_row = 0
            if self.thin:
                self._seen[id(entry)] = vals
            return result

    def _entry_for(self, skey, args, kwargs, observed):
        """``(probe, guard key, entry, leaf values)`` of an entry for this call whose program decides ``observed``."""
        for probe in self._cache.get(skey, ()):
            found = _probe_key(probe, args, kwargs) if probe.paths else None
            if found is None:
                continue
            vals, gkey = found
            entry = probe.paths.get((gkey, observed))
            if entry is not None:
                return probe, gkey, entry, vals
        return None

    def _prefer(self, skey, probe, gkey, entry):
        """The entry that ran last is the one the next call with this key tries first (decisions flip rarely)."""
        probe.entries[gkey] = entry
        probes = self._cache[skey]
        if probes[0] is not probe:
            probes.remove(probe)
            probes.insert(0, probe)

    def _miss_reason(self, skey, tried) -> str | None:
        """Which input differed from the nearest entry, and how."""
        if not self._cache:
            return None
        if tried:
            best = None
            for probe, gkey in tried:
                for e in probe.entries.values():
                    n = count_diffs(e.key, gkey)
                    if best is None or n < best[0]:
                        best = (n, probe.prologue.labels, e.key, gkey)
            if best is not None:
                diffs = describe_diffs(best[1], best[2], best[3])
                if diffs:
                    return "; ".join(diffs)
        if skey not in self._cache:
            def distance(k):  # a different argument count is farther than any value difference
                return len(struct_diffs(k, skey, limit=1000)) + 1000 * (len(k[0]) != len(skey[0]) or len(k[1]) != len(skey[1]))

            nearest = min(self._cache, key=distance)
            diffs = struct_diffs(nearest, skey)
            if diffs:
                return "; ".join(diffs)
        return "the structure of a module or container inside the arguments changed"

    def _compile_for_call(self, args, kwargs, key, reason, forced_decisions=()):
        """``_compile``, then this call's leaf values, and the entry's hooks as traced (hook_guard.py)."""
        entry = self._compile(args, kwargs, key, reason, forced_decisions)
        vals = entry.prologue.extract.fn(*args, **kwargs)
        entry.hooks = hook_guard.HookCheck(entry.leaves, vals)
        return entry, vals

    def _note_forward_hooks(self, entry, vals):
        """Forward hooks ran once, while tracing: their tensor work is in the program, their Python side effects
        (a list they append to, a print, a counter) are not repeated by later calls.  Said once per function."""
        note = hook_guard.forward_hooks_note(entry.leaves, vals)
        if note is not None and not self._warned_forward_hooks:
            self._warned_forward_hooks = True
            warnings.warn(note, stacklevel=_user_stacklevel())

    def _compile(self, args, kwargs, key, reason, forced_decisions=()) -> Entry:
        """A cache miss: run the pipeline (compiler/pipeline.py) and file the new entry."""
        self.stats.cache_misses += 1
        self._misses_in_a_row += 1
        key, reason = self._widen(args, kwargs, key, reason, forced_decisions)
        if reason is not None:
            self.stats.retrace_reasons.append(reason)
        t0 = time.perf_counter()
        try:
            compiled, opaque_ops = self._trace(args, kwargs, key, forced_decisions)
        except Exception as e:
            if isinstance(e, UninitializedLazyModule) or not isinstance(self._dims.for_trace(), SymbolicDims):
                raise
            # Automatic dynamic shapes: a program with these sizes symbolic cannot be traced (an op or a decision
            # that needs a concrete size); specialise every size from now on, as dynamic=False does.
            self._dims.give_up(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            self._drop_stale()
            key = self._dims.key(args, kwargs)
            self.stats.retrace_reasons.append(f"sizes specialised again: tracing with symbolic sizes failed ({self._dims.gave_up})")
            compiled, opaque_ops = self._trace(args, kwargs, key, forced_decisions)
        entry = Entry(compiled, self._slot(compiled))
        if self._specialises_sizes and RecurringSizes.usable(entry):
            entry.slot.specialise_sizes(RecurringSizes(entry, self._lru.limit, self.stats.recurring_sizes.append,
                                                       price=time.perf_counter() - t0))
        prologue, expected = entry.prologue, entry.key
        self.stats.memory = compiled.memory
        for note in entry.decision_notes:
            if note not in self.stats.decision_notes:
                self.stats.decision_notes.append(note)
        if self._misses_in_a_row == _RETRACE_STORM:
            self._warn_retrace_storm(entry)
        for name in opaque_ops:
            if name not in self.stats.opaque_ops:
                self.stats.opaque_ops.append(name)
        probes = self._cache.setdefault(key, [])
        for probe in probes:
            if probe.prologue is prologue:
                break
        else:
            probe = _Probe(prologue, {})
            probes.insert(0, probe)
        probe.entries[expected] = entry
        for k in range(1, len(entry.checked) + 1):
            probe.paths.setdefault((expected, entry.checked[:k]), entry)
        self.stats.entries += 1
        evicted = self._lru.add(entry)
        if evicted and self._lru.evicted == len(evicted):  # the first time the limit is hit
            warnings.warn(bounded_cache.limit_warning(getattr(self.fn, "__qualname__", "the compiled function"),
                                                      self._lru.limit, self.stats.retrace_reasons,
                                                      self._dims.describe(self._arg_names)), stacklevel=_user_stacklevel())
        for old in evicted:
            self._evict(old)
        dt = time.perf_counter() - t0
        self.stats.last_trace_seconds = dt
        self.stats.total_trace_seconds += dt
        self._last = entry
        return entry

    # ---- automatic dynamic shapes (symbolic_dims.py) and the bounded cache (bounded_cache.py) ----
    def _widen(self, args, kwargs, key, reason, forced_decisions):
        """A miss that differs from a cached call in sizes only makes those sizes symbolic: the key under them."""
        if forced_decisions or key in self._cache:
            return key, reason
        added = self._dims.widen(list(self._cache), key)
        if not added:
            return key, reason
        self._drop_stale()
        names = ", ".join(self._dims.describe(self._arg_names))
        return self._dims.key(args, kwargs), f"{reason or 'sizes changed'}; symbolic from now on: {names}"

    def _trace(self, args, kwargs, key, forced_decisions, fixed_sizes=False):
        with _no_cyclic_gc():
            return self._trace_now(args, kwargs, key, forced_decisions, fixed_sizes)

    def _trace_now(self, args, kwargs, key, forced_decisions, fixed_sizes):
        """``fixed_sizes``: every size of this call specialised (a recurring size's program, recurring_sizes.py)."""
        dynamic = False if fixed_sizes else self._dims.for_trace()
        fusion = self._fusion_mode
        if fixed_sizes and self._background_wanted:
            fusion = "background"  # fused regions need fixed sizes: this program can have them
        elif self._background_wanted and is_symbolic_trace(dynamic):
            fusion = None  # symbolic sizes: no region is fusible (docs/fusion.md), so nothing to build
            self.stats.fusion_decisions.append(symbolic_fusion_decision(dynamic, self._arg_names))
        options = Options(strict=self.strict, decompose=self.decompose, dynamic=dynamic, fusion=fusion,
                          optimizer_kernels=self.optimizer_kernels, keep_buffers=self.keep_buffers,
                          memory_budget=self.memory_budget)
        return compile_entry(
            self.fn, args, kwargs, options, self.executors, struct_key=key, arg_names=self._arg_names,
            intern_prologue=lambda p: self._prologues.setdefault(p.structure, p), fusion_notes=self.stats.fusion_notes,
            forced_decisions=forced_decisions)

    def _drop_stale(self):
        """Entries specialised on a size that is now symbolic (or symbolic where sizes are specialised again):
        no call's key finds them any more, so they go with what they hold."""
        for skey in list(self._cache):
            if self._dims.stale(skey):
                for probe in list(self._cache.get(skey, ())):
                    for e in {id(e): e for e in list(probe.entries.values()) + list(probe.paths.values())}.values():
                        self._evict(e)

    def _evict(self, entry):
        """``entry`` leaves the cache; its slot lets go of its binding, CUDA graphs, buffers and fusion build."""
        bounded_cache.remove(self._cache, entry)
        self._lru.forget(entry)
        self._forget_binding(entry, "its cache entry was evicted")  # binding.py
        entry.slot.release()
        self.stats.evictions += 1

    def _slot(self, compiled) -> Slot:
        """What the new entry runs: with background fusion, its calls counted until the build is due (background.py)."""
        if compiled.build_fused is None:
            return Slot(compiled)
        job = background.FusionJob(compiled.build_fused, lambda program: slot.swap(*program), self.stats.fusion_notes.append,
                                   "background fusion", decide=compiled.payback, record=self.stats.fusion_decisions.append)
        slot = Slot(compiled, job, on_swap=self._count_switch)
        return slot

    def _count_switch(self) -> None:
        self.stats.fusion_switches += 1

    def _warn_retrace_storm(self, entry):
        """Every call of late traced a new program: results are right, but each call pays a trace and the cache grows."""
        name = getattr(self.fn, "__qualname__", "the compiled function")
        if entry.mutated:
            advice = (f"the function changes {', '.join(entry.mutated[:3])}, which its programs are specialised on (a "
                      "list it appends to, a Python counter it increments): keep such values in tensors, or return them "
                      "and collect them outside")
        else:
            recent = self.stats.retrace_reasons[-2:]
            advice = ("the reasons of the last two: " + " | ".join(recent) + ". A Python read of a value that changes "
                      "every call (an f-string or print of loss.item(), a branch on a float) is a decision each new value "
                      "retraces: return the value and use it outside the compiled function, or keep it in a tensor")
        warnings.warn(f"{name}: the last {_RETRACE_STORM} calls each traced a new program. Results are right, but "
                      f"every call retraces; {advice}.", stacklevel=_user_stacklevel())

    def wait_for_fusion(self, timeout: float | None = None) -> bool:
        """Wait for the fused programs being built, and build the last call's now; False when ``timeout`` ran out."""
        entries = [e for probes in self._cache.values() for probe in probes for e in probe.entries.values()]
        sized = [spec for e in entries if e.slot.sizes is not None for spec, _ in e.slot.sizes.programs.values()]
        jobs = [e.fusion_job for e in entries + sized
                if e.fusion_job is not None and (e is self._last or e in sized or e.fusion_job.state != background.NEW)]
        return background.wait(jobs, timeout)

    def direct_call_parts(self, *args, **kwargs):
        """``(computation, inputs)`` of the entry these arguments select (for benchmarks and debugging)."""
        skey = self._dims.key(args, kwargs)
        for probe in self._cache.get(skey, ()):
            found = _probe_key(probe, args, kwargs)
            entry = probe.entries.get(found[1]) if found is not None else None
            if entry is not None:
                return entry.slot.run, entry.select(found[0])
        raise LookupError("no cache entry for these arguments; call the compiled function with them first")
