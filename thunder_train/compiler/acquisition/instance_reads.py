"""A walked module's private scalars and plain containers that the function reads: guarded by value.

The prologue guards a module's public Python scalars (``m.p = 0.2``) whether the function reads them or not
(walker.py ``module_snapshot``).  Private scalars (``self._scale``, peft's ``_disable_adapters``) and plain
containers, public or private (lists, tuples, dicts and sets of scalars: peft's ``merged_adapters`` and
``scaling``), are guarded where the function reads them: Lightning and other libraries assign private bookkeeping
every step, which must not retrace a step that never reads it, and a container changed in place
(``merged_adapters.append(name)``) is seen by no assignment hook.  Unguarded, a change between calls ran the
program traced for the old value: after peft's ``merge_adapter()`` the compiled forward added the adapter's
product a second time, silently.

While tracing, each such attribute name of a walked module's class is a data descriptor on the class (attribute
lookup prefers a data descriptor to the instance's ``__dict__``) that returns the instance's own value and records
the read; ``InputWalker.restore`` removes it.  The values are keyed (``plain_key``) when walked, before the function
could change them.  Not seen: a read through ``vars(m)`` or ``m.__dict__``, and other objects a module holds (a
configuration object), replaced or changed: docs/captured_inputs.md.  The full path checks the keys in the prologue's guard
key (compiler/prologue.py), thin mode on every call (runtime/thin_checks.py).
"""
from __future__ import annotations

import abc
import threading

import torch

SCALAR_TYPES = (int, float, bool, complex, str, type(None), torch.dtype, torch.device, type(Ellipsis))
# What nn.Module itself keeps in every instance's __dict__ (registries, hooks, ``training``): guarded by their own
# checks (structure, hook_guard.py), and rewritten by torch's own bookkeeping.
MODULE_OWN = frozenset(torch.nn.Module().__dict__)
MAX_ITEMS = 64  # a container with more items (all levels) is not guarded by value
_MISSING = object()


class _NotPlain:
    """The key of a value that is not plain data: equal only to itself."""

    def __repr__(self):
        return "<not plain data>"


NOT_PLAIN = _NotPlain()


_SCALARS = frozenset(SCALAR_TYPES)
_CONTAINERS = (list, tuple, dict, set, frozenset)


def plain_key(v):
    """A hashable key equal for equal plain values (scalars, and lists, tuples, dicts, sets of them, at most
    ``MAX_ITEMS`` items), ``NOT_PLAIN`` for anything else.  A NaN is keyed by a marker (it never equals itself)."""
    t = type(v)
    if t in _SCALARS:
        return ("nan",) if t is float and v != v else v
    if (t is tuple or t is list) and len(v) <= MAX_ITEMS and all(type(x) in _SCALARS and x == x for x in v):
        return (t.__name__, tuple(v))  # flat, no NaN: the common case (a LayerNorm's normalized_shape)
    return _nested_key(v)


def _nested_key(v):
    budget = [MAX_ITEMS]

    def key(x):
        t = type(x)
        if t in _SCALARS:
            return ("nan",) if t is float and x != x else x
        budget[0] -= len(x) if t in _CONTAINERS else 0
        if budget[0] < 0:
            raise _TooLarge
        if t is list or t is tuple:
            return (t.__name__, tuple(key(y) for y in x))
        if t is dict:
            return ("dict", tuple((key(k), key(y)) for k, y in x.items()))
        if t is set or t is frozenset:
            return (t.__name__, frozenset(key(y) for y in x))
        raise _TooLarge

    try:
        return key(v)
    except (_TooLarge, TypeError):  # (TypeError: an unhashable key inside a set)
        return NOT_PLAIN


class _TooLarge(Exception):
    pass


class _Attr:
    """Stands in for one instance attribute name on a class while tracing: reads and writes go to the instance's
    ``__dict__``, as they would without it; a read is recorded by the innermost trace of the thread that reads (eager
    code in other threads runs unrecorded).  One stand-in per (class, name), shared by a trace and the traces nested
    in it (acquire.py ``TRACING_LOCK`` is re-entrant; ``_users`` counts them)."""

    __slots__ = ("cls", "name")

    def __init__(self, cls, name):
        self.cls, self.name = cls, name

    def __get__(self, obj, owner=None):
        d = {} if obj is None else obj.__dict__
        if self.name not in d:  # the class's own default (peft's ``merged_adapters = []`` on its base layer class)
            return self._inherited(obj, self.cls if owner is None else owner)
        watch = _tracing.get(threading.get_ident())
        if watch is not None:
            watch.read(obj, self.name)
        return d[self.name]

    def _inherited(self, obj, owner):
        mro = owner.__mro__
        for c in mro[mro.index(self.cls) + 1:] if self.cls in mro else mro:
            if self.name in vars(c):
                v = vars(c)[self.name]
                return v.__get__(obj, owner) if hasattr(type(v), "__get__") else v
        raise AttributeError(self.name)  # nn.Module.__getattr__ looks in its registries next

    def __set__(self, obj, value):
        obj.__dict__[self.name] = value

    def __delete__(self, obj):
        try:
            del obj.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None


_lock = threading.Lock()
_users: dict = {}  # (class, name) -> how many traces use its stand-in now
_tracing: dict = {}  # thread id -> the InstanceWatch of the trace running in it


def _install(cls, name) -> bool:
    with _lock:
        if (cls, name) not in _users:
            if name in vars(cls):  # (the class's own attribute: class_attrs.py watches it)
                return False
            bases = (vars(c).get(name) for c in cls.__mro__[1:])
            if any(hasattr(type(d), "__set__") and not isinstance(d, _Attr) for d in bases):
                return False  # a base's property or other data descriptor wins over the instance's __dict__: left so
            try:
                type.__setattr__(cls, name, _Attr(cls, name))
            except (TypeError, AttributeError):
                return False
        _users[cls, name] = _users.get((cls, name), 0) + 1
        return True


class _Removal:
    """``InputWalker.restore`` target: gives up one use of a stand-in; the last takes it off its class."""

    def __init__(self, cls, name):
        self.cls, self.name = cls, name

    def set(self, _):
        with _lock:
            n = _users.pop((self.cls, self.name)) - 1
            if n:
                _users[self.cls, self.name] = n
            elif isinstance(self.cls.__dict__.get(self.name), _Attr):
                type.__delattr__(self.cls, self.name)


class InstanceWatch:
    """The instance attributes of one trace's walked modules: candidates keyed on ``watch``, reads recorded while
    the function runs (in its thread), and ``guarded(m)``: what a module's guards add."""

    def __init__(self, walker):
        self.walker = walker
        self.keys: dict = {}  # id(module) -> {name: key when walked}
        self.reads: dict = {}  # id(module) -> names read
        self.installed: set = set()  # (class, name) this trace uses
        self.thread = threading.get_ident()
        self.outer = None  # a trace that started this one (a compiled call inside a traced one)
        self.started = False

    def _start(self) -> None:
        """At the first module walked (inside the trace's ``try``): reads in this thread are recorded here, until
        ``InputWalker.restore`` calls ``set`` (``finish``), also when tracing fails."""
        self.started = True
        self.outer = _tracing.get(self.thread)
        _tracing[self.thread] = self
        self.walker.swapped.append((self, None, None))

    def watch(self, m) -> None:
        cls = type(m)
        if type(cls) not in (type, abc.ABCMeta):
            return
        if not self.started:
            self._start()
        keys = {}
        for name, v in m.__dict__.items():
            if name in MODULE_OWN or (name[:1] != "_" and type(v) in _SCALARS):
                continue  # (public scalars: guarded whether read or not, walker.module_snapshot)
            if type(v) not in _SCALARS and type(v) not in _CONTAINERS:
                continue
            k = plain_key(v)
            if k is NOT_PLAIN:
                continue
            if (cls, name) not in self.installed:
                if not _install(cls, name):
                    continue
                self.installed.add((cls, name))
                self.walker.swapped.append((_Removal(cls, name), None, None))
            keys[name] = k
        if keys:
            self.keys[id(m)] = keys

    def read(self, obj, name) -> None:
        if name in self.keys.get(id(obj), ()):
            self.reads.setdefault(id(obj), set()).add(name)

    def finish(self) -> None:
        """After the function ran (or failed): reads are no longer recorded (the outer trace's are again)."""
        if _tracing.get(self.thread) is self:
            if self.outer is None:
                del _tracing[self.thread]
            else:
                _tracing[self.thread] = self.outer

    def set(self, _) -> None:
        self.finish()

    def guarded(self, m) -> tuple:
        """``((name, key), ...)``: the attributes of module ``m`` the function read, keyed as walked."""
        keys = self.keys.get(id(m), {})
        return tuple((name, keys[name]) for name in sorted(self.reads.get(id(m), ())))
