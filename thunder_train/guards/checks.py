"""Checks called by generated prologues.  Each raises GuardFailure (never assert)."""
from __future__ import annotations

import math

import torch

from .errors import GuardFailure

Tensor = torch.Tensor


def _short_type(x) -> str:
    return type(x).__name__


def check_tensor(t, path, shape, dtype, device, requires_grad):
    if not isinstance(t, Tensor):
        raise GuardFailure(path, "type", "Tensor", _short_type(t))
    if t.shape != shape:
        raise GuardFailure(path, "shape", tuple(shape), tuple(t.shape))
    if t.dtype is not dtype:
        raise GuardFailure(path, "dtype", dtype, t.dtype)
    if t.device != device:
        raise GuardFailure(path, "device", device, t.device)
    if t.requires_grad is not requires_grad:
        raise GuardFailure(path, "requires_grad", requires_grad, t.requires_grad)


def check_value(v, path, expected):
    """Python constants the trace specialised on: same type and value (NaN equals NaN)."""
    if type(v) is not type(expected):
        raise GuardFailure(path, "type", type(expected).__name__, _short_type(v))
    if v != expected and not (isinstance(v, float) and math.isnan(v) and math.isnan(expected)):
        raise GuardFailure(path, "value", expected, v)


def check_type(v, path, expected_type):
    if type(v) is not expected_type:
        raise GuardFailure(path, "type", expected_type.__name__, _short_type(v))


def check_len(v, path, n):
    if len(v) != n:
        raise GuardFailure(path, "len", n, len(v))


def check_keys(d, path, keys):
    if tuple(d.keys()) != keys:
        raise GuardFailure(path, "keys", keys, tuple(d.keys()))


def check_id(v, path, expected_id, type_name):
    if id(v) != expected_id:
        raise GuardFailure(path, "object", f"the {type_name} object seen when compiling", f"a different {_short_type(v)} object")


def check_module(m, path, expected_id, training, n_params, n_buffers, n_modules):
    if id(m) != expected_id:
        raise GuardFailure(path, "object", "the module seen when compiling", f"a different {_short_type(m)}")
    if m.training is not training:
        raise GuardFailure(path, "training", training, m.training)
    if len(m._parameters) != n_params or len(m._buffers) != n_buffers or len(m._modules) != n_modules:
        raise GuardFailure(path, "structure", (n_params, n_buffers, n_modules), (len(m._parameters), len(m._buffers), len(m._modules)))


def check_same(v, path, other, other_path):
    if v is not other:
        raise GuardFailure(path, "identity", f"the same tensor as {other_path}", "a different tensor")


def check_global_state(grad_enabled, default_dtype, autocast_cpu, autocast_cuda):
    if torch.is_grad_enabled() is not grad_enabled:
        raise GuardFailure("torch", "grad_enabled", grad_enabled, torch.is_grad_enabled())
    if torch.get_default_dtype() is not default_dtype:
        raise GuardFailure("torch", "default_dtype", default_dtype, torch.get_default_dtype())
    state = autocast_state()
    if state != (autocast_cpu, autocast_cuda):
        raise GuardFailure("torch", "autocast", (autocast_cpu, autocast_cuda), state)


def autocast_state():
    """(cpu, cuda) autocast: each None when off, else the autocast dtype."""
    cpu = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    cuda = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    return cpu, cuda


def check_nargs(args, kwargs, nargs, kwnames):
    if len(args) != nargs:
        raise GuardFailure("args", "len", nargs, len(args))
    if tuple(kwargs) != kwnames:
        raise GuardFailure("kwargs", "keys", kwnames, tuple(kwargs))
