"""When background fusion starts: only once building the fused program has paid for itself (docs/fusion.md).

A fused program saves some time per call and costs a build (seconds of Inductor compile, on the same cores
as the training loop).  At an entry's second call ``decide`` estimates both, on CPU programs:

* **saving per call** ``s``: for each region the fusion pass would form (``inductor_fusion.plan_regions``),
  its torch calls are timed one by one on stand-in tensors of its shapes (best of ``REPEATS``), and one fused
  kernel is taken to cost what one torch copy moving the region's input and output bytes costs (one
  vectorized pass over memory, one call): the saving is the rest.  Both are timed on the machine as loaded
  now, so they scale alike; the deciding call is timed too, and the saving is at most that time times the
  regions' share of the program's lines.
* **build cost** ``B``: ``START_S`` when Inductor has not compiled anything in this process yet, plus, for
  each region structure this process has not compiled, ``WARM_S`` when this Inductor cache directory compiled
  it before (an index file per structure, written after each compile) and ``COLD_S`` otherwise.

The rule (rent or buy): start the build at call ``n = ceil(B / s)`` (at least the second), when running the
torch program has cost as much extra as the build will.  A run that stops right after spent ``B`` more than
without fusion, at most the fraction ``s / step time`` of its time; a longer run gets the speedup.  ``s = 0``:
never.  CUDA programs start at the second call (the estimate is calibrated for CPU kernels).
"""
from __future__ import annotations

import dataclasses
import getpass
import hashlib
import math
import os
import re
import sys
import tempfile
import time

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..proxies import is_proxy
from ..pytree import tree_map
from . import inductor_fusion, regions
from .fusion import on_cuda

REPEATS = 5
START_S = 1.0  # Inductor's start-up in a process (imports, first compile): 0.5 s warm to seconds on a loaded machine
COLD_S = 2.0  # compiling one region's C++ with an empty cache
WARM_S = 0.1  # one region found in Inductor's on-disk cache
MAX_MEASURED_BYTES = 1 << 26  # a region with larger stand-ins is not timed (counted as saving nothing)
MAX_MEASURED = 64  # region structures timed per program (the rest count as saving nothing)
MEASURE_BUDGET_S = 0.25  # and no more time than this spent timing them (planning the regions not counted), on the call that decides


@dataclasses.dataclass
class Decision:
    """What ``decide`` estimated, and the call at which the build starts (None: never)."""

    regions: int
    new_regions: int  # structures this process has not compiled
    warm_regions: int  # of those, how many this cache directory compiled before
    saving_s: float  # per call
    build_s: float
    start_at: int | None
    why: str = ""

    def line(self) -> str:
        est = (f"{self.regions} region(s) save an estimated {self.saving_s * 1e3:.3f} ms a call; building "
               f"{self.new_regions} new (of which {self.warm_regions} in the on-disk cache) costs an estimated "
               f"{self.build_s:.2f} s")
        if self.why:
            return f"background fusion: {self.why}" + (f" ({est})" if self.regions else "")
        if self.start_at is None:
            return f"background fusion: not started: no region's kernel would be faster than its torch ops ({est})"
        return f"background fusion: starts at call {self.start_at} ({est}; pays back after that many calls)"


def decide(traces, *, call_s=None, measure=None, started=None, warm=None) -> Decision:
    """The decision for a program made of ``traces`` (the lowered traces the fused program fuses).

    ``measure(bsyms, inputs, outputs) -> (torch seconds, fused seconds)`` estimates a region (default:
    ``region_seconds``; regions of one structure are measured once, at most ``MAX_MEASURED`` structures and
    ``MEASURE_BUDGET_S`` seconds; the rest count as saving nothing);
    ``started`` says whether Inductor already runs in this process; ``warm(key) -> bool`` whether the on-disk
    cache has a region structure.  Tests inject all three.  ``call_s``: what the deciding call took; the saving
    is at most that times the regions' share of the program's lines (isolated timings on a loaded machine can
    be far off; the step itself bounds them).
    """
    if any(on_cuda(t) for t in traces):
        return Decision(0, 0, 0, 0.0, 0.0, 2, "CUDA program: built from the second call (the pay-back estimate is for CPU kernels)")
    measure = measure or region_seconds
    started = ("torch._inductor.compile_fx" in sys.modules) if started is None else started
    warm = warm or in_index
    saving, build, count, seen, warm_count, timed = 0.0, 0.0 if started else START_S, 0, set(), 0, {}
    # The budget counts the timing runs only: planning the regions of a large program (itself 0.3 s on a loaded machine,
    # for the zoo's Llama step) used it all before the first region was timed, and the build never started.
    spent, fused_ops = 0.0, 0
    for trc in traces:
        for bsyms, outputs in inductor_fusion.plan_regions(trc):
            key, inputs = regions.structure(bsyms, outputs)
            if isinstance(inductor_fusion.known(key), str):  # failed before: it stays on torch
                continue
            count += 1
            fused_ops += len(bsyms)
            if key not in timed:
                torch_s = fused_s = 0.0
                if len(timed) < MAX_MEASURED and spent < MEASURE_BUDGET_S:
                    t0 = time.perf_counter()
                    torch_s, fused_s = measure(bsyms, inputs, outputs)
                    spent += time.perf_counter() - t0
                timed[key] = max(0.0, torch_s - fused_s)
            saving += timed[key]
            if key in seen or inductor_fusion.known(key) is not None:
                continue
            seen.add(key)
            hit = warm(key)
            warm_count += hit
            build += WARM_S if hit else COLD_S
    if not seen:
        build = 0.0
    if count == 0:
        return Decision(0, 0, 0, 0.0, 0.0, None, "not started: nothing to fuse")
    if call_s is not None:
        lines = sum(len(trc.bound_symbols) for trc in traces)
        saving = min(saving, call_s * fused_ops / max(1, lines))
    if saving <= 0.0:
        return Decision(count, len(seen), warm_count, saving, build, None)
    return Decision(count, len(seen), warm_count, saving, build, max(2, math.ceil(build / saving)))


# ---------------------------------------------------------------------------
# Saving: the region's torch ops, timed one by one; one fused kernel, estimated
# ---------------------------------------------------------------------------
def _stand_in(p):
    t = torch.empty(p._tt_shape, dtype=p._tt_dtype.torch, device=p._tt_device.torch)
    if t.is_floating_point() or t.is_complex():
        # no zeros, denormals or NaNs: the ops' ordinary speed. Drawn from a private generator: the runtime never
        # moves the global ones (only the user's random ops do; DESIGN.md 8b)
        return t.uniform_(0.5, 1.5, generator=torch.Generator(t.device).manual_seed(0))
    return t.fill_(1)


def region_seconds(bsyms, inputs, outputs) -> tuple[float, float]:
    """``(torch, fused)``: the region's torch calls, each timed alone (best of ``REPEATS``, the same callables
    and arguments the torch program passes), and an estimate of one fused kernel: a torch copy that moves the
    region's input and output bytes once.  ``(0, 0)`` when the ops fail on stand-in values or the stand-ins
    would be too large (counted as saving nothing)."""
    nbytes = sum(regions.static_nbytes(p) for p in list(inputs) + list(outputs))  # (a region's sizes are static)
    if nbytes > MAX_MEASURED_BYTES:
        return 0.0, 0.0
    # Timing is not part of the user's step: no grad, and no torch function or dispatch mode the caller has
    # active (a profiler or FLOP counter around the step must not see these ops).
    with torch.no_grad(), torch._C.DisableTorchFunction(), _disable_current_modes():
        try:
            return _time_region(bsyms, inputs), _time_copy(nbytes)
        except Exception:  # noqa: BLE001 - an op that needs other values than stand-ins
            return 0.0, 0.0


def _time_region(bsyms, inputs) -> float:
    env = {id(p): _stand_in(p) for p in inputs}

    def value(x):
        return env[id(x)] if is_proxy(x) else x

    total = 0.0
    for b in bsyms:
        fn, args, kwargs = b.sym.fn, tree_map(value, b.args), tree_map(value, b.kwargs)
        r, result = fn(*args, **kwargs), regions.result(b)
        env[id(result)] = r if result is b.output else r[0]  # a <name>_vjp line returns its one result in a 1-tuple
        total += _best(lambda: fn(*args, **kwargs))
    return total


def _time_copy(nbytes) -> float:
    src = torch.empty(max(1, nbytes // 8), dtype=torch.float32)  # a copy reads and writes: nbytes in all
    dst = torch.empty_like(src)
    return _best(lambda: dst.copy_(src))


def _best(call) -> float:
    best = math.inf
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return best


# ---------------------------------------------------------------------------
# Build cost: which region structures this Inductor cache directory has compiled before
# ---------------------------------------------------------------------------
def inductor_cache_dir() -> str:
    """Inductor's cache directory (torch._inductor.runtime.cache_dir_utils.cache_dir, whose import costs
    seconds; tests/test_payback.py checks that this agrees with it)."""
    d = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if d:
        return d
    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + user)


def _stable(x) -> str:
    """A text for a structural key that is the same in every process (callables by name, not address)."""
    if isinstance(x, tuple):
        return "(" + ",".join(_stable(a) for a in x) + ")"
    if callable(x) and not isinstance(x, type):
        return f"{getattr(x, '__module__', '')}.{getattr(x, '__qualname__', repr(x))}"
    return repr(x)


def _index_path(key) -> str:
    digest = hashlib.sha256(_stable(key).encode()).hexdigest()[:32]
    return os.path.join(inductor_cache_dir(), "thunder_train_regions", digest)


def in_index(key) -> bool:
    return os.path.exists(_index_path(key))


def remember(key, seconds: float) -> None:
    """Record that this cache directory has compiled the structure ``key`` (an estimate: failures are ignored)."""
    path = _index_path(key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(f"{seconds:.3f}\n")
    except OSError:
        pass


inductor_fusion.on_compiled.append(remember)
