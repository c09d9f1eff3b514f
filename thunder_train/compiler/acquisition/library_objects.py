"""Attributes library code sets on its own objects while we trace: rolled back, never left holding proxies.

An object the walker does not walk (a ``torch.amp.GradScaler``, a scheduler, any object that is not a plain
user object) is an input by identity: the function runs on the real object.  Library code may set attributes
on it lazily on first use (``GradScaler.scale`` creates ``_scale`` and ``_growth_tracker``).  While tracing
those values are proxies: left there, every later use of the object, also in eager code, would fail.  So
each such object's ``__dict__`` is snapshotted when walked, and

* when tracing fails, every attribute it changed is put back (the object is exactly as before the call);
* when tracing succeeds but a changed attribute holds a traced tensor, it is put back and the call is
  refused with an error naming the attribute and how to initialise it outside.

Where the lazy initialisation is known and depends on no traced value, it is done for real before tracing
(``initialise``): ``GradScaler``'s scale tensor, which eager's first ``scaler.scale(loss)`` creates on the scaler's
device.  A failed trace puts it back too.

Changes to objects nested inside such an object (a dict it holds) are not snapshotted (docs/state_audit.md).
"""
from __future__ import annotations

import torch

from ..errors import TracingError
from ..proxies import is_proxy
from ..pytree import holds
from .provenance import path_str

_MISSING = object()


def snapshot(obj):
    """The object's attribute dict now (None if it has none to snapshot)."""
    d = getattr(obj, "__dict__", None)
    return dict(d) if type(d) is dict else None


def _init_grad_scaler(scaler) -> None:
    if getattr(scaler, "_enabled", False) and getattr(scaler, "_scale", 0) is None:
        scaler._lazy_init_scale_growth_tracker(torch.device(scaler._device))  # what eager's first scale() does


_LAZY_INIT = {torch.amp.GradScaler: _init_grad_scaler}


def initialise(obj) -> None:
    """Do now the lazy initialisation library code would do on first use inside the function (known cases)."""
    for cls, init in _LAZY_INIT.items():
        if isinstance(obj, cls):
            init(obj)


def _changes(obj, before) -> list:
    d = obj.__dict__
    return [k for k in set(d) | set(before) if d.get(k, _MISSING) is not before.get(k, _MISSING)]


def _put_back(obj, before, keys) -> None:
    d = obj.__dict__
    for k in keys:
        if k in before:
            d[k] = before[k]
        else:
            d.pop(k, None)


def rollback(objects) -> None:
    """After a failed trace: every attribute changed on these objects is put back."""
    for _, obj, before in objects:
        _put_back(obj, before, _changes(obj, before))


def check(objects) -> None:
    """After a successful trace: an attribute now holding a traced tensor is put back and refused."""
    for path, obj, before in objects:
        bad = sorted(k for k in _changes(obj, before) if holds(obj.__dict__.get(k), is_proxy))
        if not bad:
            continue
        _put_back(obj, before, bad)
        name = type(obj).__name__
        raise TracingError(
            f"{path_str(path)} ({name}): {', '.join(bad)} {'was' if len(bad) == 1 else 'were'} set inside the compiled "
            f"function to a value computed there, a tensor or a traced number (library code initialising {name} lazily on first use). The compiled "
            f"program would not set it again, and the object would hold a placeholder; it has been put back. Initialise "
            f"it outside, before the first compiled call (one eager call of the same method does it).")
