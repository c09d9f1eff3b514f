"""Elementwise ops written as torch calls the torch language knows (registry.composed: traced as the user's own
calls, so each call differentiates and rounds as eager's does): ``frac``, ``sinc``, ``heaviside``, ``xlog1py``,
``entr``, ``ndtr``, ``logit``, ``float_power``, ``ldexp``, ``angle`` and the small forms of real tensors (``conj``,
``real``, ``positive``)."""
from __future__ import annotations

import math

import torch

from .registry import composed


def _real(x, op):
    if x.dtype.is_complex:
        raise NotImplementedError(f"{op} of a complex tensor is run by torch")


def _real_only(name):
    """An op that is the identity on real tensors (conj, real, ...); complex ones are run by torch."""
    def fn(input):
        _real(input, name)
        return input

    return fn


def _float(x):
    return x if x.dtype.is_floating_point else x.to(torch.get_default_dtype())


def positive(input):
    if input.dtype is torch.bool:
        raise TypeError("The `+` operator, on a bool tensor is not supported.")
    return input


composed("positive", positive, (torch.positive,), ("positive",))


conj = _real_only("conj")
composed("conj", conj, (torch.conj,), ("conj",))
composed("resolve_conj", conj, (torch.resolve_conj,), ("resolve_conj",))
composed("resolve_neg", _real_only("resolve_neg"), (torch.resolve_neg,), ("resolve_neg",))


def deg2rad(input):
    _real(input, "deg2rad")
    return _float(input) * (math.pi / 180)


composed("deg2rad", deg2rad, (torch.deg2rad,), ("deg2rad",))


def rad2deg(input):
    _real(input, "rad2deg")
    return _float(input) * (180 / math.pi)


composed("rad2deg", rad2deg, (torch.rad2deg,), ("rad2deg",))


def frac(input):
    _real(input, "frac")
    if not input.dtype.is_floating_point:
        raise RuntimeError('"frac_cpu" not implemented for integer dtypes')
    return input - torch.trunc(input)


composed("frac", frac, (torch.frac,), ("frac",))


def sinc(input):
    _real(input, "sinc")
    x = _float(input) * math.pi
    return torch.where(x == 0, torch.ones_like(x), torch.sin(x) / x)


composed("sinc", sinc, (torch.sinc, torch.special.sinc), ("sinc",))


def heaviside(input, values):
    if input.dtype != values.dtype:
        raise RuntimeError("heaviside is not yet implemented for tensors with different dtypes")
    return torch.where(input == 0, values, (input > 0).to(input.dtype))


composed("heaviside", heaviside, (torch.heaviside,), ("heaviside",))


def isposinf(input):
    return input == math.inf if input.dtype.is_floating_point else torch.zeros_like(input, dtype=torch.bool)


composed("isposinf", isposinf, (torch.isposinf,), ("isposinf",))


def isneginf(input):
    return input == -math.inf if input.dtype.is_floating_point else torch.zeros_like(input, dtype=torch.bool)


composed("isneginf", isneginf, (torch.isneginf,), ("isneginf",))


def isreal(input):
    _real(input, "isreal")
    return torch.ones_like(input, dtype=torch.bool)


composed("isreal", isreal, (torch.isreal,), ("isreal",))


def xlog1py(input, other):
    if not isinstance(input, torch.Tensor) or not isinstance(other, torch.Tensor):
        raise NotImplementedError("xlog1py with a number argument is run by torch")
    out = input * torch.log1p(other)
    return torch.where((input == 0) & ~torch.isnan(other), torch.zeros_like(out), out)


composed("xlog1py", xlog1py, (torch.special.xlog1py,))


def entr(input):
    x = _float(input)
    return torch.where(x > 0, -x * torch.log(x), torch.where(x == 0, torch.zeros_like(x), torch.full_like(x, -math.inf) + x * 0))


composed("entr", entr, (torch.special.entr,))


def ndtr(input):
    x = _float(input)
    return (1 + torch.erf(x * (1 / math.sqrt(2)))) * 0.5


composed("ndtr", ndtr, (torch.special.ndtr,))


def float_power(input, exponent):
    if (isinstance(input, torch.Tensor) and input.dtype.is_complex) or (isinstance(exponent, torch.Tensor) and exponent.dtype.is_complex):
        raise NotImplementedError("complex float_power is run by torch")
    a = input.to(torch.float64) if isinstance(input, torch.Tensor) else float(input)
    b = exponent.to(torch.float64) if isinstance(exponent, torch.Tensor) else float(exponent)
    return torch.pow(a, b)


composed("float_power", float_power, (torch.float_power,), ("float_power",))


def ldexp(input, other):
    return input * torch.pow(2.0, other)


composed("ldexp", ldexp, (torch.ldexp,), ("ldexp",))


composed("conj_physical", _real_only("conj_physical"), (torch.conj_physical,), ("conj_physical",))
composed("real", _real_only("real"), (torch.real,))


def angle(input):
    _real(input, "angle")
    x = _float(input)
    return torch.where(torch.isnan(x), x, torch.where(x < 0, torch.full_like(x, math.pi), torch.zeros_like(x)))


composed("angle", angle, (torch.angle,), ("angle",))
