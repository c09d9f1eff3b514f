"""The pass sequence: from a Python function and its arguments to the programs one cache entry runs.

``compile_entry`` is the whole pipeline, in order; each step names the module that implements it.
``CompiledFunction`` (compiled.py) calls it on a cache miss and keeps only the cache, the statistics
and the call paths.  docs/architecture.md describes every pass.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Callable

from ..autograd_function import AutogradProgram, NoBackwardProgram, may_need_autograd
from ..guards.prologue import Prologue, build_prologue
from . import acquisition
from .errors import NoGradientRuleError
from .executors import layout_rules  # noqa: F401  (installs the eager-layout hook into Symbol.__call__)
from .executors.inductor_fusion import fuse_regions
from .executors.lowering import lower_to_executors
from .executors.reinplace import reinplace
from .transforms.autograd import build_forward_backward
from .transforms.dce import dce
from .transforms.lifetimes import free_after_last_use, take_saved_as_list
from .transforms.no_grad import without_autograd
from .transforms.saved_statistics import reuse_forward_statistics


@dataclasses.dataclass
class CacheEntry:
    key: tuple  # the guard key (everything the trace was specialised on)
    struct_key: tuple  # the cheap structural key of the arguments + global state
    prologue: Prologue  # extract + guard_key, shared by entries with the same leaf structure
    computation: Callable
    traces: list
    prologue_traces: list
    leaves: list
    input_idx: tuple  # leaf index of each computation argument
    select: Callable  # leaf values -> computation arguments
    backward_traces: list | None = None  # set when the entry computes gradients for PyTorch autograd
    epilogue: object = None  # compiler/epilogue.py: Python side effects replayed after the computation
    has_backward: bool = False  # the function calls backward(): gradients are values of the computation
    updates_parameters: bool = False  # writes in place into inputs that require grad (guards/autocast_region.py)
    decision_notes: list = dataclasses.field(default_factory=list)  # "<decision>: N ops recomputed by the prologue"


@dataclasses.dataclass(frozen=True)
class Options:
    """The compile options the passes read (``tt.compile``'s keywords)."""

    strict: bool = False
    decompose: bool = False
    dynamic: bool = False
    fusion: str | None = None
    optimizer_kernels: str = "fused"


def compile_entry(fn, args, kwargs, options: Options, executors, *, struct_key, arg_names, intern_prologue,
                  fusion_notes: list) -> tuple[CacheEntry, list]:
    """Trace ``fn`` on ``args``/``kwargs`` and compile what a cache entry runs; also returns the ops run opaquely.

    ``intern_prologue`` maps a generated prologue to the one already shared by entries with the same
    leaf structure; ``fusion_notes`` collects what Inductor fusion did (``compile_stats``).
    """
    names = ", ".join(ex.name for ex in executors)
    # 1. Acquisition (compiler/acquisition/): run fn on proxies; in-place ops functionalized, a backward and an
    #    optimizer step inside fn recorded, Python side effects collected for the epilogue.
    acquired = acquisition.acquire(fn, args, kwargs, strict=options.strict, dynamic=options.dynamic,
                               fused_optimizers=options.optimizer_kernels == "fused")
    # After loss.backward() inside the function, gradients are values of the trace: no PyTorch autograd.
    has_backward = acquired.has_backward
    traces = [acquired.trace]
    # 2. Dead code elimination (transforms/dce.py).
    trc = dce(acquired.trace, keep_sizes=True)
    traces.append(trc)
    computed = trc  # what autograd differentiates (step 9)
    if has_backward:
        trc = without_autograd(trc)  # transforms/no_grad.py
        traces.append(trc)
    # 3. Lowering (executors/lowering.py): each line claimed by an executor or replaced by its decomposition.
    trc = lower_to_executors(trc, executors, header=f"Lowered to executors: {names}")
    traces.append(trc)
    # 4. Fusion (executors/inductor_fusion.py), fusion="inductor".  With autograd, step 9 fuses the forward
    #    and backward traces instead.
    if options.fusion == "inductor" and (has_backward or not may_need_autograd(computed)):
        trc = fuse_regions(trc, fusion_notes)
        traces.append(trc)
    trc = dce(trc, header=f"Final computation (executors: {names})")
    # 5. Backward kernels reuse their forward's statistics (transforms/saved_statistics.py; torch executor).
    if has_backward and not options.decompose:
        trc = reuse_forward_statistics(trc, header=f"Final computation (executors: {names}; backward kernels reuse forward statistics)")
    # 6. Re-inplacing (executors/reinplace.py): update chains of inputs run in place where safe.
    if acquired.written:
        traces.append(trc)
        trc = reinplace(trc, header=f"Final computation (executors: {names}; update chains run in place where safe)")
    # 7. Lifetimes (transforms/lifetimes.py): intermediates are freed after their last use.
    trc = free_after_last_use(trc, header=trc.header)
    traces.append(trc)
    # 8. Prologue (guards/prologue.py): extraction + guard key, generated once per leaf structure and shared.
    written = [i for i, leaf in enumerate(acquired.leaves)
               if leaf.kind == "tensor" and leaf.alias_of is None and id(leaf.proxy) in acquired.written]
    prologue, expected = build_prologue(acquired.leaves, arg_names, written, acquired.size_checks, acquired.decisions)
    prologue = intern_prologue(prologue)
    leaf_of_proxy = {id(leaf.proxy): i for i, leaf in enumerate(acquired.leaves)
                     if leaf.kind in ("tensor", "number") and leaf.alias_of is None}
    input_idx = tuple(leaf_of_proxy[id(p)] for p in trc.args)
    entry = CacheEntry(expected, struct_key, prologue, trc.python_callable(), traces, [prologue.extract, prologue.guard_key_fn],
                       acquired.leaves, input_idx, _select(input_idx), has_backward=has_backward,
                       updates_parameters=any(acquired.leaves[i].proxy._tt_requires_grad for i in written))
    entry.decision_notes = [f"{d.text}: {d.ops} op(s) recomputed by the prologue on every call" for d in acquired.decisions]
    # 9. Autograd (transforms/autograd.py, autograd_function.py): outputs that require grad connect to PyTorch
    #    autograd through one node whose forward and backward traces go through steps 3, 4 and 7.
    if not has_backward:
        _attach_autograd(entry, computed, executors, fusion=options.fusion, notes=fusion_notes)
    # 10. Epilogue (compiler/epilogue.py): Python side effects replayed after the computation.
    epilogue = acquired.epilogue
    if epilogue is not None:
        # The objects the epilogue writes to are leaves of the call: passed after the computation's inputs.
        index_of_leaf = {id(leaf): i for i, leaf in enumerate(acquired.leaves)}
        targets = [(name, index_of_leaf[id(leaf)]) for name, leaf in epilogue.targets.items() if leaf is not None]
        entry.epilogue = epilogue
        entry.computation = _with_epilogue(entry.computation, epilogue, len(input_idx), [n for n, _ in targets])
        entry.input_idx = input_idx + tuple(i for _, i in targets)
        entry.select = _select(entry.input_idx)
    # 11. Outputs (compiler/pytree.py): a returned user type (ModelOutput, dataclass, ...) was flattened at
    #     trace time; it is rebuilt around the real tensors after every call.
    if acquired.output_spec is not None:
        entry.computation = _rebuilding(entry.computation, acquired.output_spec)
    return entry, acquired.opaque_ops


def _attach_autograd(entry, trc, executors, *, fusion=None, notes=None) -> None:
    """Route ``entry`` through ``ThunderFunction`` when this call needs gradients.

    ``trc`` is the computation after dead code elimination.  Nothing changes when grad is disabled,
    no input requires grad, or no output depends on one.
    """
    if not may_need_autograd(trc):
        return
    try:
        fb = build_forward_backward(trc)
    except NoGradientRuleError as error:
        entry.computation = NoBackwardProgram(trc, entry.computation, error)
        entry.backward_traces = []
        return
    if fb is None:
        return
    names = ", ".join(ex.name for ex in executors)
    fw = fw_lowered = lower_to_executors(fb.forward, executors, header=f"Forward lowered to executors: {names}")
    bw = bw_lowered = lower_to_executors(fb.backward, executors, header=f"Backward lowered to executors: {names}")
    if fusion == "inductor":
        notes = [] if notes is None else notes
        fw = fuse_regions(fw, notes, prefix="inductor_fw_fusion", header="Forward fused by Inductor")
        bw = fuse_regions(bw, notes, prefix="inductor_bw_fusion", header="Backward fused by Inductor")
    fw = dce(fw, header=f"Final forward (autograd, executors: {names})")
    fw = free_after_last_use(fw)
    bw = dce(bw, header=f"Final backward (autograd, executors: {names})")
    bw = free_after_last_use(take_saved_as_list(bw, fb.saved))
    forward_traces = [fb.joint, fb.forward] + ([fw_lowered] if fusion else []) + [fw]
    backward_traces = [fb.backward] + ([bw_lowered] if fusion else []) + [bw]
    program = AutogradProgram(trc, fb, fw, bw)
    keep = next(i for i, t in enumerate(entry.traces) if t is trc)
    entry.traces = entry.traces[: keep + 1] + forward_traces
    entry.backward_traces = backward_traces
    entry.computation = program


def _with_epilogue(computation, epilogue, n_inputs, target_names):
    """The computation returns ``(result, extras)``; the epilogue assigns the extras to Python objects.

    ``run`` takes the computation's inputs followed by the epilogue's targets (this call's parameter
    objects), which are bound to the epilogue's names before it runs.
    """
    fn, g = epilogue.fn, epilogue.globals
    if not target_names:
        def run(*inputs):
            result, extras = computation(*inputs)
            fn(extras)
            return result

        return run
    names = tuple(target_names)

    def run(*inputs):
        result, extras = computation(*inputs[:n_inputs])
        g.update(zip(names, inputs[n_inputs:]))
        fn(extras)
        return result

    return run


def _rebuilding(computation, spec):
    rebuild = spec.rebuild

    def run(*inputs):
        return rebuild(computation(*inputs))

    return run


def _select(idx: tuple) -> Callable:
    if len(idx) == 0:
        return lambda vals: ()
    if len(idx) == 1:
        i = idx[0]
        return lambda vals: (vals[i],)
    return operator.itemgetter(*idx)
