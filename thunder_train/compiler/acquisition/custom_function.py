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

from .. import context
from .checkpoint import is_reentrant_checkpoint, reentrant_checkpoint
from ..errors import TracingError
from ..proxies import TensorProxy
from ..symbols import Symbol
from ..prims.core import zeros_like


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
    from ..pytree import tree_flatten

    values = [v for k, v in vars(ctx).items() if k != "non_differentiable"]
    seen, out = set(), []
    for v in tree_flatten(values)[0]:
        if type(v) is TensorProxy and id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


@contextlib.contextmanager
def _torch_calls_traced():
    """``Fn.backward`` is traced while the dispatcher handles ``loss.backward()``, when torch has switched the
    torch-function mode off: ops on proxies still reach the dispatcher, but a factory (``torch.zeros(n, 3)``)
    would run for real and become a constant, and writes into it (``out[:, :2] = -g``) would be lost with the
    gradient.  The mode is put back for the user's backward, as it is for the user's own code."""
    if torch._C._len_torch_function_stack() != 0:
        yield
        return
    from .dispatch import ProxyMode

    with ProxyMode():
        yield


def _fresh_outputs(out, inputs, ctx):
    """``out`` with every output that is one of ``inputs`` (``return x``, or ``x.view_as(x)``, which the trace
    records as ``x`` itself) replaced by a new value equal to it.  Eager's ``apply`` returns a view of such an
    input with the Function's node as its ``grad_fn``; the trace needs a value of its own for the composite, or
    the call records nothing and ``Fn.backward`` (a gradient reversal layer's ``-lambda * g``) is never used."""
    from ..prims.core import prims

    ins = {id(a) for a in inputs if type(a) is TensorProxy}

    def fresh(o):
        if type(o) is not TensorProxy or id(o) not in ins:
            return o
        new = prims.reshape(o, o._tt_shape)
        if id(o) in ctx.non_differentiable:
            ctx.non_differentiable.add(id(new))
        return new

    if isinstance(out, tuple):
        return tuple(fresh(o) for o in out)
    return fresh(out)


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
        return _fresh_outputs(out, inputs, ctx)

    forward.__name__ = cls.__name__

    def backward_fn(grads, saved):
        # ``saved``: every proxy ``ctx`` holds, passed explicitly so that the program keeps (and the
        # forward/backward split saves) what ``Fn.backward`` reads through ``ctx``.
        with _torch_calls_traced():
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
                from .. import clang

                ga = clang.maybe_convert(ga, a._tt_dtype)
                if ga._tt_shape != a._tt_shape:
                    raise RuntimeError(f"function {cls.__name__}Backward returned an invalid gradient: shape "
                                       f"{ga._tt_shape}, expected {a._tt_shape}")
            result.append(ga if ok else None)
        return {"inputs": result}

    sym = Symbol(cls.__name__, forward, module="ltorch")
    sym.vjp_rule = rule
    return sym(*args)


_UNTRACED = object()


@contextlib.contextmanager
def custom_functions_while_tracing(needs_grad):
    """``Function.apply`` while tracing: ``traced_apply`` when an argument needs a gradient
    (``needs_grad(st, tensors)``: one flag per tensor, also ``ctx.needs_input_grad``), else the plain
    forward (what eager does without grad).

    ``Function.apply`` is replaced for calls through the class (``Fn.apply(x)``), and the base class's ``apply``,
    which torch's own ``Function.apply`` calls, for the common ``grad_reverse = Fn.apply`` bound before the
    function was compiled: that bound method is torch's, which ran ``Fn.forward`` under no_grad on the proxies
    and cut the gradient (a gradient reversal layer trained as if its branch were detached)."""
    from torch.autograd.function import Function, _SingleLevelFunction
    from torch.nn.modules._functions import BackwardHookFunction  # module backward hooks: refused on their own

    original = Function.__dict__["apply"]
    base_original = torch._C._FunctionBase.__dict__["apply"]

    def traced(cls, args, kwargs):
        st = context.tracer_state()
        if st is not None and is_reentrant_checkpoint(cls):
            tensors = [a for a in args if type(a) is TensorProxy]
            return reentrant_checkpoint(args, torch.is_grad_enabled() and any(needs_grad(st, tensors)) if tensors else False)
        if st is not None and torch.is_grad_enabled() and cls is not BackwardHookFunction:
            positions = [i for i, a in enumerate(args) if type(a) is TensorProxy]
            extra = [v for v in kwargs.values() if type(v) is TensorProxy]
            flags = needs_grad(st, [args[i] for i in positions] + extra) if positions or extra else []
            if any(flags):
                needs_input_grad = [False] * len(args)
                for i, flag in zip(positions, flags):
                    needs_input_grad[i] = flag
                return traced_apply(cls, args, kwargs, tuple(needs_input_grad))
        return _UNTRACED

    def apply(cls, *args, **kwargs):
        out = traced(cls, args, kwargs)
        return original.__func__(cls, *args, **kwargs) if out is _UNTRACED else out

    def base_apply(cls, *args, **kwargs):
        out = traced(cls, args, kwargs)
        return base_original.__get__(None, cls)(*args, **kwargs) if out is _UNTRACED else out

    Function.apply = classmethod(apply)
    _SingleLevelFunction.apply = classmethod(base_apply)
    try:
        yield
    finally:
        Function.apply = original
        del _SingleLevelFunction.apply
