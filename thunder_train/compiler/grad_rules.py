"""The gradient-rule registry (vector-Jacobian products): rules hang off their symbols.

A rule is registered for a symbol with ``@register_vjp(symbol)``, written right after the op's
definition (prims in ``compiler/prims/``, torch-language ops in ``compiler/torchlang/``).  It is
called while the backward trace is being recorded, so it is written with prims (and clang) calls
and the backward becomes an ordinary trace::

    @register_vjp(mul)
    def mul_vjp(g, out, /, a, b):
        return {"a": prims.mul(g, b), "b": prims.mul(g, a)}

``g`` is the cotangent of the output (for a symbol with several outputs, a tuple shaped like its
output with ``None`` where no gradient arrives), ``out`` is the output, and the symbol's arguments
follow by name (bound to its signature, defaults applied).  The rule returns a dict from argument
name to gradient; arguments it leaves out (or maps to ``None``) get no gradient.  A gradient has
exactly the shape and dtype of its input; for a list argument (``prims.cat``) it is a list.

Every prim has a rule or is tagged ``"non_differentiable"`` (its outputs carry no gradient: random
values, factories, integer- or bool-valued results); ``tests/test_op_facts.py`` checks it.
Composite torch-language symbols get a *direct* rule where differentiating their decomposition
would be slow, imprecise or wrong (``embedding``'s ``padding_idx`` only affects the gradient);
``supports=`` restricts a direct rule to the arguments it handles.  Any other composite is
differentiated through its decomposition (``transforms/autograd.py``).

This module sits with the symbols, below the prims, so that every op registers its rule where it
is defined.
"""
from __future__ import annotations

import inspect

from .errors import NoGradientRuleError  # noqa: F401  (defined with the other user-facing errors)

_signatures: dict = {}


def register_vjp(*syms, supports=None):
    """Register the decorated function as the gradient rule of ``syms`` (``Symbol.grad_rule``).

    Write it next to the op's definition; ``supports(**arguments)`` restricts it to the calls it handles."""

    def deco(fn):
        for s in syms:
            s.grad_rule = (fn, supports)
        return fn

    return deco


def bind_arguments(bsym) -> dict:
    """The arguments of a bound symbol by parameter name, defaults applied."""
    sym = bsym.sym
    sig = _signatures.get(sym)
    if sig is None:
        sig = _signatures[sym] = inspect.signature(sym.fn)
    bound = sig.bind(*bsym.args, **bsym.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def get_rule(bsym):
    """The gradient rule that applies to ``bsym``, or None."""
    own = getattr(bsym.sym, "vjp_rule", None)  # a symbol made for one call (a custom autograd.Function)
    if own is not None:
        return own
    entry = bsym.sym.grad_rule
    if entry is None:
        return None
    fn, supports = entry
    if supports is not None and not supports(**bind_arguments(bsym)):
        return None
    return fn


def has_rule(sym) -> bool:
    return sym.grad_rule is not None


def differentiable(sym) -> bool:
    """False for symbols whose outputs carry no gradient (tag ``"non_differentiable"``, declared with the op)."""
    return "non_differentiable" not in sym.tags
