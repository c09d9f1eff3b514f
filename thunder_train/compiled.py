"""``compile``: the user-facing compiled function, its options and statistics.

``CompiledFunction`` is glue: its full path (lookup, compile on a miss, decision re-dispatch) is
``runtime/cache.py``, its thin path ``runtime/binding.py``, and what each cache entry runs its slot
(``runtime/slot.py``).  docs/architecture.md ("Call path") follows one call through them.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import operator
import os

import torch

from .compiler import acquisition
from .compiler.executors.torch_executor import torch_executor, decomposing_torch_executor
from .runtime.binding import ThinPath
from .runtime import bounded_cache
from .runtime.cache import FullPath


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
    # Thin calls the bound program did not accept (a new size, dtype or value): they ran the full path, which
    # found or built the right entry and bound it (its binding kept for when that entry is selected again).
    thin_fallbacks: int = 0
    eager_calls: int = 0  # calls run eagerly: they reached a lazy module not initialised yet (its forward picks its sizes)
    evictions: int = 0  # entries evicted by the cache limit, or made stale by a size becoming symbolic (runtime/bounded_cache.py)
    last_trace_seconds: float = 0.0
    total_trace_seconds: float = 0.0
    fusion_notes: list = dataclasses.field(default_factory=list)  # fusion=...: one line per region, fused or why not
    fusion_switches: int = 0  # entries whose torch program a background-built fused program replaced
    # Calls of the last entry's fused kernels that ran the region's torch ops instead, because an input or buffer
    # was not laid out as the kernel was compiled for (a wrong traced layout: the kernel never runs).  Counted per
    # kernel (regions of one structure share one, also across compiled functions); read when compile_stats is called.
    fusion_fallback_calls: int = 0
    fusion_decisions: list = dataclasses.field(default_factory=list)  # background fusion: at which call a build starts, and why
    # Symbolic entries: each size that recurred and got its own program, or why not (runtime/recurring_sizes.py)
    recurring_sizes: list = dataclasses.field(default_factory=list)
    cuda_graph_notes: list = dataclasses.field(default_factory=list)  # cuda_graphs=True: captured, dropped, or why not
    cuda_graph_captures: int = 0
    cuda_graph_replays: int = 0
    # Python decisions on tensor values (compiler/acquisition/decisions.py): where each is checked (the prologue,
    # recomputing its ops, or the program, where it computes the value) and how many ops that is.
    decision_notes: list = dataclasses.field(default_factory=list)
    # Calls whose program found a checked decision going the other way: abandoned before writing anything, and
    # the call ran (or traced) the entry for the value observed.
    decision_mismatches: int = 0
    # The memory plan of the latest compiled program (compiler/transforms/memory.py MemoryPlan): bytes saved for the
    # backward, planned peak, what the backward recomputes and why; None when the program has no backward.
    memory: object = None

    @property
    def thin_calls(self) -> int:
        return self.calls - self.full_calls


class CompiledFunction(FullPath, ThinPath):
    """A function compiled by thunder_train.

    Full path (every call without ``thin``): a structural key of the arguments
    and global state selects a bucket; the bucket's generated ``extract`` and
    ``guard_key`` run once and the guard key finds the entry with one dict
    lookup, however many entries exist.  A miss traces again, recording why
    in ``compile_stats(...).retrace_reasons``.  A program that checks a
    decision on an intermediate value and finds the other value raises
    ``DecisionMismatch`` before writing anything; ``_redispatch`` then runs
    the entry for the observed value (``_Probe.paths``), or traces it (runtime/cache.py).

    Thin mode (``thin=True``): once the same entry validated on two
    consecutive calls, ``thin_call`` (generated, see ``runtime/thin.py``)
    replaces the full path: extract and check the per-call leaves, call the
    computation with the bound static tensors (runtime/binding.py).  See docs/thin_mode.md.
    """

    def __init__(self, fn, *, strict: bool = False, decompose: bool = False, thin: bool = False, check_every: int | None = None,
                 dynamic: bool | None = None, fusion: str | None = "background", optimizer_kernels: str = "fused",
                 cuda_graphs: bool = False, keep_buffers: bool = True, memory_budget: float | None = None,
                 cache_limit: int | None = bounded_cache.DEFAULT_LIMIT):
        if not callable(fn):
            raise TypeError(f"tt.compile expects a function or an nn.Module, got {type(fn).__name__}")
        check_options(thin=thin, check_every=check_every, fusion=fusion, optimizer_kernels=optimizer_kernels,
                      cuda_graphs=cuda_graphs, dynamic=dynamic, strict=strict, decompose=decompose, keep_buffers=keep_buffers,
                      cache_limit=cache_limit)
        if memory_budget is not None and (type(memory_budget) not in (int, float) or not 0 <= memory_budget <= 1):
            raise ValueError(f"memory_budget must be a number between 0 and 1 (a fraction of what the default "
                             f"saves for the backward), got {memory_budget!r}")
        self.fn = fn
        self.keep_buffers = keep_buffers
        self.memory_budget = memory_budget
        self.strict = strict
        self.decompose = decompose
        self.thin = thin
        self.check_every = check_every
        self.dynamic = dynamic
        self.fusion = fusion
        self._fusion_mode = fusion_mode(fusion, dynamic=dynamic, cuda_graphs=cuda_graphs)
        # The default would build in the background, but not for a program with symbolic sizes (runtime/cache.py says so).
        self._background_wanted = fusion_mode(fusion, cuda_graphs=cuda_graphs) == "background"
        self.optimizer_kernels = optimizer_kernels
        self.cuda_graphs = cuda_graphs
        # A symbolic entry traces a program per size that recurs (runtime/recurring_sizes.py) when such a program
        # has something the symbolic one lacks (kept buffers for every value, fused regions); with CUDA graphs the
        # thin binding captures one graph per size instead (runtime/graphs_per_size.py).
        self._specialises_sizes = dynamic is not False and not cuda_graphs and bool(
            keep_buffers or self._background_wanted or self._fusion_mode)
        self.executors = [decomposing_torch_executor if decompose else torch_executor]
        self.stats = CompileStats()
        self._init_full_path(dynamic, cache_limit)  # runtime/cache.py: the cache, symbolic sizes, the full path as _call
        self._init_thin_path()  # runtime/binding.py: no binding yet
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
        object.__setattr__(self, "_tt_options", options)
        object.__setattr__(self, "_tt_compiled", CompiledFunction(_call_module, **options))

    def __deepcopy__(self, memo):
        """The compiled form of a deep copy of the module, with the same options and nothing compiled yet
        (``copy.deepcopy(model)`` for an EMA or teacher model, also of a model holding a compiled submodule)."""
        return compile(copy.deepcopy(self._tt_module, memo), **self._tt_options)

    def __reduce__(self):
        """Pickled (``torch.save(model)``) as the module and the options: loading compiles the loaded module again."""
        return _compiled_module, (self._tt_module, self._tt_options)

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

    # What changes the module goes to the original, which the compiled forward runs: nn.Module's own versions act
    # on the wrapper's (empty) registries, so half(), apply(init), register_buffer(...) or ``cm.weight = p`` on a
    # compiled module that holds parameters itself (tt.compile(nn.Linear(...))) left the original's as they were.
    def _apply(self, fn, recurse=True):  # half(), float(), double(), bfloat16(), cuda(), cpu(), to_empty(), ...
        self._tt_module._apply(fn, recurse)
        return self

    def apply(self, fn):
        self._tt_module.apply(fn)
        return self

    def named_children(self):
        return self._tt_module.named_children()

    def register_buffer(self, *args, **kwargs):
        return self._tt_module.register_buffer(*args, **kwargs)

    def register_parameter(self, *args, **kwargs):
        return self._tt_module.register_parameter(*args, **kwargs)

    def register_module(self, *args, **kwargs):
        return self._tt_module.register_module(*args, **kwargs)

    add_module = register_module

    def __setattr__(self, name, value):
        # The wrapper's own state (nn.Module's registries and hooks, set up by its __init__) stays the wrapper's.
        if name.startswith("_tt_") or name in self.__dict__:
            object.__setattr__(self, name, value)
        else:
            setattr(self._tt_module, name, value)

    def __delattr__(self, name):
        if name.startswith("_tt_") or name in self.__dict__:
            object.__delattr__(self, name)
        else:
            delattr(self._tt_module, name)

    def __repr__(self):
        return f"ThunderModule({self._tt_module!r})"


class _ThunderContainer(ThunderModule):
    """``tt.compile`` of a container module (nn.Sequential, nn.ModuleList, nn.ModuleDict: a class with
    ``__getitem__``): indexing, iterating, ``len`` and truth are the original's, and give its submodules
    (uncompiled), as ``module[0](x)`` in eager.  Dunder methods are looked up on the class, so ``__getattr__`` does
    not reach them; a module that is no container keeps ``ThunderModule``, which is not iterable, as the module is
    not."""

    def __getitem__(self, key):
        return self._tt_module[key]

    def __setitem__(self, key, value):
        self._tt_module[key] = value

    def __delitem__(self, key):
        del self._tt_module[key]

    def __len__(self):
        return len(self._tt_module)

    def __iter__(self):
        return iter(self._tt_module)

    def __contains__(self, key):
        return key in self._tt_module

    def __bool__(self):
        return bool(self._tt_module)


def _compiled_module(module, options):
    return compile(module, **options)


def _call_module(self, *args, **kwargs):
    # Named ``self`` so that trace names read ``self_fc1_weight``.
    return self(*args, **kwargs)


def compile(fn, *, strict: bool = False, decompose: bool = False, thin: bool = False, check_every: int | None = None,
            dynamic: bool | None = None, fusion: str | None = "background", optimizer_kernels: str = "fused",
            cuda_graphs: bool = False, keep_buffers: bool = True, memory_budget: float | None = None,
            cache_limit: int | None = bounded_cache.DEFAULT_LIMIT):
    """Compile a function or an ``nn.Module``.

    ``strict=True`` makes torch ops the compiler does not know an error
    instead of running them opaquely; ``decompose=True`` runs every op through
    its prim decomposition (slower; used to test decompositions).
    ``thin=True`` validates, then calls the computation directly (see
    docs/thin_mode.md); ``check_every=N`` (thin mode) runs the full prologue
    every N calls and raises ``ThinModeError`` naming what changed.
    ``dynamic=None`` (default): automatic dynamic shapes: the first call specialises every size; a call that
    differs from a cached one only in some sizes retraces with exactly those sizes symbolic, and later sizes
    reuse that program (docs/dynamic_shapes.md).  ``dynamic=True`` makes every size of argument tensors
    symbolic from the first call; ``dynamic=False`` specialises every size.
    ``cache_limit=8`` (default): at most this many programs per leaf structure; the least recently used is
    evicted with its kept buffers and fused kernels, and the first eviction warns naming what varies
    (``None``: unbounded).
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
    Memory (docs/memory.md): activation checkpointing (``torch.utils.checkpoint``, every form) is honoured, and
    cheap values are recomputed in the backward by default; ``memory_budget=f`` (a whole training step, or the
    backward program of ``tt.compile(model)``) also recomputes what it must so that the bytes saved for the backward are at most ``f`` of the default's.
    ``compile_stats(cf).memory`` reports the plan.
    """
    options = dict(strict=strict, decompose=decompose, thin=thin, check_every=check_every, dynamic=dynamic, fusion=fusion,
                   optimizer_kernels=optimizer_kernels, cuda_graphs=cuda_graphs, keep_buffers=keep_buffers,
                   cache_limit=cache_limit)
    if memory_budget is not None:
        options["memory_budget"] = memory_budget
    if isinstance(fn, torch.nn.Module):
        return (_ThunderContainer if hasattr(type(fn), "__getitem__") else ThunderModule)(fn, **options)
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
    if fusion == "background" and dynamic is True:
        return None  # symbolic sizes: no region is fusible (docs/fusion.md), so nothing to build
    if fusion == "background" and cuda_graphs:
        return "auto"  # the graph captures the program it replays: the fused one, from the start
    return fusion


def check_options(*, thin=False, check_every=None, fusion="background", optimizer_kernels="fused", cuda_graphs=False,
                  dynamic=None, cache_limit=bounded_cache.DEFAULT_LIMIT, **flags):
    """``ValueError`` naming a compile option with a value it does not take (also used by ThunderCallback)."""
    if dynamic is not None and type(dynamic) is not bool:
        raise ValueError(f"dynamic must be None (automatic), True or False, got {dynamic!r}")
    if cache_limit is not None and (type(cache_limit) is not int or cache_limit < 1):
        raise ValueError(f"cache_limit must be a positive int or None (unbounded), got {cache_limit!r}")
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
    from .compiler.executors.inductor_fusion import fallback_calls

    c = _compiled(cf)
    if c._last is not None:
        c.stats.fusion_fallback_calls = fallback_calls([*c._last.traces, *(c._last.backward_traces or [])])
    return c.stats



