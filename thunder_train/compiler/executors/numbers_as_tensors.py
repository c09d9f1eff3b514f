"""A Python number multiplied into, added to, subtracted from or dividing a CPU float tensor, or chosen by
``torch.where`` beside one, is passed as a 0-d tensor of that tensor's dtype, made once and shared by every program:

    t98 = torch.mul(t97, numbers.f32_0_7978845608028654)  # was torch.mul(t97, 0.7978845608028654)

``numbers`` is a namespace of printed traces (``codegen.standard_namespace``): ``numbers.f32_0_5`` is the 0-d float32
tensor 0.5, made on first use, so a printed trace runs by hand in a new process too.

Why: on every call torch wraps a Python number into a new 0-d tensor and runs type promotion with it; on a small
tensor that is about half the call (``torch.mul(x, 0.5)`` on 3,072 floats: ~4-6 us, against ~2 us with a 0-d tensor).
Programs that run such lines outside fused regions pay it on each step: the torch program (the default before its
fused program takes over, ``fusion=None``) has ~15-20 of them on a zoo transformer step (GELU's constants, scales,
the recomputed values of the default's cheap recomputation).

Values: the kernel takes a 0-d CPU operand, wrapped number or not, as a scalar, and converts it to the computation's
type the same way; a 0-d tensor of the tensor's own dtype gives the result the same dtype.  So the values are
bitwise the same (tests/test_numbers_as_tensors.py compares them); ``where`` copies the number as the result's
dtype either way (~1.3 us a call saved).  Only float32 and float64 tensors (a float16 tensor times a 0-d float16
tensor would round the number to float16 first), finite numbers, integers up to 2**24 (exact in float32), two
positional arguments and at most ``out=``; a tensor that requires grad only where the program runs without grad.
"""
from __future__ import annotations

import math

import torch

from .. import codegen
from ..proxies import TensorProxy
from .torch_executor import ImplSymbol

_CALLS = frozenset({torch.mul, torch.add, torch.sub, torch.div, torch.true_divide, torch.Tensor.mul, torch.Tensor.add,
                    torch.Tensor.sub, torch.Tensor.div, torch.Tensor.true_divide})
_DTYPES = {torch.float32: "f32", torch.float64: "f64"}


def _attr(value, dtype) -> str:
    # repr keeps -0.0 apart from 0.0 (equal as numbers, and as dict keys)
    text = repr(float(value)).replace(".", "_").replace("-", "m").replace("+", "p")
    return f"{_DTYPES[dtype]}_{text}"


class _Numbers:
    """The namespace ``numbers`` of printed traces: ``numbers.f32_0_5`` is the shared 0-d float32 tensor 0.5 (read only)."""

    def __getattr__(self, attr):  # the first use of a number: made, then found in the instance's dict
        tag, _, text = attr.partition("_")
        dtype = next((d for d, t in _DTYPES.items() if t == tag), None)
        if dtype is None or attr.startswith("__"):
            raise AttributeError(attr)
        try:
            value = float(text.replace("_", ".").replace("m", "-").replace("p", "+"))
        except ValueError:
            raise AttributeError(attr) from None
        if _attr(value, dtype) != attr:
            raise AttributeError(attr)
        tensor = torch.tensor(value, dtype=dtype)
        setattr(self, attr, tensor)
        codegen.name_object(tensor, "numbers", attr)
        return tensor


numbers = _Numbers()
codegen.register_namespace("numbers", numbers)


def _number(x) -> bool:
    if type(x) is float:
        return math.isfinite(x)
    return type(x) is int and abs(x) <= 1 << 24


def _number_at(b, grad_disabled):
    """(index of the number, the tensor it meets) where the line may take the number as a 0-d tensor, else None."""
    if type(b.sym) is not ImplSymbol or set(b.kwargs) - {"out"}:
        return None
    try:
        if b.sym.fn in _CALLS and len(b.args) == 2:
            k, x = 1, b.args[0]
        elif b.sym.fn is torch.where and len(b.args) == 3 and type(b.args[0]) is TensorProxy:
            # ``where(c, x, 0.0)``, ``where(c, 0.0, x)``: the number is copied as the result's dtype either way
            k = 2 if type(b.args[1]) is TensorProxy else 1
            x = b.args[3 - k]
        else:
            return None
    except TypeError:  # an unhashable callable
        return None
    out = b.output
    if (type(x) is TensorProxy and _number(b.args[k]) and x._tt_device.type == "cpu" and x._tt_dtype.torch in _DTYPES
            and type(out) is TensorProxy and out._tt_dtype == x._tt_dtype and (grad_disabled or not x._tt_requires_grad)):
        return k, x
    return None


def numbers_as_tensors(trc, *, grad_disabled=False):
    """The trace with the numbers of its float tensor arithmetic passed as shared 0-d tensors (see the docstring).
    ``grad_disabled``: the program always runs without grad (the forward and backward of ``ThunderFunction``)."""
    grad_disabled = grad_disabled or "@torch.no_grad()" in trc.decorators
    lines, changed = [], False
    for b in trc.bound_symbols:
        at = _number_at(b, grad_disabled)
        if at is not None:
            k, x = at
            args = list(b.args)
            args[k] = getattr(numbers, _attr(args[k], x._tt_dtype.torch))
            b = b.replace(args=tuple(args))
            changed = True
        lines.append(b)
    return trc.with_lines(lines) if changed else trc
