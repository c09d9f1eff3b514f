"""Acquisition: run the user's function on proxies and record a trace.

Inputs are walked once; every tensor becomes a ``TensorProxy`` and every
leaf gets an access path (its provenance) such as ``args[0].fc1.weight``.
Module parameters and buffers are swapped for proxies while tracing and
restored afterwards, also when tracing raises.  A ``TorchFunctionMode``
routes every torch call — including factories with no tensor argument — to
the torch language; calls on proxies outside the mode arrive through
``TensorProxy.__torch_function__`` and take the same route.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from . import context, proxies
from .opaque import call_opaque
from .proxies import TensorProxy
from .torchlang import registry
from .trace import Trace


class TracingError(RuntimeError):
    """The function cannot be traced as written; the message says why and what to do."""


# ---------------------------------------------------------------------------
# Provenance: how the prologue finds a leaf again
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Step:
    kind: str  # "arg", "kwarg", "item", "key", "attr", "param", "buffer", "module"
    key: Any

    def expr(self, base: str) -> str:
        k = self.kind
        if k == "arg":
            return f"args[{self.key}]"
        if k == "kwarg":
            return f"kwargs[{self.key!r}]"
        if k in ("item", "key"):
            return f"{base}[{self.key!r}]"
        if k == "attr":
            return f"{base}.{self.key}"
        if k == "param":
            return f"{base}._parameters[{self.key!r}]"
        if k == "buffer":
            return f"{base}._buffers[{self.key!r}]"
        if k == "module":
            return f"{base}._modules[{self.key!r}]"
        if k == "const":
            return base  # the prologue refers to the captured tensor directly
        raise AssertionError(k)

    def pretty(self, base: str) -> str:
        """The path as a user reads it: ``args[0].fc1.weight`` rather than ``._modules[...]``."""
        if self.kind in ("attr", "param", "buffer", "module"):
            return f"{base}.{self.key}"
        if self.kind == "const":
            return f"<tensor captured from the function's closure #{self.key}>"
        return self.expr(base)


def path_expr(path) -> str:
    s = ""
    for st in path:
        s = st.expr(s)
    return s


def path_str(path) -> str:
    s = ""
    for st in path:
        s = st.pretty(s)
    return s


def _name_from_path(path, fallback="t") -> str:
    parts = []
    for st in path:
        if st.kind in ("arg", "kwarg"):
            parts.append(st.key if isinstance(st.key, str) else f"arg{st.key}")
        elif st.kind in ("attr", "param", "buffer", "module", "key"):
            parts.append(str(st.key))
        elif st.kind == "item":
            parts.append(str(st.key))
    name = "_".join(parts).replace(".", "_")
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    if not name or name[0].isdigit():
        name = f"{fallback}_{name}"
    return name


@dataclasses.dataclass
class Leaf:
    """An input the computation reads, or a Python value it specialised on."""

    path: tuple
    kind: str  # "tensor", "constant", "object", "module", "seq", "dict", "dataclass"
    value: Any
    proxy: Any = None
    alias_of: "Leaf | None" = None
    # For modules: Python state read before tracing ran (guards/prologue.py guards it).
    snapshot: Any = None

    @property
    def where(self) -> str:
        return path_str(self.path)


SCALAR_TYPES = (int, float, bool, complex, str, type(None), torch.dtype, torch.device, type(Ellipsis))


def module_snapshot(m) -> dict:
    """A module's Python state before tracing runs it: flags, structure, public scalar attributes."""
    d = m.__dict__
    attrs = tuple((k, v) for k, v in d.items() if k[:1] != "_" and k != "training" and type(v) in SCALAR_TYPES)
    return {"training": m.training, "dict_len": len(d), "attrs": attrs}


class InputWalker:
    """Turns real inputs into proxied inputs, recording a Leaf for every part."""

    def __init__(self, trc: Trace, arg_names):
        self.trc = trc
        self.arg_names = arg_names
        self.leaves: list[Leaf] = []
        self.by_id: dict[int, Leaf] = {}
        self.swapped: list = []  # (dict, key, original value) to restore

    def walk_args(self, args, kwargs):
        pargs = tuple(self.walk(a, (Step("arg", i),), self.arg_names[i] if i < len(self.arg_names) else None) for i, a in enumerate(args))
        pkwargs = {k: self.walk(v, (Step("kwarg", k),), k) for k, v in kwargs.items()}
        return pargs, pkwargs

    def tensor(self, t, path, hint):
        prev = self.by_id.get(id(t))
        if prev is not None:
            # The same tensor reached twice (tied weights, one tensor passed twice): one proxy.
            self.leaves.append(Leaf(path, "tensor", t, prev.proxy, alias_of=prev))
            return prev.proxy
        name = self.trc.unique_name(hint or _name_from_path(path))
        p = TensorProxy(name, shape=tuple(t.shape), dtype=t.dtype, device=t.device, requires_grad=t.requires_grad)
        leaf = Leaf(path, "tensor", t, p)
        self.leaves.append(leaf)
        self.by_id[id(t)] = leaf
        return p

    def captured_tensor(self, t):
        """A real tensor the function reads without receiving it (a closure or global).

        It becomes an input of the computation that the prologue passes by
        reference, so in-place changes to it are seen and nothing is baked in.
        """
        prev = self.by_id.get(id(t))
        if prev is not None:
            return prev.proxy
        n = sum(1 for leaf in self.leaves if leaf.path and leaf.path[0].kind == "const")
        return self.tensor(t, (Step("const", n),), f"captured{n}")

    def walk(self, x, path, hint=None):
        t = type(x)
        if isinstance(x, torch.Tensor):
            if type(x) is TensorProxy:
                raise TracingError(f"{path_str(path)} is already a proxy: nested compiled functions are not supported")
            return self.tensor(x, path, hint)
        if t in SCALAR_TYPES:
            self.leaves.append(Leaf(path, "constant", x))
            return x
        if t is tuple or t is list or (isinstance(x, tuple) and hasattr(x, "_fields")):
            self.leaves.append(Leaf(path, "seq", x))
            items = [self.walk(v, path + (Step("item", i),)) for i, v in enumerate(x)]
            return t(*items) if hasattr(x, "_fields") else t(items)
        if t is dict:
            self.leaves.append(Leaf(path, "dict", x))
            return {k: self.walk(v, path + (Step("key", k),)) for k, v in x.items()}
        if isinstance(x, torch.nn.Module):
            self.module(x, path)
            return x
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            self.leaves.append(Leaf(path, "dataclass", x))
            fields = {f.name: self.walk(getattr(x, f.name), path + (Step("attr", f.name),)) for f in dataclasses.fields(x)}
            new = object.__new__(t)
            new.__dict__.update(getattr(x, "__dict__", {}))
            for k, v in fields.items():
                object.__setattr__(new, k, v)
            return new
        # Anything else (configs, callables, ...) is specialised on by identity.
        self.leaves.append(Leaf(path, "object", x))
        return x

    def module(self, m, path):
        if id(m) in self.by_id:
            return
        leaf = Leaf(path, "module", m, snapshot=module_snapshot(m))
        self.by_id[id(m)] = leaf
        self.leaves.append(leaf)
        for name, p in list(m._parameters.items()):
            if p is not None:
                proxy = self.tensor(p, path + (Step("param", name),), None)
                self.swapped.append((m._parameters, name, p))
                m._parameters[name] = proxy
        for name, b in list(m._buffers.items()):
            if b is not None:
                proxy = self.tensor(b, path + (Step("buffer", name),), None)
                self.swapped.append((m._buffers, name, b))
                m._buffers[name] = proxy
        for name, sub in m._modules.items():
            if sub is not None:
                self.module(sub, path + (Step("module", name),))

    def restore(self):
        for d, k, v in reversed(self.swapped):
            d[k] = v
        self.swapped.clear()


# ---------------------------------------------------------------------------
# Dispatch of torch calls while tracing
# ---------------------------------------------------------------------------
def handle_torch_function(func, types, args, kwargs):
    trc = context.get_trace()
    if trc is None:
        raise TracingError(
            "a thunder_train proxy escaped the compiled function and was used outside tracing; "
            "do not store tensors from inside a compiled function on Python objects"
        )
    fname = getattr(func, "__name__", "")
    if fname in ("__get__", "__set__") and type(func).__name__ == "method-wrapper":
        prop = getattr(func.__self__, "__name__", "?")
        if fname == "__get__":
            getter = registry.property_getters.get(prop)
            if getter is None:
                raise TracingError(f"Tensor.{prop} is not supported while tracing with thunder_train")
            return getter(args[0])
        setter = registry.property_setters.get(prop)
        if setter is None:
            raise TracingError(f"setting Tensor.{prop} is not supported while tracing with thunder_train")
        return setter(args[0], args[1])
    sym = registry.lookup(func)
    if any(isinstance(a, torch.Tensor) and type(a) is not TensorProxy for a in _flat(args, kwargs)):
        args, kwargs = _capture_real_tensors(trc, args, kwargs)
    if sym is not None:
        if kwargs.get("out") is not None:
            raise TracingError(f"{sym.name}(..., out=...) is not supported inside a compiled function; use the returned value")
        kwargs = {k: v for k, v in kwargs.items() if k != "out"}
        scope = trc._scopes[-1]
        n = len(scope)
        out = sym(*args, **kwargs)
        if len(scope) > n and scope[-1].sym is sym:
            scope[-1].torch_fn = func
        return _no_grad_region(trc, out, sym)
    return _no_grad_region(trc, call_opaque(func, args, kwargs, strict=getattr(trc, "strict", False)))


def _flat(args, kwargs):
    from .pytree import tree_flatten

    return tree_flatten((args, kwargs))[0]


def _capture_real_tensors(trc, args, kwargs):
    from .pytree import tree_map

    walker = trc.walker

    def swap(a):
        if isinstance(a, torch.Tensor) and type(a) is not TensorProxy:
            return walker.captured_tensor(a)
        return a

    return tree_map(swap, (args, kwargs))


def _no_grad_region(trc, out, sym=None):
    """Results computed under ``torch.no_grad()`` inside the function carry no gradient (``prims.stop_gradient``)."""
    if torch.is_grad_enabled() or not getattr(trc, "grad_enabled", False) or len(trc._scopes) != 1:
        return out
    if sym is not None and "inplace" in sym.tags:
        return out
    from .transforms.autograd import detach_float_tensors

    return detach_float_tensors(out)


proxies._torch_function_handler = handle_torch_function


class ProxyMode(TorchFunctionMode):
    """Routes every torch call made while tracing to the torch language."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return handle_torch_function(func, types, args, kwargs or {})


# ---------------------------------------------------------------------------
# Acquisition
# ---------------------------------------------------------------------------
@dataclasses.dataclass
class Acquired:
    trace: Trace
    leaves: list
    opaque_ops: list


def _arg_names(fn) -> list:
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


def acquire(fn, args, kwargs, *, strict: bool = False) -> Acquired:
    """Run ``fn`` on proxies of ``args``/``kwargs``; return its computation trace and input leaves."""
    check_call_signature(fn, args, kwargs)
    trc = Trace("computation", header="Constructed by acquisition (tracing fn on proxies)")
    trc.strict = strict
    trc.opaque_ops = []
    trc.grad_enabled = torch.is_grad_enabled()  # torch.no_grad() regions inside fn: see _no_grad_region
    walker = InputWalker(trc, _arg_names(fn))
    trc.walker = walker
    with context.tracing(trc):
        try:
            pargs, pkwargs = walker.walk_args(args, kwargs)
            with ProxyMode():
                out = fn(*pargs, **pkwargs)
        finally:
            walker.restore()
    inputs = []
    seen = set()
    for leaf in walker.leaves:
        if leaf.kind == "tensor" and leaf.alias_of is None and id(leaf.proxy) not in seen:
            seen.add(id(leaf.proxy))
            inputs.append(leaf.proxy)
    trc.args = inputs
    trc.output = _check_output(out)
    return Acquired(trc, walker.leaves, trc.opaque_ops)


def _check_output(out):
    from .pytree import tree_flatten

    for v in tree_flatten(out)[0]:
        if isinstance(v, torch.nn.Module):
            raise TracingError("a compiled function cannot return an nn.Module; return tensors and Python values")
    return out
