"""Building the prologue trace from the input leaves recorded during acquisition.

The prologue does two things: unpack every tensor the computation reads,
following the provenance path of each, and check everything the trace was
specialised on.  It prints as an ordinary Python function.
"""
from __future__ import annotations

import torch

from ..compiler.codegen import Name
from ..compiler.symbols import Symbol, BoundSymbol
from ..compiler.trace import Trace
from ..compiler.tracing import Step, path_str
from . import checks


class _Unpack(Symbol):
    """``name = parent<step>`` — e.g. ``fc1_weight = fc1._parameters['weight']``."""

    def __init__(self):
        super().__init__("unpack", None, module="prologue", is_prim=True)

    def format_lines(self, bsym, fmt):
        parent, step = bsym.args
        base = parent if isinstance(parent, str) else fmt(parent)
        return [f"{bsym.output} = {step.expr(base)}"]

    def codegen_globals(self):
        return {}


class _Check(Symbol):
    """A call to one of the functions in ``guards.checks``."""

    def __init__(self, fn):
        super().__init__(fn.__name__, fn, module="prologue", is_prim=True)

    def format_lines(self, bsym, fmt):
        args = ", ".join(_fmt_arg(a, fmt) for a in bsym.args)
        return [f"{self.name}({args})"]

    def codegen_globals(self):
        return {self.name: self.fn}


Var = Name


def _fmt_arg(a, fmt):
    if isinstance(a, Var):
        return str(a)
    return fmt(a)


UNPACK = _Unpack()
_CHECKS = {}


def _check(fn):
    s = _CHECKS.get(fn)
    if s is None:
        s = _CHECKS[fn] = _Check(fn)
    return s


def build_prologue(leaves, computation_args, nargs: int, kwnames: tuple, global_state: tuple) -> Trace:
    trc = Trace("prologue", header="Constructed by prologue construction (unpack inputs by provenance, then check them)")
    trc.varargs = True
    for n in ("args", "kwargs"):
        trc.names.add(n)
    add = trc.bound_symbols.append
    add(BoundSymbol(_check(checks.check_nargs), (Var("args"), Var("kwargs"), nargs, kwnames), {}, None))
    var_of: dict = {}
    tensor_var: dict = {}
    for leaf in leaves:
        if leaf.kind == "tensor" and leaf.alias_of is None:
            trc.names.add(leaf.proxy._tt_name)
    for leaf in leaves:
        path = leaf.path
        step = path[-1]
        parent = var_of.get(path[:-1]) if len(path) > 1 else None
        if step.kind == "const":
            expr_parent, expr_step = leaf.value, step
        elif parent is None:
            base = Var("args") if step.kind == "arg" else Var("kwargs")
            expr_parent, expr_step = base, step if step.kind not in ("arg", "kwarg") else Step("item", step.key)
        else:
            expr_parent, expr_step = parent, step
        hint = leaf.proxy._tt_name if leaf.kind == "tensor" and leaf.alias_of is None else _var_hint(path)
        name = Var(trc.unique_name(hint)) if not (leaf.kind == "tensor" and leaf.alias_of is None) else Var(hint)
        add(BoundSymbol(UNPACK, (expr_parent, expr_step), {}, name))
        var_of[path] = name
        where = path_str(path)
        v = leaf.value
        if leaf.kind == "tensor":
            if leaf.alias_of is not None:
                add(BoundSymbol(_check(checks.check_same), (name, where, tensor_var[id(leaf.alias_of)], leaf.alias_of.where), {}, None))
            else:
                tensor_var[id(leaf)] = name
                add(BoundSymbol(_check(checks.check_tensor), (name, where, tuple(v.shape), v.dtype, v.device, v.requires_grad), {}, None))
        elif leaf.kind == "constant":
            add(BoundSymbol(_check(checks.check_value), (name, where, v), {}, None))
        elif leaf.kind == "seq":
            add(BoundSymbol(_check(checks.check_type), (name, where, type(v)), {}, None))
            add(BoundSymbol(_check(checks.check_len), (name, where, len(v)), {}, None))
        elif leaf.kind == "dict":
            add(BoundSymbol(_check(checks.check_type), (name, where, dict), {}, None))
            add(BoundSymbol(_check(checks.check_keys), (name, where, tuple(v.keys())), {}, None))
        elif leaf.kind == "dataclass":
            add(BoundSymbol(_check(checks.check_type), (name, where, type(v)), {}, None))
        elif leaf.kind == "module":
            add(BoundSymbol(_check(checks.check_module), (name, where, id(v), v.training, len(v._parameters), len(v._buffers), len(v._modules)), {}, None))
        elif leaf.kind == "object":
            add(BoundSymbol(_check(checks.check_id), (name, where, id(v), type(v).__name__), {}, None))
    add(BoundSymbol(_check(checks.check_global_state), global_state, {}, None))
    out = [tensor_var_for(leaves, p, tensor_var) for p in computation_args]
    trc.output = tuple(Var(o) for o in out)
    return trc


def tensor_var_for(leaves, proxy, tensor_var):
    for leaf in leaves:
        if leaf.kind == "tensor" and leaf.alias_of is None and leaf.proxy is proxy:
            return tensor_var[id(leaf)]
    raise KeyError(proxy)


def _var_hint(path):
    from ..compiler.tracing import _name_from_path

    return _name_from_path(path, "obj")


def current_global_state() -> tuple:
    cpu, cuda = checks.autocast_state()
    return (torch.is_grad_enabled(), torch.get_default_dtype(), cpu, cuda)
