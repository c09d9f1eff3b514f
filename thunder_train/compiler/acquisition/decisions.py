"""Python decisions on tensor values: computed by the prologue and specialised on, not refused.

``if (mask == 1).all():``, ``mask.any()``, ``int(lengths.max())``, ``if loss.item() > 10:``,
``if (h > 0).any():`` need a value while tracing.  The trace is functional, so every value it
computed is a pure function of the inputs as they were when the call began (in-place updates are
new values until the final write-backs): the trace lines the value depends on are cut out as a
small program of their own (a *decision*), run on the real input tensors under ``no_grad``, and
the function continues with the real Python value.  The prologue runs the same program on every
call and compares (``guards/prologue.py``; thin mode per call too): a call that decides
differently gets its own trace, with the decision as the retrace reason.  A decision on an
intermediate value (a loss, an activation) so recomputes part of the program in the prologue;
``compile_stats(cf).decision_notes`` says how many ops.

A value the prologue cannot recompute exactly — one that depends on a random op (dropout), on
an op with side effects, or on an op run opaquely that torch marks as random — stays a
``DataDependentError`` naming the user's source line and what to do.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable

import torch

from .. import context, proxies
from ..executors.lowering import lower_to_executors
from ..executors.torch_executor import torch_executor
from ..proxies import NumberProxy, TensorProxy, is_proxy
from ..torchlang.tensor_methods import DataDependentError
from ..trace import Trace

# A decision that needs more of the program than this is refused (the prologue would run it on every call).
MAX_LINES = 20_000
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
    ops: int = 0  # trace lines the prologue recomputes for it


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
    return "random" in getattr(b.sym, "tags", ()) or _opaque_random(b) or any(_random(s) for s in b.subsymbols)


def _opaque_random(b) -> bool:
    """An op run opaquely whose aten overloads torch tags ``nondeterministic_seeded`` (``torch.poisson``)."""
    if "opaque" not in getattr(b.sym, "tags", ()):
        return False
    short = b.sym.name.rsplit(".", 1)[-1]
    packet = getattr(torch.ops.aten, short, None)
    if packet is None:
        return False
    try:
        overloads = [getattr(packet, o) for o in packet.overloads()]
    except Exception:  # noqa: BLE001 — not an op packet: nothing known
        return False
    return any(torch.Tag.nondeterministic_seeded in getattr(o, "tags", ()) for o in overloads)


def _slice(st, value):
    """The top-level trace lines ``value`` depends on, and the input proxies they read; or a reason why not."""
    walker = st.walker
    needed = {id(value)}
    taken = []
    for b in reversed(st.trace.bound_symbols):
        if not any(id(o) in needed for o in b.flat_outputs()):
            continue
        if _random(b):
            return None, f"the value depends on a random op ({b.sym.name}), which the prologue cannot recompute"
        if b.has_side_effect:
            return None, f"the value depends on an op with side effects ({b.sym.name})"
        taken.append(b)
        if len(taken) > MAX_LINES:
            return None, f"it needs more than {MAX_LINES} operations of the program to compute"
        for a in b.flat_args():
            if is_proxy(a):
                needed.add(id(a))
    taken.reverse()
    made = {id(o) for b in taken for o in b.flat_outputs()}
    inputs, seen = [], set()
    candidates = [value] + [a for b in taken for a in b.flat_args()]
    for a in candidates:
        if not is_proxy(a) or id(a) in made or id(a) in seen:
            continue
        seen.add(id(a))
        if _input_leaf(walker, a) is None:
            if getattr(a, "origin", (None,))[0] == "dim":
                return None, "it depends on a symbolic size (dynamic=True), which the decision's program cannot read"
            return None, "it depends on a value that is neither an input nor computed from the inputs by the trace"
        inputs.append(a)
    return (taken, inputs), None


def _without_grad(program):
    """The prologue runs a decision's program under ``no_grad``: only its value is needed (no autograd graph)."""

    def decision(*inputs):
        with torch.no_grad():
            return program(*inputs)

    return decision


def _input_leaf(walker, p):
    """The leaf of an input tensor or runtime number (an optimizer's lr), or None."""
    leaf = walker.leaf_of(p)
    if leaf is not None:
        return leaf
    for leaf in walker.leaves:
        if leaf.kind == "number" and leaf.proxy is p:
            return leaf
    return None


def decide(value, convert: str, what: str):
    """The Python value ``convert(value)`` for a tensor or runtime number of the trace, specialised and recorded."""
    where = user_line()
    st = context.tracer_state()
    # Also inside a torch-language op (a size or index argument, x[:n]): the value comes from the top-level lines.
    if st is None or st.walker is None:
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
    # Lowered like the computation (each line the torch function eager calls), so it computes eager's values.
    trc = lower_to_executors(trc, [torch_executor], header=f"Decision: {what} at {where}")
    source = trc.python_source()
    fn = _without_grad(trc.python_callable())
    real = [_input_leaf(st.walker, p).value for p in inputs]
    with context.tracing(None), torch._C.DisableTorchFunction(), torch.no_grad():
        v = fn(*real)
    result = _CONVERT[convert](v)
    st.decisions.append(Decision(fn, list(inputs), convert, result, f"{what} at {where}", source, ops=len(lines)))
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
