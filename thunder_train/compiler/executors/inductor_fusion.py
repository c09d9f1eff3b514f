"""Fusion by Inductor: groups of small elementwise ops and reductions become one compiled kernel.

``tt.compile(fn, fusion="inductor")`` runs this pass on the trace after it was lowered to executors
(docs/fusion.md).  It finds regions of *fusible* bound symbols (elementwise torch calls and simple
reductions on CPU or CUDA tensors of static shape), traces each region to an ATen graph and compiles it with
Inductor (``make_fx`` with Inductor's decompositions, then ``compile_fx_inner``) and replaces the region by
one bound symbol that calls the compiled kernel directly, without Dynamo or AOTAutograd wrappers:

    # inductor_fusion_0: 20 ops fused by Inductor (add, mul, sub, sin, cos, ...)
    t20 = inductor_fusion_0(x, y)  # t20: "cpu f32[8]"
      # t0 = torch.Tensor.add(x, y)  # t0: "cpu f32[8]"
      # ...

Regions form in one forward walk.  A fusible op joins the open region; a non-fusible op that reads none
of the region's values and has no side effect moves ahead of it (its relative order with other
non-fusible ops is kept, and fusible ops are pure, so nothing observable changes); anything else closes
the region: ops that read its values, write-backs (``ttex.copy_``) and ``Tensor.item``.  A region with
fewer than ``MIN_OPS`` ops stays as it was, unless a line has a fusion form (``fusion_form``: what the kernel
computes for an op whose eager kernel is slow, e.g. tanh GELU as x * sigmoid(2u); declared with the op).

Inductor generates C++ for CPU regions and Triton for CUDA regions; a region holds tensors of one device
(a fusible op on another device closes the open region).  Kernels are cached by structure (ops, constants,
input shapes, strides, dtypes and devices, which values leave the region), process-wide, so identical regions — every layer of a model, a retrace, another compiled
function — compile once.  If Inductor cannot compile a region (not installed, no C++ compiler, an op it
does not lower) the region runs on the torch executor as before and one line in
``compile_stats(cf).fusion_notes`` says why.  Kernels write their outputs into buffers (the runner's ``.out``
form, which kept buffers use) and are compiled for the trace's layouts of the inputs and outputs; an input or
buffer with other strides fails the size/stride check made before any work (executors/layout_check.py: one C++
call for all the kernel's tensors, in place of Inductor's per-input asserts), and that call runs the region's
torch calls instead and copies their values (eager's values, no speedup).
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref

import torch

from ..proxies import TensorProxy, is_proxy
from ..pytree import tree_map
from ..symbols import BoundSymbol
from . import layout_check
from .torch_executor import NOT_A_KERNEL
from .regions import MIN_OPS, FusionSymbol, fusible_name, fusion_form, op_names, result, results, static_nbytes, structure, \
    uses, whole_check, whole_form, whole_guard

_DTYPE_ONLY = {"to", "float", "double", "half", "bfloat16", "type_as"}  # conversions: never a device move


FUSED_DEVICES = ("cpu", "cuda")  # Inductor's C++ and Triton backends


def why_not_in_kernel(x) -> str | None:
    """None when ``x`` may enter a kernel, else why not."""
    if type(x) is not TensorProxy:
        return "a runtime number or size is an argument" if is_proxy(x) else None
    if any(type(d) is not int for d in x._tt_shape):
        return "symbolic sizes (dynamic=True)"
    if x._tt_device.torch.type not in FUSED_DEVICES:
        return f"{x._tt_device.torch.type} tensors (this executor fuses CPU and CUDA regions)"
    return None


def device_of(bsym):
    """The one device of a line's tensors (None: tensors on several devices, e.g. a CPU scalar tensor)."""
    devs = {x._tt_device for x in list(bsym.flat_args()) + [o for o, _ in results(bsym)] if type(x) is TensorProxy}
    return devs.pop() if len(devs) == 1 else None


def _classify(bsym) -> tuple[str | None, str | None]:
    """``(op name, None)`` for a fusible bound symbol, ``(None, reason)`` for a candidate that is not,
    ``(None, None)`` for anything else."""
    name = fusible_name(bsym)
    if name is None or bsym.has_side_effect or result(bsym) is None:
        return None, None
    if name in _DTYPE_ONLY and name != "type_as":
        extra = [a for a in bsym.flat_args()[1:] if not isinstance(a, torch.dtype)]
        if extra or (set(bsym.kwargs) - {"dtype"}):
            return None, None
    for x in list(bsym.flat_args()) + [result(bsym)]:
        why = why_not_in_kernel(x)
        if why is not None:
            return None, why
    if device_of(bsym) is None:
        return None, "tensors on more than one device"
    return name, None


def _view_in_region(bsym) -> bool:
    """A view or reshape of one tensor (``expand``, ``unsqueeze``, ``x[..., :4]``, ``view``): it may join a region that
    produces its tensor (the kernel reads through it: RMSNorm's ``rsqrt(...).expand(...)``, rotary embedding's
    halves).  Its result never leaves the kernel: one read after the region is made there from a region output
    (``_split_views``)."""
    src = bsym.source
    if bsym.sym.module != "torch_executor" or src is None or bsym.has_side_effect:
        return False
    if "view" not in src.tags and getattr(bsym.sym, "fn", None) not in NOT_A_KERNEL:  # expand: a broadcast_in_dim
        return False
    r = result(bsym)
    if r is None or r is bsym.output and isinstance(bsym.output, (tuple, list)):
        return False
    tensors = [a for a in bsym.flat_args() if is_proxy(a)]
    if len(tensors) != 1 or tensors[0] is not bsym.args[0]:
        return False  # tensor indices (gather), sizes given as values
    return why_not_in_kernel(r) is None and why_not_in_kernel(tensors[0]) is None and device_of(bsym) is not None


def _is_barrier(bsym) -> bool:
    return bsym.has_side_effect or getattr(bsym.sym, "fn", None) is torch.Tensor.item


# ---------------------------------------------------------------------------
# The pass
# ---------------------------------------------------------------------------
def fuse_regions(trc, notes: list, *, prefix: str = "inductor_fusion", header: str = "Fused by Inductor",
                 as_written: bool = False):
    """A new trace with each region of ≥ MIN_OPS fusible ops replaced by one Inductor kernel call.

    ``notes`` receives one line per decision (``compile_stats(cf).fusion_notes``)."""
    readers, returned = uses(trc)
    state = _State(trc, readers, returned, notes, prefix)
    _walk(trc, state.flush, state.out.append, state.skipped, _constants(trc), as_written)
    fused = state.count
    if state.reused:
        names = ", ".join(state.reused[:6]) + (", ..." if len(state.reused) > 6 else "")
        notes.append(f"{prefix}: {len(state.reused)} region(s) reused a kernel compiled for the same structure ({names})")
    for why, n in state.skipped.items():
        notes.append(f"{prefix}: {n} op(s) left to torch: {why}")
    if fused == 0 and not state.skipped and not state.failed:
        notes.append(f"{prefix}: nothing fused: no region of ≥ {MIN_OPS} elementwise/reduction ops on CPU or CUDA tensors")
    new = trc.derive(f"{header}: {fused} region(s)")
    new.bound_symbols = state.out
    return new


def plan_regions(trc) -> list:
    """The regions ``fuse_regions`` would compile, as ``(bsyms, outputs)``, without compiling anything."""
    readers, returned = uses(trc)
    found = []

    def flush(region, hoisted, deferred):
        _, region = _overlapping_results(region, readers, returned)
        if _worth_fusing([b for _, b in region]):
            _, outputs = _split_views(region, readers, returned)
            if outputs:
                found.append(([b for _, b in region], outputs))

    _walk(trc, flush, lambda b: None, {}, _constants(trc))
    return found


def _constants(trc) -> set:
    """ids of the lines computed once, at the program's first call (executors/constants.py): not fused."""
    from .constants import constant_line_ids

    return constant_line_ids(trc)


def _worth_fusing(bsyms) -> bool:
    """At least ``MIN_OPS`` ops (views not counted), or one whose fusion form is faster compiled than its torch call."""
    return len([b for b in bsyms if fusible_name(b) is not None]) >= MIN_OPS or any(fusion_form(b) is not None for b in bsyms)


def _split_views(region, readers, returned):
    """``(after, outputs)``: the region's views whose results are read after it (or returned), in order, to run after
    its kernel from its outputs (a kernel writes new buffers: a view's result is no kernel output; one that region
    lines read as well stays in the kernel too), and the values the kernel returns: those read after the region, by
    the moved views included."""
    inside = {i for i, _ in region}
    after = {i: b for i, b in region if fusible_name(b) is None
             and (id(result(b)) in returned or readers.get(id(result(b)), set()) - inside)}
    made = {id(result(b)): i for i, b in region}
    line = dict(region)
    needed: set = set()
    todo = list(after.values())
    while todo:  # a moved view reads a view: that one runs after the kernel too
        for x in todo.pop().flat_args():
            j = made.get(id(x))
            if j is None or id(x) in needed:
                continue
            needed.add(id(x))
            v = line[j]
            if fusible_name(v) is None and j not in after:
                after[j] = v
                todo.append(v)
    outputs = [result(b) for _, b in region if fusible_name(b) is not None and (
        id(result(b)) in returned or readers.get(id(result(b)), set()) - inside or id(result(b)) in needed)]
    return [after[i] for i in sorted(after)], outputs


def _walk(trc, flush, emit, skipped: dict, constants: set = frozenset(), as_written: bool = False) -> None:
    """The one forward walk that forms regions: ``flush(region, hoisted, deferred)`` at each region's end (the region,
    the lines moved ahead of it and the lines moved after it: (index, bsym) pairs), ``emit(bsym)`` for every other
    line; ``skipped`` counts the candidates that could not join, by reason; the lines in ``constants`` (ids) join none
    (they read no region's value, so they move ahead of the open one).

    A line that joins no region moves ahead of the open one where it reads none of its values; it moves after it
    where it reads a value the backward recomputes there (``_tt_recomputed_of``) or the result of a line so moved
    (``_deferrable`` lines only; a region op reading such a result closes the region first).  A weight gradient's
    matmul reads the recomputed input of its layer (T5's and Llama's norms' products): between the recomputation and
    the norm's backward it closed the region, and the recomputation ran as a kernel of its own (T5's fused step: 41
    kernels against 34 without the recomputation, 4-5 % of its time).  ``as_written``: the program may hold what the
    step as written holds (a default whole step: executors/buffers.py ``_room``), so a recomputed value held until
    such a line costs nothing the step as written did not; elsewhere its bytes count."""
    region: list = []  # (index, bsym)
    produced: set = set()
    hoisted: list = []
    deferred: list = []
    later: set = set()  # ids of the deferred lines' results
    recomputed: set = set()  # ids of the region's recomputed values (and views of them)
    device = None  # of the open region: one kernel runs on one device
    inputs = {id(a) for a in trc.args if is_proxy(a)}
    moved: set = set()  # ids of the lines carried into a next region once

    def close(closer=None):
        nonlocal region, produced, hoisted, deferred, later, recomputed
        carried = _carried(region, recomputed, deferred, closer, inputs, moved) if closer is not None else []
        if carried:  # (once: the next region is the one that computes the gradient of what they recompute)
            region = [x for x in region if x not in carried]
            moved.update(id(c) for _, c in carried)
        flush(region, hoisted, deferred)
        region, produced, hoisted, deferred, later, recomputed = list(carried), set(), [], [], set(), set()
        for _, c in carried:
            produced.update(id(o) for o in c.flat_outputs())
            recomputed.update(id(o) for o in c.flat_outputs())

    for i, b in enumerate(trc.bound_symbols):
        name, why = _classify(b) if id(b) not in constants else (None, None)
        reads = [id(a) for a in b.flat_args() if is_proxy(a)]
        if name is not None:
            if region and device_of(b) != device:
                close()
            elif region and any(r in later for r in reads):
                close(b)
            device = device_of(b)
            region.append((i, b))
            produced.add(id(result(b)))
            if getattr(result(b), "_tt_recomputed_of", None) is not None:
                recomputed.add(id(result(b)))
            continue
        if why is not None:
            skipped[why] = skipped.get(why, 0) + 1
        if region and id(b.args[0] if b.args else None) in produced and _view_in_region(b) and device_of(b) == device:
            region.append((i, b))
            produced.add(id(result(b)))
            if id(b.args[0]) in recomputed:
                recomputed.add(id(result(b)))
            continue
        if region and not _is_barrier(b) and not any(r in produced or r in later for r in reads):
            hoisted.append((i, b))
            continue
        # Not held longer by a deferral: the program's inputs (alive throughout) and what deferred lines make (it
        # exists only after the region).
        held = inputs | later | (recomputed if as_written else set())
        if region and any(r in recomputed or r in later for r in reads) and _deferrable(b, held):
            deferred.append((i, b))
            later.update(id(o) for o in b.flat_outputs())
            continue
        close(b)
        emit(b)
    close()


def _carried(region, recomputed: set, deferred, closer, held: set, moved: set) -> list:
    """The open region's recomputed lines to carry into the next region, past ``closer``, the line that closes this
    one: those that neither the region's other lines, nor its deferred lines, nor ``closer`` read (with what they
    read of each other).  The recomputation is placed before its first reader while the backward still computes each
    op's gradients in one line; lowered, a linear's input gradient (``g @ w``) comes between it and the gradient of
    the op it recomputes.  There it closed the region the recomputation had joined: GPT's tanh GELU ran in a kernel
    of its own, and again inside the kernel of GELU's gradient, which computes the same tanh (0.9 ms a layer; the
    step's recomputation cost 1.1 % -> 0.2 %, docs/performance.md).  Carried, both are one kernel's.  Only past a
    pure line (nothing it writes, nothing opaque), lines not carried before (``moved``: ids of lines), and where the
    values the carried lines read from outside them, less ``held`` (ids of values), are at most the bytes they make
    (``_deferrable``'s rule: nothing between holds more)."""
    if not recomputed or _is_barrier(closer) or closer.draws_random or closer.sym.runs_opaquely:
        return []
    line = dict(region)
    carry = {i for i, b in region if id(b) not in moved and all(id(o) in recomputed for o in b.flat_outputs())}
    if not carry:
        return []
    made = {id(o): i for i, b in region for o in b.flat_outputs()}

    def producers(b):
        return [made[id(a)] for a in b.flat_args() if is_proxy(a) and made.get(id(a)) in carry]

    todo = [j for b in [b for i, b in region if i not in carry] + [b for _, b in deferred] + [closer] for j in producers(b)]
    while todo:
        j = todo.pop()
        if j in carry:
            carry.discard(j)
            todo += producers(line[j])
    ins = {id(a): a for i in carry for a in line[i].flat_args()
           if type(a) is TensorProxy and made.get(id(a)) not in carry and id(a) not in held}
    if not carry or not _no_more_bytes(ins.values(), [o for i in carry for o in line[i].flat_outputs()]):
        return []
    return [(i, b) for i, b in region if i in carry]


def _deferrable(bsym, held: set) -> bool:
    """A line that may run after the open region although it reads the region's values: pure (no side effect, no
    random draw, no generator read, nothing opaque), every result a tensor.  Lines moved ahead of the region may
    then run before it: none of them reads its results, and neither writes anything.

    Memory: until it runs, the line's inputs stay alive (through the rest of the region's kernel) and its results do
    not exist yet; it moves only where its inputs, less those in ``held`` (ids), hold at most the bytes of its
    results (``transforms/sinking.py``'s rule).  The zoo's weight gradients qualify (a few tokens, a larger weight,
    the recomputed input held: ``_walk``); the GPT benchmark's checkpointed step's did not (a recomputed 4 MiB GELU
    output held across the rest of its region for a 1 MiB weight gradient: its peak 0.15x -> 0.18x eager's)."""
    outs = bsym.flat_outputs()
    if _is_barrier(bsym) or bsym.draws_random or "reads_generator" in bsym.sym.tags or bsym.sym.runs_opaquely \
            or not outs or not all(type(o) is TensorProxy for o in outs):
        return False
    ins = [a for k, a in {id(a): a for a in bsym.flat_args() if type(a) is TensorProxy}.items() if k not in held]
    return _no_more_bytes(ins, outs)


def _no_more_bytes(held_longer, made_later) -> bool:
    """Whether the tensors a move keeps alive longer hold at most the bytes of those it makes later (all sizes
    known): no line in between then holds more than before."""
    held_longer, made_later = list(held_longer), list(made_later)
    sizes = [static_nbytes(p) for p in (*held_longer, *made_later)]
    return None not in sizes and sum(sizes[:len(held_longer)]) <= sum(sizes[len(held_longer):])


class _State:
    def __init__(self, trc, readers, returned, notes, prefix):
        self.trc, self.readers, self.returned, self.notes, self.prefix = trc, readers, returned, notes, prefix
        self.out: list = []
        self.count = 0
        self.failed = 0
        self.skipped: dict = {}
        self.reused: list = []  # names of fused regions whose kernel was compiled before

    def flush(self, region, hoisted, deferred):
        # A region not fused leaves its lines, and those the walk moved ahead of or after it, in the trace's order:
        # moved, a lone reduction (a head's bias gradient) ran after the lines hoisted past it, the opaque LSTM's
        # backward among them, and held its input across it (the LSTM zoo step's fused program 1.025x eager's peak).
        whole = [b for _, b in sorted(region + hoisted + deferred, key=lambda ib: ib[0])]
        ahead, region = _overlapping_results(region, self.readers, self.returned)
        if not _worth_fusing([b for _, b in region]):
            self.out.extend(whole)
            return
        after, outputs = _split_views(region, self.readers, self.returned)
        bsyms = [b for _, b in region]
        if not outputs:  # dead code: the final DCE drops it
            self.out.extend(whole)
            return
        name = f"{self.prefix}_{self.count + self.failed}"
        ops = op_names(bsyms)
        kernel, inputs = kernel_for(bsyms, outputs)
        if isinstance(kernel, str):
            self.failed += 1
            self.notes.append(f"{name}: {len(bsyms)} ops ({ops}) left to torch: Inductor failed: {kernel}")
            self.out.extend(whole)
            return
        self.out.extend(b for _, b in hoisted)
        self.count += 1
        if kernel.uses > 0:
            self.reused.append(name)
        else:
            self.notes.append(f"{name}: fused {len(bsyms)} ops ({ops}) into one Inductor kernel, compiled in {kernel.seconds:.2f} s")
        kernel.uses += 1
        sym = FusionSymbol(name, kernel.runner, owner=kernel)
        out = outputs[0] if len(outputs) == 1 else tuple(outputs)
        comment = f"{name}: {len(bsyms)} ops fused by Inductor ({ops})"
        self.out.extend(ahead)
        self.out.append(BoundSymbol(sym, tuple(inputs), {}, out, tuple(bsyms), comment))
        self.out.extend(after)
        self.out.extend(b for _, b in deferred)


def _overlapping_results(region, readers, returned):
    """``(ahead, region)``: the region's lines that read only its inputs and whose result, read after the region, has
    elements that share memory (``broadcast_in_dim`` of RMSNorm's weight, which the backward reads too), and the
    rest.  No kernel can write such a result into a buffer (Inductor refused the whole region): they run ahead of
    the kernel on torch and it reads their results."""
    inside = {i for i, _ in region}
    made = {id(result(b)) for _, b in region}
    ahead, keep = [], []
    for i, b in region:
        r = result(b)
        escapes = id(r) in returned or bool(readers.get(id(r), set()) - inside)
        if escapes and not any(id(a) in made for a in b.flat_args() if is_proxy(a)) and not _dense(r):
            ahead.append(b)
            made.discard(id(r))
        else:
            keep.append((i, b))
    return ahead, keep


def _dense(p) -> bool:
    from ..dense import is_non_overlapping_and_dense
    from ..proxies import meta_tensor

    return is_non_overlapping_and_dense(meta_tensor(p))


# ---------------------------------------------------------------------------
# Compiling a region, cached by structure
# ---------------------------------------------------------------------------
class _Kernel:
    def __init__(self, runner, seconds):
        self.runner = runner
        self.seconds = seconds
        self.uses = 0


# structural key -> _Kernel, while a program calls it: the symbols of the programs' fused lines hold their kernel
# (``FusionSymbol.owner``), so a kernel leaves with the last program that calls it (an evicted cache entry, a
# released program per size, runtime/recurring_sizes.py) instead of living as long as the process.  Inductor keeps
# the generated module registered (its PyCodeCache: loaded code, no tensors); a later region of that structure
# compiles again from Inductor's on-disk cache.
_kernels: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_failed: dict = {}  # structural key -> why compiling it failed (a region of that structure stays on torch)
on_compiled: list = []  # hooks called with (structural key, seconds) after a region compiled (payback.py installs one)


def known(key):
    """The live kernel of structure ``key``, why compiling it failed (str), or None."""
    return _failed.get(key) or _kernels.get(key)


def compiled_before(bsyms, outputs) -> bool:
    """Whether a live program holds a kernel of this structure (or compiling it failed)."""
    return known(structure(bsyms, outputs)[0]) is not None


def kernel_for(bsyms, outputs):
    """``(kernel, inputs)``: the live or new kernel of the region ``bsyms`` returning ``outputs`` (why compiling it
    failed: a str), and its input proxies in the order its runner takes them."""
    key, inputs = structure(bsyms, outputs)
    kernel = known(key)
    if kernel is None:
        t0 = time.perf_counter()
        try:
            kernel = _Kernel(_compile_region(bsyms, inputs, outputs), 0.0)
            kernel.seconds = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - any failure means: run the region through torch
            first = (str(e).strip().splitlines() or [""])[0][:160]
            kernel = _failed[key] = f"{type(e).__name__}: {first}"
        else:
            _kernels[key] = kernel
        if not isinstance(kernel, str):
            for hook in on_compiled:
                hook(key, kernel.seconds)
    return kernel, inputs


def _region_graph(bsyms, inputs, outputs, *, into: bool = False):
    """The region as a Python function of its inputs that calls the same torch callables as the trace and returns
    its outputs (the fallback).  ``into``: what Inductor compiles, a function of the inputs and one buffer per
    output that writes the outputs into the buffers, with each line's fusion form in place of its torch call
    (``fusion_form``).  Writing into given buffers lets a program keep them between calls (executors/buffers.py).

    ``make_fx`` traces it to ATen.  Not a torch.fx graph of those callables: fx prints a call by its
    callable's ``__module__`` and ``__name__``, which for some (``Tensor.__pow__``, whose wrapper says
    ``torch._tensor.pow``) names nothing, and the whole region failed.
    """
    in_ids = [id(p) for p in inputs]
    steps = [((into and (whole_form(b) or fusion_form(b))) or b.sym.fn, b.args, b.kwargs, [(id(o), k) for o, k in results(b)])
             for b in bsyms]
    out_ids = [id(o) for o in outputs]
    # The values each step reads for the last time: freed after it, as the torch program frees them (a region whose
    # input is not laid out as compiled runs this on every call; holding every intermediate raised its peak).
    last: dict = {}
    for j, b in enumerate(bsyms):
        for a in b.flat_args():
            if is_proxy(a):
                last[id(a)] = j
    keep = set(out_ids)
    dead: list = [[] for _ in bsyms]
    for k, j in last.items():
        if k not in keep:
            dead[j].append(k)

    def values(*args):
        env = dict(zip(in_ids, args))

        def value(x):
            return env[id(x)] if is_proxy(x) else x

        for (fn, a, kw, made), gone in zip(steps, dead):
            r = fn(*tree_map(value, a), **tree_map(value, kw))
            for out, k in made:
                env[out] = r if k is None else r[k]
            for k in gone:
                env.pop(k, None)
        return tuple(env[i] for i in out_ids)

    if not into:
        return values

    def region_into(*args):
        for buffer, v in zip(args[len(in_ids):], values(*args[:len(in_ids)])):
            buffer.copy_(v)
        return ()

    return region_into


_compiling = threading.local()


def _keep_rng_while_compiling():
    """Inductor saves the global generators' state before compiling and sets it back afterwards. Built on the
    background worker (``fusion="background"``) that rewinds the random numbers the training loop drew meanwhile
    (dropout masks repeat, the run leaves eager's stream). Our regions hold no random ops, so compiling them draws
    nothing: while one of ours compiles, that save-and-restore is skipped (other compiles keep it)."""
    import torch._dynamo.utils as dynamo_utils

    original = dynamo_utils.preserve_rng_state
    if getattr(original, "_tt_keeps_rng", False):
        return

    @contextlib.contextmanager
    def preserve_rng_state():
        if getattr(_compiling, "active", False):
            yield
        else:
            with original():
                yield

    preserve_rng_state._tt_keeps_rng = True
    dynamo_utils.preserve_rng_state = preserve_rng_state


def _inductor_compile(gm, example, *, asserts: bool = True):
    """Compile a torch-level function of tensors; returns ``call(list_of_tensors) -> tuple``.  ``asserts``: whether
    the generated code checks its inputs' sizes and strides itself (else its caller does, executors/layout_check.py)."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    if asserts and not config.size_asserts:
        raise RuntimeError("torch._inductor.config.size_asserts is off: a kernel could not check its inputs' strides")

    _keep_rng_while_compiling()
    with torch.no_grad():
        aten = make_fx(gm, tracing_mode="fake", decomposition_table=select_decomp_table())(*example)
        _compiling.active = True
        try:
            with config.patch(size_asserts=asserts):  # thread-local: another thread's torch.compile keeps its own
                compiled = compile_fx_inner(aten, example)
        finally:
            _compiling.active = False
    call = getattr(compiled, "current_callable", None)
    return call if call is not None else compiled  # the bare generated ``call``: no per-call bookkeeping


def _compile_region(bsyms, inputs, outputs):
    """The region compiled for its inputs' and outputs' layouts (the proxies', which are eager's)."""
    tensors = list(inputs) + list(outputs)
    example = [_allocator(p)() for p in tensors]
    asserts = layout_check.needs_asserts()
    call = _inductor_compile(_region_graph(bsyms, inputs, outputs, into=True), example, asserts=asserts)
    fits = None if asserts else layout_check.LayoutCheck(
        (p._tt_shape, p._tt_strides, p._tt_dtype.torch, p._tt_device.torch.type) for p in tensors)
    guards = tuple(g for g in map(whole_guard, bsyms) if g is not None)
    if guards:  # process state the lines' own functions read: where it says no, those functions run
        fits = functools.partial(_guarded, guards, fits or _always)
    # A line compiled whole that checks its results (``whole_check``: cross-entropy's targets were classes): where
    # they say no, its own function runs, which raises eager's error.
    check = whole_check(bsyms[0]) if len(bsyms) == 1 else None
    return _runner(call, _region_graph(bsyms, inputs, outputs), outputs, fits, check)


def _guarded(guards, fits, tensors) -> bool:
    return all(guard() for guard in guards) and fits(tensors)


def _allocator(p):
    """A function of no arguments returning a new tensor laid out as the proxy ``p`` (on the CPU Inductor's own
    allocation helper where this torch has it: a third of ``torch.empty_strided``'s cost, which counts for small
    regions)."""
    shape, strides, dtype, device = tuple(p._tt_shape), tuple(p._tt_strides), p._tt_dtype.torch, p._tt_device.torch
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    fast = getattr(guards, "_empty_strided_cpu", None) if device.type == "cpu" else None
    if fast is not None:
        return functools.partial(fast, shape, strides, dtype)
    return functools.partial(torch.empty_strided, shape, strides, dtype=dtype, device=device)


def _always(tensors) -> bool:
    return True


def _runner(call, fallback, outputs, fits=None, check=None):
    """The function the trace calls, with its out form ``.out`` (executors/buffers.py): the kernel writes the
    outputs into buffers it is given (``out``: one per output, None for one it allocates, with its proxy's
    layout).  Before any work, ``fits`` checks every input's and buffer's layout against the compiled ones
    (executors/layout_check.py; None: the generated code checks them itself); after it, ``check`` (if given) the
    outputs' values.  When either (or anything else) fails, the region's torch ops run instead and their values are
    copied into the buffers."""
    single = len(outputs) == 1
    allocate = [_allocator(o) for o in outputs]
    fits = fits or _always
    missed = _Fallbacks()

    def into(args, buffers):
        tensors = [*args, *buffers]
        if fits(tensors):
            try:
                call(tensors)  # the generated code empties the list it is given
                if check is None or check(*buffers):
                    return
            except Exception:  # noqa: BLE001 - typically an input not laid out as compiled
                pass
        missed.calls += 1
        for b, v in zip(buffers, fallback(*args)):
            b.copy_(v)

    def run_into(*args, out):
        buffers = [out] if single and not isinstance(out, (tuple, list)) else list(out)
        for i, b in enumerate(buffers):
            if b is None:
                buffers[i] = allocate[i]()
        into(args, buffers)
        return buffers[0] if single else tuple(buffers)

    if single:
        new_output = allocate[0]

        def run(*args):  # the common case, without the general path's calls (small regions are µs)
            b = new_output()
            into(args, [b])
            return b
    else:
        def run(*args):
            buffers = [new() for new in allocate]
            into(args, buffers)
            return tuple(buffers)

    run.out, run.aliases = run_into, ()  # the outputs are new tensors
    run.fallbacks = missed
    return run


class _Fallbacks:
    """How often a kernel's call ran the region's torch ops instead (an input or buffer not laid out as compiled:
    a wrong traced layout costs the kernel on every call).  ``compile_stats(cf).fusion_fallback_calls``."""

    calls = 0


def fallback_calls(traces) -> int:
    """The fallbacks of the kernels these traces call (each kernel once: regions of one structure share it)."""
    seen = {}
    for trc in traces:
        for b in trc.bound_symbols:
            count = getattr(getattr(b.sym, "runner", None), "fallbacks", None)
            if isinstance(count, _Fallbacks):
                seen[id(count)] = count.calls
    return sum(seen.values())
