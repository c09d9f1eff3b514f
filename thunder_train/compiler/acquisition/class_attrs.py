"""Class attributes the function reads: inputs, found while tracing.

``self.scale`` where ``scale`` is defined on the class (or a base class), ``Cfg.bias`` read from a class
the step captured, a class-level config object or tensor: eager reads the class's current value on
every call, so the compiled program must not freeze the one it saw while tracing.

While tracing, every data attribute of the classes of the walked objects (plain objects, modules,
dataclasses, ``__slots__`` objects) and of user classes the function captured is replaced by a
``_Read`` descriptor. A non-data descriptor, so an instance attribute of the same name still wins, as
in eager. The first read of ``name`` through a class ``C`` (``obj.name``, ``C.name``, ``super()``,
a ``@property`` reading it) walks the value like an argument under the root ``C.name``, whose
prologue expression is ``getattr(C, 'name')``: the lookup through the MRO is repeated on every call,
so a value changed on ``C``, or on a base class, or shadowed later on a subclass, is seen (full
mode retraces, thin mode re-validates). Only attributes that are read become inputs.

Not watched: methods, properties and other descriptors (their code runs while tracing, so what it
reads is traced through), nested classes, Python modules, dunder names, classes of ``torch``,
``thunder_train`` and ``builtins``, and classes with a metaclass other than ``type``/``ABCMeta``
(``Enum``: members are constants). Assigning a class attribute inside the function would happen
once, while tracing: an error (``finish``), and the class is left as it was.
"""
from __future__ import annotations

import abc
import threading
import types

import torch

from ..errors import TracingError
from .provenance import Step, name_from_path

_METACLASSES = (type, abc.ABCMeta)
_MISSING = object()


def user_class(cls) -> bool:
    """A class whose attributes are the user's state (not ``builtins``, ``torch`` or ``thunder_train``)."""
    mod = getattr(cls, "__module__", None) or ""
    return (cls is not object and type(cls) in _METACLASSES
            and not (mod == "builtins" or mod == "torch" or mod.startswith(("torch.", "thunder_train."))))


def _is_data(name, v) -> bool:
    if name[:2] == "__" and name[-2:] == "__":
        return False
    if isinstance(v, (type, types.ModuleType)):
        return False
    # Functions, properties, class/static methods, slots, cached_property: code that runs (and is traced) on access.
    return not hasattr(type(v), "__get__")


class _Read:
    """Stands in for a class attribute while tracing: a read walks the value as an input."""

    __slots__ = ("watch", "cls", "name", "value")

    def __init__(self, watch, cls, name, value):
        self.watch, self.cls, self.name, self.value = watch, cls, name, value

    def __get__(self, obj, owner=None):
        return self.watch.read(self, type(obj) if owner is None else owner)


class _ClassEntry:
    """``InputWalker.restore`` target: puts a class attribute back."""

    def __init__(self, cls, name):
        self.cls, self.name = cls, name

    def set(self, v):
        type.__setattr__(self.cls, self.name, v)


class ClassWatch:
    """The class attributes of one trace: installed on ``watch``, read as inputs, checked by ``finish``."""

    def __init__(self, walker):
        self.walker = walker
        self.installed: list = []  # _Read
        self.watched: set = set()  # ids of classes seen
        self.values: dict = {}  # (id(owner), name) -> the walked value the function reads
        self.active = True
        self.thread = threading.get_ident()

    def watch(self, cls) -> None:
        for c in getattr(cls, "__mro__", ()):
            if id(c) in self.watched:
                continue
            self.watched.add(id(c))
            if not user_class(c):
                continue
            for name, v in list(vars(c).items()):
                if not _is_data(name, v):
                    continue
                r = _Read(self, c, name, v)
                try:
                    type.__setattr__(c, name, r)
                except (TypeError, AttributeError):
                    continue
                self.installed.append(r)
                self.walker.swapped.append((_ClassEntry(c, name), None, v))

    def read(self, r, owner):
        if not self.active or threading.get_ident() != self.thread:
            return r.value
        key = (id(owner), r.name)
        got = self.values.get(key)
        if got is not None:
            return got[1]
        path = (Step("classattr", (owner.__qualname__, r.name), ref=owner),)
        with torch._C.DisableTorchFunction():  # the read happens inside the traced code: walk real tensors as such
            new = self.walker.walk(r.value, path, name_from_path(path))
        self.values[key] = (owner, new)
        return new

    def finish(self) -> None:
        """After the function ran: reads return the real values again; a class attribute it assigned is an error."""
        self.active = False
        for r in self.installed:
            if r.cls.__dict__.get(r.name, _MISSING) is not r:
                raise TracingError(
                    f"the function assigned or deleted the class attribute {r.cls.__qualname__}.{r.name}: a compiled "
                    "function runs its Python code once, while tracing, so the change would not happen on later calls "
                    "(the class is left as it was). Set it outside the compiled function, or keep the value in a tensor "
                    "updated in place."
                )
