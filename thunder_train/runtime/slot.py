"""What one cache entry runs now: the ``Slot``, and the ``Entry`` that pairs it with its frozen compiled product.

A cache entry's compiled product (``compiler/pipeline.py: Compiled``) never changes.  What a call of the entry
runs does: background fusion replaces the torch program by the fused one between two calls, the call counting
that decides when to build it ends, thin mode calls the program with its bound inputs in another order
(``thin_args.py``), and CUDA graphs replay a captured program on the thin path (``cuda_graphs.py``).  The slot is
the one object that knows all of these; each change goes through one of its methods, which recomputes both
callables a call reads:

* ``run``: what a full-path call runs (``entry.slot.run(*entry.select(leaf values))``);
* ``thin``: what the bound ``thin_call`` runs (``thin.py`` generates ``_slot.thin(...)``).

``specialise_sizes`` puts a symbolic entry's dispatch on recurring sizes in front of both (recurring_sizes.py).
In the default mode an entry's first call runs a program without the passes that pay off only over calls (kept
buffers, folded constants, ...); the program with them is built when the entry runs a second time
(``Compiled.build_steady``, compiler/pipeline.py): until then both callables go through a wrapper whose second call
builds it (``settle``) and runs it; thin mode's binding, made at that call, settles before it binds (binding.py).
``swap`` is the background-fusion switch (called from the worker thread: the lock keeps ``run`` and ``thin`` in
step with the program), ``stop_counting`` ends the pay-back count, ``bind_thin``/``unbind_thin`` follow the
thin binding, ``release`` frees what an evicted entry holds.
"""
from __future__ import annotations

import threading

from ..compiler.executors.buffers import release_replaced


class Slot:
    """What one cache entry runs now (see the module docstring)."""

    def __init__(self, compiled, job=None, on_swap=None):
        self._wrap = compiled.wrap  # program -> computation (epilogue, output rebuild)
        self.program = compiled.program
        self.traces = list(compiled.traces)
        self.backward_traces = None if compiled.backward_traces is None else list(compiled.backward_traces)
        self.job = job  # background fusion: the FusionJob building the fused program (background.py)
        self._counting = job is not None  # the job counts the entry's calls until it decided when to build
        self._adapt = None  # thin mode: computation -> what thin_call calls (its argument order); None: unbound
        self.thin_codes = {}  # thin_args.py: the computation's code with the bound inputs last, per layout
        self.graphed = None  # cuda_graphs.GraphedProgram of the thin binding
        self._on_swap = on_swap
        self.released = False  # evicted from the cache (bounded_cache.py): a build that finishes frees its program
        self.sizes = None  # recurring_sizes.RecurringSizes of a symbolic entry: programs for the sizes that recur
        self._steady_later = compiled.build_steady  # () -> (program, traces); None once settled
        self._ran = False  # a call ran the first call's program
        self._lock = threading.Lock()
        self._refresh()

    def _refresh(self) -> None:
        run = self._wrap(self.program)
        if self._counting:
            run = self.job.counted(run, self.stop_counting)
        if self.sizes is not None:
            run = self.sizes.wrap(run, self)
        self.run = run
        if self.graphed is not None:
            self.thin = self._wrap(self.graphed)
        elif self._adapt is not None:
            self.thin = self._adapt(run)
        else:
            self.thin = run
        if self._steady_later is not None:
            self.run, self.thin = self._then_settled(self.run, "run"), self._then_settled(self.thin, "thin")

    def _then_settled(self, call, which):
        """``call`` for the entry's first call; from its second on, the steady program."""
        def first_call(*args):
            if self._ran:
                self.settle()
                return getattr(self, which)(*args)
            self._ran = True
            return call(*args)

        return first_call

    def settle(self) -> None:
        """Build the steady program now, if it waits for the entry's second call, and run it from now on."""
        build = self._steady_later
        if build is None:
            return
        built = build()  # outside the lock: a fused program may be installed meanwhile (then this one is dropped)
        with self._lock:
            if self._steady_later is not build:
                release_replaced(built[1][-1:], [])
                return
            self._steady_later = None
            self.program, self.traces = built[0], list(built[1])
            self._refresh()

    def swap(self, program, traces, backward_traces) -> None:
        """Run ``program`` (same inputs and results as the current one) from the next call on; ``backward_traces``
        None keeps the current ones."""
        with self._lock:
            if self.released:  # no call can reach this entry any more: free what was built instead of installing it
                release_replaced(list(traces) + list(backward_traces or ()), [])
                return
            # The replaced programs' kept buffers (executors/buffers.py); an autograd node made before the switch
            # still runs its backward correctly, allocating as it goes.
            kept_backward = backward_traces if backward_traces is not None else self.backward_traces
            release_replaced(self.traces + list(self.backward_traces or ()), list(traces) + list(kept_backward or ()))
            self.traces = list(traces)
            if backward_traces is not None:
                self.backward_traces = list(backward_traces)
            self.program = program
            self._counting = False
            self._steady_later = None  # the fused program went through the same passes
            self._refresh()
        if self._on_swap is not None:
            self._on_swap()

    def stop_counting(self) -> None:
        """Background fusion will not start (pay-back): call the program directly again."""
        with self._lock:
            if self._counting:
                self._counting = False
                self._refresh()

    def specialise_sizes(self, sizes) -> None:
        """Calls go through ``sizes`` (recurring_sizes.py): a size with its own program runs that one."""
        with self._lock:
            self.sizes = sizes
            self._refresh()

    def bind_thin(self, adapt=None, graphed=None) -> None:
        """Thin mode bound this entry: ``thin`` is ``adapt`` of what runs (its argument order), or the CUDA graph."""
        with self._lock:
            self._adapt = adapt if adapt is not None else _same
            self.graphed = graphed
            self._refresh()

    def unbind_thin(self) -> None:
        """The thin binding is gone: drop its argument order and its CUDA graph (with the graph's buffers)."""
        with self._lock:
            if self.graphed is not None:
                self.graphed.release()
            self._adapt = self.graphed = None
            self._refresh()


    def release(self) -> None:
        """The entry was evicted (bounded_cache.py): drop its thin binding and CUDA graphs, cancel a fusion build
        not started yet (one in flight frees its program instead of installing it, ``swap``), and free the kept
        buffers of its programs."""
        self.unbind_thin()
        with self._lock:
            self.released = True
            self._steady_later = None
            if self.job is not None:
                self.job.cancel()
            if self.sizes is not None:
                self.sizes.release()
            release_replaced(self.traces + list(self.backward_traces or ()), [])


def _same(computation):
    return computation


class Entry:
    """One cache entry: its frozen compiled product and its slot.

    The fields a call reads are copied here (one attribute lookup each); the others are read from the product
    (``entry.epilogue``, ``entry.leaves``, ... fall through to ``compiled``).
    """

    __slots__ = ("compiled", "slot", "key", "struct_key", "prologue", "select", "checked", "updates_parameters", "hooks",
                 "__weakref__")  # the bounded cache's tests check that an evicted entry is freed

    def __init__(self, compiled, slot: Slot):
        self.compiled, self.slot = compiled, slot
        self.hooks = None  # hook_guard.HookCheck: the hook registries as traced (set by cache.py after compiling)
        self.key, self.struct_key, self.prologue = compiled.key, compiled.struct_key, compiled.prologue
        self.select, self.checked, self.updates_parameters = compiled.select, compiled.checked, compiled.updates_parameters

    def __getattr__(self, name):
        if name == "compiled":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.compiled, name)

    @property
    def computation(self):
        """What a full-path call runs now."""
        return self.slot.run

    @property
    def traces(self) -> list:
        return self.slot.traces

    @property
    def backward_traces(self):
        return self.slot.backward_traces

    @property
    def fusion_job(self):
        return self.slot.job

    @property
    def program(self):
        return self.slot.program
