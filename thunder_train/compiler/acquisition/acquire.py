"""``acquire``: run the user's function on proxies and record its computation trace.

Inputs are walked once (``walker.py``); every tensor becomes a ``TensorProxy``
and every leaf gets a provenance path (``provenance.py``).  While the function
runs, ``ProxyMode`` routes every torch call to the torch language
(``dispatch.py``), and the optimizers, DDP and custom autograd Functions are
patched to trace.  At the end the epilogue pass turns in-place updates into
write-backs and Python side effects into the epilogue.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import threading
import types

import torch

from .. import context, prims
from .class_attrs import user_class
from .custom_function import custom_functions_while_tracing
from .data_assignment import check_input_data_shares
from .distributed import check_finished as check_ddp_finished, ddp_while_tracing
from .epilogue import finish
from ..errors import TracingError
from .functional import Buffers
from ..proxies import is_proxy
from ..pytree import flatten_output, holds, tree_flatten
from ..symbols import BoundSymbol
from ..torchlang.optim import optimizers_while_tracing
from ..trace import Trace
from . import traced_autograd
from .traced_autograd import GradState
from . import checkpoint_regions as _checkpoint_regions  # noqa: F401  (installs the checkpoint-region marker)
from . import called_functions, fsdp, kernel_switches, library_objects, user_generators
from .torch_compiled import traced_as_python
from . import tensor_attributes as _tensor_attributes  # noqa: F401  (installs the proxies' attribute reads)
from .leaf_values import LeafValues
from . import decisions as _decisions  # installs the decision handler
from .captured import Scanner, default_roots, self_root
from .containers import mutated, mutated_paths, replay_lines
from .dispatch import ProxyMode
from .global_state import global_state_unchanged, parametrizations_computed_where_read
from .provenance import path_str
from .python_effects import needs_grad, only_walked_optimizers_step, refuse_backward_hooks, refuse_new_leaves_returned
from . import returned_graph, saved_versions
from .state import TracerState
from .module_writes import settle as settle_module_writes
from .walker import InputWalker


@dataclasses.dataclass
class Acquired:
    trace: Trace
    leaves: list
    opaque_ops: list
    written: set = dataclasses.field(default_factory=set)  # ids of input proxies updated in place
    size_checks: list = dataclasses.field(default_factory=list)  # (op, size, other, result) decided while tracing
    has_backward: bool = False  # the function called backward(): gradients are values of the trace
    epilogue: object = None  # epilogue.Epilogue replaying Python side effects, or None
    output_spec: object = None  # pytree.OutputSpec rebuilding a returned user type (ModelOutput, dataclass, ...)
    decisions: list = dataclasses.field(default_factory=list)  # decisions.Decision the trace specialised on
    mutated_paths: list = dataclasses.field(default_factory=list)  # containers/objects the epilogue changes (containers.py)
    random_before_checks: bool = False  # a random op runs before a decision check (decisions.py): save the RNG state
    # eager's error for PyTorch's backward through each output (a saved value written in place: saved_versions.py)
    backward_errors: dict = dataclasses.field(default_factory=dict)  # output name -> error
    # (input, [values]): the values besides the input itself that stand for it in PyTorch's backward (an update under
    # no_grad or through ``.data`` inside a forward, ops after it reading the new value: leaf_values.py)
    grad_stand_ins: list = dataclasses.field(default_factory=list)
    # output name -> (eager's view calls, a piece of split/unbind/chunk) of returned views (returned_graph.py)
    returned_view_calls: dict = dataclasses.field(default_factory=dict)
    # (class or module, ((name, value), ...)): the user's methods the traced code may call (captured.py ``Scanner``)
    # and the module-level functions that ran torch ops (called_functions.py), guarded by name
    called_names: tuple = ()


def arg_names(fn) -> list:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def check_call_signature(fn, args, kwargs):
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        name = getattr(fn, "__qualname__", getattr(fn, "__name__", "the function"))
        raise TypeError(f"{name}{sig}: {e}") from None


def acquire(fn, args, kwargs, *, strict: bool = False, dynamic: bool = False, fused_optimizers: bool = True,
            forced_decisions=(), keep_decompositions: bool = True) -> Acquired:
    """Run ``fn`` on proxies of ``args``/``kwargs``; return its computation trace and input leaves.

    ``fused_optimizers``: optimizer updates take torch's fused kernels where they compute the
    same thing (``torchlang/optim.py``); False traces the optimizers' own per-op code.
    ``forced_decisions``: ``(text, value)`` of the first decisions the program checks, as a run observed them
    (``decisions.py``): the trace takes them instead of computing them.
    ``keep_decompositions``: False records the ops that can make their results without one
    (``Symbol.results_without_decomposition``) with no decomposition (lowered whole: no ``decompose=True``).
    """
    check_call_signature(fn, args, kwargs)
    with TRACING_LOCK:
        return _acquire(fn, args, kwargs, strict=strict, dynamic=dynamic, fused_optimizers=fused_optimizers,
                        forced_decisions=forced_decisions, keep_decompositions=keep_decompositions)


def _held(values, depth=3) -> list:
    """The objects ``values`` hold (directly or in a list, tuple or dict: its first 256 items, as the walker walks),
    and, in turn, the attributes of those of the user's classes, ``depth`` deep (``self.a.inner.run(h)``: ``inner``)."""
    out = []
    for v in values:
        for x in itertools.islice(v if type(v) in (list, tuple) else v.values() if type(v) is dict else (v,), 256):
            out.append(x)
            attrs = getattr(x, "__dict__", None)
            if depth > 1 and type(attrs) is dict and user_class(type(x)) and not isinstance(x, torch.nn.Module):
                out += _held(list(attrs.values()), depth - 1)
    return out


def walk_module_globals(walker, scanner) -> None:
    """The globals and closure cells the walked modules' own code reads (captured.py ``Scanner.module_class``: a
    model file's ``SCALE`` or ``CFG`` read in ``forward``), and the functions and objects of the user's classes they
    hold (directly or in a list, tuple or dict), or the function reaches otherwise (an argument, a captured
    ``trainer`` whose ``loss`` it calls), walked like the function's: a module or object found on the way is
    scanned in turn."""
    done = seen_leaves = 0
    while done < len(walker.module_states) or seen_leaves < len(walker.leaves):
        new, batch = [], walker.module_states[done:]
        reached = [leaf.value for leaf in walker.leaves[seen_leaves:] if leaf.kind in ("namespace", "dataclass", "object")]
        done, seen_leaves = len(walker.module_states), len(walker.leaves)
        for st in batch:
            new += scanner.module_class(type(st.module))
        held = _held([v for st in batch for v in list(vars(st.module).values())])
        for x in held:
            if isinstance(x, (types.FunctionType, types.MethodType, functools.partial)):
                new += scanner.held_function(x)
        for x in held + reached:  # (after the classes and functions: an object's methods are those the code names)
            if user_class(type(x)) and not isinstance(x, (torch.nn.Module, torch.optim.Optimizer, types.FunctionType,
                                                          types.MethodType, functools.partial)):
                new += scanner.object_class(type(x))  # (self.helper.run(y), trainer.loss(x))
        walker.walk_captured(new)


# One acquisition at a time in the process. While it runs, tracing patches process-wide names (torch.optim's
# update functions, ``Function.apply``, DDP's forward, the reseeding functions) and registers a global optimizer
# step hook; done by two threads at once, one trace would see the other's patches and hooks, and undoing them
# out of order would leave one installed. Each patch acts only in the thread whose trace installed it
# (``context.tracer_state()``) and passes everything else through, so eager code in other threads runs unchanged
# while a trace holds the lock. Re-entrant: a trace may acquire a nested function in the same thread.
TRACING_LOCK = threading.RLock()


def _acquire(fn, args, kwargs, *, strict, dynamic, fused_optimizers, forced_decisions, keep_decompositions) -> Acquired:
    trc = Trace("computation", header="Constructed by acquisition (tracing fn on proxies)")
    trc.keep_decompositions = keep_decompositions
    walker = InputWalker(trc, arg_names(fn))
    walker.dynamic = dynamic
    # grad_enabled: torch.no_grad() regions inside fn (dispatch.no_grad_region)
    state = TracerState(trc, walker, Buffers(), strict=strict, grad_enabled=torch.is_grad_enabled())
    state.grads = GradState(state)
    state.leaf_values = LeafValues(state)
    state.forced_decisions = list(forced_decisions)
    kernel_switches.remember_start(state)
    with context.tracing(trc, state):
        try:
            scanner = Scanner()
            roots = self_root(fn) + default_roots(fn, args, kwargs) + scanner.function(fn)
            fsdp.lazy_init_roots(list(args) + list(kwargs.values()) + [r.value for r in roots])
            pargs, pkwargs = walker.walk_args(args, kwargs)
            walker.walk_captured(roots)
            walk_module_globals(walker, scanner)
            fsdp.check_walked(walker)
            # Module backward hooks where inputs require grad: refused before torch's hook machinery meets proxies
            # (the end of tracing checks again, with what the function did: a backward inside).
            refuse_backward_hooks(state)
            with global_state_unchanged(), traced_as_python(), ProxyMode(), optimizers_while_tracing(fused_kernels=fused_optimizers), \
                    ddp_while_tracing(), only_walked_optimizers_step(walker), custom_functions_while_tracing(needs_grad), \
                    parametrizations_computed_where_read([s.module for s in walker.module_states]):
                out = fn(*pargs, **pkwargs)
                settle_module_writes(walker.module_states, lambda t: needs_grad(state, [t])[0], walker.module_tensor)
            user_generators.check(walker.generators)
            walker.classes.finish()
            walker.instances.finish()
            walker.instances.check_writes()
            for leaf in walker.leaves:  # what the prologue guards beyond the public scalars (instance_reads.py)
                if leaf.kind in ("module", "optimizer") and leaf.snapshot is not None:
                    leaf.snapshot["read"] = walker.instances.guarded(leaf.value)
            walker.check_unwalked_unchanged()
            check_ddp_finished(state)
            fsdp.check_finished(state)
            fsdp.check_shard_uses(state)
            refuse_backward_hooks(state)
            for traced in walker.optimizers:
                traced.check_groups_unchanged(path_str(walker.by_id[id(traced.opt)].path))
            library_objects.check(walker.library_objects)  # after the checks that name a more specific cause
            out, output_spec = _check_output(out)
            inputs = []
            seen = set()
            for leaf in walker.leaves:
                if leaf.kind in ("tensor", "number") and leaf.alias_of is None and id(leaf.proxy) not in seen:
                    seen.add(id(leaf.proxy))
                    inputs.append(leaf.proxy)
            trc.args = inputs
            changed = []

            def python_effects(names, extra):
                # Lists, dicts, dataclasses and objects the function changed: replayed on this call's objects.
                changed[:] = mutated(walker.tracked)
                return replay_lines(changed, names, extra, walker.copy_leaf)

            trc.output, epilogue = finish(state, out, python_effects)
            backward_errors, stand_ins = {}, []
            if not state.has_backward:
                stand_ins = [(p, [v for v in vals if v is not p]) for p, vals in traced_autograd.grad_leaves(state)
                             if walker.is_input(p) and any(v is not p for v in vals)]
            if not state.has_backward and state.stale_values:
                seeds = [v for _, vals in traced_autograd.grad_leaves(state) for v in vals]
                user_out, trc_out = tree_flatten(out)[0], tree_flatten(trc.output)[0]
                returned = list(zip(user_out, trc_out)) if len(user_out) == len(trc_out) else []
                backward_errors = saved_versions.errors_for_outside_backward(state, trc, seeds, returned)
            pieces = {} if state.has_backward else returned_graph.returned_view_calls(state, out, trc.output)
            refuse_new_leaves_returned(state, trc)
            traced_autograd.check_data_assignments(state)
            check_input_data_shares(state, trc.output)
            _insert_shape_queries(trc, walker.symbolic_inputs)
        except BaseException:
            library_objects.rollback(walker.library_objects + walker.walked_objects)
            user_generators.put_back(walker.generators)
            raise
        finally:
            walker.restore()
    written = {id(dst) for dst in state.written_inputs}
    return Acquired(trc, walker.leaves, state.opaque_ops, written, list(state.size_checks), state.has_backward, epilogue,
                    output_spec=output_spec, decisions=list(state.decisions), mutated_paths=mutated_paths(changed),
                    random_before_checks=_decisions.random_before_checks(trc), backward_errors=backward_errors,
                    grad_stand_ins=stand_ins, returned_view_calls=pieces,
                    called_names=scanner.guarded_methods() + called_functions.guarded(state))


def _insert_shape_queries(trc, symbolic_inputs):
    """``(x_size0, _) = prims.shape(x)`` at the top of the program for every input with symbolic sizes.

    DCE removes the queries nothing reads; everything else reads sizes through these names.
    """
    queries = [BoundSymbol(prims.shape, (p,), {}, tuple(p._tt_shape)) for p in symbolic_inputs]
    trc.bound_symbols[:0] = queries


def _check_output(out):
    """``(trace output, OutputSpec or None)``: user types in the output are flattened (pytree.flatten_output)."""

    def refuse_modules(leaves):
        for v in leaves:
            if isinstance(v, torch.nn.Module):
                raise TracingError("a compiled function cannot return an nn.Module; return tensors and Python values")

    refuse_modules(tree_flatten(out)[0])
    try:
        out, spec = flatten_output(out, lambda x: holds(x, is_proxy))
    except TypeError as e:
        raise TracingError(str(e)) from None
    refuse_modules(tree_flatten(out)[0])
    return out, spec
