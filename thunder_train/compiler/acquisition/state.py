"""The tracer's state while one function is acquired: one object, not attributes on the Trace.

``acquire`` makes one ``TracerState`` and activates it with the trace
(``context.tracing(trc, state)``).  Code that runs during tracing — the
dispatcher, ``traced_autograd``, the epilogue, opaque ops, checked numbers in
``proxies`` — reads it with ``context.tracer_state()`` (None outside
acquisition, e.g. while a pass builds a joint trace), so a lower layer needs
no import of this module.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..trace import Trace


@dataclasses.dataclass
class TracerState:
    trace: Trace
    walker: Any  # acquisition.walker.InputWalker: leaves and proxies of the inputs
    buffers: Any  # functional.Buffers: current value of every buffer (functionalization)
    grads: Any = None  # traced_autograd.GradState: ``.grad`` of the tensors the function touched
    leaf_values: Any = None  # leaf_values.LeafValues: the values standing for each input in a backward
    strict: bool = False  # unknown torch ops are errors instead of running opaquely
    grad_enabled: bool = True  # grad mode when the call began (``torch.no_grad()`` regions inside)
    opaque_ops: list = dataclasses.field(default_factory=list)  # names of ops run opaquely by torch
    # Decisions on symbolic sizes and checked numbers: (op, value, other, result); the prologue re-checks them.
    size_checks: list = dataclasses.field(default_factory=list)
    requires_grad_changes: dict = dataclasses.field(default_factory=dict)  # id(proxy) -> (proxy, flag before)
    # ids of the values made under torch.no_grad() inside the function (``inplace.no_grad_region``: results of
    # ``prims.stop_gradient``): none is on the gradient path unless it stands for a leaf
    made_without_grad: set = dataclasses.field(default_factory=set)
    has_backward: bool = False  # the function called backward()/autograd.grad
    # (values a backward inside started from, whether it retained the graph) (traced_autograd.record_roots)
    backward_roots: list = dataclasses.field(default_factory=list)
    ddp_pending: list = dataclasses.field(default_factory=list)  # (module, ignored names): DDP forwards awaiting a backward
    written_inputs: list = dataclasses.field(default_factory=list)  # input proxies updated in place (set by the epilogue)
    decisions: list = dataclasses.field(default_factory=list)  # decisions.Decision: Python values computed from inputs
    # (text, value) of the first decisions the program checks, as a run of the program observed them: a trace
    # for the other value of a decision takes these (compiled.py, after a DecisionMismatch).
    forced_decisions: list = dataclasses.field(default_factory=list)
    # Inputs whose shape/strides a method like t_() changed (metadata_inplace.py): id -> proxy, and the
    # (input, (method, args, kwargs)) the epilogue replays on the real input.
    metadata_inputs: dict = dataclasses.field(default_factory=dict)
    metadata_replays: list = dataclasses.field(default_factory=list)
    # ``t.data = v`` on tensors made inside the function: (t, v, their versions after it) (traced_autograd.py)
    data_assignments: list = dataclasses.field(default_factory=list)
    # ``p.data = v`` on an input: id -> the views of p made before it, which keep p's old memory (data_assignment.py)
    old_memory_views: dict = dataclasses.field(default_factory=dict)
    input_data_shares: list = dataclasses.field(default_factory=list)  # data_assignment._Shared
    # In-place writes and the values each made stale, for eager's check of saved values (saved_versions.py), and
    # the trace length when the in-place op being traced began (its own lines read the values it overwrites).
    stale_values: list = dataclasses.field(default_factory=list)
    inplace_start: int | None = None
    # id(view) -> (view, "multi" | "no_grad", eager's node name, output index): views eager forbids writing into in
    # place in grad mode (view_creation.py)
    view_creation: dict = dataclasses.field(default_factory=dict)
    # (id(module globals), name) -> (module, name, function) or None: the module-level functions that ran torch ops
    # while tracing, guarded by name (called_functions.py)
    called_functions: dict = dataclasses.field(default_factory=dict)
    # id(new value) -> (the torch in-place call, its args, kwargs, the new value): what eager's in-place op saves is
    # asked of it, not of the out-of-place form its line records (``leaky_relu_`` saves its result, ``leaky_relu``
    # its input)
    inplace_calls: dict = dataclasses.field(default_factory=dict)
    # id(counter) -> earlier values of tensors with that counter, changed through ``.data`` without moving it
    unmoved: dict = dataclasses.field(default_factory=dict)
    # {symbol: its kernel switches when the call began} (acquisition/kernel_switches.py)
    kernel_switches: dict = dataclasses.field(default_factory=dict)
    # Tensors made from Python numbers alone (acquisition/known_values.py): id -> tensor; and the constants they
    # entered the program as, by id, with their value as a size: id -> (proxy, int)
    known_tensors: dict = dataclasses.field(default_factory=dict)
    known_sizes: dict = dataclasses.field(default_factory=dict)
