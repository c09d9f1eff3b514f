"""Globals and closure cells the function reads: inputs, found from its code.

A training step written ``def step(batch): loss = model(batch).loss; ...`` reads
``model`` and ``opt`` from its module's globals or from closure cells.  They are
inputs like arguments: walked, guarded and bound, each under a root path
``globals['model']`` or ``closure['opt']`` that the prologue reads again on
every call, so rebinding the name is seen.

The rule (``docs/captured_inputs.md``):

* the compiled function's own reads: every ``LOAD_GLOBAL``/``LOAD_NAME`` in its code
  and in the code nested in it (inner functions, lambdas, comprehensions) that names
  a key of its ``__globals__``, and every cell of its ``__closure__``;
* recursively the same for every plain Python function among those values (also the
  ``func`` of a ``functools.partial``) that is defined in the same module as the step or
  in another file of the user's own code, outside the standard library and site-packages
  (helpers: ``def loss_fn(...)`` next to the step, ``from utils import loss_fn``), and the
  attributes read from a module of the user's code (``utils.loss_fn``, ``cfg_module.lr``);
* the same for the user's own module classes among the walked modules (``Scanner.module_class``):
  their ``forward``, the methods and properties of the class it names, in turn, the functions
  a module holds (closures: ``self.act = make_act(cfg)``) and the methods of the user's classes
  whose objects it holds (``Scanner.object_class``: ``self.helper.run(y)``), or the function reaches otherwise
  (an argument, a captured ``trainer``, the object of a compiled bound method or callable object);
* the user's methods and properties found so (``Scanner.methods``) are guarded too, as their classes give them
  (``Scanner.guarded_methods``): ``Block.helper = f`` after the first call retraces, as eager runs the new one;
* not captured: Python modules (``torch``, ``F``, ``math``: rebinding one is not a
  thing training code does), builtins, what library code reads (installed packages,
  the standard library), and the globals of methods reached through objects more than three
  deep. A tensor such code reads is still an input, passed by reference (in-place
  changes are seen), but rebinding that name is not detected.
* thunder_train's own wrappers (``tt.compile(module)``, ThunderCallback's programs) are
  transparent: their cells and globals are not inputs, the user functions they wrap are
  scanned by the rule above.

Writing a captured name inside the function (``global n; n += 1``, ``nonlocal``) would
happen once, while tracing: it is an error that says so.
"""
from __future__ import annotations

import dataclasses
import dis
import functools
import inspect
import os
import site
import sysconfig
import types
from typing import Any

from ..errors import TracingError
from .provenance import Step

_INTERNAL = "thunder_train."


@dataclasses.dataclass
class Root:
    step: Step  # Step("global", name, ref=globals) or Step("closure", (owner, name), ref=cell)
    value: Any

    def set(self, value) -> None:
        """Make the function read ``value`` (while tracing: its proxies)."""
        kind, ref, key = self.step.kind, self.step.ref, self.step.key
        if kind == "global":
            ref[key] = value
        elif kind == "modattr":
            ref[key[1]] = value
        elif kind == "closure":
            ref.cell_contents = value
        elif kind == "default" and key[0] == "pos":
            d = list(ref.__defaults__)
            d[key[1]] = value
            ref.__defaults__ = tuple(d)
        elif kind == "default":
            ref.__kwdefaults__ = {**ref.__kwdefaults__, key[1]: value}
        else:
            raise AssertionError(f"cannot rebind {kind}")  # "self": walked in place (a module or plain object)


def _code_names(code, loads: set, stores: set, module_attrs: set, free_stores: set | None = None) -> None:
    """The global names ``code`` and the functions defined in it read and write, the attributes of globals they read,
    and (``free_stores``) the names among ``code.co_freevars`` it assigns (``nonlocal x; x = ...``): one pass over
    its instructions."""
    prev = None
    free = set(code.co_freevars) if free_stores is not None else ()
    for ins in dis.get_instructions(code):
        if ins.opname in ("STORE_DEREF", "DELETE_DEREF") and ins.argval in free:
            free_stores.add(ins.argval)
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            loads.add(ins.argval)
        elif ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            stores.add(ins.argval)
        elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and prev is not None and prev.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            module_attrs.add((prev.argval, ins.argval))  # utils.loss_fn: an attribute of a global (a module?)
        prev = ins
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _code_names(c, loads, stores, module_attrs)


def _user_module(m) -> bool:
    """A Python module of the user's own code (``import utils``): its attributes the function reads are captured."""
    f = getattr(m, "__file__", None)
    return bool(f) and _user_file(f) and not (m.__name__ + ".").startswith(_INTERNAL)


def _function_of(fn):
    """The plain function behind ``fn`` (bound methods, ``functools.wraps`` wrappers stay as they are)."""
    if isinstance(fn, types.MethodType):
        fn = fn.__func__
    return fn if isinstance(fn, types.FunctionType) else None


def _library_dirs() -> tuple:
    paths = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths |= set(getattr(site, "getsitepackages", lambda: [])()) | {getattr(site, "USER_SITE", None)}
    return tuple(os.path.realpath(p) + os.sep for p in paths if p)


_LIBRARY_DIRS = _library_dirs()


@functools.lru_cache(maxsize=1024)
def _user_file(filename: str) -> bool:
    """Source outside the standard library and site-packages (the user's project), or typed in (``<stdin>``)."""
    return filename.startswith("<") or not os.path.realpath(filename).startswith(_LIBRARY_DIRS)


def _user_code(fn) -> bool:
    return _user_file(fn.__code__.co_filename)


_INTERNAL_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))) + os.sep


def _is_internal(fn) -> bool:
    """thunder_train's own code, also behind ``functools.wraps`` (which copies the user's ``__module__``: the
    callback's patched ``training_step``)."""
    if (getattr(fn, "__module__", None) or "").startswith(_INTERNAL):
        return True
    code = getattr(fn, "__code__", None)
    return code is not None and os.path.realpath(code.co_filename).startswith(_INTERNAL_DIR)


def default_roots(fn, args, kwargs) -> list:
    """The default values ``fn`` uses in this call (parameters the call does not pass): inputs read from
    ``fn.__defaults__``/``__kwdefaults__`` on every call, so replacing them, or changing a tensor default in place,
    is seen."""
    f = _function_of(fn)
    if f is None or _is_internal(f) or not (f.__defaults__ or f.__kwdefaults__):
        return []
    try:
        sig = inspect.signature(fn)
        passed = sig.bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return []
    code = f.__code__
    positional = code.co_varnames[:code.co_argcount]
    first = len(positional) - len(f.__defaults__ or ())
    roots = []
    for i, name in enumerate(positional[first:]):
        if name not in passed:
            roots.append(Root(Step("default", ("pos", i, name), ref=f), f.__defaults__[i]))
    for name, v in (f.__kwdefaults__ or {}).items():
        if name not in passed:
            roots.append(Root(Step("default", ("kw", name), ref=f), v))
    return roots


def self_root(fn) -> list:
    """``tt.compile(obj.step)``: ``obj`` is an input (a plain object's attributes, a module's parameters)."""
    if isinstance(fn, types.MethodType) and not _is_internal(fn.__func__) and not inspect.isclass(fn.__self__):
        return [Root(Step("self", None, ref=fn), fn.__self__)]
    if (not isinstance(fn, (types.FunctionType, types.BuiltinFunctionType, functools.partial, type)) and not _is_internal(fn)
            and type(getattr(fn, "__dict__", None)) is dict and not (type(fn).__module__ or "").startswith("torch")):
        # tt.compile(obj) of a callable object (a class with __call__): obj is read as it is on every call.
        return [Root(Step("self", "object", ref=fn), fn)]
    return []


class Scanner:
    """The globals and closure cells of the functions scanned so far (``roots``, in a deterministic order): the
    compiled function's, by the rule above, and (``scan_module_class``) those of the user's own module classes."""

    def __init__(self):
        self.roots: list = []
        self.seen_fns: set = set()
        self.seen_roots: set = set()
        self.seen_classes: set = set()
        self.names: set = set()  # every name the scanned methods use (``self.helper.run``: ``helper``, ``run``)
        self.home = None  # the step's module: the first user function's __module__
        self.step_names: set = set()  # the names the compiled function and the helpers it calls use (``m.helper(x)``)
        # class -> the names of the user's methods and properties on it that the scanned code may call: the trace ran
        # what they were, so ``Cls.helper = f`` after the first call must be seen (``guarded_methods``).
        self.methods: dict = {}

    def function(self, fn) -> list:
        """The roots ``fn`` adds."""
        target = fn.func if isinstance(fn, functools.partial) else fn
        if inspect.isclass(target):
            return []
        n = len(self.roots)
        self._scan(target, None)
        return self.roots[n:]

    def module_class(self, cls) -> list:
        """The roots a walked module's class adds: what its ``forward`` reads, and the methods and properties of the
        class that it (and they) name, where they are the user's own code (a model file's ``SCALE`` or ``CFG``, a
        helper it calls).  A library's classes (torch.nn, transformers) read no captured names."""
        if cls in self.seen_classes:
            return []
        self.seen_classes.add(cls)
        return self._methods(cls, ["forward", *sorted(self.step_names)])

    def object_class(self, cls) -> list:
        """The roots the methods and properties of a user's class add, for an object a walked module holds
        (``self.helper.run(y)`` reading ``SCALE``) or the function reaches otherwise (``trainer.loss(x)``, the object
        of a compiled bound method or callable object): ``__call__`` and those the scanned code names (``run``), and
        those they name in turn, where they are the user's code."""
        if cls in self.seen_classes:
            return []
        self.seen_classes.add(cls)
        return self._methods(cls, ["__call__", *sorted(self.names | self.step_names)])

    def _methods(self, cls, todo) -> list:
        n, done = len(self.roots), set()
        while todo:
            name = todo.pop()
            if name in done:
                continue
            done.add(name)
            try:
                v = inspect.getattr_static(cls, name)
            except AttributeError:
                continue
            v = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v.fget if isinstance(v, property) else v
            if isinstance(v, types.FunctionType) and not _is_internal(v) and _user_code(v):
                if name != "forward":  # (a module class's forward: always in the guard, prologue.guard_specs)
                    self.methods.setdefault(cls, []).append(name)
                self._scan(v, v, method=True)
                used = _attribute_names(v.__code__)
                self.names |= used
                todo.extend(sorted(used))  # (roots in a deterministic order)
        return self.roots[n:]

    def guarded_methods(self) -> tuple:
        """``(class, ((name, value), ...))`` of the user's methods and properties the scanned code may call, as each
        class gives them now (``getattr(cls, name)``: a function, a property, a class method bound to the class): the
        guard compares them on every call (compiler/prologue.py)."""
        return tuple((cls, tuple((n, getattr(cls, n, None)) for n in sorted(set(names))))
                     for cls, names in sorted(self.methods.items(), key=lambda kv: (kv[0].__module__, kv[0].__qualname__)))

    def held_function(self, f) -> list:
        """The roots a function a walked module holds adds (``self.act = make_act(cfg)``: its closure cells and
        globals), where it is the user's own code."""
        f = _function_of(f.func if isinstance(f, functools.partial) else f)
        if f is None or _is_internal(f) or not _user_code(f):
            return []
        n = len(self.roots)
        self._scan(f, f, method=True)
        self.names |= _attribute_names(f.__code__)  # (``self.forward = lambda x: self.post.run(x)``: ``run``)
        return self.roots[n:]

    def _scan(self, f, owner, method=False):
        f = _function_of(f)
        if f is None or id(f) in self.seen_fns:
            return
        self.seen_fns.add(id(f))
        code = f.__code__
        cells = dict(zip(code.co_freevars, f.__closure__ or ()))
        if _is_internal(f):
            # A wrapper of ours: follow the user functions it closes over, capture nothing of its own.
            for cell in cells.values():
                try:
                    v = cell.cell_contents
                except ValueError:
                    continue
                if _function_of(v) is not None:
                    self._scan(v, None)
            return
        if self.home is None and not method:
            self.home = f.__module__
        elif f.__module__ != self.home and not _user_code(f):
            return
        name = None if owner is None else f.__qualname__
        if not method:  # (the step, a helper it calls, a ThunderCallback's wrapped training_step: ``model.helper(x)``)
            self.step_names |= _attribute_names(code)
        loads, stores, module_attrs, free_stores = set(), set(), set(), set()
        _code_names(code, loads, stores, module_attrs, free_stores)
        for what, names in (("global", sorted(stores & set(f.__globals__))), ("nonlocal", sorted(free_stores))):
            if names:
                raise TracingError(
                    f"{f.__qualname__} assigns the {what} {names[0]!r}: a compiled function runs its Python code once, "
                    "while tracing, so the assignment would not happen on later calls. Return the value and assign it "
                    "outside the compiled function (or keep it in a tensor updated in place)."
                )
        g = f.__globals__
        found = []
        for n in sorted(loads):
            if n in g and not isinstance(g[n], types.ModuleType):
                found.append(Root(Step("global", n, ref=g), g[n]))
        for n, attr in sorted(module_attrs):
            m = g.get(n)
            if isinstance(m, types.ModuleType) and _user_module(m) and attr in vars(m) \
                    and not isinstance(vars(m)[attr], types.ModuleType):
                found.append(Root(Step("modattr", (m.__name__, attr), ref=vars(m)), vars(m)[attr]))
        for n in code.co_freevars:
            if method and n == "__class__":
                continue  # (``super()``'s cell: the method's own class)
            cell = cells[n]
            try:
                v = cell.cell_contents
            except ValueError:
                continue  # not assigned yet
            if not isinstance(v, types.ModuleType):
                found.append(Root(Step("closure", (name, n), ref=cell), v))
        for r in found:
            key = (r.step.kind, id(r.step.ref), r.step.key)
            if key in self.seen_roots:
                continue
            self.seen_roots.add(key)
            self.roots.append(r)
        for r in found:
            # A helper reached through functools.partial(loss_fn, model) is scanned like loss_fn itself.
            h = _function_of(r.value.func if isinstance(r.value, functools.partial) else r.value)
            if h is not None and not _is_internal(h) and (h.__module__ == self.home or _user_code(h)):
                self._scan(h, h)


def _attribute_names(code) -> set:
    """Every name ``code`` and the code nested in it use (attributes among them: ``self.helper``)."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _attribute_names(c)
    return names

