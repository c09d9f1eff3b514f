"""Printing traces as Python and compiling them to callables.

Every trace prints as a runnable function: a header naming the pass that made
it, one line per bound symbol with a type comment for each value it defines,
and the decomposition of composite symbols as indented comments.  Compiled
source is registered with ``linecache`` so tracebacks point into it.
"""
from __future__ import annotations

import itertools
import linecache
import math

import torch

from . import dtypes, devices
from .proxies import TensorProxy, Proxy, is_proxy

_counter = itertools.count()


class _Globals:
    """Names the generated source refers to, besides proxies."""

    def __init__(self):
        self.d = {"torch": torch, "dtypes": dtypes, "devices": devices, "inf": math.inf, "nan": math.nan}
        self._n = 0

    def constant(self, value) -> str:
        for k, v in self.d.items():
            if v is value and k.startswith("_c"):
                return k
        name = f"_c{self._n}"
        self._n += 1
        self.d[name] = value
        return name


class Name(str):
    """A variable name in generated code, printed bare rather than quoted."""


def format_value(x, g: _Globals | None) -> str:
    if type(x) is Name:
        return str(x)
    if is_proxy(x):
        return x._tt_name if type(x) is TensorProxy else x.name
    t = type(x)
    if x is None or t is bool or t is int or t is str:
        return repr(x)
    if t is float:
        if math.isinf(x):
            return "float('inf')" if x > 0 else "-float('inf')"
        if math.isnan(x):
            return "float('nan')"
        return repr(x)
    if t is complex:
        return f"complex({format_value(x.real, g)}, {format_value(x.imag, g)})"
    if t is torch.Size:  # eager's sizes are torch.Size, also when a program returns one
        return f"torch.Size([{', '.join(format_value(v, g) for v in x)}])"
    if t is tuple:
        inner = ", ".join(format_value(v, g) for v in x)
        return f"({inner},)" if len(x) == 1 else f"({inner})"
    if t is list:
        return "[" + ", ".join(format_value(v, g) for v in x) + "]"
    if isinstance(x, tuple) and t.__module__ == "torch.return_types":
        return f"torch.return_types.{t.__name__}(({', '.join(format_value(v, g) for v in x)},))"
    if isinstance(x, tuple) and hasattr(t, "_fields") and g is not None:
        return f"{g.constant(t)}({', '.join(format_value(v, g) for v in x)})"
    if t is dict:
        return "{" + ", ".join(f"{format_value(k, g)}: {format_value(v, g)}" for k, v in x.items()) + "}"
    if t is slice:
        return f"slice({format_value(x.start, g)}, {format_value(x.stop, g)}, {format_value(x.step, g)})"
    if x is Ellipsis:
        return "..."
    if t is dtypes.DType:
        return repr(x)
    if t is devices.Device:
        return f"devices.Device({str(x)!r})"
    if t is torch.dtype or t is torch.memory_format or t is torch.layout:
        return str(x)
    if t is torch.device:
        return f"torch.device({str(x)!r})"
    if any(x is b for b in _BUILTIN_TYPES):
        return x.__name__
    named = _named_objects.get(id(x))
    if named is not None:
        if g is not None:
            g.d[named[0]] = namespaces[named[0]]
        return named[1]
    if g is None:
        return f"<{type(x).__name__}>"
    return g.constant(x)


_BUILTIN_TYPES = (dict, list, tuple, int, float, bool, str, complex)


def _type_comment(x) -> str | None:
    if type(x) is TensorProxy:
        return f'{x._tt_name}: "{x.type_string()}"'
    if isinstance(x, Proxy):
        return f"{x.name}: {x.type_string()}"
    return None


def _format_lhs(out, g) -> str:
    if out is None:
        return ""
    if is_proxy(out):
        return f"{format_value(out, g)} = "
    if isinstance(out, (tuple, list)):  # includes named tuples and torch.return_types
        if not any(is_proxy(v) or type(v) in (tuple, list) for v in out):
            return ""
        parts = [_format_lhs_item(v, g) for v in out]
        inner = ", ".join(parts)
        return f"({inner},) = " if len(parts) == 1 else f"({inner}) = "
    return ""


def _format_lhs_item(v, g) -> str:
    if is_proxy(v):
        return format_value(v, g)
    if isinstance(v, (tuple, list)):
        inner = ", ".join(_format_lhs_item(x, g) for x in v)
        return f"({inner},)" if len(v) == 1 else f"({inner})"
    return "_"


def format_call(bsym, g) -> str:
    sym = bsym.sym
    if g is not None:
        g.d.update(sym.codegen_globals())
    args = [format_value(a, g) for a in bsym.args]
    args += [f"{k}={format_value(v, g)}" for k, v in bsym.kwargs.items()]
    return f"{sym.print_name}({', '.join(args)})"


def format_bsym(bsym, g, *, indent: str = "", with_subsymbols: bool = True, comment_prefix: str = "") -> list:
    from .pytree import tree_flatten

    lines = []
    if bsym.comment:
        for c in bsym.comment.splitlines():
            lines.append(f"{indent}{comment_prefix}# {c}")
    custom = getattr(bsym.sym, "format_lines", None)
    if custom is not None:
        if g is not None:
            g.d.update(bsym.sym.codegen_globals())
        body = custom(bsym, lambda v: format_value(v, g))
        lines.extend(f"{indent}{comment_prefix}{line}" for line in body)
    else:
        line = f"{indent}{comment_prefix}{_format_lhs(bsym.output, g)}{format_call(bsym, g)}"
        comments = [c for c in (_type_comment(o) for o in tree_flatten(bsym.output)[0]) if c]
        if comments:
            line += "  # " + ", ".join(comments)
        lines.append(line)
    if with_subsymbols:
        for sub in bsym.subsymbols:
            lines.extend(format_bsym(sub, None, indent=indent + "  ", with_subsymbols=True, comment_prefix="# " if not comment_prefix else comment_prefix))
    return lines


# A debugging hook, off by default: ``layout_audit(name, tensor, shape, strides)``, called by programs compiled while
# it is set after every line, with each tensor the line made and the shape and strides the trace recorded for it
# (tests/test_recorded_layouts.py compares them with the real tensor's).  Programs compiled while it is None have no
# such lines.
layout_audit = None


def layout_differs(t, shape, strides) -> str | None:
    """How the tensor a line made differs from the layout its trace recorded: ``"shape"``, ``"strides"`` (of a dim
    larger than one of a non-empty tensor: the others address nothing), or None (what ``layout_audit``'s users ask)."""
    if tuple(t.shape) != tuple(shape):
        return "shape"
    if t.numel() and any(a != b for n, a, b in zip(shape, t.stride(), strides) if n != 1):
        return "strides"
    return None


def _audit_line(bsym, g, indent: str) -> str | None:
    from .pytree import tree_flatten

    checks = []
    for o in tree_flatten(bsym.output)[0]:
        if type(o) is TensorProxy and all(type(n) is int for n in (*o._tt_shape, *o._tt_strides)):
            checks.append(f"{indent}_tt_layout_audit({o._tt_name!r}, {format_value(o, g)}, {tuple(o._tt_shape)!r}, "
                          f"{tuple(o._tt_strides)!r})")
    return "\n".join(checks) if checks else None


def trace_source(trc, *, with_subsymbols: bool = True, audit: bool = False) -> tuple[str, dict]:
    g = _Globals()
    lines = []
    for h in (trc.header or "").splitlines():
        lines.append(f"# {h}" if h else "#")
    lines.extend(trc.decorators)
    if trc.varargs:
        sig = "*args, **kwargs"
    else:
        sig = ", ".join(format_value(a, g) for a in trc.args)
    lines.append(f"def {trc.fn_name}({sig}):")
    for a in trc.args:
        c = _type_comment(a)
        if c:
            lines.append(f"  # {c}")
    for bsym in trc.bound_symbols:
        lines.extend(format_bsym(bsym, g, indent="  ", with_subsymbols=with_subsymbols))
        check = _audit_line(bsym, g, "  ") if audit else None
        if check:
            lines.append(check)
    if audit:
        g.d["_tt_layout_audit"] = layout_audit
    lines.append(f"  return {format_value(trc.output, g)}")
    return "\n".join(lines) + "\n", g.d


# Modules printed traces call into by prefix ("prims", "ltorch", "ttex"): each registers itself when it is
# imported (they sit in layers above this one).
namespaces: dict = {}


def register_namespace(prefix: str, module) -> None:
    namespaces[prefix] = module


# Shared objects printed as an attribute of a registered namespace (``numbers.f32_0_5``, a 0-d tensor): id -> (prefix,
# text, the object).  The entry holds the object, so its id is never another object's (two threads making the same
# number each get a tensor; the namespace keeps only the last).
_named_objects: dict = {}


def name_object(obj, prefix: str, attr: str) -> None:
    _named_objects[id(obj)] = (prefix, f"{prefix}.{attr}", obj)


def standard_namespace() -> dict:
    """The names a printed trace refers to, for executing its printed source by hand."""
    return {"torch": torch, **namespaces, "dtypes": dtypes, "devices": devices}


_NO_GRAD = "@torch.no_grad()"


def _inline_no_grad(src: str, fn_name: str) -> str:
    """``@torch.no_grad()`` written as the grad-mode switch it performs, inside the function.

    The decorator's context manager costs about 1.4 µs a call in Python (two context objects, their
    ``__enter__``/``__exit__``, ``*args`` repacked twice); the switch costs about 0.1 µs and restores the mode
    the same way, on return and on an exception."""
    lines = src.split("\n")
    i = lines.index(_NO_GRAD)
    d = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(f"def {fn_name}("))
    body = [("  " + line) if line else line for line in lines[d + 1:] if line]
    return "\n".join(lines[:i] + lines[i + 1:d + 1] + [
        "  _tt_grad_mode = _tt_is_grad_enabled()", "  _tt_set_grad_enabled(False)", "  try:",
        *body, "  finally:", "    _tt_set_grad_enabled(_tt_grad_mode)"]) + "\n"


def compile_trace(trc):
    """Compile a trace to a Python function; its source is registered for tracebacks."""
    src, gdict = trace_source(trc, with_subsymbols=False, audit=layout_audit is not None)
    if _NO_GRAD in trc.decorators:
        src = _inline_no_grad(src, trc.fn_name)
        gdict = {**gdict, "_tt_is_grad_enabled": torch.is_grad_enabled, "_tt_set_grad_enabled": torch._C._set_grad_enabled}
    filename = f"<thunder_train {trc.fn_name} {next(_counter)}>"
    code = compile(src, filename, "exec")
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    ns: dict = dict(gdict)
    exec(code, ns)
    fn = ns[trc.fn_name]
    fn.__thunder_source__ = src
    return fn
