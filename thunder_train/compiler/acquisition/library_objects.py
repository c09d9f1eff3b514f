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

Objects a module holds that the function reads are snapshotted too (``instance_reads.py``), a ``__slots__`` object's
members through ``SlotMembers``.  Walked modules and optimizers are snapshotted too (``InputWalker.walked_objects``),
for the rollback only: what the function or library code set on them (``self.calls += 1``, an LR scheduler's ``_opt_called``) is put back when
tracing fails; on success module writes are settled by ``module_writes.py``.

Containers the object holds (a dict of per-optimizer states, a list of learning rates), and the containers
inside those, down to ``_DEPTH`` levels, are snapshotted the same way: a key added to a ``defaultdict`` or a
traced tensor stored in a nested dict is rolled back or refused as well.  Objects nested inside are not
walked (each is an input of its own, or reached by library code only).
"""
from __future__ import annotations

import collections.abc

import torch

from ..errors import TracingError
from ..proxies import is_proxy
from ..pytree import holds
from .provenance import path_str

_MISSING = object()
_DEPTH = 3  # GradScaler: __dict__ -> _per_optimizer_states -> one optimizer's entry -> found_inf_per_device


class Snapshot:
    """Each container reachable from an object's ``__dict__`` through dicts and lists, with its items then."""

    def __init__(self, attrs: dict):
        self.attrs = attrs
        self.saved: list = []  # (container, its items when taken); the attribute dict first
        self._take(attrs, 0, set())

    def _take(self, container, depth, seen) -> None:
        if id(container) in seen or depth > _DEPTH:
            return
        seen.add(id(container))
        items = dict(container) if isinstance(container, _MAPPINGS) else list(container)
        self.saved.append((container, items))
        for v in (items.values() if isinstance(items, dict) else items):
            if isinstance(v, (dict, list)):
                self._take(v, depth + 1, seen)

    def changed(self) -> list:
        """(container, its items when taken, keys changed since) for every container that changed."""
        out = []
        for c, before in self.saved:
            if isinstance(c, _MAPPINGS):
                keys = [k for k in set(c) | set(before) if c.get(k, _MISSING) is not before.get(k, _MISSING)]
            else:
                same = len(c) == len(before) and all(a is b for a, b in zip(c, before))
                keys = [] if same else [slice(None)]
            if keys:
                out.append((c, before, keys))
        return out


def _put_back(container, before, keys) -> None:
    if not isinstance(container, _MAPPINGS):
        container[:] = before
        return
    for k in keys:
        if k in before:
            container[k] = before[k]
        else:
            container.pop(k, None)


class SlotMembers(collections.abc.MutableMapping):
    """The filled ``__slots__`` members of an object that has no ``__dict__``, as a mapping a ``Snapshot`` takes
    (written past the class's ``__setattr__``: a frozen dataclass's members are put back too)."""

    def __init__(self, obj, names):
        self.obj, self.names = obj, names

    def __getitem__(self, name):
        try:
            return object.__getattribute__(self.obj, name)
        except AttributeError:
            raise KeyError(name) from None

    def __setitem__(self, name, value):
        object.__setattr__(self.obj, name, value)

    def __delitem__(self, name):
        try:
            object.__delattr__(self.obj, name)
        except AttributeError:
            raise KeyError(name) from None

    def __iter__(self):
        return (n for n in self.names if self.get(n, _MISSING) is not _MISSING)

    def __len__(self):
        return sum(1 for _ in self)


_MAPPINGS = (dict, SlotMembers)  # what a Snapshot reads by key (other containers: as lists)


def snapshot(obj, slots=()):
    """A snapshot of the object's attributes and the containers they hold: its ``__dict__``, or the ``slots`` named
    where it has none (None where it has neither)."""
    d = getattr(obj, "__dict__", None)
    if type(d) is dict:
        return Snapshot(d)
    return Snapshot(SlotMembers(obj, slots)) if slots else None


def _init_grad_scaler(scaler) -> None:
    if getattr(scaler, "_enabled", False) and getattr(scaler, "_scale", 0) is None:
        scaler._lazy_init_scale_growth_tracker(torch.device(scaler._device))  # what eager's first scale() does


_LAZY_INIT = {torch.amp.GradScaler: _init_grad_scaler}


def initialise(obj) -> None:
    """Do now the lazy initialisation library code would do on first use inside the function (known cases)."""
    for cls, init in _LAZY_INIT.items():
        if isinstance(obj, cls):
            init(obj)


def rollback(objects) -> None:
    """After a failed trace: every attribute and container entry changed on these objects is put back."""
    for _, _, snap in objects:
        if snap is None:
            continue
        for container, before, keys in snap.changed():
            _put_back(container, before, keys)


def _held(container, keys) -> list:
    if isinstance(container, _MAPPINGS):
        return [k for k in keys if holds(container.get(k), is_proxy)]
    return keys if holds(list(container), is_proxy) else []


def put_back_traced(snap) -> list:
    """The attributes and container entries changed since ``snap`` that hold a traced value, put back: their names
    (``str(attribute)``, or ``"an entry of a container it holds (key)"``)."""
    bad = []
    for container, before, keys in snap.changed():
        held = _held(container, keys)
        if held:
            _put_back(container, before, held)
            bad += [str(k) if container is snap.attrs else f"an entry of a container it holds ({k!r})" for k in held]
    return bad


def check(objects) -> None:
    """After a successful trace: an attribute or container entry holding a traced value is put back and refused."""
    for path, obj, snap in objects:
        bad = put_back_traced(snap)
        if not bad:
            continue
        name = type(obj).__name__
        raise TracingError(
            f"{path_str(path)} ({name}): {', '.join(sorted(bad))} {'was' if len(bad) == 1 else 'were'} set inside the "
            f"compiled function to a value computed there, a tensor or a traced number (library code initialising {name} "
            f"lazily on first use). The compiled program would not set it again, and the object would hold a "
            f"placeholder; it has been put back. Initialise it outside, before the first compiled call (one eager call "
            f"of the same method does it).")
