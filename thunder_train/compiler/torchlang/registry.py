"""Registry of torch-language symbols: which torch callables map to which symbol.

``@torchsymbol(torch.add, methods=("add", "__add__"))`` defines a symbol in
the torch language whose decomposition is the decorated function, routes
``torch.add`` and the ``Tensor`` methods to it while tracing, and records
``torch.add`` as its torch implementation (the torch executor runs that when
it claims the symbol whole).  The op's other facts are declared in the same
place: tags (``"fusible"``, ``"fused_backward"``, ...), its autocast policy,
and, where it has a direct one, its gradient rule, registered right after the
definition with ``@register_vjp(symbol)`` (``compiler/grad_rules.py``).

``composed(name, fn, torch_fns, methods)`` routes torch callables to an op written as torch calls the
torch language already knows (``logaddexp``, ``pixel_shuffle``, the composed losses, ...): the dispatcher
traces those calls as the user's own, so the op runs natively with the gradient of its parts.  Argument
forms such a function does not cover raise ``NotImplementedError`` and the dispatcher runs the call
opaquely (eager's result).  The composed ops live in their family's module, next to its symbols.
"""
from __future__ import annotations

import torch

from .. import context
from ..proxies import TensorProxy
from ..pytree import tree_flatten, tree_map
from ..symbols import Symbol

_DEFAULT = object()

# torch callable (function, method descriptor, slot wrapper) → Symbol
by_torch_fn: dict = {}
# Tensor method name → Symbol; fallback for wrappers whose identity differs
by_method_name: dict = {}


def bind(entry, torch_fns=(), methods=()):
    """Calls of these torch callables and ``Tensor`` methods (on both Tensor and TensorBase) go to ``entry``."""
    for f in torch_fns:
        by_torch_fn[f] = entry
    for m in methods:
        by_method_name[m] = entry
        for owner in (torch.Tensor, torch._C.TensorBase):
            f = getattr(owner, m, None)
            if f is not None:
                by_torch_fn[f] = entry


# property name → getter(proxy) and setter(proxy, value); the properties are in tensor_methods.py
property_getters: dict = {}
property_setters: dict = {}
all_symbols: dict = {}


def torchsymbol(*torch_fns, methods=(), name=None, torch_impl=_DEFAULT, tags=(), returns=None, autocast=None,
                not_differentiated_by_torch=(), explicit_defaults=False):
    """Define a torch-language symbol whose decomposition is the decorated function.

    ``torch_fns``/``methods``: the torch callables and ``Tensor`` methods routed to it while tracing;
    ``torch_impl``: what the torch executor runs for the whole op (default: the first of them);
    ``tags``: see ``Symbol``; ``returns``: a ``torch.return_types`` class the caller gets when the
    symbol returns a tuple; ``autocast``: ``{"cpu": policy, "cuda": policy}`` (torchlang/autocast.py);
    ``not_differentiated_by_torch``: arguments PyTorch's autograd does not differentiate, so a
    ``fused_backward`` gradient for them stays op by op; ``explicit_defaults``: the recorded line passes
    the ``dtype``/``device`` the trace gave its output (factories: the torch executor must not read the
    default dtype again at run time, which the function may have changed meanwhile).
    """

    def deco(fn):
        sym = Symbol(name or fn.__name__, fn, module="ltorch", tags=tags)
        if autocast is not None:
            sym.autocast = dict(autocast)
        if not_differentiated_by_torch:
            sym.not_differentiated_by_torch = frozenset(not_differentiated_by_torch)
        impl = torch_impl
        if impl is _DEFAULT:
            impl = torch_fns[0] if torch_fns else (getattr(torch.Tensor, methods[0]) if methods else None)
        sym.torch_impl = impl
        entry = sym if returns is None else _NamedResult(sym, returns)
        if explicit_defaults:
            entry = _ExplicitDefaults(sym)
        bind(entry, torch_fns, methods)
        all_symbols[sym.name] = sym
        return sym

    return deco


class _NamedResult:
    """Dispatch entry for ops that return ``torch.return_types`` (values, indices).

    The symbol itself records a plain tuple, which traces can flatten and
    unpack; the caller gets the named tuple eager returns (``.values``).
    """

    def __init__(self, sym, result_type):
        self.sym = sym
        self.name = sym.name
        self.result_type = result_type

    def __call__(self, *args, **kwargs):
        out = self.sym(*args, **kwargs)
        return self.result_type(out) if type(out) is tuple else out

    def __getattr__(self, name):  # the symbol's facts (tags, functional, ...) for the dispatcher
        return getattr(self.sym, name)


class _ExplicitDefaults:
    """Dispatch entry for factories: the recorded line gets ``dtype=``/``device=`` of its output when the call
    left them to the defaults, so the torch executor creates what the trace says."""

    def __init__(self, sym):
        self.sym = sym
        self.name = sym.name

    def __call__(self, *args, **kwargs):
        out = self.sym(*args, **kwargs)
        trc = context.get_trace()
        scope = trc._scopes[-1] if trc is not None else ()
        if scope and scope[-1].sym is self.sym and scope[-1].output is out and hasattr(out, "_tt_dtype"):
            kw = scope[-1].kwargs
            if kw.get("dtype") is None:
                kw["dtype"] = out._tt_dtype.torch
            if kw.get("device") is None:
                kw["device"] = out._tt_device.torch
        return out

    def __getattr__(self, name):
        return getattr(self.sym, name)


class _Composed:
    """Dispatch entry: ``fn`` runs at the top level (its torch calls are traced as the user's own).
    With a ``target`` symbol (what ``fn`` ends in), the entry answers for that symbol's facts."""

    tags = frozenset()
    traces_torch_calls = True  # the dispatcher traces fn's torch calls (factories included)

    def __init__(self, name, fn, target=None):
        self.name, self.fn = name, fn
        if target is not None:
            self.sym = target

    def __call__(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        st = context.tracer_state()
        if st is None or st.buffers is None:
            return out
        # A tensor ``fn`` made and then updated in place (``out = x.clone(); out[i] = v``) is returned as its
        # current value, so a caller that binds the result (an in-place form, out=) gets the update; an
        # argument returned (``inplace=True``) stays that object.
        mine = {id(a) for a in tree_flatten((args, kwargs))[0] if type(a) is TensorProxy}
        return tree_map(lambda t: st.buffers.read(t) if type(t) is TensorProxy and id(t) not in mine else t, out)

    def __getattr__(self, name):
        target = self.__dict__.get("sym")
        if target is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(target, name)


def composed(name, fn, torch_fns=(), methods=(), sym=None):
    """Route ``torch_fns`` and the ``Tensor`` ``methods`` to ``fn``, an op written as torch calls (see above);
    ``sym``: the symbol ``fn`` ends in, whose facts the entry answers for."""
    entry = _Composed(name, fn, sym)
    bind(entry, torch_fns, methods)
    return entry


def direct(sym, *args, **kwargs):
    """Call a torch-language symbol from a composed op: without the torch-function mode the dispatcher put back
    for the op's torch calls (the symbol's own passes run torch on fake tensors, which must not be traced)."""
    st = context.tracer_state()
    if st is not None and st.buffers is not None:  # the entry got the user's objects: their current values
        args, kwargs = tree_map(lambda t: st.buffers.read(t) if type(t) is TensorProxy else t, (args, kwargs))
    if torch._C._len_torch_function_stack() == 0:
        return sym(*args, **kwargs)
    with torch.overrides._pop_mode_temporarily():
        return sym(*args, **kwargs)


def lookup(func):
    """The symbol for a torch callable seen in __torch_function__, or None."""
    sym = by_torch_fn.get(func)
    if sym is not None:
        return sym
    qual = getattr(func, "__qualname__", "") or ""
    if qual.startswith(("TensorBase.", "Tensor.", "_TensorBase.")):
        return by_method_name.get(getattr(func, "__name__", None))
    return None


def tensor_property(name):
    def deco(fn):
        property_getters[name] = fn
        return fn

    return deco


def tensor_property_setter(name):
    def deco(fn):
        property_setters[name] = fn
        return fn

    return deco


# What torch's argument parser (C++-bound functions and Tensor methods only) takes that a symbol's Python signature
# does not: numpy's names for some parameters (``torch.cat(ts, axis=1)``, ``x.sum(axis=0, keepdims=True)``:
# transformers' Funnel), taken only where the signature lacks a parameter of that name (``torch.trapezoid(y,
# x=...)``); a size given by keyword (``torch.ones(size=(2, 3))``: transformers' Canine, ``x.reshape(shape=s)``),
# where the symbol takes ``*size``; and a Python number as the tensor of add/sub/mul/div
# (``torch.div(seq_len, w, rounding_mode="trunc")``: transformers' Longformer), a 0-d tensor of the number's
# default dtype, which promotes with the other number as eager's wrapped number does.
_NUMPY_NAMES = {"axis": "dim", "keepdims": "keepdim", "x": "input", "a": "input", "x1": "input", "x2": "other"}
_SIZE_NAMES = ("size", "shape", "repeats", "dims")
NUMBER_AS_TENSOR = {torch.add, torch.sub, torch.subtract, torch.mul, torch.multiply, torch.div, torch.divide,
                     torch.true_divide, torch.floor_divide}
_C_BOUND = (type(torch.cat), type(torch.Tensor.sum), type(torch.Tensor.__add__))
_signatures: dict = {}


def _signature(sym):
    """(parameter names, name of its ``*args`` parameter or None) of ``sym``'s Python function."""
    found = _signatures.get(sym)
    if found is None:
        import inspect

        try:
            params = inspect.signature(getattr(sym, "fn", sym)).parameters
        except (TypeError, ValueError):
            params = {}
        star = next((n for n, p in params.items() if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
        by_name = (n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        found = _signatures[sym] = (frozenset(by_name), star)
    return found


def torch_arguments(sym, func, args: tuple, kwargs: dict):
    """``(args, kwargs)`` for ``sym`` as eager's parser reads them for ``func`` (see above)."""
    if sym is None or not isinstance(func, _C_BOUND):
        return args, kwargs
    if func in NUMBER_AS_TENSOR and args and _is_python_number(args[0]) and not _has_tensor(args[1:], kwargs):
        args = (_number_tensor(args[0]), *args[1:])
    if not kwargs:
        return args, kwargs
    names, star = _signature(sym)
    out = {}
    for k, v in kwargs.items():
        torch_name = _NUMPY_NAMES.get(k)
        if torch_name is not None and k not in names and torch_name in names and torch_name not in kwargs:
            k = torch_name
        elif star is not None and k in _SIZE_NAMES and k not in names:
            args = (*args, v)  # one sequence, as the torch function takes it (``torch.permute(x, (1, 0))``)
            continue
        out[k] = v
    return args, out


def _number_tensor(v):
    """A 0-d tensor of ``v`` (a runtime number: plain numbers run for real, acquisition/known_values.py) in the
    dtype torch gives a Python number of its type."""
    from .. import clang, devices, dtypes
    from ..proxies import NumberProxy

    kind = v.python_type if isinstance(v, NumberProxy) else type(v)
    dt = {bool: dtypes.bool8, int: dtypes.int64}.get(kind) or dtypes.default_float()
    device = devices.from_torch(torch.get_default_device()) if hasattr(torch, "get_default_device") else devices.cpu
    return clang.full((), v, device=device, dtype=dt)


def _is_python_number(v) -> bool:
    from ..proxies import NumberProxy

    return isinstance(v, (bool, int, float, NumberProxy))


def _has_tensor(args, kwargs) -> bool:
    return any(isinstance(a, torch.Tensor) for a in tree_flatten((args, kwargs))[0])
