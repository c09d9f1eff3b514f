"""Background fusion: a cache entry runs its torch program while its fused program is built in a worker thread.

``fusion="background"`` (the default, docs/fusion.md) gives each cache entry a ``FusionJob``: building the
entry's fused program (Inductor kernels: seconds of C++ compile when cold) without making any call wait for
it.  The entry's calls are counted (``counted``); at the second, ``decide`` (compiler/executors/payback.py) says
at which call the build pays for itself, and the job is submitted then, or never.  One daemon thread runs the jobs
in order.  When a job has built its program it hands it to ``on_ready``, the entry's ``Slot.swap`` (slot.py), which
puts it in place for the full path and the thin binding together, between two calls: the torch program and the fused program take the same inputs and compute the same
values, so which one a call runs changes no result beyond floating-point rounding.

A job that raises leaves the torch program in place and reports one line through ``note``.
``wait(jobs)`` makes tests and benchmarks deterministic (``tt.wait_for_fusion``).
"""
from __future__ import annotations

import atexit
import math
import os
import queue
import threading
import time
from typing import Callable

NEW, QUEUED, DONE = "new", "queued", "done"


class FusionJob:
    """Build a fused program once, off the calling thread.

    ``build()`` returns the fused program or None (nothing to fuse); ``on_ready(program)`` installs it;
    ``note(line)`` records what happened (``compile_stats(cf).fusion_notes``).
    """

    def __init__(self, build: Callable, on_ready: Callable, note: Callable, name: str,
                 decide: Callable | None = None, record: Callable | None = None):
        self.build, self.on_ready, self.note, self.name = build, on_ready, note, name
        self.decide = decide  # (seconds the second call took) -> payback.Decision; None: start at the second call
        self.record = record or (lambda line: None)  # one line per decision (compile_stats(cf).fusion_decisions)
        self.decision = None
        self.start_at = 2  # the call that submits the job (None: never)
        self.calls = 0
        self.state = NEW
        self._uncount = None  # set by ``counted``
        self.switched = False
        self.done = threading.Event()

    def counted(self, computation: Callable, uncount: Callable) -> Callable:
        """``computation`` counting the calls of its entry; the call ``start_at`` submits the job.

        ``uncount()`` puts the uncounted computation back once the job will never start, or has finished without
        installing a program (``Slot.stop_counting``).  Every call of the torch program goes through here until
        then, so the common path is one count and one comparison with ``_next`` (the next call with something to do).
        """
        self._uncount = uncount

        def run(*args):
            self.calls = calls = self.calls + 1
            if calls < self._next:
                return computation(*args)
            if self.decide is not None and self.decision is None:  # decide after timing this call
                t0 = time.perf_counter()
                out = computation(*args)
                self._due(time.perf_counter() - t0)
                return out
            self._due()
            return computation(*args)

        return run

    # ``_next`` follows ``start_at`` and ``state``, so that ``run`` reads one attribute.
    @property
    def start_at(self) -> int | None:
        return self._start_at

    @start_at.setter
    def start_at(self, n: int | None) -> None:
        self._start_at = n
        self._sync()

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, state: str) -> None:
        self._state = state
        self._sync()

    def _sync(self) -> None:
        start_at, state = getattr(self, "_start_at", None), getattr(self, "_state", NEW)
        self._next = start_at if state == NEW and start_at is not None else math.inf

    def _due(self, call_s=None) -> None:
        if self.decide is not None and self.decision is None:
            try:
                self.decision = self.decide(call_s)
            except Exception as e:  # noqa: BLE001 - an estimate that fails: build as without the rule
                self.record(f"{self.name}: the pay-back estimate failed ({type(e).__name__}: {e}); built from the second call")
                self.decide = None
            else:
                self.start_at = self.decision.start_at
                self.record(self.decision.line())
                if self.start_at is None:
                    self._uncount()
                    return
                if self.calls < self.start_at:
                    return
        self.submit()

    def submit(self) -> None:
        """Start the build now (``tt.wait_for_fusion`` calls this whatever the decision said)."""
        if self.state == NEW:
            self.state = QUEUED
            _worker().put(self)

    def cancel(self) -> None:
        """The entry was evicted (bounded_cache.py): a build not started never starts (the traces it holds go)."""
        if self.state == NEW:
            self.start_at = None
            self.state = DONE
            self.build = None
            self.done.set()

    def run(self) -> None:
        try:
            program = self.build()
            if program is not None:
                self.on_ready(program)
                self.switched = True
        except Exception as e:  # noqa: BLE001 - any failure: the torch program keeps running
            first = (str(e).strip().splitlines() or [""])[0][:160]
            self.note(f"{self.name}: background fusion failed, the torch program stays: {type(e).__name__}: {first}")
        finally:
            if not self.switched and self._uncount is not None:
                self._uncount()  # the torch program stays: no count in front of it any more
            self.build = None  # drop the traces it held
            self.state = DONE
            self.done.set()


def wait(jobs, timeout: float | None = None) -> bool:
    """Submit the jobs not submitted yet and wait until all are done; False when ``timeout`` ran out."""
    jobs = list(jobs)
    for job in jobs:
        job.submit()
    return all(job.done.wait(timeout) for job in jobs)


_queue: queue.Queue | None = None
_pid = None  # the process that started the worker: a forked child has the queue but not the thread
_lock = threading.Lock()
_stopping = threading.Event()


def _worker() -> queue.Queue:
    global _queue, _pid
    with _lock:
        if _queue is None or _pid != os.getpid():
            _queue, _pid = queue.Queue(), os.getpid()
            threading.Thread(target=_loop, args=(_queue,), name="thunder_train-fusion", daemon=True).start()
    return _queue


def _loop(q: queue.Queue) -> None:
    while True:
        job = q.get()
        if _stopping.is_set():  # the interpreter is exiting: start no new compile
            job.state = DONE
            job.done.set()
            continue
        job.run()
        # Dropped before waiting for the next job: this frame is no object the garbage collector sees, so the last
        # job (its entry, the compiled function and, through them, the user's model and optimizer) would stay alive
        # here after the user dropped them, until another job arrived.
        job = None


atexit.register(_stopping.set)
