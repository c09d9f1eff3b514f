"""What a LightningModule step reads that changes every step but is not a tensor.

A compiled step is traced once and then replayed; a Python value it reads while
tracing (an ``int``, a ``float``) becomes a constant of the program or, when it is
an argument, a value the program is specialised on.  Two kinds of such values
change on every step of a Lightning loop:

* ``batch_idx`` — Lightning passes it as an argument.  Passing it on to the
  compiled function would retrace on every step; not passing it and baking in the
  first value would be silently wrong.
* loop counters read from the module: ``self.global_step``, ``self.current_epoch``.

``ThunderCallback`` therefore inspects the step's bytecode (and that of helper
methods of the same class it calls through ``self``) before compiling it and
refuses, with a message naming the line, a step that reads one of them.  A step
that does not read ``batch_idx`` gets it as Lightning passes it, unused.

This is a static check of what the code *can* read: it is conservative
(reading ``batch_idx`` on a branch never taken still counts) and it does not see
through code it cannot inspect (C functions, other objects' methods, a value
reached through ``self.trainer.fit_loop``); docs/callback.md lists these limits.
"""
from __future__ import annotations

import dataclasses
import dis
import inspect
import types

# Attributes of a LightningModule (and its Trainer) that change as the loop advances.
LOOP_STATE_ATTRS = ("global_step", "current_epoch")

# Packages whose methods are not the user's step logic and are not inspected.
_LIBRARY_PREFIXES = ("lightning", "pytorch_lightning", "lightning_fabric", "torch", "thunder_train", "torchmetrics")


def _is_library(module_name: str) -> bool:
    return any(module_name == p or module_name.startswith(p + ".") for p in _LIBRARY_PREFIXES)


@dataclasses.dataclass(frozen=True)
class Finding:
    what: str  # "batch_idx", "self.global_step"
    where: str  # "MyModel.training_step (model.py:42)"

    def __str__(self):
        return f"{self.what} in {self.where}"


def _code_of(fn):
    fn = inspect.unwrap(fn) if callable(fn) else fn
    fn = getattr(fn, "__func__", fn)
    return getattr(fn, "__code__", None)


def _instructions(code):
    """Instructions of ``code`` and of every code object nested in it (comprehensions, lambdas, inner functions)."""
    for ins in dis.get_instructions(code):
        yield code, ins
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _instructions(c)


def _where(code, ins) -> str:
    line = getattr(getattr(ins, "positions", None), "lineno", None) or code.co_firstlineno
    return f"{code.co_qualname if hasattr(code, 'co_qualname') else code.co_name} ({code.co_filename}:{line})"


def _loads_name(ins, name: str) -> bool:
    op = ins.opname
    if not op.startswith("LOAD_") or op == "LOAD_FAST_AND_CLEAR":
        return False
    if op in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL", "LOAD_CONST", "LOAD_NAME", "LOAD_SUPER_ATTR"):
        return False
    v = ins.argval
    return v == name or (isinstance(v, tuple) and name in v)


def step_parameter(fn, position: int) -> tuple[str | None, bool]:
    """The name of the parameter that receives positional argument ``position`` (0 = the batch) of a bound step.

    Returns ``(name, is_varargs)``; ``(None, False)`` when the signature cannot be read.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None, False
    positional = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if position < len(positional):
        return positional[position].name, False
    for p in sig.parameters.values():
        if p.kind == p.VAR_POSITIONAL:
            return p.name, True
    return None, False


def reads_parameter(fn, name: str) -> Finding | None:
    """Where the step ``fn`` reads its parameter ``name`` (``None`` if it never does).

    Code that cannot be inspected, or that calls ``locals()``/``vars()``, counts as reading it.
    """
    code = _code_of(fn)
    if code is None:
        return Finding(name, f"{getattr(fn, '__qualname__', fn)!r} (its code cannot be inspected)")
    for c, ins in _instructions(code):
        if _loads_name(ins, name):
            return Finding(name, _where(c, ins))
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval in ("locals", "vars"):
            return Finding(f"{name} (through {ins.argval}())", _where(c, ins))
    return None


def reads_loop_state(fn, cls, max_depth: int = 4) -> Finding | None:
    """Where ``fn`` — or a helper method of ``cls`` it calls through an attribute — reads a loop counter."""
    seen: set = set()

    def visit(code, depth):
        if code is None or id(code) in seen:
            return None
        seen.add(id(code))
        helpers = []
        for c, ins in _instructions(code):
            if ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR") or (ins.opname == "LOAD_CONST" and isinstance(ins.argval, str)):
                attr = ins.argval[1] if isinstance(ins.argval, tuple) else ins.argval  # 3.12 LOAD_SUPER_ATTR
                if attr in LOOP_STATE_ATTRS:
                    return Finding(f"self.{attr}", _where(c, ins))
                if ins.opname != "LOAD_CONST" and depth < max_depth:
                    helpers.append(attr)
        for attr in helpers:
            member = inspect.getattr_static(cls, attr, None) if isinstance(attr, str) else None
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if isinstance(member, property):
                member = member.fget
            if not isinstance(member, types.FunctionType):
                continue
            if _is_library(getattr(member, "__module__", None) or ""):
                continue
            found = visit(_code_of(member), depth + 1)
            if found is not None:
                return found
        return None

    return visit(_code_of(fn), 0)
