"""A user's ``torch.autograd.Function`` inside a compiled function.

PyTorch calls ``Fn.forward`` and records ``Fn.backward`` as the gradient of its outputs.
While tracing, ``Fn.apply`` on tensors that need gradients becomes one composite symbol
per call whose decomposition is ``Fn.forward`` (run on proxies, with a stand-in ``ctx``)
and whose gradient rule is ``Fn.backward`` — traced when the backward is recorded, as a
second composite (``<Fn>_backward``), so a straight-through estimator's gradient is the
one its author wrote, not the derivative of its forward.  Both paths use it: a backward
inside the function and ``tt.compile(model)`` with PyTorch autograd around it.

Not supported (a clear error): ``ctx.mark_dirty`` (in-place custom functions).  With
``create_graph=True`` the traced ``Fn.backward`` is differentiated through its ops.  Under
``torch.no_grad()`` (or on tensors that need no gradient) ``apply`` runs the forward
directly, as eager does.
"""
from __future__ import annotations

import contextlib

import torch

from . import context
from .errors import TracingError
from .proxies import TensorProxy
from .symbols import Symbol
from .prims.core import zeros_like


class TracedCtx:
    """The ``ctx`` of a traced ``Fn.apply``: saved tensors are proxies of the program."""

    def __init__(self, needs_input_grad):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors = ()
        self.materialize_grads = True
        self.non_differentiable = set()

    def save_for_backward(self, *tensors):
        self.saved_tensors = tuple(tensors)

    def save_for_forward(self, *tensors):
        pass

    def mark_non_differentiable(self, *tensors):
        self.non_differentiable.update(id(t) for t in tensors)

    def set_materialize_grads(self, value: bool):
        self.materialize_grads = value

    def mark_dirty(self, *tensors):
        raise TracingError("a custom torch.autograd.Function that modifies its inputs in place (ctx.mark_dirty) "
                           "is not supported inside a compiled function")

    @property
    def saved_variables(self):
        return self.saved_tensors


def _proxies_in(ctx) -> list:
    """The tensors ``ctx`` holds: ``save_for_backward`` and tensors stored as attributes (``ctx.x = x``)."""
    from .pytree import tree_flatten

    values = [v for k, v in vars(ctx).items() if k != "non_differentiable"]
    seen, out = set(), []
    for v in tree_flatten(values)[0]:
        if type(v) is TensorProxy and id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def traced_apply(cls, args, kwargs, needs_input_grad):
    """Record ``cls.apply(*args, **kwargs)`` as a composite with ``cls.backward`` as its gradient rule."""
    from torch.autograd.function import _is_setup_context_defined

    if kwargs:
        raise TracingError(f"custom torch.autograd.Function {cls.__name__}: keyword arguments to apply() are not supported")
    ctx = TracedCtx(needs_input_grad)
    setup = _is_setup_context_defined(cls.setup_context)

    def forward(*inputs):
        with torch.no_grad():  # eager runs forward with grad disabled
            if setup:
                out = cls.forward(*inputs)
                cls.setup_context(ctx, inputs, out)
            else:
                out = cls.forward(ctx, *inputs)
        return out

    forward.__name__ = cls.__name__

    def backward_fn(grads, saved):
        # ``saved``: every proxy ``ctx`` holds, passed explicitly so that the program keeps (and the
        # forward/backward split saves) what ``Fn.backward`` reads through ``ctx``.
        return cls.backward(ctx, *grads)

    backward_fn.__name__ = f"{cls.__name__}_backward"
    bwd = Symbol(f"{cls.__name__}_backward", backward_fn, module="ltorch")

    def rule(g, out, inputs):
        outs = out if isinstance(out, tuple) else (out,)
        gs = g if isinstance(out, tuple) else (g,)
        grads_out = []
        for o, go in zip(outs, gs):
            if type(o) is TensorProxy and id(o) in ctx.non_differentiable:
                go = None
            if go is None and ctx.materialize_grads and type(o) is TensorProxy:
                go = zeros_like(o)
            grads_out.append(go)
        grads = bwd(tuple(grads_out), _proxies_in(ctx))
        grads = grads if isinstance(grads, tuple) else (grads,)
        if len(grads) < len(inputs) or any(g is not None for g in grads[len(inputs):]):
            raise RuntimeError(f"function {cls.__name__}Backward returned an incorrect number of gradients "
                               f"(expected {len(inputs)}, got {len(grads)})")
        result = []
        for a, ga in zip(inputs, grads):
            ok = type(a) is TensorProxy and type(ga) is TensorProxy
            if ok and (ga._tt_shape != a._tt_shape or ga._tt_dtype is not a._tt_dtype):
                from . import clang

                ga = clang.maybe_convert(ga, a._tt_dtype)
                if ga._tt_shape != a._tt_shape:
                    raise RuntimeError(f"function {cls.__name__}Backward returned an invalid gradient: shape "
                                       f"{ga._tt_shape}, expected {a._tt_shape}")
            result.append(ga if ok else None)
        return {"inputs": result}

    sym = Symbol(cls.__name__, forward, module="ltorch")
    sym.vjp_rule = rule
    return sym(*args)


def _checkpoint_function():
    from torch.utils.checkpoint import CheckpointFunction

    return CheckpointFunction


@contextlib.contextmanager
def custom_functions_while_tracing(needs_grad):
    """``Function.apply`` while tracing: ``traced_apply`` when an argument needs a gradient
    (``needs_grad(st, tensors)``: one flag per tensor, also ``ctx.needs_input_grad``), else the plain
    forward (what eager does without grad)."""
    from torch.autograd.function import Function
    from torch.nn.modules._functions import BackwardHookFunction  # module backward hooks: refused on their own

    original = Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        st = context.tracer_state()
        if st is not None and torch.is_grad_enabled() and cls is not BackwardHookFunction:
            positions = [i for i, a in enumerate(args) if type(a) is TensorProxy]
            extra = [v for v in kwargs.values() if type(v) is TensorProxy]
            flags = needs_grad(st, [args[i] for i in positions] + extra) if positions or extra else []
            if any(flags) and cls is _checkpoint_function():
                # Reentrant activation checkpointing: a region of fn's lines (acquisition/checkpoint_regions.py).
                from .acquisition.checkpoint_regions import trace_reentrant_checkpoint

                return trace_reentrant_checkpoint(args)
            if any(flags):
                needs_input_grad = [False] * len(args)
                for i, flag in zip(positions, flags):
                    needs_input_grad[i] = flag
                return traced_apply(cls, args, kwargs, tuple(needs_input_grad))
        return original.__func__(cls, *args, **kwargs)

    Function.apply = classmethod(apply)
    try:
        yield
    finally:
        Function.apply = original
