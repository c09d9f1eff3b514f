"""The pass sequence: from a Python function and its arguments to the programs one cache entry runs.

``compile_entry`` is the whole pipeline, in order; each step names the module that implements it.
``CompiledFunction`` (compiled.py) calls it on a cache miss and keeps only the cache, the statistics
and the call paths.  docs/architecture.md describes every pass.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import time
from typing import Callable

import torch

from ..autograd_function import AutogradProgram, NoBackwardProgram, may_need_autograd
from ..guards.prologue import Prologue, build_prologue
from . import acquisition
from .errors import DecisionMismatch, NoGradientRuleError
from .executors import layout_rules  # noqa: F401  (installs the eager-layout hook into Symbol.__call__)
from .executors import payback
from .executors.background import FusionJob
from .executors.fusion import fuse
from .executors.inductor_fusion import FusionSymbol
from .executors.lowering import lower_to_executors
from .executors.buffers import keep_large_buffers, release_replaced
from .executors.reinplace import reinplace
from .executors.torch_impls import decision_key
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
    decision_notes: list = dataclasses.field(default_factory=list)  # where each decision is checked, and its cost
    # (text, value) of each decision the program checks (acquisition/decisions.py), in the order it checks them:
    # a DecisionMismatch at index i means the first i held and the i-th went the other way.
    checked: tuple = ()
    mutated: tuple = ()  # the containers and objects the epilogue changes (acquisition/containers.py), as paths
    program: Callable | None = None  # the computation before the epilogue and output rebuild (guards/cuda_graphs.py)
    wrap: Callable | None = None  # program -> computation: adds the epilogue and the output rebuild
    fusion_job: object = None  # fusion="background": the FusionJob building this entry's fused program
    on_switch: Callable | None = None  # called with the entry after a fused program replaced its computation
    hooks: object = None  # guards/hook_guard.HookCheck: the hook registries as traced (set by compiled.py)

    def switch(self, program, traces, backward_traces) -> None:
        """Run ``program`` from the next call on (same inputs and results as the current one)."""
        # The replaced programs' kept buffers (executors/buffers.py); an autograd node made before the switch still
        # runs its backward correctly, allocating as it goes.
        kept_backward = backward_traces if backward_traces is not None else self.backward_traces
        release_replaced(self.traces + list(self.backward_traces or ()), traces + list(kept_backward or ()))
        self.traces = traces
        if backward_traces is not None:
            self.backward_traces = backward_traces
        self.program = program
        self.computation = self.wrap(program)
        if self.on_switch is not None:
            self.on_switch(self)

    def uncount(self, computation) -> None:
        """Background fusion will not start: call ``computation`` directly again (no switch is counted)."""
        if self.fusion_job is not None and not self.fusion_job.switched:
            self.computation = computation
            if self.on_switch is not None:
                self.on_switch(self, count=False)


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


def compile_entry(fn, args, kwargs, options: Options, executors, *, struct_key, arg_names, intern_prologue,
                  fusion_notes: list, fusion_decisions: list | None = None, forced_decisions=()) -> tuple[CacheEntry, list]:
    """Trace ``fn`` on ``args``/``kwargs`` and compile what a cache entry runs; also returns the ops run opaquely.

    ``intern_prologue`` maps a generated prologue to the one already shared by entries with the same
    leaf structure; ``fusion_notes`` collects what Inductor fusion did, ``fusion_decisions`` when background
    fusion starts and why (``compile_stats``); ``forced_decisions`` the checked decisions a run of another
    entry observed (``acquire``).
    """
    names = ", ".join(ex.name for ex in executors)
    # 1. Acquisition (compiler/acquisition/): run fn on proxies; in-place ops functionalized, a backward and an
    #    optimizer step inside fn recorded, Python side effects collected for the epilogue.
    acquired = acquisition.acquire(fn, args, kwargs, strict=options.strict, dynamic=options.dynamic,
                               fused_optimizers=options.optimizer_kernels == "fused", forced_decisions=forced_decisions)
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
    lowered = lower_to_executors(trc, executors, header=f"Lowered to executors: {names}")
    traces.append(lowered)
    # 4.-7. Fusion (executors/fusion.py: Inductor or nvFuser; with autograd, step 9 fuses the forward and backward
    #    instead), DCE, statistics reuse, re-inplacing, lifetimes.  fusion="background" builds the fused program
    #    later (step 12).
    finish = functools.partial(_finish, lowered, has_backward=has_backward, decompose=options.decompose,
                               written=bool(acquired.written), names=names, keep_buffers=options.keep_buffers)
    fuse_main = has_backward or not may_need_autograd(computed)
    now = options.fusion if options.fusion != "background" else None
    trc, more = finish(fusion=now if fuse_main else None, notes=fusion_notes)
    traces.extend(more)
    # 8. Prologue (guards/prologue.py): extraction + guard key, generated once per leaf structure and shared.
    written = [i for i, leaf in enumerate(acquired.leaves)
               if leaf.kind == "tensor" and leaf.alias_of is None and id(leaf.proxy) in acquired.written]
    # Decisions on the call's own inputs are part of the guard key; the program checks the others itself.
    in_prologue = [d for d in acquired.decisions if not d.checked]
    prologue, expected = build_prologue(acquired.leaves, arg_names, written, acquired.size_checks, in_prologue)
    prologue = intern_prologue(prologue)
    leaf_of_proxy = {id(leaf.proxy): i for i, leaf in enumerate(acquired.leaves)
                     if leaf.kind in ("tensor", "number") and leaf.alias_of is None}
    input_idx = tuple(leaf_of_proxy[id(p)] for p in trc.args)
    entry = CacheEntry(expected, struct_key, prologue, trc.python_callable(), traces, [prologue.extract, prologue.guard_key_fn],
                       acquired.leaves, input_idx, _select(input_idx), has_backward=has_backward,
                       updates_parameters=any(acquired.leaves[i].proxy._tt_requires_grad for i in written))
    entry.decision_notes = [_decision_note(d) for d in acquired.decisions]
    entry.checked = tuple((d.text, decision_key(d.result)) for d in acquired.decisions if d.checked)
    entry.mutated = tuple(acquisition.path_str(p) for p in acquired.mutated_paths)
    # 9. Autograd (transforms/autograd.py, autograd_function.py): outputs that require grad connect to PyTorch
    #    autograd through one node whose forward and backward traces go through steps 3, 4 and 7.
    build_fused = None  # fusion="background": notes -> (program, traces, backward traces) of the fused program
    to_fuse = [lowered]  # the traces the fused program fuses (the pay-back estimate looks at them)
    if not has_backward and may_need_autograd(computed):
        attached = _attach_autograd(entry, computed, executors, fusion=options.fusion, notes=fusion_notes,
                                    keep_buffers=options.keep_buffers)
        if attached is not None:
            build_fused, to_fuse = attached
    elif fuse_main:
        shown = list(traces[: len(traces) - len(more)])

        def build_fused(notes):
            fused, fused_shown = finish(fusion="background", notes=notes)
            if [id(a) for a in fused.args] != [id(a) for a in trc.args]:
                raise RuntimeError("the fused program takes other inputs than the torch program")
            return (fused.python_callable() if _fused_regions(fused) else None), shown + fused_shown, None
    # 10.-11. Epilogue and outputs (_wrapping): Python side effects replayed after the computation, a returned
    #     user type rebuilt around the real tensors.
    entry.program = entry.computation
    entry.wrap = _wrapping(entry, acquired, len(input_idx))
    entry.computation = entry.wrap(entry.program)
    # 12. Background fusion (executors/background.py): the entry runs the torch program built above while its
    #     fused program is built in a worker thread, submitted at the call where it pays for itself
    #     (executors/payback.py, decided at the second call); it then replaces the torch program between two calls.
    if options.fusion == "background" and build_fused is not None:
        decisions = fusion_decisions if fusion_decisions is not None else []
        entry.fusion_job = job = _fusion_job(entry, build_fused, fusion_notes)
        job.decide, job.record = (lambda call_s: payback.decide(to_fuse, call_s=call_s)), decisions.append
        entry.computation = job.counted(entry.computation, entry.uncount)
    return entry, acquired.opaque_ops


def _decision_note(d) -> str:
    if d.checked:
        return (f"{d.text}: checked by the program where it computes the value; the prologue recomputes none of "
                f"its {d.ops} op(s)")
    why = f" ({d.why_prologue})" if d.why_prologue else ""
    return f"{d.text}: {d.ops} op(s) recomputed by the prologue on every call{why}"


def _finish(lowered, *, fusion, notes, has_backward, decompose, written, names, keep_buffers):
    """Steps 4-7 on the lowered computation: the final trace, and the traces shown before and with it."""
    shown = []
    trc = lowered
    if fusion is not None:
        trc = fuse(trc, fusion, notes)  # executors/fusion.py
        shown.append(trc)
    trc = dce(trc, header=f"Final computation (executors: {names})")
    # 5. Backward kernels reuse their forward's statistics (transforms/saved_statistics.py; torch executor).
    if has_backward and not decompose:
        trc = reuse_forward_statistics(trc, header=f"Final computation (executors: {names}; backward kernels reuse forward statistics)")
    # 6. Re-inplacing (executors/reinplace.py): update chains of inputs run in place where safe.
    if written:
        shown.append(trc)
        trc = reinplace(trc, header=f"Final computation (executors: {names}; update chains run in place where safe)")
    # 7. Kept buffers (executors/buffers.py): large CPU intermediates are written into memory the program keeps
    #    between calls; lifetimes (transforms/lifetimes.py): the others are freed after their last use.
    if keep_buffers:
        trc = keep_large_buffers(trc)
    trc = free_after_last_use(trc, header=trc.header)
    shown.append(trc)
    return trc, shown


def _fused_regions(*trcs) -> int:
    """How many lines of the traces call a fused region (Inductor's or nvFuser's)."""
    return sum(isinstance(b.sym, FusionSymbol) for t in trcs for b in t.bound_symbols)


def _fusion_job(entry, build_fused, notes) -> FusionJob:
    def build():
        t0 = time.perf_counter()
        computation, traces, backward_traces = build_fused(notes)
        if computation is None:
            notes.append("background fusion: nothing to fuse, the torch program stays")
            return None
        notes.append(f"background fusion: the fused program replaced the torch program "
                     f"(built in {time.perf_counter() - t0:.2f} s while the torch program ran)")
        return computation, traces, backward_traces

    return FusionJob(build, lambda program: entry.switch(*program), notes.append, "background fusion")


def _attach_autograd(entry, trc, executors, *, fusion=None, notes=None, keep_buffers=True):
    """Route ``entry`` through ``ThunderFunction`` when this call needs gradients.

    ``trc`` is the computation after dead code elimination.  Nothing changes when grad is disabled,
    no input requires grad, or no output depends on one.  Returns the builder of the fused program
    (``fusion="background"``) and the traces it fuses, or None.
    """
    if not may_need_autograd(trc):
        return None
    try:
        fb = build_forward_backward(trc)
    except NoGradientRuleError as error:
        entry.computation = NoBackwardProgram(trc, entry.computation, error)
        entry.backward_traces = []
        return None
    if fb is None:
        return None
    names = ", ".join(ex.name for ex in executors)
    fw_lowered = lower_to_executors(fb.forward, executors, header=f"Forward lowered to executors: {names}")
    bw_lowered = lower_to_executors(fb.backward, executors, header=f"Backward lowered to executors: {names}")
    keep = next(i for i, t in enumerate(entry.traces) if t is trc)
    before = entry.traces[: keep + 1]

    def program(kind, notes):
        fw, bw = fw_lowered, bw_lowered
        if kind is not None:
            fw = fuse(fw, kind, notes, "fw_")
            bw = fuse(bw, kind, notes, "bw_")
        fw = dce(fw, header=f"Final forward (autograd, executors: {names})")
        bw = take_saved_as_list(dce(bw, header=f"Final backward (autograd, executors: {names})"), fb.saved)
        if keep_buffers:  # ThunderFunction runs both without grad (autograd.Function's forward; once_differentiable)
            fw, bw = keep_large_buffers(fw, grad_disabled=True), keep_large_buffers(bw, grad_disabled=True)
        fw = free_after_last_use(fw)
        bw = free_after_last_use(bw)
        forward_traces = [fb.joint, fb.forward] + ([fw_lowered] if kind else []) + [fw]
        backward_traces = [fb.backward] + ([bw_lowered] if kind else []) + [bw]
        run = AutogradProgram(trc, fb, fw, bw) if kind != "background" or _fused_regions(fw, bw) else None
        return run, before + forward_traces, backward_traces

    now = fusion if fusion != "background" else None
    entry.computation, entry.traces, entry.backward_traces = program(now, [] if notes is None else notes)
    return (lambda notes: program("background", notes)), [fw_lowered, bw_lowered]


def _wrapping(entry, acquired, n_inputs):
    """Steps 10-11 as a function of the computation (applied again to a fused program that replaces it).

    10. Epilogue (compiler/epilogue.py): Python side effects replayed after the computation.
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
        entry.epilogue = epilogue
        entry.input_idx = entry.input_idx + tuple(i for _, i in targets)
        entry.select = _select(entry.input_idx)

    def wrap(computation):
        if acquired.random_before_checks:
            computation = _restoring_rng(computation)
        if epilogue is not None:
            computation = _with_epilogue(computation, epilogue, n_inputs, target_names)
        if spec is not None:
            computation = _rebuilding(computation, spec)
        return computation

    return wrap


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

    return run


def _select(idx: tuple) -> Callable:
    if len(idx) == 0:
        return lambda vals: ()
    if len(idx) == 1:
        i = idx[0]
        return lambda vals: (vals[i],)
    return operator.itemgetter(*idx)
