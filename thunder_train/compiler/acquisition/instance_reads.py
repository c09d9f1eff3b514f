"""What the function reads from the state walked modules hold: private scalars and plain containers guarded by
value, other objects by identity and, where read, their own attributes in turn.

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
could change them.

Other objects a module holds (a configuration object, an activation function, an enum member) are keyed by identity:
replaced, the program is traced again.  A held object of a user's class (``_watchable``: a transformers config, a
dataclass, a ``SimpleNamespace``) that the function reads is watched in turn, from that first read on: its plain
attributes and held objects get stand-ins on its class the same way, so ``self.config.pad_token_id = 3`` or
``self.cfg.mode = "b"`` between calls is seen, at any depth the function reads.  A plain default its class defines
for the name (a dataclass field's) is kept behind the stand-in and put back after; a name that takes no stand-in (a
``SimpleNamespace``'s: a built-in type; a method of that name on the class) is guarded whenever its object is.
Where no attribute read leads to an object (``_watch_value``), the way to it is guarded whenever its holder is: a
list's, tuple's or dict's items by ``held_key`` (objects by identity; the container itself by its contents, not its
identity), a ``__slots__`` object's members, a bound method's object, a partial's function and arguments (``Step``);
a small numpy array by its bytes.  Not seen: a read through ``vars(m)`` or ``m.__dict__``, the attributes of torch's
own objects: docs/captured_inputs.md.
The full path checks the keys in the prologue's guard key (compiler/prologue.py), thin mode on every call
(runtime/thin_checks.py).
"""
from __future__ import annotations

import abc
import functools
import sys
import threading
import types
import weakref

import torch

from ..errors import TracingError
from ..proxies import is_proxy
from . import library_objects, user_generators
from .class_attrs import user_class

SCALAR_TYPES = (int, float, bool, complex, str, type(None), torch.dtype, torch.device, type(Ellipsis))
# What nn.Module itself keeps in every instance's __dict__ (registries, hooks, ``training``): guarded by their own
# checks (structure, hook_guard.py), and rewritten by torch's own bookkeeping.
MODULE_OWN = frozenset(torch.nn.Module().__dict__)


@functools.cache
def optimizer_own() -> frozenset:
    """What torch.optim.Optimizer keeps (``param_groups`` and ``state`` are walked; hooks are refused or guarded
    apart) and what an LR scheduler sets on it every step (``_opt_called``; its wrapper of ``step``): a custom
    optimizer's other attributes (Lookahead's step counter, a held config) are guarded where its step reads them.
    Made at the first walked optimizer: making one imports torch._dynamo, which importing thunder_train does not."""
    return frozenset(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]).__dict__) | {
        "param_groups", "state", "defaults", "_opt_called", "step", "_step_count"}
MAX_ITEMS = 64  # a container with more items (all levels) is not guarded by value
_MISSING = object()


class _NotPlain:
    """The key of a value that is not plain data: equal only to itself."""

    def __repr__(self):
        return "<not plain data>"


NOT_PLAIN = _NotPlain()


class Same:
    """The key of a held object: the object itself, compared by identity (the key keeps it alive)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return type(other) is Same and other.obj is self.obj

    def __hash__(self):
        return id(self.obj)

    def __repr__(self):
        return f"<the same {type(self.obj).__name__}>"


class Step:
    """A way into a held value other than an instance ``__dict__`` entry: ``contents`` (a list's, tuple's, dict's or
    set's items, a partial's function and arguments, keyed by ``held_key``: objects by identity), ``item``, ``arg``,
    ``kw`` (one of them, the way to an object's own attributes), ``slot`` (a ``__slots__`` member), ``self`` (a
    bound method's object)."""

    __slots__ = ("kind", "arg")
    _ORDER = {"contents": 0, "slot": 1, "self": 2, "item": 3, "arg": 4, "kw": 5}

    def __init__(self, kind, arg=None):
        self.kind, self.arg = kind, arg

    def __eq__(self, other):
        return type(other) is Step and (other.kind, other.arg) == (self.kind, self.arg)

    def __hash__(self):
        return hash((self.kind, self.arg))

    def __repr__(self):
        return f"Step({self.kind!r}, {self.arg!r})"

    def label(self) -> str:
        return {"contents": "", "item": f"[{self.arg!r}]", "slot": f".{self.arg}", "self": ".__self__",
                "arg": f".args[{self.arg}]", "kw": f".keywords[{self.arg!r}]"}[self.kind]

    def order(self):
        return (self._ORDER[self.kind], repr(self.arg))


CONTENTS, SELF = Step("contents"), Step("self")


def step_of(x, kind, arg=None):
    """What ``Step(kind, arg)`` reaches from ``x`` (guards), ``_MISSING`` where it reaches nothing."""
    try:
        if kind == "item":
            if isinstance(x, dict):
                return dict.get(x, arg, _MISSING)  # (no ``__missing__``: a defaultdict gains nothing)
            return x[arg] if isinstance(x, (list, tuple)) else _MISSING
        if kind == "slot":
            return object.__getattribute__(x, arg)
        if kind == "self":
            return x.__self__ if type(x) is types.MethodType else _MISSING
        if kind == "arg":
            return x.args[arg] if type(x) is functools.partial else _MISSING
        if kind == "kw":
            return x.keywords.get(arg, _MISSING) if type(x) is functools.partial else _MISSING
    except (LookupError, AttributeError, TypeError):
        return _MISSING
    return x  # (contents: the container itself, keyed by ``held_key``)


def _order(name):
    return (0, name) if type(name) is str else (1,) + name.order()


class Held:
    """What a module's guard checks of an object it holds: that it is still ``obj``, and ``attrs``,
    ``((name, key or Held), ...)``, what the function read from it (empty where another holder checks them)."""

    __slots__ = ("obj", "attrs")

    def __init__(self, obj, attrs):
        self.obj, self.attrs = obj, attrs

    def __repr__(self):
        return f"Held({type(self.obj).__name__}, {self.attrs!r})"


def attr_of(x, name):
    """``x.__dict__[name]``, or ``_MISSING`` where ``x`` has no such entry or no ``__dict__`` (guard keys).  The
    ``__dict__`` is read past the class's own ``__getattribute__`` (transformers' configs have one in Python: 2 us a
    read)."""
    try:
        d = object.__getattribute__(x, "__dict__")
    except AttributeError:
        return _MISSING
    return d.get(name, _MISSING) if type(d) is dict else _MISSING


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
    return _contents_key(v, objects=False)


class _TooLarge(Exception):
    pass


def held_key(v):
    """``plain_key`` where objects may be items: the key of a container's contents, its objects compared by identity
    (``Same``), at most ``MAX_ITEMS`` items; ``NOT_PLAIN`` for more."""
    return _contents_key(v, objects=True)


def _contents_key(v, objects):
    """``plain_key``'s nested case, and (``objects``) ``held_key``: containers' subclasses keyed by their name too
    (a named tuple, an OrderedDict), other objects by identity."""
    budget = [MAX_ITEMS]

    def key(x):
        t = type(x)
        if t in _SCALARS:
            return ("nan",) if t is float and x != x else x
        if not isinstance(x, _CONTAINERS):
            # Not guarded: a container of the trace's own values, or of weak references (bookkeeping: torch's RNNs
            # point theirs at the weights the forward finds, the trace's own while it runs).
            if not objects or is_proxy(x) or t is weakref.ref:
                raise _TooLarge
            if t is functools.partial:  # (its keywords are a dict, changed in place as any)
                return ("partial", Same(x.func), key(x.args), key(x.keywords))
            return _array_key(x) if _small_array(x) else Same(x)
        if not objects and t not in _CONTAINERS:
            raise _TooLarge  # (a container's subclass is not plain data)
        budget[0] -= len(x)
        if budget[0] < 0:
            raise _TooLarge
        if isinstance(x, (list, tuple)):  # (and their subclasses: a named tuple, torch.Size)
            return (t.__name__, tuple(key(y) for y in x))
        if isinstance(x, dict):  # (an OrderedDict)
            return (t.__name__, tuple((key(k), key(y)) for k, y in x.items()))
        return (t.__name__, frozenset(key(y) for y in x))

    try:
        return key(v)
    except (_TooLarge, TypeError):  # (TypeError: an unhashable key inside a set)
        return NOT_PLAIN


def by_contents(o) -> bool:
    """A container is checked by its contents, not its identity (a list rebuilt with the same items is the same); so
    is a small numpy array (changed in place, a read of it, ``float(self.table[0])``, reads a new value)."""
    return isinstance(o, _CONTAINERS) or type(o) is functools.partial or _small_array(o)


MAX_ARRAY_BYTES = 4096  # a numpy array a module holds, guarded by its bytes up to this size (by identity above)


def _small_array(x) -> bool:
    np = sys.modules.get("numpy")  # (not imported here: a held array means the user's code has)
    return np is not None and type(x) is np.ndarray and x.nbytes <= MAX_ARRAY_BYTES


def _array_key(x):
    return ("ndarray", x.dtype.str, x.shape, x.tobytes())


class Contents:
    """The key of a held container's items (``held_key``), checked by value."""

    __slots__ = ("key",)

    def __init__(self, key):
        self.key = key

    def __repr__(self):
        return f"Contents({self.key!r})"


class _Attr:
    """Stands in for one instance attribute name on a class while tracing: reads and writes go to the instance's
    ``__dict__``, as they would without it; a read is recorded by the innermost trace of the thread that reads (eager
    code in other threads runs unrecorded).  One stand-in per (class, name), shared by a trace and the traces nested
    in it (acquire.py ``TRACING_LOCK`` is re-entrant; ``_users`` counts them).  ``default``: the class's own value of
    the name it replaces (a dataclass field's default), put back by ``_Removal``."""

    __slots__ = ("cls", "name", "default")

    def __init__(self, cls, name, default=_MISSING):
        self.cls, self.name, self.default = cls, name, default

    def __get__(self, obj, owner=None):
        d = {} if obj is None else obj.__dict__
        if self.name not in d:
            if self.default is not _MISSING:
                return self.default
            # a base class's default (peft's ``merged_adapters = []`` on its base layer class)
            return self._inherited(obj, self.cls if owner is None else owner)
        v = d[self.name]
        watch = _tracing.get(threading.get_ident())
        if watch is not None:
            watch.read(obj, self.name, v)
        return v

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


def _install(cls, name, own_default=False):
    """Put the stand-in for ``name`` on ``cls``: True, False where it cannot be, None where the instance's
    ``__dict__`` entry is not what a read returns (a base class's property of that name wins over it).
    ``own_default``: a plain value the class itself has for the name (not a method or other descriptor) is kept by
    the stand-in (a module class's own attributes are class_attrs.py's: not replaced)."""
    with _lock:
        if (cls, name) not in _users:
            default = vars(cls).get(name, _MISSING)
            if default is not _MISSING and (not own_default or hasattr(type(default), "__get__")):
                return False  # (class_attrs.py watches a module class's own attributes)
            bases = (vars(c).get(name) for c in cls.__mro__[1:])
            if any(hasattr(type(d), "__set__") and not isinstance(d, _Attr) for d in bases):
                return None  # a base's property or other data descriptor wins over the instance's __dict__: left so
            try:
                type.__setattr__(cls, name, _Attr(cls, name, default))
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
            else:
                attr = self.cls.__dict__.get(self.name)
                if isinstance(attr, _Attr) and attr.default is not _MISSING:
                    type.__setattr__(self.cls, self.name, attr.default)
                elif isinstance(attr, _Attr):
                    type.__delattr__(self.cls, self.name)


class InstanceWatch:
    """The instance attributes of one trace: those of its walked modules keyed on ``watch``, of the objects they
    hold on their first read; reads recorded while the function runs (in its thread); ``guarded(m)``: what a
    module's guards add."""

    def __init__(self, walker):
        self.walker = walker
        self.keys: dict = {}  # id(module or held object) -> {name: key when watched}
        self.reads: dict = {}  # id(module or held object) -> names read
        self.always: dict = {}  # id(held object) -> names guarded with it (no stand-in: read unseen)
        self.objects: dict = {}  # id(held object) -> the object, watched since its first read
        self.where: dict = {}  # id(module or held object) -> where it is, for errors ("args[0].cfg")
        # id(held object) -> library_objects.Snapshot when watched; also in walker.walked_objects, so a failed trace
        # puts back whatever the function changed on it, as on a walked module
        self.snaps: dict = {}
        self.installed: set = set()  # (class, name) this trace uses
        self.emitted: set = set()  # ids of held objects whose attributes a guard already checks
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

    def _stand_in(self, cls, name, own_default=False):
        """``_install``'s answer, remembering what this trace gives back."""
        if (cls, name) in self.installed:
            return True
        done = _install(cls, name, own_default)
        if done:
            self.installed.add((cls, name))
            self.walker.swapped.append((_Removal(cls, name), None, None))
        return done

    def watch(self, m, where) -> None:
        """A walked module or optimizer: its attributes keyed now, guarded where the function reads them."""
        cls = type(m)
        if type(cls) not in (type, abc.ABCMeta):
            return
        if not self.started:
            self._start()
        self.where[id(m)] = where
        keys = {}
        optimizer = isinstance(m, torch.optim.Optimizer)
        own = optimizer_own() if optimizer else MODULE_OWN
        for name, v in m.__dict__.items():
            if name in own or (not optimizer and name[:1] != "_" and type(v) in _SCALARS):
                continue  # (a module's public scalars: guarded whether read or not, walker.module_snapshot)
            k = _key(v)
            if k is not NOT_PLAIN and self._stand_in(cls, name):
                keys[name] = k
        if keys:
            self.keys[id(m)] = keys

    def _watch_object(self, o, where) -> None:
        """A held object the function reads, from now on: its plain attributes and the objects it holds."""
        if id(o) in self.keys or id(o) in self.objects or not _watchable(o) or id(o) in self.walker.by_id:
            return  # (an object the walker walked is guarded by its own leaf)
        self.objects[id(o)] = o
        if len(self.objects) > MAX_OBJECTS:
            return  # read unseen past this many: only its identity is guarded
        self.where[id(o)] = where
        self._put_back_later(o, library_objects.snapshot(o))  # (_watchable: it has a __dict__)
        cls, keys, always = type(o), {}, set()
        for name, v in vars(o).items():
            k = _key(v)
            if k is NOT_PLAIN:
                continue
            done = self._stand_in(cls, name, own_default=True)
            if done is None:
                continue  # (a property of that name reads something else)
            keys[name] = k
            if not done:
                always.add(name)
        self.keys[id(o)] = keys
        if always:
            self.always[id(o)] = always

    def read(self, obj, name, value) -> None:
        k = self.keys.get(id(obj), {}).get(name, _MISSING)
        if k is _MISSING:
            return
        if type(k) is Same:
            if k.obj is not value:
                return  # an object the function put there itself before reading it
            self._watch_value(value, f"{self.where.get(id(obj), '?')}.{name}")
        self.reads.setdefault(id(obj), set()).add(name)

    def _watch_value(self, o, where) -> None:
        """A held value the function reads: an object of a user's class, and the ways to the objects it holds that no
        attribute read shows (a container's items, ``__slots__`` members, a bound method's object), watched from now on."""
        if id(o) in self.keys or id(o) in self.objects or id(o) in self.walker.by_id:
            return
        t = type(o)
        if user_generators.is_generator(o):  # (``self.rng.random()``: a draw is refused, user_generators.py)
            user_generators.note(self.walker.generators, o, where)
        elif _small_array(o):
            self._watch_all(o, where, {CONTENTS: Contents(_array_key(o))})
        elif isinstance(o, _CONTAINERS) or t is functools.partial:  # (a subclass too: an OrderedDict, a named tuple)
            contents = held_key(o)
            if contents is NOT_PLAIN:
                return  # (more than MAX_ITEMS items, or the trace's own values: not guarded)
            keys = {CONTENTS: Contents(contents)}
            for step, item in _ways_in(o):  # (the way to an object's own attributes)
                if type(_key(item)) is Same:
                    keys[step] = Same(item)
            self._watch_all(o, where, keys)
        elif t is types.MethodType:
            self._watch_all(o, where, {SELF: Same(o.__self__)})
        elif _watchable(o):
            self._watch_object(o, where)
        elif user_class(t) and not hasattr(o, "__dict__"):
            names = _slot_names(t)
            self._watch_all(o, where, {Step("slot", n): _key(v) for n in names
                                       if (v := step_of(o, "slot", n)) is not _MISSING and _key(v) is not NOT_PLAIN})
            if id(o) in self.where and names:  # (watched, not past MAX_OBJECTS; members to put back)
                self._put_back_later(o, library_objects.snapshot(o, names))

    def _put_back_later(self, o, snap) -> None:
        """``o``'s attributes as they are now: a failed trace puts back what the function changed on it (as on a
        walked module), a successful one refuses a traced tensor left there (``check_writes``)."""
        self.snaps[id(o)] = snap
        self.walker.walked_objects.append((None, o, snap))

    def _watch_all(self, o, where, keys) -> None:
        """``o`` watched by ``keys`` (``Step -> key``), all of them guarded whenever ``o`` is (no read of them is
        seen); the objects they hold watched in turn."""
        self.objects[id(o)] = o
        if len(self.objects) > MAX_OBJECTS:
            return
        self.where[id(o)] = where
        self.keys[id(o)] = keys
        self.always[id(o)] = set(keys)
        for step, k in keys.items():
            if type(k) is Same:
                self._watch_value(k.obj, where + step.label())

    def finish(self) -> None:
        """After the function ran (or failed): reads are no longer recorded (the outer trace's are again)."""
        if _tracing.get(self.thread) is self:
            if self.outer is None:
                del _tracing[self.thread]
            else:
                _tracing[self.thread] = self.outer

    def check_writes(self) -> None:
        """After the function ran: a traced tensor it put on an object a module holds (``self.stats.last =
        y.detach()``) would stay there as a placeholder, set once: put back, and an error naming it."""
        for i, snap in self.snaps.items():
            bad = library_objects.put_back_traced(snap)
            if bad:
                raise TracingError(
                    f"the function set {', '.join(f'{self.where[i]}.{b}' for b in sorted(bad))} (on a "
                    f"{type(self.objects[i]).__name__} the module holds) to a tensor it computed: a compiled function "
                    "runs its Python code once, while tracing, so the object would keep a placeholder and later calls "
                    "would not update it (it is left as it was). Return the tensor from the function instead, or keep "
                    "it in a registered buffer updated in place (buf.copy_(...)).")

    def set(self, _) -> None:
        """``InputWalker.restore``: reads are no longer recorded."""
        self.finish()

    def guarded(self, m) -> tuple:
        """``((name, key or Held), ...)``: the attributes of module ``m`` the function read, keyed as watched.  A
        held object's own attributes are checked under its first holder only (every holder checks its identity)."""
        return self._guards(m, frozenset())

    def _guards(self, obj, around) -> tuple:
        keys = self.keys.get(id(obj), {})
        out = []
        for name in sorted(self.reads.get(id(obj), set()) | self.always.get(id(obj), set()), key=_order):
            k = keys[name]
            if type(k) is Same:
                o, inner = k.obj, ()
                if id(o) not in self.emitted and id(o) not in around:
                    self.emitted.add(id(o))
                    inner = self._guards(o, around | {id(o)})
                if not inner and (type(name) is Step and name.kind in ("item", "self", "arg", "kw") or by_contents(o)):
                    continue  # (its identity is its holder's, the contents' or the method's; a container unwatched)
                k = Held(o, inner)
            out.append((name, k))
        return tuple(out)


MAX_OBJECTS = 1024  # held objects watched in one trace


def _key(v):
    """What a watched attribute is keyed by: ``plain_key`` for plain data, ``Same`` for another object, ``NOT_PLAIN``
    for what is not guarded here (tensors, containers of objects)."""
    t = type(v)
    if t in _SCALARS or t in _CONTAINERS:
        k = plain_key(v)
        if k is NOT_PLAIN and t in _CONTAINERS and held_key(v) is not NOT_PLAIN:
            return Same(v)  # (objects among its items: its contents watched where read, ``_watch_value``)
        return k
    if is_proxy(v):
        return NOT_PLAIN  # (a module's public tensors, inputs of their own)
    return Same(v)  # (a tensor held elsewhere is read as the program's constant: replaced, it is traced again)


_NOT_WATCHED = (type, types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType,
                functools.partial, torch.Tensor, torch.nn.Module, torch.optim.Optimizer)


def _ways_in(o):
    """``(Step, item)`` for each item of a list, tuple or dict (keyed by an int or a string) and each argument and
    keyword of a partial."""
    if isinstance(o, (list, tuple)):
        yield from ((Step("item", i), x) for i, x in enumerate(o))
    elif isinstance(o, dict):
        yield from ((Step("item", k), x) for k, x in o.items() if type(k) in (int, str))
    elif type(o) is functools.partial:
        yield from ((Step("arg", i), x) for i, x in enumerate(o.args))
        yield from ((Step("kw", k), x) for k, x in o.keywords.items())


def _slot_names(cls) -> list:
    """The ``__slots__`` members of ``cls`` and its bases."""
    names = []
    for c in cls.__mro__:
        slots = vars(c).get("__slots__", ())
        for n in (slots,) if type(slots) is str else slots:
            if n not in ("__dict__", "__weakref__") and n not in names:
                names.append(n)
    return names[:MAX_ITEMS]


def _watchable(o) -> bool:
    """An instance of a user's class with a ``__dict__`` (not a function, class, module or torch's own object)."""
    return (not isinstance(o, _NOT_WATCHED) and user_class(type(o))
            and type(getattr(o, "__dict__", None)) is dict)
