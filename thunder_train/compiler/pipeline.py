"""The pass sequence: from a Python function and its arguments to the programs one cache entry runs.

``compile_entry`` is the whole pipeline, in order; each step names the module that implements it.  It ends
in a ``Compiled``: a frozen product (prologue, program, backward, the builder of the fused program) that call
time (``runtime/``) wraps in a cache entry and never changes.  docs/architecture.md describes every pass.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import time
from typing import Callable

import torch

from .autograd_function import AutogradProgram, NoBackwardProgram, may_need_autograd
from .prologue import Prologue, build_prologue
from . import acquisition
from .acquisition import output_aliases
from .errors import DecisionMismatch, NoGradientRuleError
from .executors import layout_rules  # noqa: F401  (installs the eager-layout hook into Symbol.__call__)
from .executors import payback
from .executors.fusion import fuse
from .executors.regions import FusionSymbol
from .executors.lowering import lower_to_executors
from .executors.buffers import keep_large_buffers
from .executors.constants import fold_constants
from .executors.duplicates import merge_duplicates
from .executors.slices_of_pads import slices_of_pads
from .executors.decided_layouts import decide_layouts
from .executors.row_major_weight_grads import row_major_weight_grads
from .executors.identity_views import drop_identity_views
from .executors.numbers_as_tensors import numbers_as_tensors
from .executors.mm_calls import matmuls_as_mm
from .executors.reinplace import reinplace
from .executors.torch_impls import decision_key
from .transforms.autograd import build_forward_backward
from .transforms.dce import dce
from .transforms.collectives import late_waits, prefetch
from .transforms.lifetimes import free_after_last_use, take_saved_as_list
from .transforms.early_updates import update_when_final
from .transforms.memory import plan_memory, split_memory_plan
from .transforms.remat import in_region
from .transforms.no_grad import without_autograd
from .transforms.opaque_grad import free_graphs_at_last_vjp
from .executors.saved_statistics import reuse_forward_statistics
from .executors.whole_lines import compile_whole_lines
from .executors import narrow_value_attention  # noqa: F401  (registers the fused programs' attention pair)
from .executors.blocked_head import block_the_head, whole_logits_bytes
from .executors.into_dead_grad import gelu_grad_in_place, regions_into_dead_inputs
from .executors.sums_in_place import scatters_into_sums, sums_in_place


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What compile time hands to call time for one cache entry (frozen: call time never changes it).

    ``program`` is the torch program (the computation before the epilogue and the output rebuild) and
    ``wrap(program)`` what a call runs; ``build_fused`` (``fusion="background"``) builds the fused program that
    may replace ``program`` later: ``runtime/slot.py`` owns which one runs.
    """

    key: tuple  # the guard key (everything the trace was specialised on)
    struct_key: tuple  # the cheap structural key of the arguments + global state
    prologue: Prologue  # extract + guard_key, shared by entries with the same leaf structure
    program: Callable
    wrap: Callable  # program -> computation: adds the RNG restore, the epilogue and the output rebuild
    traces: tuple
    backward_traces: tuple | None  # set when the entry computes gradients for PyTorch autograd
    prologue_traces: tuple
    leaves: tuple
    input_idx: tuple  # leaf index of each computation argument (then the epilogue's targets)
    select: Callable  # leaf values -> computation arguments
    epilogue: object = None  # compiler/acquisition/epilogue.py: Python side effects replayed after the computation
    has_backward: bool = False  # the function calls backward(): gradients are values of the computation
    updates_parameters: bool = False  # writes in place into inputs that require grad (runtime/autocast_region.py)
    decision_notes: tuple = ()  # where each decision is checked, and its cost
    # (text, value) of each decision the program checks (acquisition/decisions.py), in the order it checks them:
    # a DecisionMismatch at index i means the first i held and the i-th went the other way.
    checked: tuple = ()
    mutated: tuple = ()  # the containers and objects the epilogue changes (acquisition/containers.py), as paths
    # fusion="background": () -> (fused program, traces, backward traces or None) or None (nothing to fuse), run
    # off the calling thread; payback(seconds the second call took) -> payback.Decision: the call it pays off at.
    build_fused: Callable | None = None
    payback: Callable | None = None
    memory: object = None  # transforms/memory.py MemoryPlan: what the backward recomputes, what is saved
    # The default (fusion="background"): () -> (program, traces) of the torch program after the passes that pay off
    # only over calls; built at the entry's second call (``_steady_later``; runtime/slot.py).
    build_steady: Callable | None = None


@dataclasses.dataclass(frozen=True)
class Options:
    """The compile options the passes read (``tt.compile``'s keywords)."""

    strict: bool = False
    decompose: bool = False
    dynamic: bool = False
    fusion: str | None = None  # None, "inductor", "nvfuser", "auto" (fused before the first call; executors/fusion.py)
    #                            or "background" (built later, executors/background.py)
    optimizer_kernels: str = "fused"
    keep_buffers: bool = True  # executors/buffers.py
    memory_budget: float | None = None  # transforms/memory.py


def compile_entry(fn, args, kwargs, options: Options, executors, *, struct_key, arg_names, intern_prologue,
                  fusion_notes: list, forced_decisions=()) -> tuple[Compiled, list]:
    """Trace ``fn`` on ``args``/``kwargs`` and compile what a cache entry runs; also returns the ops run opaquely.

    ``intern_prologue`` maps a generated prologue to the one already shared by entries with the same
    leaf structure; ``fusion_notes`` collects what Inductor fusion did (``compile_stats``);
    ``forced_decisions`` the checked decisions a run of another entry observed (``acquire``).
    """
    names = ", ".join(ex.name for ex in executors)
    # 1. Acquisition (compiler/acquisition/): run fn on proxies; in-place ops functionalized, a backward and an
    #    optimizer step inside fn recorded, Python side effects collected for the epilogue.
    acquired = acquisition.acquire(fn, args, kwargs, strict=options.strict, dynamic=options.dynamic,
                               fused_optimizers=options.optimizer_kernels == "fused", forced_decisions=forced_decisions,
                               keep_decompositions=options.decompose)
    # After loss.backward() inside the function, gradients are values of the trace: no PyTorch autograd.
    has_backward = acquired.has_backward
    traces = [acquired.trace]
    # 2. Dead code elimination (transforms/dce.py).
    trc = dce(acquired.trace, keep_sizes=True)
    traces.append(trc)
    computed = trc  # what autograd differentiates (step 9)
    memory, asks, keep_graphs = None, False, True  # asks: the program asks for memory (checkpoint regions or a budget)
    if has_backward:
        # The default's torch program, which runs until its fused program is built (tens of thousands of calls on
        # a small step: executors/payback.py), is planned as a program of torch kernels, like ``fusion=None``'s: a
        # value costly to recompute as a kernel of its own is recomputed only as far as the peak needs.  The fused
        # program, whose kernels recompute it for free, plans again where that kept any (``build_fused`` below).
        steps, steps_shown = trc, list(traces)  # (the traced step and the traces before its plan, to plan again)
        alone = options.fusion in (None, "background")
        trc, memory, asks, keep_graphs, made = _planned(steps, options, kernels_alone=alone)
        traces.extend(made)
    # 3. Lowering (executors/lowering.py): each line claimed by an executor or replaced by its decomposition.
    #    A slice of a zero pad that reads only the padded tensor's elements reads that tensor, a pad of a pad is one
    #    pad (executors/slices_of_pads.py): once, for the torch program and the fused one built from ``lowered``.
    lowered = _lowered(trc, executors, names, traces)
    # 4.-7. Fusion (executors/fusion.py: Inductor or nvFuser; with autograd, step 9 fuses the forward and backward
    #    instead), DCE, statistics reuse, re-inplacing, lifetimes.  fusion="background" builds the fused program
    #    later (step 12).
    # A default step's kept buffers may fill towards what the step as written holds (executors/buffers.py ``_room``);
    # one that asks for memory keeps them within its own peak.
    traced = memory.traced_peak_bytes if memory is not None and not asks else None
    finish = functools.partial(_finish, has_backward=has_backward, decompose=options.decompose,
                               written=bool(acquired.written), names=names, keep_buffers=options.keep_buffers,
                               blocked_head=asks, keep_graphs=keep_graphs, traced=traced)
    fuse_main = has_backward or not may_need_autograd(computed)
    now = options.fusion if options.fusion != "background" else None
    # The default runs an entry's first call without the passes that pay off only over calls, kept buffers included
    # (``_steady_later``): the entry of a step's first call (the optimizer's state made) runs once.  (Not where an
    # autograd node may run instead: step 9 builds its programs whole.)
    later = options.fusion == "background" and fuse_main
    trc, more = finish(lowered, fusion=now if fuse_main else None, notes=fusion_notes, later=later)
    if later:
        unsettled = trc
        trc = _freed(unsettled)
        more.append(trc)
    traces.extend(more)
    if asks:
        memory.head_by_blocks(whole_logits_bytes(trc))
    # 8. Prologue (compiler/prologue.py): extraction + guard key, generated once per leaf structure and shared.
    written = [i for i, leaf in enumerate(acquired.leaves)
               if leaf.kind == "tensor" and leaf.alias_of is None and id(leaf.proxy) in acquired.written]
    # Decisions on the call's own inputs are part of the guard key; the program checks the others itself.
    in_prologue = [d for d in acquired.decisions if not d.checked]
    prologue, expected = build_prologue(acquired.leaves, arg_names, written, acquired.size_checks, in_prologue,
                                        acquired.called_names)
    prologue = intern_prologue(prologue)
    leaf_of_proxy = {id(leaf.proxy): i for i, leaf in enumerate(acquired.leaves)
                     if leaf.kind in ("tensor", "number") and leaf.alias_of is None}
    input_idx = tuple(leaf_of_proxy[id(p)] for p in trc.args)
    program, backward_traces, build_steady = trc.python_callable(), None, None
    # 9. Autograd (transforms/autograd.py, compiler/autograd_function.py): outputs that require grad connect to PyTorch
    #    autograd through one node whose forward and backward traces go through steps 3, 4 and 7.
    build_fused = None  # fusion="background": notes -> (program, traces, backward traces) of the fused program
    to_fuse = [lowered]  # the traces the fused program fuses (the pay-back estimate looks at them)
    if not has_backward and may_need_autograd(computed):
        attached = _attach_autograd(program, traces, computed, executors, fusion=options.fusion, notes=fusion_notes,
                                    keep_buffers=options.keep_buffers, backward_errors=acquired.backward_errors,
                                    memory_budget=options.memory_budget, stand_ins=acquired.grad_stand_ins,
                                    pieces=acquired.returned_view_calls)
        if attached is not None:
            program, traces, backward_traces, build_fused, to_fuse, memory = attached
    elif fuse_main:
        shown = list(traces[: len(traces) - len(more)])

        def build_fused(notes):
            if memory is None or not memory.costly_kept:
                fused, fused_shown = finish(lowered, fusion="background", notes=notes)
                fused_shown = shown + fused_shown
            else:  # planned again, as a fused program: every cheap value recomputed where that lowers the peak
                made = list(steps_shown)
                again, fused_memory, *_, planned = _planned(steps, options, kernels_alone=False)
                made.extend(planned)
                fused, fused_shown = finish(_lowered(again, executors, names, made), fusion="background", notes=notes)
                fused_shown = made + fused_shown
                if _fused_regions(fused):
                    memory.replaced_by(fused_memory)
            _same_inputs(fused, trc, "the fused program")
            return (fused.python_callable() if _fused_regions(fused) else None), fused_shown, None
    if later and backward_traces is None and traces[-1] is trc:  # the torch program runs (no autograd node)
        build_steady = _steady_later(unsettled, trc, traces, options.keep_buffers, traced)
    # 10.-11. Epilogue and outputs (_wrapping): Python side effects replayed after the computation, a returned
    #     user type rebuilt around the real tensors.
    wrap, targets = _wrapping(acquired, len(input_idx))
    input_idx += targets  # the epilogue's targets are passed after the computation's inputs
    # 12. Background fusion (runtime/background.py, runtime/slot.py): the entry runs the torch program built
    #     above while ``build_fused`` runs in a worker thread, submitted at the call where it pays for itself
    #     (executors/payback.py, decided at the second call); its program then replaces the torch program.
    background = options.fusion == "background" and build_fused is not None
    compiled = Compiled(
        expected, struct_key, prologue, program, wrap, tuple(traces), None if backward_traces is None else tuple(backward_traces),
        (prologue.extract, prologue.guard_key_fn), tuple(acquired.leaves), input_idx, _select(input_idx),
        epilogue=acquired.epilogue, has_backward=has_backward,
        updates_parameters=any(acquired.leaves[i].proxy._tt_requires_grad for i in written),
        decision_notes=tuple(_decision_note(d) for d in acquired.decisions),
        checked=tuple((d.text, decision_key(d.result)) for d in acquired.decisions if d.checked),
        mutated=tuple(acquisition.path_str(p) for p in acquired.mutated_paths),
        build_fused=_noting(build_fused, fusion_notes) if background else None,
        payback=(lambda call_s: payback.decide(to_fuse, call_s=call_s)) if background else None,
        memory=memory, build_steady=build_steady)
    return compiled, acquired.opaque_ops


def _planned(trc, options: Options, kernels_alone: bool) -> tuple:
    """Steps 2a-2c on a whole step's traced program ``trc`` (its backward in it): (the program, its
    ``MemoryPlan``, whether it asks for memory, whether forwards keep their autograd graphs, the traces made).
    ``kernels_alone``: planned as a program of torch kernels (``plan_memory``)."""
    made: list = []
    trc, memory = plan_memory(trc, made, options.memory_budget, kernels_alone=kernels_alone)  # transforms/memory.py: what the backward recomputes
    trc = without_autograd(trc)  # transforms/no_grad.py
    made.append(trc)
    # transforms/early_updates.py: each parameter updated once its gradient is final.  Not with fusion chosen up
    # front: update lines inside the backward split the regions Inductor would fuse (the zoo's ViT step fused
    # nothing); docs/memory.md, known gaps.  Except where the program asks for memory: it updates every
    # parameter as soon as it can (no small gradients held back), fused or not (without, a checkpointed GPT
    # fused up front peaked at 1.48x its torch program).
    asks = memory is not None and (memory.checkpoint_regions > 0 or memory.memory_budget is not None)
    # A checkpoint region whose values nothing needed to recompute still asks for memory: no forward keeps its
    # autograd graph for the backward there (executors/saved_statistics.py ``keep_graphs``).
    keep_graphs = not asks and not any(in_region(b) for b in trc.bound_symbols)
    updated = (update_when_final(trc, hold_back_bytes=0 if asks else None, group_bytes=0 if asks else None)
               if options.fusion in (None, "background") or asks else trc)
    if updated is not trc:
        trc = updated
        made.append(trc)
    return trc, memory, asks, keep_graphs, made


def _lowered(trc, executors, names: str, traces: list):
    """Step 3: ``trc`` lowered to ``executors`` (executors/lowering.py), a slice of a zero pad reading what was
    padded (executors/slices_of_pads.py); the traces made are appended to ``traces``."""
    lowered = lower_to_executors(trc, executors, header=f"Lowered to executors: {names}")
    traces.append(lowered)
    sliced = slices_of_pads(lowered, header=f"Lowered to executors: {names}; slices and pads of pads read what was padded")
    if sliced is not lowered:
        lowered = dce(sliced, header=sliced.header)
        traces.append(lowered)
    return lowered


def _steady_later(unsettled, first, traces, keep_buffers, traced=None):
    """``Compiled.build_steady``: the torch program after ``_steady_passes`` (layouts decided, duplicates merged,
    constants folded, kept buffers, identity views dropped, numbers as tensors, matmuls as mm), made when its entry
    runs a second time.  Each pays off over calls, and a step's first call runs an entry no later call matches (the
    optimizer's state is made there): T5's zoo step spent ~0.2 s of its first call on them.  ``first`` is the program
    the entry runs until then (lifetimes only), last in ``traces``."""
    shown = list(traces)

    def build():
        program = _steady_passes(unsettled, keep_buffers, traced)
        _same_inputs(program, first, "the steady program")
        return program.python_callable(), shown[:-1] + [program]

    return build


def _same_inputs(program, runs_now, what) -> None:
    """``program`` replaces ``runs_now``, which the entry's callers pass its inputs to: it must take the same."""
    if [id(a) for a in program.args] != [id(a) for a in runs_now.args]:
        raise RuntimeError(f"{what} takes other inputs than the torch program it replaces")


def _decision_note(d) -> str:
    if d.checked:
        return (f"{d.text}: checked by the program where it computes the value; the prologue recomputes none of "
                f"its {d.ops} op(s)")
    why = f" ({d.why_prologue})" if d.why_prologue else ""
    return f"{d.text}: {d.ops} op(s) recomputed by the prologue on every call{why}"


def _finish(lowered, *, fusion, notes, has_backward, decompose, written, names, keep_buffers, blocked_head=False,
            keep_graphs=True, later=False, traced=None):
    """Steps 4-7 on the lowered computation: the final trace, and the traces shown before and with it.  ``later``:
    the trace before ``_steady_passes`` instead (not shown); ``traced``: as ``_steady_passes``'."""
    shown = []
    trc = lowered
    if has_backward and not decompose:  # before fusion takes the sums into regions (executors/sums_in_place.py)
        trc = scatters_into_sums(trc)
    if fusion is not None:
        trc = fuse(trc, fusion, notes, as_written=traced is not None)  # executors/fusion.py
        shown.append(trc)
    trc = dce(trc, header=f"Final computation (executors: {names})")
    # 5. Backward kernels reuse their forward's statistics (executors/saved_statistics.py; torch executor).
    if has_backward and not decompose:
        trc = reuse_forward_statistics(trc, header=f"Final computation (executors: {names}; backward kernels reuse forward statistics)",
                                       keep_graphs=keep_graphs, fused=fusion is not None)
        # A pair line made of many torch calls (eager's math attention) runs as one Inductor kernel in a fused
        # program (executors/whole_lines.py).
        if fusion is not None:
            trc = compile_whole_lines(trc, fusion, notes)
        # A scatter_add whose first operand dies there (gradient sums of weight[e]) is written into it
        # (executors/sums_in_place.py).
        trc = sums_in_place(trc, header=f"Final computation (executors: {names}; scatter_add written into its dead first operand)")
        # 5a. Where the program asks for memory (checkpoint regions, a budget), a language model's head and its
        #     cross-entropy run by blocks of rows: the logits never exist whole (executors/blocked_head.py).
        #     GELU's gradient is written over its dead incoming gradient (executors/into_dead_grad.py).
        if blocked_head:
            header = f"Final computation (executors: {names}; the head's matmul and cross-entropy by blocks of rows)"
            blocked = block_the_head(trc, header=header)
            # Gradients made with the loss leave the backward's copy of the head's input (a budget's) unread.
            trc = dce(blocked, header=header) if blocked is not trc else trc
            trc = gelu_grad_in_place(trc, header=f"Final computation (executors: {names}; GELU's gradient over its dead incoming gradient)")
            if fusion is not None:  # a fused region computing it (or other pointwise ops) writes over a dead input too
                trc = regions_into_dead_inputs(trc, header=f"Final computation (executors: {names}; fused regions over a dead input)")
    # 6. Re-inplacing (executors/reinplace.py): update chains of inputs run in place where safe.
    if written:
        shown.append(trc)
        trc = reinplace(trc, header=f"Final computation (executors: {names}; update chains run in place where safe)")
    # 7. Collectives (transforms/collectives.py): each unit's all-gathers start during the unit before it, and
    #    each wait moves down to the first use of its result.
    #    Kept buffers (executors/buffers.py): large CPU intermediates are written into memory the program keeps
    #    between calls; lifetimes (transforms/lifetimes.py): the others are freed after their last use.
    trc = late_waits(prefetch(trc))
    if later:
        return trc, shown
    trc = _steady_passes(trc, keep_buffers, traced)
    shown.append(trc)
    return trc, shown


def _steady_passes(trc, keep_buffers: bool, traced: int | None = None):
    """Steps 7a-7d: passes that make each call cheaper (and the kept buffers), then the lifetimes.  The default runs
    an entry's first call without the first ones (``_steady_later``).  ``traced``: the bytes the step as written
    holds at once, towards which a default step's kept buffers may fill (executors/buffers.py ``_room``)."""
    # 7a. Layout questions (identity .grad layouts, the fused optimizers' layout comparison) answered once from the
    #     traced layouts (executors/decided_layouts.py).
    #     A product transposed twice (a transposed weight's gradient, made as eager makes it) is read as the product
    #     (executors/row_major_weight_grads.py).
    trc = row_major_weight_grads(decide_layouts(trc))
    # 7b. A call repeated while its first result is alive (a view: at all) reads it (executors/duplicates.py);
    #     lines computing constants (position ids, masks from sizes) run once, at the first call (executors/constants.py).
    trc = fold_constants(merge_duplicates(trc))
    if keep_buffers:
        trc = keep_large_buffers(trc, traced=traced)
    # 7c. View lines that give back the tensor their chain of views started from are dropped
    #     (executors/identity_views.py; after the buffers, whose plan counts what the lines allocate).
    #     A Python number in float tensor arithmetic is passed as a shared 0-d tensor: torch does not wrap it on each
    #     call (executors/numbers_as_tensors.py); a matmul of two matrices calls mm (executors/mm_calls.py).
    return _freed(matmuls_as_mm(numbers_as_tensors(drop_identity_views(trc))))


def _freed(trc):
    """7d. The last backward through an opaque op's autograd graph frees its saved tensors as it goes
    (transforms/opaque_grad.py); every trace then frees each value after its last use (transforms/lifetimes.py)."""
    return free_after_last_use(free_graphs_at_last_vjp(trc), header=trc.header)


def _fused_regions(*trcs) -> int:
    """How many lines of the traces call a fused region (Inductor's or nvFuser's)."""
    return sum(isinstance(b.sym, FusionSymbol) for t in trcs for b in t.bound_symbols)


def _noting(build_fused, notes):
    """``build_fused`` for the worker thread: the fused program, traces and backward traces, or None (nothing to
    fuse), with a note either way."""
    def build():
        t0 = time.perf_counter()
        computation, traces, backward_traces = build_fused(notes)
        if computation is None:
            notes.append("background fusion: nothing to fuse, the torch program stays")
            return None
        notes.append(f"background fusion: the fused program replaced the torch program "
                     f"(built in {time.perf_counter() - t0:.2f} s while the torch program ran)")
        return computation, traces, backward_traces

    return build


def _attach_autograd(program, traces, trc, executors, *, fusion=None, notes=None, keep_buffers=True, backward_errors=None,
                     memory_budget=None, stand_ins=(), pieces=None):
    """Route the entry through ``ThunderFunction`` when this call needs gradients.

    ``program`` and ``traces`` are the entry's program and traces so far, ``trc`` the computation after dead code
    elimination.  None when grad is disabled, no input requires grad, or no output depends on one; else the
    program, traces and backward traces that replace them, the builder of the fused program
    (``fusion="background"``, or None), the traces it fuses and the memory plan (transforms/memory.py).
    ``backward_errors``: output name -> the error eager's backward through that output raises (a saved value written
    in place); the node raises it when a gradient reaches that output.  ``stand_ins``: (input, [values]) whose
    gradients are the input's too (``build_forward_backward``).  ``pieces``: output name -> eager's view calls of a
    returned view and whether it is a piece of ``split``/``unbind``/``chunk`` (``returned_graph.returned_view_calls``),
    made again outside the node by them (eager's node, and eager's error on a write into a piece).
    """
    if not may_need_autograd(trc):
        return None
    try:
        fb = build_forward_backward(trc, memory_budget, stand_ins)  # transforms/memory.py plans what the forward saves
    except NoGradientRuleError as error:
        return NoBackwardProgram(trc, program, error), traces, [], None, [trc], None
    if fb is None:
        return None
    errors = [(backward_errors or {}).get(o.name) for o in fb.outputs]
    pieces_of = [(pieces or {}).get(o.name) for o in fb.outputs]
    if any(errors) and all(e is not None for e, d in zip(errors, fb.differentiable) if d):
        # every backward through this function raises in eager: so does this one
        return NoBackwardProgram(trc, program, next(e for e in errors if e)), traces, [], None, [trc], None
    names = ", ".join(ex.name for ex in executors)
    fw_lowered = lower_to_executors(fb.forward, executors, header=f"Forward lowered to executors: {names}")
    bw_lowered = lower_to_executors(fb.backward, executors, header=f"Backward lowered to executors: {names}")
    keep = next(i for i, t in enumerate(traces) if t is trc)
    before = traces[: keep + 1]

    def program(kind, notes):
        fw, bw = fw_lowered, bw_lowered
        if kind is not None:
            fw = fuse(fw, kind, notes, "fw_")
            bw = fuse(bw, kind, notes, "bw_")
        fw = dce(fw, header=f"Final forward (autograd, executors: {names})")
        bw = take_saved_as_list(dce(bw, header=f"Final backward (autograd, executors: {names})"), fb.saved)
        fw, bw = (fold_constants(merge_duplicates(decide_layouts(t))) for t in (fw, bw))
        if keep_buffers:  # ThunderFunction runs both without grad (autograd.Function's forward; once_differentiable)
            fw, bw = keep_large_buffers(fw, grad_disabled=True), keep_large_buffers(bw, grad_disabled=True)
        fw = free_after_last_use(matmuls_as_mm(numbers_as_tensors(drop_identity_views(fw), grad_disabled=True)))
        bw = free_after_last_use(free_graphs_at_last_vjp(matmuls_as_mm(numbers_as_tensors(drop_identity_views(bw), grad_disabled=True))))
        forward_traces = [fb.joint, fb.forward] + ([fw_lowered] if kind else []) + [fw]
        backward_traces = [fb.backward] + ([bw_lowered] if kind else []) + [bw]
        run = AutogradProgram(trc, fb, fw, bw, errors, pieces_of) if kind != "background" or _fused_regions(fw, bw) else None
        return run, before + forward_traces, backward_traces

    now = fusion if fusion != "background" else None
    run, traces, backward_traces = program(now, [] if notes is None else notes)
    return (run, traces, backward_traces, (lambda notes: program("background", notes)), [fw_lowered, bw_lowered],
            split_memory_plan(fb))


def _wrapping(acquired, n_inputs):
    """Steps 10-11 as a function of the computation (applied again to a fused program that replaces it), and the
    leaf indices of the epilogue's targets (passed after the computation's inputs).

    10. Epilogue (compiler/acquisition/epilogue.py): Python side effects replayed after the computation.
    11. Outputs (compiler/pytree.py): a returned user type (ModelOutput, dataclass, ...) was flattened at
        trace time; it is rebuilt around the real tensors after every call.
    """
    epilogue, spec = acquired.epilogue, acquired.output_spec
    target_names = []
    if epilogue is not None:
        # The objects the epilogue writes to are leaves of the call: passed after the computation's inputs.
        index_of_leaf = {id(leaf): i for i, leaf in enumerate(acquired.leaves)}
        targets = [(name, index_of_leaf[id(leaf)]) for name, leaf in epilogue.targets.items() if leaf is not None]
        target_names = [n for n, _ in targets]

    def wrap(computation):
        if acquired.random_before_checks:
            computation = _restoring_rng(computation)
        if epilogue is not None:
            computation = _with_epilogue(computation, epilogue, n_inputs, target_names)
        if spec is not None:
            computation = _rebuilding(computation, spec)
        return computation

    return wrap, tuple(i for _, i in targets) if epilogue is not None else ()


def _with_epilogue(computation, epilogue, n_inputs, target_names):
    """The computation returns ``(result, extras)``; the epilogue assigns the extras to Python objects.

    ``run`` takes the computation's inputs followed by the epilogue's targets (this call's parameter
    objects), which are bound to the epilogue's names before it runs.
    """
    fn, g = epilogue.fn, epilogue.globals
    if epilogue.returns:  # results sharing an input's memory, rebuilt from the real input (output_aliases.py)
        effects, replace = fn, output_aliases.replace_results

        def fn(extras, result):
            return replace(result, effects(extras))
    else:
        effects = fn

        def fn(extras, result):
            effects(extras)
            return result
    if not target_names:
        def run(*inputs):
            result, extras = computation(*inputs)
            return fn(extras, result)

        return _passing_inputs(run, computation, lambda c: _with_epilogue(c, epilogue, n_inputs, target_names))
    names = tuple(target_names)

    def run(*inputs):
        result, extras = computation(*inputs[:n_inputs])
        g.update(zip(names, inputs[n_inputs:]))
        return fn(extras, result)

    return run


def _restoring_rng(computation):
    """A program whose decision check can abandon it after a random op ran: put the RNG state back then, so
    the program that runs instead draws what eager draws."""

    def run(*inputs):
        cpu = torch.random.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        try:
            return computation(*inputs)
        except DecisionMismatch:
            torch.random.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
            raise

    return run


def _rebuilding(computation, spec):
    rebuild = spec.rebuild

    def run(*inputs):
        return rebuild(computation(*inputs))

    return _passing_inputs(run, computation, lambda c: _rebuilding(c, spec))


def _passing_inputs(run, computation, rewrap):
    """Mark ``run`` as a wrapper that passes its inputs to ``computation`` unchanged: thin mode then reorders the
    generated computation inside it and wraps that again (``runtime/thin_args.py``), keeping its bound inputs as
    defaults behind an epilogue or an output rebuild."""
    run.inner, run.rewrap = computation, rewrap
    return run


def _select(idx: tuple) -> Callable:
    if len(idx) == 0:
        return lambda vals: ()
    if len(idx) == 1:
        i = idx[0]
        return lambda vals: (vals[i],)
    return operator.itemgetter(*idx)
