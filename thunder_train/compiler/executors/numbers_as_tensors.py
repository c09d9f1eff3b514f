"""A Python number multiplied into, added to, subtracted from or dividing a CPU float tensor is passed as a 0-d tensor
of that tensor's dtype, made once and shared by every program:

    t98 = torch.mul(t97, _f32_0_7978845608028654)  # was torch.mul(t97, 0.7978845608028654)

Why: on every call torch wraps a Python number into a new 0-d tensor and runs type promotion with it; on a small
tensor that is about half the call (``torch.mul(x, 0.5)`` on 3,072 floats: ~4-6 us, against ~2 us with a 0-d tensor).
Programs that run such lines outside fused regions pay it on each step: the torch program (the default before its
fused program takes over, ``fusion=None``) has ~15-20 of them on a zoo transformer step (GELU's constants, scales,
the recomputed values of the default's cheap recomputation).

Values: the kernel takes a 0-d CPU operand, wrapped number or not, as a scalar, and converts it to the computation's
type the same way; a 0-d tensor of the tensor's own dtype gives the result the same dtype.  So the values are
bitwise the same (tests/test_numbers_as_tensors.py compares them).  Only float32 and float64 tensors (a float16
tensor times a 0-d float16 tensor would round the number to float16 first), finite numbers, integers up to 2**24
(exact in float32), two positional arguments and at most ``out=``; a tensor that requires grad only where the program
runs without grad.
"""
from __future__ import annotations

import math

import torch

from ..codegen import Name
from ..proxies import TensorProxy
from .torch_executor import ImplSymbol

_CALLS = frozenset({torch.mul, torch.add, torch.sub, torch.div, torch.true_divide, torch.Tensor.mul, torch.Tensor.add,
                    torch.Tensor.sub, torch.Tensor.div, torch.Tensor.true_divide})
_DTYPES = {torch.float32: "f32", torch.float64: "f64"}

_numbers: dict = {}  # (value, dtype) -> (name, 0-d tensor); read only, shared by every program
_symbols: dict = {}  # (symbol, name) -> the symbol whose globals hold the tensor


def _number(x) -> bool:
    if type(x) is float:
        return math.isfinite(x)
    return type(x) is int and abs(x) <= 1 << 24


def number_tensor(value, dtype) -> tuple:
    """(name, 0-d CPU tensor of ``dtype`` holding ``value``), made once."""
    key = (float(value), dtype)
    got = _numbers.get(key)
    if got is None:
        text = repr(float(value)).replace(".", "_").replace("-", "m").replace("+", "p")
        got = _numbers[key] = (f"_{_DTYPES[dtype]}_{text}", torch.tensor(float(value), dtype=dtype))
    return got


def _with_number(sym, name, tensor):
    """``sym``'s callable, printed as it is, with the 0-d tensor among its globals."""
    key = (sym, name)
    got = _symbols.get(key)
    if got is None:
        got = _symbols[key] = ImplSymbol(sym.fn, sym.print_name)
        got.tags = sym.tags
        got._globals = {**sym.codegen_globals(), name: tensor}
    return got


def _rewritable(b, grad_disabled) -> bool:
    if type(b.sym) is not ImplSymbol or len(b.args) != 2 or set(b.kwargs) - {"out"}:
        return False
    try:
        if b.sym.fn not in _CALLS:
            return False
    except TypeError:  # an unhashable callable
        return False
    x, n = b.args
    out = b.output
    return (type(x) is TensorProxy and _number(n) and x._tt_device.type == "cpu" and x._tt_dtype.torch in _DTYPES
            and type(out) is TensorProxy and out._tt_dtype == x._tt_dtype
            and (grad_disabled or not x._tt_requires_grad))


def numbers_as_tensors(trc, *, grad_disabled=False):
    """The trace with the numbers of its float tensor arithmetic passed as shared 0-d tensors (see the docstring).
    ``grad_disabled``: the program always runs without grad (the forward and backward of ``ThunderFunction``)."""
    grad_disabled = grad_disabled or "@torch.no_grad()" in trc.decorators
    lines, changed = [], False
    for b in trc.bound_symbols:
        if _rewritable(b, grad_disabled):
            x, n = b.args
            name, tensor = number_tensor(n, x._tt_dtype.torch)
            b = b.replace(sym=_with_number(b.sym, name, tensor), args=(x, Name(name)))
            changed = True
        lines.append(b)
    if not changed:
        return trc
    new = trc.derive(trc.header)
    new.bound_symbols = lines
    return new
