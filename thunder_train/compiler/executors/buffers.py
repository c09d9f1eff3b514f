"""Kept buffers (torch executor, CPU): large intermediates are written into memory the program keeps between calls.

Why: glibc gives a large freed block back to the operating system (``munmap``, or trimming the top of the
heap), so a training step that allocates and frees the same activations and gradients on every call
page-faults them in again on every call: 6,000-14,000 page faults and ~8 % of the GPT benchmark's step on
the CPU.  PyTorch's CPU allocator keeps no cache that would stop this (CUDA's caching allocator does).  For
small tensors the allocation itself is what a kept buffer saves.

What: on a program that runs without grad (a whole training step; a call without grad; the forward and the
backward ``ThunderFunction`` runs for ``tt.compile(model)``), each CPU intermediate (of at least ``MIN_BYTES``)

* computed by a line whose function has an out form (``out_form``: the torch function's own ``out=``, declared
  with the op as ``Symbol.torch_out_forms``, or a ``ttex`` function's ``.out``: the same kernels, writing into
  the buffer),
* that is not returned, not aliased by anything returned, and not passed to a line that may keep a
  reference (an op run opaquely),

gets a place in one arena, shared by values whose storage lifetimes do not overlap.  A storage lives until
the last line that reads it or anything that may alias it; a line whose function is not known to return new
tensors (``aliases`` declared with the function, its op's ``Symbol.torch_fresh``, or an ATen overload's schema) is
taken to alias all its tensor arguments.  Each value is a view of the arena with the shape and strides its proxy has (eager's layout), so
the kernels, the values and every later view are the same as without the buffers (``tests/test_kept_buffers.py``
checks the zoo's steps bitwise).  The arena is held for the whole call, so the plan keeps the arena plus what
the call still allocates within ``PEAK_SLACK`` of the call's peak without it, or in a default whole step within
``_room`` of it, towards what the step as written holds (``plan``: rounds that drop values
until that holds; the values alive where the call peaks packed first, the others in their gaps,
``arena.around_the_peak``; or arena sizes tried in turn, values dropped where the kept bytes are above one,
``arena.in_a_band``: whichever keeps more values).  At a line whose kernel
allocates scratch memory of unknown size (``Symbol.torch_unknown_scratch``: the CPU convolution backward) the call
may peak inside the kernel, so there the arena holds no byte beyond what the kept values alive at the line need.
A function or op that declares its scratch memory (``fn.scratch_bytes(*args, **kwargs)``: the blocked head's;
``Symbol.scratch_bytes``: an opaque op's ``opaque.scratch_rule``) has it counted as a value alive at its line only;
a function whose result holds memory no proxy shows (``fn.held_bytes``: an attention line keeping its autograd
graph, executors/kept_graphs.py) has that counted alive until the result's last read (``_inside_lines``).

The program takes one set of views when it starts (``_pool = ttex.kept_buffers(k)``, ``_b = _pool.take()``)
and gives it back before it returns.  A call running at the same time (another thread, or reentrant) takes
another set; a call that raises does not give its set back, and the next call allocates a new one.  When
background fusion replaces the program, its sets are freed (``release_replaced``).
"""
from __future__ import annotations

import itertools
import math
import operator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..codegen import Name, format_call
from ..dense import dense_layout
from ..proxies import TensorProxy, is_proxy, meta_tensor
from ..pytree import tree_flatten, tree_map
from ..symbols import BoundSymbol, Symbol
from . import torch_impls
from .arena import ALIGN as _ALIGN, SMALL as _SMALL, SMALL_ALIGN as _SMALL_ALIGN
from .arena import Packing as _Packing, around_the_peak as _around_the_peak, fill as _fill, in_a_band as _in_a_band
from .arena import live_bytes as _live_bytes, overlaps as _overlaps
from .out_forms import ANY_LAYOUT, TAKES_TENSORS, aliased_args, aliasing_results, contiguous_copies, out_form
from .out_forms import reshape_copies
from .regions import FusionSymbol
from .torch_executor import ImplSymbol, impl_symbol, to_torch_arg

_T = torch.Tensor

# Every size is worth keeping: a large block saves its page faults, a small one the allocation itself (the model
# zoo's tiny steps are 3-5 % faster keeping every size than keeping only blocks of 128 KiB and more).
MIN_BYTES = 0
# The arena may raise the plan's estimate of the peak by this much: the few scalars a call allocates while the arena
# is full (64 KiB had put the zoo's tiny steps, whose peaks are 0.1-0.3 MiB, above eager's; docs/memory.md).
PEAK_SLACK = 1024
# At a line whose kernel's scratch memory is unknown (``Symbol.torch_unknown_scratch``) the call may peak inside the
# kernel, above every line the plan sees: there the arena may hold this many bytes beyond what the kept values alive
# at the line need.  None: with ``PEAK_SLACK`` there (up to 1 KiB of dead values), ResNet's and DeepSeek-V3's zoo
# steps were above eager's peak (docs/memory.md).
SCRATCH_SLACK = 0


def _slack(natural: int) -> int:
    """What the arena may add to a program's planned peak of ``natural`` bytes: ``PEAK_SLACK``, and at most a 32nd of
    that peak (a whole KiB put a sharded 8-33-5 MLP's 4 KiB step above eager FSDP2's)."""
    return min(PEAK_SLACK, natural // 32)


# A default whole step's arena may raise the call's peak above the program's own, up to what the step as written
# holds (``traced``: the memory plan's count of the traced step before it recomputes or moves anything,
# ``MemoryPlan.traced_peak_bytes``; eager runs that program).  Each value kept saves its allocation and the view lines
# made on it every call; without this room the default's cheap recomputation, which lowers the program's own peak,
# took them away (the fused Llama zoo step 10 % slower than without it; issue 27 allows 2 %).  That count holds each
# gradient to the optimizer, as eager's ``.grad`` (since session 50; before, 4.4 % under ModernBERT's measured peak):
# 84-100 % of eager's measured peak on the zoo's transformer steps (it does not see eager's float attention masks and
# the statistics autograd saves), less where kernels' scratch is unknown (recurrent and convolution steps, which get
# no room).  The arena may fill up to this share of it (0.9 until session 38: the recomputation still cost Mistral's
# and Qwen2's fused steps 3-5 %, 0-1 % with the whole count, whose peaks stayed at most 0.94x eager's):
TRACED_SHARE = 1.0
# and at most this share of the program's own peak above it (a step whose traced count is above eager's: Mixtral's,
# whose experts' weights the trace reads by copies the program no longer makes).
ROOM_SHARE = 0.15


def _room(natural: int, traced: int | None) -> int:
    """What the arena may add to a program's planned peak of ``natural`` bytes: ``_slack``, or where the step as
    written holds ``traced`` bytes (a default whole step), up to ``TRACED_SHARE`` of those within ``ROOM_SHARE``."""
    if traced is None:
        return _slack(natural)
    return max(_slack(natural), min(int(traced * TRACED_SHARE) - natural, int(natural * ROOM_SHARE)))


def _surely_held(storages, inside, n) -> int:
    """The most bytes the call surely holds at one line: a kept graph's backward temporaries are counted at their
    most (``_inside_lines``: as much again as the graph; measured 0.2-0.75 of it), which raises the peak the plan's
    rounds are bound to.  ``_around``, the bolder choice, is bound to this one: with the larger bound it filled room
    the call did not have (DeepSeek-V3's torch program: 9.6 KiB above its real peak, 0.3 % above eager's)."""
    return max(_live_bytes(storages, [k for k in storages if k not in inside or k[0] != "held scratch"], n), default=0)


def _inside_lines(bsyms, output):
    """(the lines whose kernel's scratch memory is unknown, {key: [first line, last line, bytes, None]} of the memory
    lines hold beyond their results): a kernel's declared scratch, alive at its line only; and what a line's first
    result holds until its last read (``fn.held_bytes``: a kept autograd graph, which the result itself holds, not
    its views), and as much again inside that last reader's line, which runs the graph's backward (its temporaries)."""
    unknown, inside = [], {}
    returned = {id(p) for p in tree_flatten(output)[0]}
    for i, b in enumerate(bsyms):
        line_scratch = _scratch(b)
        if line_scratch is None:
            unknown.append(i)
        if getattr(b.sym, "hands_in", False):
            continue
        if line_scratch:
            inside[("scratch", i)] = [i, i, line_scratch, None]
        held_of = getattr(getattr(b.sym, "fn", None), "held_bytes", None)
        o = next((o for o in b.flat_outputs() if _tensor(o)), None) if held_of is not None else None
        if o is not None and o._tt_device.type == "cpu":  # (kept buffers are CPU memory)
            try:
                nbytes = held_of(*b.args, **b.kwargs)
            except Exception:  # noqa: BLE001 - not found on meta tensors: unknown, as a kernel's scratch
                unknown.append(i)
                continue
            last = len(bsyms) - 1 if id(o) in returned else \
                max((j for j in range(i, len(bsyms)) if any(a is o for a in bsyms[j].flat_args())), default=i)
            inside[("held", i)] = [i, last, nbytes, None]
            inside[("held scratch", i)] = [last, last, nbytes, None]
    return unknown, inside


def _unseen_memory(bsyms) -> bool:
    """Whether a line's backend allocates memory the plan does not see (``Symbol.torch_unseen_memory``: the
    collectives), so that the program gets no ``_room``."""
    return any(getattr(b.source or b.sym, "torch_unseen_memory", False) for b in bsyms)


def _scratch(b) -> int | None:
    """The bytes line ``b``'s kernel allocates and frees inside the line: its function's rule (``fn.scratch_bytes``,
    the torch executor's own functions) or its op's (``Symbol.scratch_bytes``), else 0, or None where unknown
    (``Symbol.torch_unknown_scratch``, or the rule says so for these arguments)."""
    rule = getattr(getattr(b.sym, "fn", None), "scratch_bytes", None)
    if rule is not None:
        return rule(*b.args, **b.kwargs)
    return (b.source or b.sym).kernel_scratch(*b.args, **b.kwargs)


def _meta(x):
    return meta_tensor(x) if _tensor(x) else to_torch_arg(x)


def _kind(x):
    """What decides whether an overload takes an argument: a tensor's dtype and rank, a number's type, the rest as is."""
    if _tensor(x):
        return ("tensor", x._tt_dtype, len(x._tt_shape))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *map(_kind, x))
    if isinstance(x, dict):
        return ("dict", *((k, _kind(v)) for k, v in x.items()))
    if type(x) in (int, float, complex) or is_proxy(x):
        return type(x).__name__
    return repr(x)


_accepted: set = set()  # (out form, argument kinds) it took


class _Dispatched(Exception):
    """The call got past its argument checks to torch's dispatcher (``_ArgumentCheck``)."""


class _ArgumentCheck(TorchDispatchMode):
    """Stops a call at the first op it dispatches, before any kernel runs.

    Why not run the out form on meta tensors: torch's meta kernels of elementwise ops are Python functions
    (torch._prims_common.wrappers) whose first call imports torch._dynamo (about 1 s), and a compiled function's
    first call must not pay that (tests/test_first_call.py)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps ``__torch_dispatch__`` in torch._disable_dynamo, whose first call imports
        # torch._dynamo; nothing runs under torch.compile inside this check, so there is nothing to disable.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        raise _Dispatched


def _accepts_out(bsym, form) -> bool:
    """Whether the out form takes this line's kind of call.  ``out=`` overloads accept fewer argument kinds than
    their functions (``torch.where(c, x, 0.0, out=o)`` is a TypeError): the form is called on meta tensors once
    for each kind of call and taken if the call gets past torch's argument parser to the dispatcher
    (``_ArgumentCheck``), where nothing is left to refuse it: ``out`` holds tensors of the line's own results
    (dtype, shape, device), which the out forms here write as they would allocate them (the TensorIterator
    kernels, matmul, cat, and the ``ttex`` forms written for these calls; tests/test_kept_buffers.py compares each
    with its functional call).  Autocast and grad mode are off as when the program runs; a refusal is not
    remembered (the caller's state could have caused it)."""
    if isinstance(bsym.sym, FusionSymbol):
        return True  # compiled for these very layouts; any other buffer fails its check and runs the region's torch ops
    if form in TAKES_TENSORS and not bsym.kwargs and _tensor(bsym.output) and all(map(_tensor, bsym.args)):
        return True  # what the check below answers, without a first dispatch of each op (a small program's first call)
    key = (form, _kind(bsym.args), _kind(bsym.kwargs), _kind(bsym.output))
    if key in _accepted:
        return True
    if not reaches_dispatcher(form, bsym.args, bsym.kwargs, bsym.output):
        return False
    _accepted.add(key)
    return True


def reaches_dispatcher(form, args, kwargs, out) -> bool:
    """Whether ``form(*args, **kwargs, out=out)`` gets past its argument checks to torch's dispatcher, called on meta
    tensors (proxies are replaced by theirs) with autocast and grad mode off as when the program runs."""
    try:
        with torch.autocast("cpu", enabled=False), torch.no_grad():
            args, kwargs, out = tree_map(_meta, args), tree_map(_meta, kwargs), tree_map(_meta, out)
            with _ArgumentCheck():
                form(*args, **kwargs, out=out)
        return False  # it returned without dispatching anything: not a call this check understands
    except _Dispatched:
        return True
    except Exception:
        return False


def _writes_any_layout(bsym, form) -> bool:
    """Whether the line's out form writes its values right into a buffer laid out as its proxy says, whatever that
    layout (``ANY_LAYOUT``); a fused region checks the layouts it was compiled for and runs its torch ops otherwise."""
    if isinstance(bsym.sym, FusionSymbol):
        return True
    try:
        return form in ANY_LAYOUT
    except TypeError:  # an unhashable callable
        return False


def _keeps_no_reference(bsym) -> bool:
    """Lines known to keep no reference to their inputs once they return: the torch executor's calls of the ops
    it knows, and fused regions.  An op run opaquely (any torch or user function) may keep one."""
    if isinstance(bsym.sym, FusionSymbol):
        return True
    return isinstance(bsym.sym, ImplSymbol) and not (bsym.source is not None and bsym.source.runs_opaquely)


def _tensor(x) -> bool:
    return type(x) is TensorProxy


def _storage_bytes(p, rounded=True) -> int | None:
    """Bytes of the proxy's storage, rounded up to ``_ALIGN`` (``_SMALL_ALIGN`` under ``_SMALL`` bytes) unless not
    ``rounded``, when its layout is one an arena view can have (dense, non-overlapping, concrete sizes, no storage
    offset); else None."""
    shape, strides = p._tt_shape, p._tt_strides
    if not all(type(n) is int for n in shape) or not all(type(s) is int for s in strides) or p._tt_storage_offset != 0:
        return None
    numel = math.prod(shape)
    if numel == 0 or not dense_layout(shape, strides):
        return None
    nbytes = numel * p._tt_dtype.torch.itemsize
    if not rounded:
        return nbytes
    align = _SMALL_ALIGN if nbytes < _SMALL else _ALIGN
    return -(-nbytes // align) * align


# ---------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------
def _reached(values, may_alias) -> set:
    out = set()
    for a in values:
        if _tensor(a):
            out |= may_alias.get(id(a), set())
    return out


def storage_sets(bsyms, inputs=()):
    """``(may_alias, escaped)`` of a lowered trace's lines: ``id(value) -> ids of the storages it may share`` (an input
    of the program, a line's new result: its own; a line's result that may alias its arguments: theirs) and the
    storages a line that may keep a reference was given (an op run opaquely)."""
    may_alias = {id(a): {id(a)} for a in inputs if _tensor(a)}
    escaped: set = set()
    for b in bsyms:
        reached = _reached(b.flat_args(), may_alias)
        if not _keeps_no_reference(b):
            escaped |= reached
        aliased = () if out_form(b) is not None else aliased_args(b)
        shared = reached if aliased is None else _reached(tree_flatten([b.args[k] for k in aliased])[0], may_alias)
        sharing = {id(o) for o in aliasing_results(b)} if aliased != () and shared else ()
        for o in b.flat_outputs():
            if _tensor(o):
                may_alias[id(o)] = shared if id(o) in sharing else {id(o)}
    return may_alias, escaped


def overwritable(trc, bsyms=None):
    """``(may_alias, off_limits)`` for a pass that writes a line's result over the memory of a value it reads:
    ``may_alias`` as ``storage_sets`` gives it for ``bsyms`` (default: the trace's lines), and the storages no line
    may overwrite: the program's inputs', its returned values' and those handed to a line that may keep a reference."""
    bsyms = trc.bound_symbols if bsyms is None else bsyms
    may_alias, escaped = storage_sets(bsyms, trc.args)
    returned = set().union(*(may_alias.get(id(p), set()) for p in tree_flatten(trc.output)[0] if type(p) is TensorProxy))
    return may_alias, {id(a) for a in trc.args} | escaped | returned


def _eligible(trc) -> bool:
    """``out=`` refuses tensors that need grad under grad mode: the program runs without grad, or no value needs it."""
    if "@torch.no_grad()" in trc.decorators:
        return True
    values = list(trc.args) + [o for b in trc.bound_symbols for o in b.flat_outputs()]
    return not any(_tensor(v) and v._tt_requires_grad for v in values)


def plan(trc, whole_call: bool = True, traced: int | None = None):
    """(arena bytes, {id(value): (byte offset, bytes, value)}) for the trace's lines: see ``_plan``."""
    nbytes, assigned = _plan(trc, whole_call, traced)
    return nbytes, {id(v): (offset, size, v) for offset, size, v in assigned.values()}


def _plan(trc, whole_call: bool = True, traced: int | None = None):
    """(arena bytes, {key: (byte offset, bytes, value)}) for the trace's lines.

    Every storage a line creates is tracked (for the peak-memory rule below), the ones a kept buffer can hold
    are the candidates.  A kept arena is held for the whole call, so the program's peak becomes the arena plus
    the peak of what it still allocates; when that is above the peak without buffers by more than ``_room``
    (``PEAK_SLACK``, or up to ``TRACED_SHARE`` of ``traced``, the step as written), candidates alive where the
    arena is fullest but not where the other allocations peak are allocated again until it is not (or nothing is
    kept); then those dropped are placed again where they fit
    (``arena.fill``: in the arena as it is, or growing it within the same rule)."""
    bsyms = trc.bound_symbols
    # id(value) -> ids of the storages it may share.  An input's is its own, not allocated by the call: a view of one
    # (``weight.T``) is no new memory (Falcon's fused step peaked 1.05x eager's).  Values handed in (a backward's) are
    # not entered: most are freed inside the call, unmodelled; entered, a backward's arena passed its real peak.
    may_alias: dict = {id(a): {id(a)} for a in trc.args if _tensor(a)}
    storages: dict = {}  # id(value) -> [first line, last line, bytes, value] of a storage a line created
    candidates: dict = {}  # id(value) -> (line, out form) of a value a kept buffer could hold
    escaped: set = set()
    # Results taken to share their arguments' memory (not declared new) that are no view and write nothing: they may
    # be new memory all the same (``Tensor.square``), which the peak above does not count.  ``around`` counts them.
    maybe_new: dict = {}
    for i, b in enumerate(bsyms):
        if getattr(b.sym, "hands_in", False):
            continue  # values handed in: see above
        reached = _reached(b.flat_args(), may_alias)
        for r in reached:
            if r in storages:
                storages[r][1] = i
            elif r in maybe_new:
                maybe_new[r][1] = i
        if not _keeps_no_reference(b):
            escaped |= reached
        form = out_form(b)
        aliased = () if form is not None or reshape_copies(b) or contiguous_copies(b) else aliased_args(b)
        shared = reached if aliased is None else _reached(tree_flatten([b.args[k] for k in aliased])[0], may_alias)
        sharing = {id(o) for o in aliasing_results(b)} if aliased != () and shared else ()
        for o in b.flat_outputs():
            if not _tensor(o):
                continue
            if id(o) in sharing:
                may_alias[id(o)] = shared
                if aliased is None and not b.has_side_effect and not view_call(b):
                    may_alias[id(o)] = shared | {id(o)}
                    maybe_new[id(o)] = [i, i, _storage_bytes(o) or 0, o]
                continue
            may_alias[id(o)] = {id(o)}
            nbytes = _storage_bytes(o)  # None: a layout no arena view can have
            storages[id(o)] = [i, i, nbytes or 0, o]
            if form is not None and nbytes is not None and o._tt_device.type == "cpu" and nbytes >= max(MIN_BYTES, 1) \
                    and (o._tt_rowmajor or _writes_any_layout(b, form)):
                candidates[id(o)] = (b, form)
    candidates = _worth_their_forms(candidates, bsyms)
    for p in tree_flatten(trc.output)[0]:
        if is_proxy(p):
            escaped |= may_alias.get(id(p), set())
    scratch, inside = _inside_lines(bsyms, trc.output)
    storages.update(inside)
    sure = _surely_held(storages, inside, len(bsyms))
    storages, candidates, escaped = _keyed_by_place(storages, candidates, escaped)
    # Whether the line's out form takes its call is asked only for values that could be kept (the first call of a
    # small program is mostly these questions).
    accepts = {}  # id(line) -> answer
    kept = set()
    for k, (b, form) in candidates.items():
        if k not in escaped:
            if id(b) not in accepts:
                accepts[id(b)] = _accepts_out(b, form)
            if accepts[id(b)]:
                kept.add(k)
    if not kept:
        return 0, {}
    candidates_kept = set(kept)
    alive_with = _overlaps(storages, kept)  # for the rounds' packings
    packing = _Packing(storages, alive_with)
    n = len(bsyms)
    without = _live_bytes(storages, storages.keys(), n)  # bytes alive at each line
    natural = max(without)
    # The loop drops one value a round: the kept bytes alive at each line lose that value's bytes over its lifetime.
    # Python lists, not tensors: a round reads every line once (a Llama step: ~150 rounds over ~450 lines), about as
    # fast either way there, and a small program's first call does not pay each tensor op's first dispatch.
    pooled = _live_bytes(storages, kept, n)
    slack = _room(natural, None if scratch or _unseen_memory(bsyms) else traced)  # (memory the plan does not see)
    exact = {k: _storage_bytes(storages[k][3], rounded=False) for k in kept} if scratch else {}
    need = _live_bytes(storages, kept, n, exact) if scratch else None  # the kept values' unrounded bytes at each line
    # The candidates as (first line, last line, bytes, key), in order of lifetime, for the rounds' questions.
    columns = sorted(((*storages[k][:3], k) for k in kept), key=lambda c: c[:2])

    def drop(k):
        nonlocal columns
        kept.discard(k)
        columns = [c for c in columns if c[3] != k]
        first, last, nbytes, _ = storages[k]
        pooled[first:last + 1] = [p - nbytes for p in pooled[first:last + 1]]
        if need is not None:
            need[first:last + 1] = [p - exact[k] for p in need[first:last + 1]]

    # A second choice, made before the rounds (see ``_around``); the plan keeping more values is taken.
    around = _around(storages, kept, without, maybe_new, sure, slack, alive_with) if whole_call and not scratch else None
    while kept:
        # Allocating again a value alive where the arena is fullest, but not where the other allocations peak,
        # shrinks the arena and leaves that peak as it is: the smallest one that covers the excess, else the largest.
        others = list(map(operator.sub, without, pooled))
        most_others = max(others)
        t = others.index(most_others)  # the first line where the others peak
        fullest = max(pooled)
        # alive at a line where the arena is fullest: a full line between its first and last line
        full_before = list(itertools.accumulate(map(fullest.__eq__, pooled), initial=0))
        at_full = [(nbytes, first, k, last) for first, last, nbytes, k in columns if full_before[last + 1] > full_before[first]]
        movable = [(nbytes, first, k) for nbytes, first, k, last in at_full if not first <= t <= last]
        # The arena holds at least the kept bytes alive together (``fullest``): where that alone leaves an excess
        # larger than every movable value, the largest goes whatever the packing (no packing needed: it is the
        # planner's cost on a first call, one packing per value dropped).
        if movable and fullest + most_others - natural - slack > max(movable)[0]:
            drop(max(movable)[2])
            continue
        if scratch:
            # A line whose kernel's scratch memory is unknown may be where the call peaks, above every line the plan
            # sees: there the arena may hold no byte (``SCRATCH_SLACK``) beyond what the kept values alive at it need
            # (their sizes unrounded; the call's memory without the arena would hold them there too).  Where the rounding of the
            # values alive there is the excess, the one rounded most goes; else the smallest value not alive there
            # that covers the excess, else the largest.
            # The packing is at least ``fullest``: where that alone settles the round, no packing is made (one per
            # value dropped: ~280 on DeepSeek-V3's first two calls, most of its planner's time).
            s = min(scratch, key=need.__getitem__)
            dropped = _scratch_drop(columns, s, fullest - need[s] - SCRATCH_SLACK, pooled[s] > need[s], exact, settled=False)
            if dropped is not None:
                drop(dropped)
                continue
        nbytes, assigned = packing.pack(kept)
        excess = nbytes + most_others - natural - slack
        if scratch:
            dropped = _scratch_drop(columns, s, nbytes - need[s] - SCRATCH_SLACK, pooled[s] > need[s], exact, settled=True)
            if dropped is not None:
                drop(dropped)
                continue
        if excess <= 0:
            # (where a kernel's scratch is unknown the arena may not grow: see above)
            limit = None if scratch else natural + slack
            nbytes = _fill(storages, assigned, nbytes, candidates_kept - kept, others, limit, alive_with)
            return _keeping_more(around, (nbytes, assigned))
        if not movable:
            # Every value where the arena is fullest is alive where the others peak too: the excess is the packing's
            # (the arena above the kept bytes alive at once).  Allocating one of them again shrinks the arena at most
            # as much as it adds there; the smallest that covers the excess, else the largest, repacks the rest.
            movable = [(nbytes, first, k) for nbytes, first, k, _ in at_full]
            if not movable:
                break
        covering = [m for m in movable if m[0] >= excess]
        drop((min(covering) if covering else max(movable))[2])
    return _keeping_more(around, (0, {}))


def _worth_their_forms(candidates, bsyms):
    """The candidates less those whose out form runs Python between (``fn.python_between``) and of which the program
    takes no view.  A kept value saves its allocation and makes each view of it once per set of buffers instead of
    once a call (a dispatch each); ``linear_rows_out``'s frame and two views cost ~1.7 us a call against the ~0.5 us
    of the allocation it saves (a 2x12x32 input), so such a value pays only with views taken of it (BERT's zoo step,
    its nine biased projections kept: ~3 % slower than without kept buffers for them; Qwen2's, whose query, key and
    value projections are viewed as heads: ~5 % faster)."""
    costly = {k for k, (b, form) in candidates.items() if getattr(form, "python_between", False)}
    if not costly:
        return candidates
    viewed = {id(b.args[0]) for b in bsyms if b.args and view_call(b)}
    return {k: c for k, c in candidates.items() if k not in costly or k in viewed}


def _keyed_by_place(storages, candidates, escaped):
    """The storages, candidates and escaped storages keyed by the storage's place in the trace instead of an ``id()``:
    the plan's choices break ties by key (and by the order of sets of keys), and ids differ from one compile to the
    next (the same fused Llama step kept 69, 77 or 78 values).  ``plan`` gives the chosen values back by id."""
    order = {k: i for i, k in enumerate(storages)}
    return ({order[k]: v for k, v in storages.items()}, {order[k]: v for k, v in candidates.items()},
            {order[k] for k in escaped if k in order})


def _around(storages, kept, without, maybe_new, natural, slack, alive_with):
    """The plan of ``arena.around_the_peak`` (the values alive where the call peaks packed first, the others in their
    gaps) or of ``arena.in_a_band`` (arena sizes tried in turn), whichever keeps more, then ``arena.fill``; or None.
    Each value it keeps more than the rounds is an allocation, and the views made on it, that the call no longer makes
    (the fused Llama zoo step: 69 values kept instead of 55, 5 % faster; nn.TransformerEncoder's with its cheap
    recomputation, whose memory is high at two lines: 36 instead of 24, ``in_a_band``'s).

    Only where the program is the whole call (``plan``'s ``whole_call``): a compiled module's forward keeps its
    arena while its backward runs, which neither program's peak counts, and the larger arenas this choice makes put
    tt.compile(model)'s checkpointed step above eager's (1.09x; tests/test_memory.py
    ::test_compiled_module_is_planned_like_whole_steps).  Its bound counts the results that may be new memory
    (``maybe_new``: ``Tensor.square``'s, not declared new) against the peak that does not count them, and keeps a
    quarter of the slack (``_slack``'s) for what the plan does not see (a few scalars: 12 bytes over the slack in
    tests/test_kept_buffers.py::test_results_that_are_new_memory_count_in_the_plan without it)."""
    n = len(without)
    upper = list(map(operator.add, without, _live_bytes(maybe_new, maybe_new.keys(), n))) if maybe_new else without
    budget = natural + slack - _slack(natural) // 4
    best = None
    for choose in (_around_the_peak, _in_a_band):
        found = choose(storages, kept, upper, budget, alive_with)
        if found is None:
            continue
        arena_bytes, placed = found
        rest = list(map(operator.sub, upper, _live_bytes(storages, placed.keys(), n)))
        arena_bytes = _fill(storages, placed, arena_bytes, set(kept) - placed.keys(), rest, budget, alive_with)
        best = _keeping_more(best, (arena_bytes, placed))
        if len(best[1]) == len(kept):
            break  # (every candidate kept)
    return best


def _keeping_more(a, b):
    """Of two plans ``(arena bytes, assigned)`` (``a`` may be None), the one keeping more values, else the smaller."""
    if a is None:
        return b
    return min(a, b, key=lambda p: (-len(p[1]), p[0]))


def _scratch_drop(columns, s, over, rounding_is_over, exact, *, settled):
    """The value ``plan`` drops for the unknown-scratch line ``s`` when the arena is ``over`` bytes above what the
    kept values alive at ``s`` need, or None (nothing to drop).  ``settled``: ``over`` is the packing's; else it is a
    lower bound (the packing not made), and None also means the packing must decide."""
    if over <= 0:
        return None
    if rounding_is_over:
        return max((nb - exact[k], k) for first, last, nb, k in columns if first <= s <= last)[1]
    away = [(nb, first, k) for first, last, nb, k in columns if not first <= s <= last]
    away = away or [(nb, first, k) for first, last, nb, k in columns]
    covering = [m for m in away if m[0] >= over]
    if covering and not settled:
        return None  # which value covers the excess depends on the packing's own excess
    return (min(covering) if covering else max(away))[2]


class BufferPool:
    """Sets of views into a kept arena, one set per running call."""

    def __init__(self, nbytes, views, derived=()):
        self.nbytes = nbytes  # the arena's size
        self.views = views  # (byte offset, bytes, shape, strides, torch dtype) of each pooled value
        # (index of the view it is taken from, view function, its other arguments, kwargs, shape, strides) of each
        # view of a pooled value the program takes (``_hoisted_view``), made once per set after ``views``
        self.derived = tuple(derived)
        self._free: list = []
        self.released = False
        self.key = _register(self)

    def take(self) -> list:
        try:
            return self._free.pop()
        except IndexError:
            arena = torch.empty(self.nbytes, dtype=torch.uint8)
            views = [arena[o:o + n].view(dtype).as_strided(shape, strides) for o, n, shape, strides, dtype in self.views]
            for base, fn, args, kwargs, several, layouts in self.derived:
                made = fn(views[base], *args, **kwargs)
                for v, (shape, strides) in zip(made if several else (made,), layouts):
                    if not v._is_view() or tuple(v.shape) != shape or v.stride() != strides:
                        raise RuntimeError(f"kept buffers: {fn} of a kept buffer gave {tuple(v.shape)}/{v.stride()}, not "
                                           f"the view of {shape}/{strides} the program was planned with (a bug: please "
                                           "report it)")
                    views.append(v)
            return views

    def give(self, views) -> None:
        if not self.released:
            self._free.append(views)

    def drop_sets(self) -> None:
        """Give the kept sets back to the allocator; the next call allocates a new one (recurring_sizes.py)."""
        self._free.clear()

    def release(self) -> None:
        """The program was replaced (background fusion switched): its buffers go back to the allocator."""
        self.released = True
        self._free.clear()


# Printed programs name their pool by key (``ttex.kept_buffers(3)``); the program's globals hold the pool
# (``_kept_buffers_3``).
_register, kept_buffers = torch_impls.numbered_objects("kept_buffers")


class _PoolLine(Symbol):
    """The lines that take a set of buffers from this program's pool, and give it back before returning."""

    def __init__(self, pool, take):
        super().__init__("take_buffers" if take else "give_buffers", None, module="torch_executor", is_prim=True)
        self.pool, self.take = pool, take  # no side effect on any input: the lines run after the last DCE

    def format_lines(self, bsym, fmt):
        if self.take:
            mib = self.pool.nbytes / 2**20
            n = sum(len(d[-1]) for d in self.pool.derived)
            views = f" and {n} views of them" if n else ""
            return [f"_pool = ttex.kept_buffers({self.pool.key})  # {len(self.pool.views)} intermediates in {mib:.1f} MiB{views} "
                    f"kept between calls (executors/buffers.py)", "_b = _pool.take()"]
        return ["_pool.give(_b)"]

    def codegen_globals(self) -> dict:
        return {"ttex": torch_impls, f"_kept_buffers_{self.pool.key}": self.pool}


# Torch callables that return a view of their first argument (the line's only tensor): a view of a pooled value is
# the same view of the same memory on every call, so each set of buffers makes it once (``BufferPool.take``) and the
# line becomes ``t = _b[k]``: one dispatch less per call.  Checked on meta tensors when planned and on the arena when
# a set is made: a call that copies (``reshape`` of a layout no view has) stays a line.
VIEW_FNS = frozenset({
    torch.permute, _T.permute, torch.transpose, _T.transpose, torch.t, _T.t, _T.view, _T.expand, torch.unsqueeze,
    _T.unsqueeze, torch.squeeze, _T.squeeze, torch.reshape, _T.reshape, _T.__getitem__, torch.narrow, _T.narrow,
    torch.flatten, _T.flatten, _T.unflatten, torch.movedim, _T.movedim, torch.select, _T.select,
    torch_impls.broadcast_in_dim, torch.split, _T.split, torch.chunk, _T.chunk, torch.unbind, _T.unbind})


_EXPANDS = frozenset({_T.expand, torch_impls.broadcast_in_dim})


def view_call(b) -> bool:
    """A line calling a view (its result is its argument's memory): an op tagged a view, or a view function."""
    tags = b.sym.tags | (b.source.tags if b.source is not None else frozenset())
    if tags & {"view", "shape_only"}:
        return True
    try:
        return isinstance(b.sym, ImplSymbol) and b.sym.fn in VIEW_FNS
    except TypeError:  # an unhashable callable
        return False


def plain_arg(x) -> bool:
    """A constant argument of a view call: numbers, None, Ellipsis, slices of numbers and tuples of those."""
    if isinstance(x, (tuple, list)):
        return all(plain_arg(e) for e in x)
    if type(x) is slice:
        return plain_arg((x.start, x.stop, x.step))
    return x is None or x is Ellipsis or type(x) in (int, bool)


def _hoisted_view(b, order, metas):
    """(id of the pooled value it views, its meta results, the pool's entry) for a view line of a pooled value whose
    other arguments are constants, else None."""
    fn = b.sym.fn if isinstance(b.sym, ImplSymbol) else None
    try:
        if fn not in VIEW_FNS:
            return None
    except TypeError:  # an unhashable callable
        return None
    if not b.args or not _tensor(b.args[0]) or id(b.args[0]) not in order:
        return None
    outs = b.output if isinstance(b.output, (tuple, list)) else (b.output,)
    if not outs or not all(_tensor(o) and all(type(n) is int for n in (*o._tt_shape, *o._tt_strides, o._tt_storage_offset))
                           for o in outs):
        return None
    rest, kwargs = b.args[1:], b.kwargs
    if not plain_arg(rest) or not plain_arg(tuple(kwargs.values())):
        return None
    try:
        with torch.no_grad():
            meta = fn(metas[id(b.args[0])], *rest, **kwargs)
    except Exception:  # noqa: BLE001 - not a call this rule understands: the line stays
        return None
    got = tuple(meta) if isinstance(b.output, (tuple, list)) and isinstance(meta, (tuple, list)) else (meta,)
    # The view the line makes is the meta call's (the pooled value has its planned layout): its strides are what
    # the line would give on every call, also where a proxy's traced strides say otherwise (an ``expand`` of a
    # ``broadcast_in_dim`` is traced row-major; eager's has stride 0 on the expanded dims).
    if len(got) != len(outs) or not all(
            type(m) is torch.Tensor and m._is_view() and m.dtype == o._tt_dtype.torch and tuple(m.shape) == tuple(o._tt_shape)
            and (m.stride() == tuple(o._tt_strides) and m.storage_offset() == o._tt_storage_offset or fn in _EXPANDS)
            for m, o in zip(got, outs)):
        return None
    layouts = tuple((tuple(m.shape), tuple(m.stride())) for m in got)
    return id(b.args[0]), got, (fn, rest, dict(kwargs), isinstance(b.output, (tuple, list)), layouts)


class _PooledView(Symbol):
    """``t = _b[k]``: a view of a kept buffer, made once per set of buffers (``_hoisted_view``)."""

    def __init__(self, indices, call):
        super().__init__("pooled_view", None, module="torch_executor", is_prim=True)
        self.indices, self.call = indices, call

    def format_lines(self, bsym, fmt):
        outs = bsym.output if isinstance(bsym.output, (tuple, list)) else (bsym.output,)
        names = ", ".join(fmt(o) for o in outs)
        views = ", ".join(f"_b[{k}]" for k in self.indices)
        types = ", ".join(f'{o._tt_name}: "{o.type_string()}"' for o in outs)
        lhs, rhs = (f"({names},)", f"({views},)") if len(outs) == 1 and isinstance(bsym.output, (tuple, list)) else (names, views)
        return [f"{lhs} = {rhs}  # {types} = {self.call}, made with the buffers"]

    def codegen_globals(self) -> dict:
        return {}


def keep_large_buffers(trc, header=None, *, grad_disabled=False, traced: int | None = None):
    """The trace with its large intermediates written into kept buffers (see the module docstring).
    ``grad_disabled``: the program always runs without grad (the forward and backward of ``ThunderFunction``);
    ``traced``: the bytes the step as written holds at once (a default whole step; ``_room``)."""
    if not grad_disabled and not _eligible(trc):
        return trc
    nbytes, assigned = plan(trc, whole_call=not grad_disabled, traced=traced)
    if not assigned:
        return trc
    order = {key: k for k, key in enumerate(sorted(assigned, key=lambda key: assigned[key][2]._tt_name))}
    views = [None] * len(order)
    for key, k in order.items():
        offset, size, o = assigned[key]
        views[k] = (offset, size, tuple(o._tt_shape), tuple(o._tt_strides), o._tt_dtype.torch)
    derived, lines, n = [], [], len(views)
    metas = {key: meta_tensor(assigned[key][2]) for key in order}
    for b in trc.bound_symbols:
        view = _hoisted_view(b, order, metas)
        if view is not None:
            base, made, entry = view
            outs = b.output if isinstance(b.output, (tuple, list)) else (b.output,)
            indices = tuple(range(n, n + len(outs)))
            for o, m, k in zip(outs, made, indices):
                order[id(o)], metas[id(o)] = k, m
            n += len(outs)
            derived.append((order[base], *entry))
            b = BoundSymbol(_PooledView(indices, format_call(b, None)), (b.args[0],), {}, b.output)
        lines.append(b)
    pool = BufferPool(nbytes, views, derived)
    new = trc.derive(header or trc.header)
    new.bound_symbols.append(BoundSymbol(_PoolLine(pool, True), (), {}, None))
    for b in lines:
        if isinstance(b.sym, _PooledView):
            new.bound_symbols.append(b)
            continue
        outs = [o for o in tree_flatten(b.output)[0] if _tensor(o)]
        if any(id(o) in order for o in outs):
            out = tree_map(lambda o: Name(f"_b[{order[id(o)]}]") if _tensor(o) and id(o) in order else None, b.output)
            into = b.sym.out_symbol() if isinstance(b.sym, FusionSymbol) else impl_symbol(out_form(b))
            b = b.replace(sym=into, kwargs={**b.kwargs, "out": out})
        new.bound_symbols.append(b)
    new.bound_symbols.append(BoundSymbol(_PoolLine(pool, False), (), {}, None))
    return new


def kept_bytes(trc) -> int:
    """Bytes the trace's program keeps between calls (one set of buffers; benchmarks add it to the step's peak)."""
    return sum(b.sym.pool.nbytes for b in trc.bound_symbols if isinstance(b.sym, _PoolLine) and b.sym.take)


def release_replaced(old_traces, new_traces) -> None:
    """Free the kept buffers of the programs among ``old_traces`` that ``new_traces`` no longer has."""
    keep = {id(t) for t in new_traces}
    for t in old_traces:
        if id(t) not in keep:
            for b in t.bound_symbols:
                if isinstance(b.sym, _PoolLine) and b.sym.take:
                    b.sym.pool.release()


def drop_kept_sets(traces) -> None:
    """Free the buffers the programs of ``traces`` keep between calls; they are allocated again by their next call."""
    for t in traces:
        for b in t.bound_symbols:
            if isinstance(b.sym, _PoolLine) and b.sym.take:
                b.sym.pool.drop_sets()
