"""The cheap structural key of a call, and what differs between two keys (the retrace reasons).

A call's key holds each argument's type and, for tensors, shape, dtype, device, requires_grad and Python type
(an ``nn.Parameter`` passes ``isinstance(_, nn.Parameter)`` while tracing, as in eager; sizes of 2 or more are left
out with ``dynamic=True``), plain values, containers to depth 3 and the global state
(grad mode, autocast, default dtype, ...).  A key no cache entry has means a retrace without running any
prologue; ``struct_diffs`` words the difference from the nearest key for ``compile_stats().retrace_reasons``.
"""
from __future__ import annotations

import torch

from ..compiler.prologue import GLOBAL_LABELS, current_global_state, describe_diffs, fmt_value

_T = "tensor"


def arg_key(x, depth=0):
    if isinstance(x, torch.Tensor):
        return (_T, x.shape, x.dtype, x.device, x.requires_grad, x.layout, type(x))
    t = type(x)
    if t in (int, bool, str, type(None), complex):
        return (t, x)
    if t is float:
        return (t, x if x == x else "nan")
    if depth < 3 and (t is tuple or t is list):
        return (t, tuple(arg_key(v, depth + 1) for v in x))
    if depth < 3 and t is dict:
        return (t, tuple((k, arg_key(v, depth + 1)) for k, v in x.items()))
    return (t, id(x))


def dynamic_arg_key(x, depth=0):
    """``arg_key`` for dynamic=True: sizes ≥ 2 of argument tensors are symbolic, so not part of the key."""
    if isinstance(x, torch.Tensor):
        return (_T, tuple(s if s < 2 else -1 for s in x.shape), x.dtype, x.device, x.requires_grad, x.layout, type(x))
    t = type(x)
    if depth < 3 and (t is tuple or t is list):
        return (t, tuple(dynamic_arg_key(v, depth + 1) for v in x))
    if depth < 3 and t is dict:
        return (t, tuple((k, dynamic_arg_key(v, depth + 1)) for k, v in x.items()))
    return arg_key(x, depth)


def struct_key(args, kwargs, key=arg_key) -> tuple:
    return (tuple(key(a) for a in args), tuple((k, key(v)) for k, v in kwargs.items()), current_global_state())


_TENSOR_FIELDS = ("shape", "dtype", "device", "requires_grad", "layout", "type")


def _key_diffs(a, b, path: str, out: list, limit: int = 3) -> None:
    """Append ``"path.what: old → new"`` for the differences between two ``arg_key`` values."""
    if len(out) >= limit or a == b:
        return
    if a[0] == _T and b[0] == _T:
        for i, field in enumerate(_TENSOR_FIELDS, 1):
            if a[i] != b[i] and len(out) < limit:
                out.append(f"{path}.{field}: {fmt_value(field, a[i])} → {fmt_value(field, b[i])}")
        return
    ta = "Tensor" if a[0] == _T else a[0].__name__
    tb = "Tensor" if b[0] == _T else b[0].__name__
    if a[0] != b[0]:
        out.append(f"{path}.type: {ta} → {tb}")
    elif a[0] in (tuple, list) and type(a[1]) is tuple and type(b[1]) is tuple:  # beyond depth 3: (type, id)
        if len(a[1]) != len(b[1]):
            out.append(f"{path}.len: {len(a[1])} → {len(b[1])}")
        else:
            for i, (x, y) in enumerate(zip(a[1], b[1])):
                _key_diffs(x, y, f"{path}[{i}]", out, limit)
    elif a[0] is dict and type(a[1]) is tuple and type(b[1]) is tuple:
        ka, kb = tuple(k for k, _ in a[1]), tuple(k for k, _ in b[1])
        if ka != kb:
            out.append(f"{path}.keys: {ka!r} → {kb!r}")
        else:
            for (k, x), (_, y) in zip(a[1], b[1]):
                _key_diffs(x, y, f"{path}[{k!r}]", out, limit)
    elif a[0] in (int, bool, str, type(None), complex, float):
        out.append(f"{path}.value: {a[1]!r} → {b[1]!r}")
    else:
        out.append(f"{path}: a different {ta} object")


def struct_diffs(old: tuple, new: tuple, limit: int = 3) -> list:
    (oa, ok, og), (na, nk, ng) = old, new
    out: list = []
    if len(oa) != len(na):
        out.append(f"number of positional arguments: {len(oa)} → {len(na)}")
    else:
        for i, (a, b) in enumerate(zip(oa, na)):
            _key_diffs(a, b, f"args[{i}]", out, limit)
    if tuple(k for k, _ in ok) != tuple(k for k, _ in nk):
        out.append(f"keyword arguments: {tuple(k for k, _ in ok)!r} → {tuple(k for k, _ in nk)!r}")
    else:
        for (k, a), (_, b) in zip(ok, nk):
            _key_diffs(a, b, f"kwargs[{k!r}]", out, limit)
    out.extend(describe_diffs(GLOBAL_LABELS, og, ng, limit))
    return out[:limit]


def describe_struct_diff(old_key, args, kwargs) -> str:
    diffs = struct_diffs(old_key, struct_key(args, kwargs))
    return "; ".join(diffs) if diffs else "the inputs' structure differs from the bound one"
