"""Python decisions on input values: computed by the prologue and specialised on, not refused.

``if (mask == 1).all():``, ``mask.any()``, ``int(lengths.max())``, ``if x.sum().item() > 0:``
need a value while tracing.  When the value is a function of the per-call inputs alone
(the batch, a captured tensor — not parameters, optimizer state or anything the function
computed with them), it is computed here from the example inputs: the trace lines it
depends on are cut out as a small program of their own (a *decision*), run on the real
input tensors, and the function continues with the real Python value.  The prologue runs
the same program on every call and compares (``guards/prologue.py``): a call that decides
differently gets its own trace, with the decision as the retrace reason.

A decision on anything else (a loss, an activation, an optimizer's state) would need the
program split at that point; that is not implemented, so it is a ``DataDependentError``
naming the user's source line and what to do.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable

import torch

from .. import context, proxies
from ..proxies import NumberProxy, TensorProxy, is_proxy
from ..torchlang.tensor_methods import DataDependentError
from ..trace import Trace

# A decision's program is the few lines that compute a mask test; beyond this it is an intermediate value.
MAX_LINES = 32
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


@dataclasses.dataclass
class Decision:
    fn: Callable  # the decision's program: inputs -> the value decided on
    inputs: list  # input proxies it reads (per-call leaves)
    convert: str  # "bool", "int", "float", "list": how Python turned the value into a decision
    result: Any
    text: str  # what the user's code decided, and where: "bool(tensor) at masking_utils.py:354"
    source: str  # the program's Python source (part of the prologue's structure)


def user_line() -> str:
    """``file.py:123 (source line)`` of the innermost frame outside thunder_train and torch."""
    f = sys._getframe(1)
    while f is not None:
        fn = os.path.abspath(f.f_code.co_filename)
        if not fn.startswith(_PACKAGE) and not fn.startswith(_TORCH) and not fn.startswith("<"):
            import linecache

            line = linecache.getline(fn, f.f_lineno).strip()
            return f"{os.path.basename(fn)}:{f.f_lineno}" + (f" ({line})" if line else "")
        f = f.f_back
    return "<unknown line>"


def _refuse(what: str, where: str, why: str):
    raise DataDependentError(
        f"{what} at {where} needs the value of a tensor, which does not exist while thunder_train traces the function, "
        f"and {why}. Python control flow on such values cannot be compiled: use torch.where (or masking arithmetic), "
        "or move the branch outside the compiled function and pass its result in."
    )


def _random(b) -> bool:
    return "random" in getattr(b.sym, "tags", ()) or any(_random(s) for s in b.subsymbols)


def _slice(st, value):
    """The top-level trace lines ``value`` depends on, and the input proxies they read; or a reason why not."""
    walker = st.walker
    needed = {id(value)}
    taken = []
    for b in reversed(st.trace.bound_symbols):
        if not any(id(o) in needed for o in b.flat_outputs()):
            continue
        if _random(b) or b.has_side_effect:
            return None, "the value depends on a random or side-effecting op"
        taken.append(b)
        if len(taken) > MAX_LINES:
            return None, f"it is an intermediate value (more than {MAX_LINES} operations from the inputs)"
        for a in b.flat_args():
            if is_proxy(a):
                needed.add(id(a))
    taken.reverse()
    made = {id(o) for b in taken for o in b.flat_outputs()}
    kinds = {leaf.path: leaf.kind for leaf in walker.leaves}
    inputs, seen = [], set()
    candidates = [value] + [a for b in taken for a in b.flat_args()]
    for a in candidates:
        if not is_proxy(a) or id(a) in made or id(a) in seen:
            continue
        seen.add(id(a))
        leaf = walker.leaf_of(a)
        if leaf is None:
            return None, "it depends on a value the function computed outside the inputs"
        if leaf.kind != "tensor" or any(kinds.get(leaf.path[:j]) in ("module", "object", "optimizer")
                                        for j in range(1, len(leaf.path))) or leaf.path[0].kind == "const":
            return None, f"it depends on {leaf.where}, which is not a per-call input (parameters and optimizer state change every step)"
        inputs.append(a)
    return (taken, inputs), None


def decide(value, convert: str, what: str):
    """The Python value ``convert(value)`` for a tensor or runtime number of the trace, specialised and recorded."""
    where = user_line()
    st = context.tracer_state()
    if st is None or st.walker is None or len(st.trace._scopes) != 1:
        _refuse(what, where, "it is not computed by the function's own code")
    got, why = _slice(st, value)
    if got is None:
        _refuse(what, where, why)
    lines, inputs = got
    trc = Trace("decision", header=f"Decision: {what} at {where}")
    trc.args = list(inputs)
    trc.bound_symbols = list(lines)
    trc.output = value
    trc.names = set(st.trace.names)
    source = trc.python_source()
    fn = trc.python_callable()
    real = [st.walker.leaf_of(p).value for p in inputs]
    with context.tracing(None), torch._C.DisableTorchFunction(), torch.no_grad():
        v = fn(*real)
    result = _CONVERT[convert](v)
    st.decisions.append(Decision(fn, list(inputs), convert, result, f"{what} at {where}", source))
    return result


_CONVERT = {
    "bool": lambda v: bool(v),
    "int": lambda v: int(v),
    "float": lambda v: float(v),
    "index": lambda v: v.__index__(),
    "list": lambda v: v.tolist() if isinstance(v, torch.Tensor) else v,
}


def _decide_hook(value, convert, what):
    if type(value) is TensorProxy or isinstance(value, NumberProxy):
        return decide(value, convert, what)
    raise TypeError(f"cannot decide on {type(value).__name__}")


proxies._decision_handler = _decide_hook
