"""``compile``: the user-facing compiled function, its cache and statistics."""
from __future__ import annotations

import dataclasses
import functools
import operator
import os
import sys
import time
import warnings

import torch

from .compiler import acquisition
from .compiler.errors import DecisionMismatch
from .compiler.executors import background
from .compiler.executors.torch_executor import torch_executor, decomposing_torch_executor
from .compiler.pipeline import CacheEntry, Options, compile_entry
from .guards import cuda_graphs as graphs, hook_guard, thin
from .guards.autocast_region import RegionProbe
from .guards.errors import GuardFailure
from .guards.prologue import GLOBAL_LABELS, Prologue, count_diffs, current_global_state, describe_diffs
from .guards.thin import ThinBinding
from .cache_keys import arg_key, describe_struct_diff, dynamic_arg_key, struct_diffs, struct_key


@dataclasses.dataclass
class CompileStats:
    """What a compiled function has done so far (``tt.compile_stats(cf)``).

    ``validations`` counts full-prologue runs (every full-path call plus the
    periodic ``check_every`` checks); ``thin_calls`` the calls that took the thin
    path; ``thin_binds`` how often thin mode bound an entry and
    ``thin_invalidations`` why a binding was dropped.
    """

    calls: int = 0
    validations: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    retrace_reasons: list = dataclasses.field(default_factory=list)
    opaque_ops: list = dataclasses.field(default_factory=list)
    entries: int = 0
    full_calls: int = 0
    thin_binds: int = 0
    thin_invalidations: list = dataclasses.field(default_factory=list)
    thin_bind_failures: list = dataclasses.field(default_factory=list)
    last_trace_seconds: float = 0.0
    total_trace_seconds: float = 0.0
    fusion_notes: list = dataclasses.field(default_factory=list)  # fusion=...: one line per region, fused or why not
    fusion_switches: int = 0  # entries whose torch program a background-built fused program replaced
    fusion_decisions: list = dataclasses.field(default_factory=list)  # background fusion: at which call a build starts, and why
    cuda_graph_notes: list = dataclasses.field(default_factory=list)  # cuda_graphs=True: captured, dropped, or why not
    cuda_graph_captures: int = 0
    cuda_graph_replays: int = 0
    # Python decisions on tensor values (compiler/acquisition/decisions.py): where each is checked (the prologue,
    # recomputing its ops, or the program, where it computes the value) and how many ops that is.
    decision_notes: list = dataclasses.field(default_factory=list)
    # Calls whose program found a checked decision going the other way: abandoned before writing anything, and
    # the call ran (or traced) the entry for the value observed.
    decision_mismatches: int = 0

    @property
    def thin_calls(self) -> int:
        return self.calls - self.full_calls


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
    while f is not None and f.f_code.co_filename.startswith(_PACKAGE_DIR):
        f, level = f.f_back, level + 1
    return level


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_RETRACE_STORM = 8  # consecutive cache misses after which a self-inflicted retrace storm is reported

_STRUCTURE_ERRORS = (LookupError, AttributeError, TypeError)


def _probe_key(probe, args, kwargs):
    """``(leaf values, guard key)`` of this call under ``probe``'s prologue, or None when its structure differs."""
    pro = probe.prologue
    try:
        vals = pro.extract.fn(*args, **kwargs)
        return vals, pro.guard_key_fn.fn(*vals)
    except _STRUCTURE_ERRORS:
        return None


class CompiledFunction:
    """A function compiled by thunder_train.

    Full path (every call without ``thin``): a structural key of the arguments
    and global state selects a bucket; the bucket's generated ``extract`` and
    ``guard_key`` run once and the guard key finds the entry with one dict
    lookup, however many entries exist.  A miss traces again, recording why
    in ``compile_stats(...).retrace_reasons``.  A program that checks a
    decision on an intermediate value and finds the other value raises
    ``DecisionMismatch`` before writing anything; ``_redispatch`` then runs
    the entry for the observed value (``_Probe.paths``), or traces it.

    Thin mode (``thin=True``): once the same entry validated on two
    consecutive calls, ``thin_call`` (generated, see ``guards/thin.py``)
    replaces the full path: extract and check the per-call leaves, call the
    computation with the bound static tensors.  See docs/thin_mode.md.
    """

    def __init__(self, fn, *, strict: bool = False, decompose: bool = False, thin: bool = False, check_every: int | None = None,
                 dynamic: bool = False, fusion: str | None = "background", optimizer_kernels: str = "fused",
                 cuda_graphs: bool = False, keep_buffers: bool = True):
        if not callable(fn):
            raise TypeError(f"tt.compile expects a function or an nn.Module, got {type(fn).__name__}")
        check_options(thin=thin, check_every=check_every, fusion=fusion, optimizer_kernels=optimizer_kernels,
                      cuda_graphs=cuda_graphs, dynamic=dynamic, strict=strict, decompose=decompose, keep_buffers=keep_buffers)
        self.fn = fn
        self.keep_buffers = keep_buffers
        self.strict = strict
        self.decompose = decompose
        self.thin = thin
        self.check_every = check_every
        self.dynamic = dynamic
        self.fusion = fusion
        self._fusion_mode = fusion_mode(fusion, dynamic=dynamic, cuda_graphs=cuda_graphs)
        self.optimizer_kernels = optimizer_kernels
        self.cuda_graphs = cuda_graphs
        self._graphed = None  # guards/cuda_graphs.GraphedProgram of the current binding
        self.arg_key = dynamic_arg_key if dynamic else arg_key
        self.executors = [decomposing_torch_executor if decompose else torch_executor]
        self._cache: dict = {}  # structural key -> [_Probe]
        self._prologues: dict = {}  # generated source -> Prologue (shared across buckets)
        self._last: CacheEntry | None = None
        self._prev_validated = None  # (entry, leaf values) of the previous full-path call
        self._binding: ThinBinding | None = None
        self._call = self._full_call
        self._autocast_region = RegionProbe()  # eager's autocast weight cache across calls (guards/autocast_region.py)
        self._misses_in_a_row = 0  # a function that changes what it is specialised on retraces every call
        self._thin_decided_at = -1  # stats.calls of the last thin call whose program went another way
        self.stats = CompileStats()
        self._arg_names = acquisition.arg_names(fn)
        if cuda_graphs and not torch.cuda.is_available():
            self._graph_note("cuda_graphs: not captured: no CUDA device on this machine (torch.cuda.is_available() is False); "
                             "the program runs uncaptured")
        functools.update_wrapper(self, fn, updated=())

    # ---- calling ----
    # ``cf(...)`` calls ``self._call`` (the full path, or the bound ``thin_call``) directly: CPython looks
    # ``__call__`` up on the type, and this property hands back the function in C, with no Python frame of
    # its own in between (about 0.3 µs a call less than a method that forwards ``*args, **kwargs``).
    __call__ = property(operator.attrgetter("_call"))

    def _full_call(self, *args, **kwargs):
        self.stats.calls += 1
        return self._run_full(args, kwargs)

    def _run_full(self, args, kwargs):
        st = self.stats
        st.full_calls += 1
        st.validations += 1
        skey = struct_key(args, kwargs, self.arg_key)
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
            entry = self._compile(args, kwargs, skey, hooks_changed or self._miss_reason(skey, tried))
            vals = entry.prologue.extract.fn(*args, **kwargs)
            entry.hooks = hook_guard.HookCheck(entry.leaves, vals)
            self._note_forward_hooks(entry, vals)
        else:
            st.cache_hits += 1
        self._last = entry
        if entry.updates_parameters:
            self._autocast_region.check()
        if self.thin:
            self._after_validation(entry, vals)
        try:
            out = entry.computation(*entry.select(vals))
        except DecisionMismatch as mismatch:
            return self._redispatch(args, kwargs, skey, entry, mismatch)
        if hit:
            self._misses_in_a_row = 0  # a call that traced nothing ends a run of retraces
        return out

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
                entry = self._compile(args, kwargs, skey, f"{text} was {expected!r}, now {mismatch.value!r}",
                                      forced_decisions=observed)
                vals = entry.prologue.extract.fn(*args, **kwargs)
                entry.hooks = hook_guard.HookCheck(entry.leaves, vals)
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
                result = entry.computation(*entry.select(vals))
            except DecisionMismatch as again:
                mismatch = again
                continue
            if found is not None:
                self._prefer(skey, probe, gkey, entry)
                self._misses_in_a_row = 0
            if self.thin:
                self._prev_validated = (entry, vals)
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

    def _compile(self, args, kwargs, key, reason, forced_decisions=()) -> CacheEntry:
        """A cache miss: run the pipeline (compiler/pipeline.py) and file the new entry."""
        self.stats.cache_misses += 1
        self._misses_in_a_row += 1
        if reason is not None:
            self.stats.retrace_reasons.append(reason)
        t0 = time.perf_counter()
        options = Options(strict=self.strict, decompose=self.decompose, dynamic=self.dynamic, fusion=self._fusion_mode,
                          optimizer_kernels=self.optimizer_kernels, keep_buffers=self.keep_buffers)
        entry, opaque_ops = compile_entry(
            self.fn, args, kwargs, options, self.executors, struct_key=key, arg_names=self._arg_names,
            intern_prologue=lambda p: self._prologues.setdefault(p.structure, p), fusion_notes=self.stats.fusion_notes,
            forced_decisions=forced_decisions, fusion_decisions=self.stats.fusion_decisions)
        prologue, expected = entry.prologue, entry.key
        entry.on_switch = self._entry_switched
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
        dt = time.perf_counter() - t0
        self.stats.last_trace_seconds = dt
        self.stats.total_trace_seconds += dt
        self._last = entry
        return entry

    def _note_forward_hooks(self, entry, vals):
        """Forward hooks ran once, while tracing: their tensor work is in the program, their Python side effects
        (a list they append to, a print, a counter) are not repeated by later calls.  Said once per function."""
        note = hook_guard.forward_hooks_note(entry.leaves, vals)
        if note is not None and not getattr(self, "_warned_forward_hooks", False):
            self._warned_forward_hooks = True
            warnings.warn(note, stacklevel=_user_stacklevel())

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

    # ---- thin mode ----
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
        graphed = computation = None
        if self.cuda_graphs:
            why = graphs.obstacle(entry)
            if why is not None:
                self._graph_note(f"cuda_graphs: not captured: {why}; the program runs uncaptured")
            else:
                graphed = graphs.GraphedProgram(entry, binding, self._graph_note, self.stats)
                computation = entry.wrap(graphed)
        try:
            fn, static_idx = thin.build_thin_call(
                entry, entry.prologue, entry.leaves, vals, prev[1], nargs=len(entry.struct_key[0]),
                kwnames=tuple(k for k, _ in entry.struct_key[1]), global_state=entry.struct_key[2],
                handlers=handlers, stats=self.stats, binding_holder=binding, check_every=self.check_every,
                computation=computation)
        except thin.CannotBind as why:
            if str(why) not in self.stats.thin_bind_failures[-1:]:
                self.stats.thin_bind_failures.append(str(why))
            return
        binding.fn, binding.static_idx = fn, static_idx
        self._binding = binding
        self._graphed = graphed
        self._entry_switched(entry, count=False)  # a fused program that replaced the torch one while binding
        self._call = fn.fn
        if entry.updates_parameters and torch._C._is_any_autocast_enabled():
            # Bound under autocast (a change of autocast state unbinds): each call probes the region first.
            probe, thin_fn = self._autocast_region.check, fn.fn

            def call_in_region(*args, **kwargs):
                probe()
                return thin_fn(*args, **kwargs)

            self._call = call_in_region
        self.stats.thin_binds += 1

    def _entry_switched(self, entry, count: bool = True):
        """A fused program replaced ``entry.computation`` (worker thread): the thin binding calls it from now on."""
        if count:
            self.stats.fusion_switches += 1
        b = self._binding
        if b is not None and b.entry is entry and b.fn is not None and self._graphed is None:
            g = b.fn.fn.__globals__
            if g["_computation_of"] is not entry.computation:
                # A thin_call that passes only the per-call values calls the new program adapted (guards/thin_args.py).
                g["_computation"] = entry.computation if g["_adapt"] is None else g["_adapt"](entry.computation)
                g["_computation_of"] = entry.computation

    def wait_for_fusion(self, timeout: float | None = None) -> bool:
        """Wait for the fused programs being built, and build the last call's now; False when ``timeout`` ran out."""
        jobs = [e.fusion_job for probes in self._cache.values() for probe in probes for e in probe.entries.values()
                if e.fusion_job is not None and (e is self._last or e.fusion_job.state != background.NEW)]
        return background.wait(jobs, timeout)

    def _graph_note(self, line: str) -> None:
        if line not in self.stats.cuda_graph_notes[-1:]:
            self.stats.cuda_graph_notes.append(line)

    def _unbind(self, reason: str | None):
        if self._binding is not None and reason is not None:
            self.stats.thin_invalidations.append(reason)
        if self._graphed is not None:
            if self._graphed.graph is not None:
                self._graph_note(f"cuda_graphs: graph dropped with the thin binding ({reason}); the next binding captures again")
            self._graphed.release()
            self._graphed = None
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
            return b.entry.computation(*b.entry.select(vals))
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

    def direct_call_parts(self, *args, **kwargs):
        """``(computation, inputs)`` of the entry these arguments select (for benchmarks and debugging)."""
        skey = struct_key(args, kwargs, self.arg_key)
        for probe in self._cache.get(skey, ()):
            found = _probe_key(probe, args, kwargs)
            entry = probe.entries.get(found[1]) if found is not None else None
            if entry is not None:
                return entry.computation, entry.select(found[0])
        raise LookupError("no cache entry for these arguments; call the compiled function with them first")

    # ---- introspection ----
    def last_traces(self) -> list:
        if self._last is None:
            raise RuntimeError("the compiled function has not been called yet; traces exist after the first call")
        return list(self._last.traces)

    def last_backward_traces(self) -> list:
        """The backward traces of the last entry (empty when it computes no gradients)."""
        if self._last is None:
            raise RuntimeError("the compiled function has not been called yet; traces exist after the first call")
        return list(self._last.backward_traces or [])

    def last_prologue_traces(self) -> list:
        """``extract`` and ``guard_key`` of the last entry, plus ``thin_call`` when thin mode bound it."""
        if self._last is None:
            raise RuntimeError("the compiled function has not been called yet; traces exist after the first call")
        out = list(self._last.prologue_traces)
        if self._binding is not None and self._binding.entry is self._last:
            out.append(self._binding.fn)
        return out


class ThunderModule(torch.nn.Module):
    """``tt.compile(module)``: calls go through the compiler, state stays the module's own.

    Parameters, buffers and ``state_dict()`` keys are the original module's (no
    prefix), so checkpoints load into the uncompiled model and vice versa.
    """

    def __init__(self, module: torch.nn.Module, **options):
        super().__init__()
        object.__setattr__(self, "_tt_module", module)
        object.__setattr__(self, "_tt_compiled", CompiledFunction(_call_module, **options))

    def forward(self, *args, **kwargs):
        return self._tt_compiled(self._tt_module, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_tt_module"), name)

    def revalidate(self) -> None:
        """See ``CompiledFunction.revalidate``."""
        self._tt_compiled.revalidate()

    # Delegate everything that defines the module's state to the original.
    def state_dict(self, *args, **kwargs):
        return self._tt_module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self._tt_module.load_state_dict(*args, **kwargs)

    def named_parameters(self, *args, **kwargs):
        return self._tt_module.named_parameters(*args, **kwargs)

    def parameters(self, *args, **kwargs):
        return self._tt_module.parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        return self._tt_module.named_buffers(*args, **kwargs)

    def buffers(self, *args, **kwargs):
        return self._tt_module.buffers(*args, **kwargs)

    def named_modules(self, *args, **kwargs):
        return self._tt_module.named_modules(*args, **kwargs)

    def modules(self):
        return self._tt_module.modules()

    def children(self):
        return self._tt_module.children()

    def train(self, mode: bool = True):
        self._tt_module.train(mode)
        return self

    @property
    def training(self):  # type: ignore[override]
        return object.__getattribute__(self, "_tt_module").training

    @training.setter
    def training(self, value):
        pass  # nn.Module.__init__ assigns it; the wrapped module owns the flag

    def to(self, *args, **kwargs):
        self._tt_module.to(*args, **kwargs)
        return self

    def __repr__(self):
        return f"ThunderModule({self._tt_module!r})"


def _call_module(self, *args, **kwargs):
    # Named ``self`` so that trace names read ``self_fc1_weight``.
    return self(*args, **kwargs)


def compile(fn, *, strict: bool = False, decompose: bool = False, thin: bool = False, check_every: int | None = None,
            dynamic: bool = False, fusion: str | None = "background", optimizer_kernels: str = "fused",
            cuda_graphs: bool = False, keep_buffers: bool = True):
    """Compile a function or an ``nn.Module``.

    ``strict=True`` makes torch ops the compiler does not know an error
    instead of running them opaquely; ``decompose=True`` runs every op through
    its prim decomposition (slower; used to test decompositions).
    ``thin=True`` validates, then calls the computation directly (see
    docs/thin_mode.md); ``check_every=N`` (thin mode) runs the full prologue
    every N calls and raises ``ThinModeError`` naming what changed.
    ``dynamic=True`` makes the sizes of argument tensors symbolic: a new batch
    size or sequence length reuses the program (see docs/thin_mode.md).
    ``fusion="inductor"`` compiles regions of elementwise ops and reductions on CPU or CUDA into Inductor
    kernels (C++ or Triton); ``fusion="nvfuser"`` CUDA regions and their write-backs into nvFuser fusions
    (where ``nvfuser_direct`` imports); ``fusion="auto"`` picks the best available for the program's device
    (see docs/fusion.md; ``compile_stats(cf).fusion_notes`` says what was fused and why not).  These fuse
    before the first call.  ``fusion="background"`` (default) runs the torch program at once and switches to
    the program ``"auto"`` fuses once a worker thread built it, a build started only at the call where it pays
    for itself (``compile_stats(cf).fusion_decisions`` says when and why; ``tt.wait_for_fusion(cf)`` builds now
    and waits);
    the environment variable ``THUNDER_TRAIN_FUSION`` (``off``, ``inductor``, ``nvfuser``, ``auto``) replaces
    ``"background"`` process-wide.  ``fusion=None`` never fuses.
    ``cuda_graphs=True`` (with ``thin=True``) captures the bound whole step as one CUDA graph and replays it
    (docs/fusion.md; ``compile_stats(cf).cuda_graph_notes`` says whether and why not).
    ``optimizer_kernels="fused"`` (default): an Adam, AdamW, SGD or (CPU) Adagrad step inside the function runs
    torch's fused kernel (one pass over all parameters) where that computes the same update;
    ``"traced"`` runs the optimizer's own per-op code (see docs/training_step.md).
    ``keep_buffers=True`` (default): a program that runs without grad (a whole training step, and the forward and
    backward connected to PyTorch autograd) writes its CPU intermediates into memory it keeps between calls
    instead of allocating them on every call, never raising the call's peak (docs/performance.md); ``False``
    frees them after each call.
    """
    options = dict(strict=strict, decompose=decompose, thin=thin, check_every=check_every, dynamic=dynamic, fusion=fusion,
                   optimizer_kernels=optimizer_kernels, cuda_graphs=cuda_graphs, keep_buffers=keep_buffers)
    if isinstance(fn, torch.nn.Module):
        return ThunderModule(fn, **options)
    return CompiledFunction(fn, **options)


FUSION_CHOICES = (None, "inductor", "nvfuser", "auto", "background")
_FUSION_ENV = {"": "background", "background": "background", "inductor": "inductor", "nvfuser": "nvfuser", "auto": "auto",
               "off": None, "none": None, "0": None}


def fusion_mode(fusion, *, dynamic: bool = False, cuda_graphs: bool = False):
    """What ``fusion`` means for the passes (``"background"`` read through ``THUNDER_TRAIN_FUSION``)."""
    if fusion != "background":
        return fusion
    value = os.environ.get("THUNDER_TRAIN_FUSION", "").strip().lower()
    if value not in _FUSION_ENV:
        raise ValueError(f"THUNDER_TRAIN_FUSION must be one of off, background, inductor, nvfuser, auto; got {value!r}")
    fusion = _FUSION_ENV[value]
    if fusion == "background" and dynamic:
        return None  # symbolic sizes: no region is fusible (docs/fusion.md), so nothing to build
    if fusion == "background" and cuda_graphs:
        return "auto"  # the graph captures the program it replays: the fused one, from the start
    return fusion


def check_options(*, thin=False, check_every=None, fusion="background", optimizer_kernels="fused", cuda_graphs=False, **flags):
    """``ValueError`` naming a compile option with a value it does not take (also used by ThunderCallback)."""
    for name, value in (("thin", thin), ("cuda_graphs", cuda_graphs), *flags.items()):
        if type(value) is not bool:  # thin="False" is truthy: accepting it would turn thin mode on
            raise ValueError(f"{name} must be a bool (True or False), got {value!r}")
    if cuda_graphs and not thin:
        raise ValueError("cuda_graphs=True captures the step thin mode binds; pass thin=True as well")
    if check_every is not None:
        if not thin:
            raise ValueError("check_every=N applies to thin mode; pass thin=True as well")
        if type(check_every) is not int or check_every < 1:
            raise ValueError(f"check_every must be a positive int, got {check_every!r}")
    if fusion not in FUSION_CHOICES:
        raise ValueError(f"fusion must be one of {', '.join(map(repr, FUSION_CHOICES))}, got {fusion!r}")
    if optimizer_kernels not in ("fused", "traced"):
        raise ValueError(f"optimizer_kernels must be 'fused' or 'traced', got {optimizer_kernels!r}")


def _compiled(cf) -> CompiledFunction:
    if isinstance(cf, ThunderModule):
        return cf._tt_compiled
    if isinstance(cf, CompiledFunction):
        return cf
    raise TypeError(f"expected the result of thunder_train.compile, got {type(cf).__name__}")


def last_traces(cf) -> list:
    """Every trace of the computation from the last call, acquisition first, executed trace last."""
    return _compiled(cf).last_traces()


def last_prologue_traces(cf) -> list:
    """The prologue (unpack + checks) of the last call's cache entry."""
    return _compiled(cf).last_prologue_traces()


def last_backward_traces(cf) -> list:
    """The backward traces of the last call's cache entry; empty when it computed no gradients."""
    return _compiled(cf).last_backward_traces()


def wait_for_fusion(cf, timeout: float | None = None) -> bool:
    """Wait until the fused programs of ``cf`` (``fusion="background"``, the default) are built and in place.

    Covers the entries already building and the one the last call ran (built now if it was not yet).  After
    True, those run their final program: the fused one where something was fused
    (``compile_stats(cf).fusion_switches`` counts them), else the torch program.  False: ``timeout`` ran out.
    """
    return _compiled(cf).wait_for_fusion(timeout)


def compile_stats(cf) -> CompileStats:
    """Calls, validations, thin calls, cache hits and misses, retrace reasons and ops run opaquely."""
    return _compiled(cf).stats



