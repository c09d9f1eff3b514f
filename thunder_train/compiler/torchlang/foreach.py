"""``torch._foreach_*``: the list ops optimizers and ``clip_grad_norm_`` use.

Each out-of-place op (``_foreach_add``) is a torch-language symbol whose
decomposition applies the elementwise symbol to every list element; the torch
executor claims it whole and calls ``torch._foreach_add`` (one call for the
list).  The in-place forms (``_foreach_add_``) are functionalized like every
in-place method: their ``functional`` form returns the new value of each
destination (see ``compiler/acquisition/functional.py``).

The second operand may be a number (or runtime number), a list of numbers, a
tensor, or a list of tensors — torch's overloads.
"""
from __future__ import annotations

import torch

from .. import prims
from ..proxies import TensorProxy
from . import elementwise as ew
from .inplace import _functional, _new_value
from .reductions import norm
from .registry import torchsymbol


def _per_item(other, n, what):
    """``other`` broadcast to one operand per list element."""
    if isinstance(other, (list, tuple)):
        if len(other) != n:
            raise RuntimeError(f"{what}: tensor lists must have the same number of elements, got {n} and {len(other)}")
        return list(other)
    return [other] * n


def _check_list(tensors, what):
    if not isinstance(tensors, (list, tuple)) or not all(type(t) is TensorProxy for t in tensors):
        raise TypeError(f"{what} expects a list of tensors")
    return list(tensors)


# The out-of-place ``_foreach_`` ops: each returns new tensors, one per element of its first list
# (executors/layout_rules.py declares their layout rule).
OUT_OF_PLACE: list = []


def _define(name, per_element, n_operands, n_optional=0):
    """``torch._foreach_<name>`` and ``torch._foreach_<name>_`` from ``per_element(a, *operands, **kw)``.

    ``n_optional`` trailing operands may be omitted (``_foreach_addcdiv_``'s per-element scalars).
    """
    what = f"torch._foreach_{name}"

    def outplace(tensors, *operands, **kwargs):
        tensors = _check_list(tensors, what)
        if not n_operands <= len(operands) <= n_operands + n_optional:
            raise TypeError(f"{what} takes {n_operands} operand(s) after the tensor list, got {len(operands)}")
        ops = [_per_item(o, len(tensors), what) for o in operands]
        return [per_element(t, *(o[i] for o in ops), **kwargs) for i, t in enumerate(tensors)]

    outplace.__name__ = f"_foreach_{name}"
    out_sym = torchsymbol(getattr(torch, f"_foreach_{name}"), name=f"_foreach_{name}")(outplace)
    OUT_OF_PLACE.append(out_sym)

    def new_values(tensors, *operands, **kwargs):
        return [_new_value(v, t) for v, t in zip(out_sym(tensors, *operands, **kwargs), tensors)]

    def inplace(tensors, *operands, **kwargs):
        return [prims.copy_(v, t) for v, t in zip(new_values(tensors, *operands, **kwargs), tensors)]

    inplace.__name__ = f"_foreach_{name}_"
    in_sym = torchsymbol(getattr(torch, f"_foreach_{name}_"), name=f"_foreach_{name}_", tags=("inplace",))(inplace)
    return out_sym, _functional(in_sym, new_values)


foreach_add, foreach_add_ = _define("add", ew.add, 1)
foreach_sub, foreach_sub_ = _define("sub", ew.sub, 1)
foreach_mul, foreach_mul_ = _define("mul", ew.mul, 1)
foreach_div, foreach_div_ = _define("div", ew.div, 1)
foreach_maximum, foreach_maximum_ = _define("maximum", ew.maximum, 1)
foreach_minimum, foreach_minimum_ = _define("minimum", ew.minimum, 1)
foreach_clamp_min, foreach_clamp_min_ = _define("clamp_min", ew.clamp_min, 1)
foreach_clamp_max, foreach_clamp_max_ = _define("clamp_max", ew.clamp_max, 1)
foreach_pow, foreach_pow_ = _define("pow", ew.pow, 1)
foreach_lerp, foreach_lerp_ = _define("lerp", ew.lerp, 2)
foreach_addcmul, foreach_addcmul_ = _define("addcmul", lambda a, t1, t2, value=1: ew.addcmul(a, t1, t2, value=value), 2, 1)
foreach_addcdiv, foreach_addcdiv_ = _define("addcdiv", lambda a, t1, t2, value=1: ew.addcdiv(a, t1, t2, value=value), 2, 1)
foreach_sqrt, foreach_sqrt_ = _define("sqrt", ew.sqrt, 0)
foreach_neg, foreach_neg_ = _define("neg", ew.neg, 0)
foreach_reciprocal, foreach_reciprocal_ = _define("reciprocal", ew.reciprocal, 0)
foreach_exp, foreach_exp_ = _define("exp", ew.exp, 0)
foreach_abs, foreach_abs_ = _define("abs", ew.abs, 0)
foreach_sign, foreach_sign_ = _define("sign", ew.sign, 0)


def _zero_values(tensors):
    return [prims.full(t._tt_shape, 0, device=t._tt_device, dtype=t._tt_dtype) for t in _check_list(tensors, "torch._foreach_zero_")]


@torchsymbol(torch._foreach_zero_, name="_foreach_zero_", tags=("inplace",))
def foreach_zero_(tensors):
    return [prims.copy_(v, t) for v, t in zip(_zero_values(tensors), tensors)]


_functional(foreach_zero_, _zero_values)


@torchsymbol(torch._foreach_norm, name="_foreach_norm")
def foreach_norm(tensors, ord=2, dtype=None):
    return [norm(t, ord, dtype=dtype) for t in _check_list(tensors, "torch._foreach_norm")]


OUT_OF_PLACE.append(foreach_norm)


# Every out-of-place list op computes result ``i`` from the ``i``-th operands alone (transforms/early_updates.py may
# split it per index: the step counters' ``_foreach_add`` of an optimizer updating each parameter on its own).
for _sym in OUT_OF_PLACE:
    _sym.splits_by_index = True
