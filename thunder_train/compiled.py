"""``compile``: the user-facing compiled function, its cache and statistics."""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import torch

from .compiler import tracing
from .compiler.executors.passes import lower_to_executors
from .compiler.executors.torch_executor import torch_executor, decomposing_torch_executor
from .compiler.transforms.dce import dce
from .guards.errors import GuardFailure
from .guards.prologue import build_prologue, current_global_state


@dataclasses.dataclass
class CompileStats:
    """What a compiled function has done so far (``tt.compile_stats(cf)``)."""

    calls: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    retrace_reasons: list = dataclasses.field(default_factory=list)
    opaque_ops: list = dataclasses.field(default_factory=list)
    entries: int = 0
    last_trace_seconds: float = 0.0
    total_trace_seconds: float = 0.0


@dataclasses.dataclass
class CacheEntry:
    key: tuple
    prologue: Callable
    computation: Callable
    traces: list
    prologue_traces: list
    leaves: list


def _arg_key(x, depth=0):
    """A cheap structural key: a miss here means a retrace without running any prologue."""
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype, x.device, x.requires_grad)
    t = type(x)
    if t in (int, float, bool, str, type(None), complex):
        return (t, x)
    if depth < 3 and (t is tuple or t is list):
        return (t, tuple(_arg_key(v, depth + 1) for v in x))
    if depth < 3 and t is dict:
        return (t, tuple((k, _arg_key(v, depth + 1)) for k, v in x.items()))
    return (t, id(x))


def _describe_key_diff(old: tuple, new: tuple, arg_names) -> str:
    (oa, ok), (na, nk) = old, new
    if len(oa) != len(na):
        return f"number of positional arguments: {len(oa)} → {len(na)}"
    for i, (a, b) in enumerate(zip(oa, na)):
        if a != b:
            name = arg_names[i] if i < len(arg_names) else f"args[{i}]"
            return f"{name}: {_fmt_key(a)} → {_fmt_key(b)}"
    if ok != nk:
        return f"keyword arguments: {_fmt_key(ok)} → {_fmt_key(nk)}"
    return "unknown"


def _fmt_key(k):
    if isinstance(k, tuple) and len(k) == 4 and isinstance(k[1], torch.dtype):
        return f"tensor{k[0]} {str(k[1]).replace('torch.', '')} {k[2]}{' requires_grad' if k[3] else ''}"
    if isinstance(k, tuple) and len(k) == 2 and isinstance(k[0], type):
        if k[0] in (tuple, list, dict):
            return f"{k[0].__name__} {k[1]!r}"
        return f"{k[0].__name__} {k[1]!r}" if k[0] in (int, float, bool, str, complex, type(None)) else f"{k[0].__name__} object"
    return repr(k)


class CompiledFunction:
    """A function compiled by thunder_train.

    Calls look up a cache entry by a cheap structural key of the arguments,
    run that entry's prologue (which checks everything the trace depends on
    and unpacks the input tensors) and then its computation.  A key miss or a
    failed check traces again and adds an entry.
    """

    def __init__(self, fn, *, strict: bool = False, decompose: bool = False):
        if not callable(fn):
            raise TypeError(f"tt.compile expects a function or an nn.Module, got {type(fn).__name__}")
        self.fn = fn
        self.strict = strict
        self.decompose = decompose
        self.executors = [decomposing_torch_executor if decompose else torch_executor]
        self._cache: dict = {}
        self._last: CacheEntry | None = None
        self.stats = CompileStats()
        self._arg_names = tracing._arg_names(fn)
        functools.update_wrapper(self, fn, updated=())

    # ---- calling ----
    def __call__(self, *args, **kwargs):
        self.stats.calls += 1
        key = (tuple(_arg_key(a) for a in args), tuple((k, _arg_key(v)) for k, v in kwargs.items()))
        entries = self._cache.get(key)
        reason = None
        if entries is not None:
            for entry in entries:
                try:
                    inputs = entry.prologue(*args, **kwargs)
                except GuardFailure as failure:
                    reason = failure.reason
                    continue
                self.stats.cache_hits += 1
                self._last = entry
                return entry.computation(*inputs)
        elif self._cache:
            nearest = next(reversed(self._cache))
            reason = _describe_key_diff(nearest, key, self._arg_names)
        entry = self._compile(args, kwargs, key, reason)
        inputs = entry.prologue(*args, **kwargs)
        return entry.computation(*inputs)

    def _compile(self, args, kwargs, key, reason) -> CacheEntry:
        self.stats.cache_misses += 1
        if reason is not None:
            self.stats.retrace_reasons.append(reason)
        t0 = time.perf_counter()
        acquired = tracing.acquire(self.fn, args, kwargs, strict=self.strict)
        traces = [acquired.trace]
        trc = dce(acquired.trace)
        traces.append(trc)
        names = ", ".join(ex.name for ex in self.executors)
        trc = lower_to_executors(trc, self.executors, header=f"Lowered to executors: {names}")
        traces.append(trc)
        trc = dce(trc, header=f"Final computation (executors: {names})")
        traces.append(trc)
        prologue = build_prologue(acquired.leaves, trc.args, len(args), tuple(kwargs), current_global_state())
        entry = CacheEntry(key, prologue.python_callable(), trc.python_callable(), traces, [prologue], acquired.leaves)
        for name in acquired.opaque_ops:
            if name not in self.stats.opaque_ops:
                self.stats.opaque_ops.append(name)
        self._cache.setdefault(key, []).insert(0, entry)
        self.stats.entries += 1
        dt = time.perf_counter() - t0
        self.stats.last_trace_seconds = dt
        self.stats.total_trace_seconds += dt
        self._last = entry
        return entry

    # ---- introspection ----
    def last_traces(self) -> list:
        if self._last is None:
            raise RuntimeError("the compiled function has not been called yet; traces exist after the first call")
        return list(self._last.traces)

    def last_prologue_traces(self) -> list:
        if self._last is None:
            raise RuntimeError("the compiled function has not been called yet; traces exist after the first call")
        return list(self._last.prologue_traces)


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


def compile(fn, *, strict: bool = False, decompose: bool = False):
    """Compile a function or an ``nn.Module``.

    ``strict=True`` makes torch ops the compiler does not know an error
    instead of running them opaquely; ``decompose=True`` runs every op through
    its prim decomposition (slower; used to test decompositions).
    """
    if isinstance(fn, torch.nn.Module):
        return ThunderModule(fn, strict=strict, decompose=decompose)
    return CompiledFunction(fn, strict=strict, decompose=decompose)


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


def compile_stats(cf) -> CompileStats:
    """Calls, cache hits and misses, retrace reasons and ops run opaquely."""
    return _compiled(cf).stats



