"""Python decisions on tensor values: specialised on, not refused — checked by the prologue or by the program.

``if (mask == 1).all():``, ``mask.any()``, ``int(lengths.max())``, ``if loss.item() > 10:``,
``if (h > 0).any():`` need a value while tracing.  The trace is functional, so every value it
computed is a pure function of the inputs as they were when the call began (in-place updates are
new values until the final write-backs): the trace lines the value depends on are cut out as a
small program of their own (a *decision*), run on the real input tensors under ``no_grad``, and
the function continues with the real Python value.  Where the decision is checked on later calls:

- **in the prologue**, when it reads only the call's own inputs (arguments, globals, runtime
  numbers) through at most ``PROLOGUE_MAX_OPS`` lines without a matmul, convolution or opaque op
  (HF's ``(mask == 1).all()`` is two): the prologue runs the decision's program on every call and
  its value is part of the guard key (``compiler/prologue.py``; thin mode per call too), so a call
  that decides differently finds (or traces) its own entry before anything runs;
- **in the program** otherwise (a loss, an activation, a gradient norm, a parameter after
  ``opt.step()``): one line ``prims.check_decision(value, ...)`` right after the line that computes
  the value compares it with what this trace decided, as eager reads it once.  Every write of the
  program (write-backs, in-place updates) comes after it, so a call that decides differently raises
  ``DecisionMismatch`` having changed nothing (the RNG state is restored where a random op ran
  before the check), and ``compiled.py`` runs the entry traced for the value observed, tracing it
  with that value (``TracerState.forced_decisions``) if none exists.  A decision after an op with
  side effects falls back to the prologue.

``compile_stats(cf).decision_notes`` says where each decision is checked and how many ops that is.
A value that cannot be recomputed exactly — one that depends on a random op (dropout), on an op
with side effects, or on an op run opaquely that torch marks as random — stays a
``DataDependentError`` naming the user's source line and what to do.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable

import torch

from .. import context, prims, proxies
from ..executors.lowering import lower_to_executors
from ..executors.torch_executor import torch_executor
from ..executors.torch_impls import DECISION_CONVERT, decision_key
from ..proxies import NumberProxy, TensorProxy, is_proxy
from ..torchlang.tensor_methods import DataDependentError
from ..trace import Trace
from .provenance import per_call_mask

# A decision that needs more of the program than this is refused (the prologue would run it on every call).
MAX_LINES = 20_000
# A decision on the call's own inputs with at most this many lines (no matmul, convolution or opaque op) is
# checked by the prologue: a few elementwise ops and reductions over a mask cost less there than an abandoned
# program costs when the decision flips.  Anything else is checked by the program where it computes the value.
PROLOGUE_MAX_OPS = 8
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
    ops: int = 0  # trace lines the prologue recomputes for it (checked in the program: the lines it no longer recomputes)
    checked: bool = False  # checked by the program (prims.check_decision), not by the prologue
    index: int = -1  # position among the program's checked decisions
    why_prologue: str = ""  # a decision on intermediate values the prologue checks: why not the program


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
        "or move the branch outside the compiled function and pass its result in." + _validation_hint()
    )


_DISTRIBUTIONS = os.path.join(_TORCH, "distributions") + os.sep


def _validation_hint() -> str:
    """What to do when the decision is torch.distributions checking its arguments or a sample (``validate_args``,
    on by default: ``if not valid.all(): raise ValueError``), the usual one in a policy-gradient step."""
    f = sys._getframe(2)
    while f is not None:
        if os.path.abspath(f.f_code.co_filename).startswith(_DISTRIBUTIONS):
            return (f" Here it is torch.distributions validating a value ({f.f_code.co_name} in "
                    f"{os.path.basename(f.f_code.co_filename)}): create the distribution with validate_args=False, or "
                    "call torch.distributions.Distribution.set_default_validate_args(False) once.")
        f = f.f_back
    return ""


def _random(b) -> bool:
    """A random op (tag ``"random"``, or run opaquely with an aten overload torch tags ``nondeterministic_seeded``),
    a read of a generator's state (``"reads_generator"``), or a decomposition holding one."""
    return b.draws_random or _reads_generator(b)


def _reads_generator(b) -> bool:
    return "reads_generator" in getattr(b.sym, "tags", ()) or any(_reads_generator(s) for s in b.subsymbols)


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
        if _input_leaf(walker, a) is None and not _symbolic_size(a):
            return None, "it depends on a value that is neither an input nor computed from the inputs by the trace"
        inputs.append(a)
    return (taken, inputs), None


def _symbolic_size(p) -> bool:
    """A size of a per-call input (dynamic=True): the program reads it at its top, the prologue cannot."""
    return getattr(p, "origin", (None,))[0] == "dim"


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
    text = f"{what} at {where}"
    pos, why_prologue = None, ""
    if not _stays_in_prologue(st.walker, lines, inputs):
        pos, why_prologue = _check_position(st.trace.bound_symbols, value)
    if pos is not None:
        return _checked_in_program(st, value, convert, text, lines, inputs, pos)
    if any(_symbolic_size(p) for p in inputs):
        _refuse(what, where, f"it depends on a symbolic size (dynamic=True), which the prologue cannot read, and {why_prologue}")
    fn, source = _program(lines, inputs, value, text, st.trace.names)
    result = _CONVERT[convert](_run(fn, st.walker, inputs))
    st.decisions.append(Decision(fn, list(inputs), convert, result, text, source, ops=len(lines), why_prologue=why_prologue))
    return result


def _program(lines, inputs, value, text, names):
    """The decision's program (lowered like the computation: each line the torch function eager calls)."""
    trc = Trace("decision", header=f"Decision: {text}")
    trc.args = list(inputs)
    trc.bound_symbols = list(lines)
    trc.output = value
    trc.names = set(names)
    trc = lower_to_executors(trc, [torch_executor], header=f"Decision: {text}")
    return _without_grad(trc.python_callable()), trc.python_source()


def _run(fn, walker, inputs):
    real = [p.value if _symbolic_size(p) else _input_leaf(walker, p).value for p in inputs]
    with context.tracing(None), torch._C.DisableTorchFunction(), torch.no_grad():
        return fn(*real)


def _heavy(b) -> bool:
    """A line that multiplies matrices, convolves or runs opaquely (anywhere in its decomposition)."""
    if b.sym in (prims.matmul, prims.convolution) or b.sym.runs_opaquely:
        return True
    return any(_heavy(s) for s in b.subsymbols)


def _stays_in_prologue(walker, lines, inputs) -> bool:
    """Cheap and computed from the call's own inputs only: the prologue checks it (see the module docstring)."""
    if len(lines) > PROLOGUE_MAX_OPS or any(_heavy(b) for b in lines):
        return False
    per_call = per_call_mask(walker.leaves)
    index = {id(leaf): i for i, leaf in enumerate(walker.leaves)}
    for p in inputs:
        if _symbolic_size(p):
            return False  # only the program has the sizes of this call's inputs
        leaf = _input_leaf(walker, p)
        if leaf.kind != "number" and not per_call[index[id(leaf)]]:
            return False  # a parameter, a buffer, optimizer state: the model's values, not the batch's
    return True


_CHECKS = (prims.check_decision, prims.check_finite)


def _check_position(bsyms, value):
    """``(index, "")`` where the program checks a decision on ``value``: right after the line computing it and
    after the checks before it (they run in the order Python decided); ``(None, why)`` when an op with side
    effects runs before that (an abandoned call would have done it), which leaves the check to the prologue."""
    pos = 0
    for i, b in enumerate(bsyms):
        if b.sym is prims.check_decision or any(o is value for o in b.flat_outputs()):
            pos = i + 1
    for b in bsyms[:pos]:
        if b.has_side_effect and b.sym not in _CHECKS:
            return None, f"an op with side effects ({b.sym.name}) runs before its value"
    return pos, ""


def _checked_in_program(st, value, convert, text, lines, inputs, pos):
    """Record ``prims.check_decision`` at ``pos``; the value is the one a run observed or the decision's program's."""
    index = sum(1 for d in st.decisions if d.checked)
    forced = st.forced_decisions
    if index < len(forced) and forced[index][0] != text:
        forced.clear()  # this trace took another way before: nothing observed applies any more
    if index < len(forced):
        result = _from_key(forced[index][1])
    else:
        fn, _ = _program(lines, inputs, value, text, st.trace.names)
        result = _CONVERT[convert](_run(fn, st.walker, inputs))
    bsyms = st.trace.bound_symbols
    prims.check_decision(value, convert, decision_key(result), index, text)
    check = st.trace._scopes[-1].pop()  # recorded in the current scope: inside a torch-language op for x[:n]
    if check.sym is not prims.check_decision:
        raise RuntimeError("thunder_train internal error: the decision's check was not recorded as the scope's last line")
    bsyms.insert(pos, check)
    st.decisions.append(Decision(None, list(inputs), convert, result, text, "", ops=len(lines), checked=True, index=index))
    return result


_CONVERT = DECISION_CONVERT  # the program's check converts the same way (executors/torch_impls.py)


def _decide_hook(value, convert, what):
    if type(value) is TensorProxy or isinstance(value, NumberProxy):
        return decide(value, convert, what)
    raise TypeError(f"cannot decide on {type(value).__name__}")


proxies._decision_handler = _decide_hook


def _from_key(v):
    """The Python value of a ``decision_key``."""
    if type(v) is tuple:
        return [_from_key(e) for e in v]
    return float("nan") if v == "nan" else v


def random_before_checks(trc) -> bool:
    """Whether a random op runs before a check of the program: an abandoned call must put the RNG state back."""
    last = max((i for i, b in enumerate(trc.bound_symbols) if b.sym is prims.check_decision), default=0)
    return any(_random(b) for b in trc.bound_symbols[:last])  # none when the program checks nothing
