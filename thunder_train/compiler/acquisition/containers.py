"""Python containers and objects the function changes: replayed by the epilogue on every call.

The walker hands the function copies of the lists, dicts and dataclasses it receives (their
tensors are proxies), and runs it with a plain object's ``__dict__`` swapped for a copy.  So a
change the function makes — ``log.append(loss)``, ``d['n'] = d['n'] + 1``, ``metrics.update(...)``,
``state.step += 1`` — lands in the copy while tracing.  Afterwards every copy is compared with
what it held when the function started, and each change becomes lines of the epilogue
(``compiler/acquisition/epilogue.py``) that give the real object of *this* call (found by the prologue
like any input) the same final contents, with the real tensors the computation returns:

    log[0:] = [extras[0]]
    d['n'] = 1

A value the epilogue cannot rebuild (an object of another type holding a traced tensor) and a
container reached twice and changed are errors that name it.
"""
from __future__ import annotations

import dataclasses
import math
import types

from ..errors import TracingError
from ..proxies import is_proxy
from ..pytree import holds
from .provenance import name_from_path


@dataclasses.dataclass
class Tracked:
    """A copy the function worked on, and how to find the real object again."""

    leaf: object  # provenance.Leaf of the real object
    copy: object  # what the function saw (and possibly changed)
    initial: object  # its contents when the function started (list items / dict items / attribute dict)
    kind: str  # "list", "dict", "dataclass", "namespace" (a walked plain object), "object" (checked by identity)


def slot_descriptors(cls) -> dict:
    """``{name: member descriptor}`` of the slots the Python classes in ``cls.__mro__`` declare (``__slots__``)."""
    out = {}
    for c in reversed(getattr(cls, "__mro__", ())):
        if "__slots__" in vars(c):
            for k, v in vars(c).items():
                if type(v) is types.MemberDescriptorType:
                    out[k] = v
    return out


def attrs_of(obj) -> dict:
    """Instance attributes (``__dict__``), filled slots, and dataclass fields of slotted dataclasses."""
    d = dict(getattr(obj, "__dict__", {}))
    for k, desc in slot_descriptors(type(obj)).items():
        if k not in d:
            try:
                d[k] = desc.__get__(obj, type(obj))
            except AttributeError:
                pass
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            if f.name not in d and hasattr(obj, f.name):
                d[f.name] = getattr(obj, f.name)
    return d


_MISSING = object()


def _changed(t: Tracked) -> bool:
    if t.kind == "list":
        now = list(t.copy)
        return len(now) != len(t.initial) or any(a is not b for a, b in zip(now, t.initial))
    now = list(t.copy.items()) if t.kind == "dict" else list(attrs_of(t.copy).items())
    return len(now) != len(t.initial) or any(a[0] != b[0] or a[1] is not b[1] for a, b in zip(now, t.initial))


def mutated(tracked) -> list:
    """The tracked copies the function changed (after checking that none is reached twice)."""
    out = [t for t in tracked if _changed(t)]
    by_original: dict = {}
    for t in tracked:
        by_original.setdefault(id(t.leaf.value), []).append(t)
    for t in out:
        twins = [o for o in by_original[id(t.leaf.value)] if o is not t and o.copy is not t.copy]
        if twins:
            raise TracingError(
                f"the function changed {t.leaf.where}, which is the same {type(t.leaf.value).__name__} as "
                f"{twins[0].leaf.where}: a container reached twice and changed inside a compiled function is not "
                "supported (each path saw its own copy while tracing). Pass it once."
            )
    return out


class _Renderer:
    """Python source for a value of the traced call, as the epilogue rebuilds it on every call."""

    def __init__(self, names, extra, copy_leaf):
        self.names, self.extra, self.copy_leaf = names, extra, copy_leaf

    def target(self, leaf) -> str:
        return self.names(leaf.value, name_from_path(leaf.path, "obj"), leaf)

    def __call__(self, v, where: str, depth: int = 0) -> str:
        if depth > 32:
            raise TracingError(f"{where}: the value the function stored is nested too deeply to replay")
        leaf = self.copy_leaf.get(id(v))
        if leaf is not None:  # an input container (or its copy): the real object of this call
            return self.target(leaf)
        if is_proxy(v):
            return self.extra(v)
        t = type(v)
        if v is None or t in (bool, int, str) or (t is float and math.isfinite(v)):
            return repr(v)
        if t is list:
            return "[" + ", ".join(self(x, where, depth + 1) for x in v) + "]"
        if t is tuple:
            return "(" + "".join(self(x, where, depth + 1) + ", " for x in v) + ")"
        if t is dict:
            return "{" + ", ".join(f"{self(k, where, depth + 1)}: {self(x, where, depth + 1)}" for k, x in v.items()) + "}"
        if isinstance(v, tuple) and hasattr(t, "_fields"):
            return f"{self.names(t, t.__name__)}(" + ", ".join(self(x, where, depth + 1) for x in v) + ")"
        if dataclasses.is_dataclass(v) and not isinstance(v, type) and not isinstance(v, types.FunctionType):
            fields = ", ".join(f"{f.name}={self(getattr(v, f.name), where, depth + 1)}"
                               for f in dataclasses.fields(v) if f.init)
            if holds(v, is_proxy):
                return f"{self.names(t, t.__name__)}({fields})"
        if holds(v, is_proxy):
            raise TracingError(
                f"{where}: the function stored a {t.__name__} holding a tensor computed inside the compiled function; "
                "the epilogue can rebuild lists, tuples, dicts, named tuples and dataclasses of tensors and Python "
                "values. Store one of those, or return the value and store it outside."
            )
        return self.names(v, "value")  # a Python object the trace specialised on (same on every call)


def replay_lines(changed, names, extra, copy_leaf) -> list:
    """Epilogue lines that give each changed container's real object its final contents.

    Attribute changes of walked plain objects (``namespace``) are replayed; of objects the walker checks by
    identity only (nested too deep) refused.
    """
    render = _Renderer(names, extra, copy_leaf)
    lines = []
    for t in changed:
        where = t.leaf.where
        if t.kind == "object":
            now, before = attrs_of(t.copy), dict(t.initial)
            key = next((k for k, v in now.items() if before.get(k, _MISSING) is not v), None)
            key = key if key is not None else next(k for k in before if k not in now)
            raise TracingError(
                f"the function sets {where}.{key} on a {type(t.leaf.value).__name__} object nested too deeply in plain "
                "objects to be walked: the change would happen once, while tracing. Pass the object as an argument, "
                "or return the value and set it outside."
            )
        tgt = render.target(t.leaf)
        if t.kind == "list":
            now, before = list(t.copy), t.initial
            i = 0
            while i < min(len(now), len(before)) and now[i] is before[i]:
                i += 1
            if i == len(now):
                lines.append(f"  del {tgt}[{i}:]")
            else:
                items = ", ".join(render(v, f"{where}[{j}]") for j, v in enumerate(now[i:], i))
                lines.append(f"  {tgt}[{i}:] = [{items}]")
            continue
        if t.kind == "dict":
            now, before = dict(t.copy), dict(t.initial)
            key = lambda k: render(k, where)  # noqa: E731
            surviving = [k for k in before if k in now]
            if list(now) != surviving + [k for k in now if k not in before]:  # reordered: rebuild
                items = ", ".join(f"{key(k)}: {render(v, f'{where}[{k!r}]')}" for k, v in now.items())
                lines += [f"  {tgt}.clear()", f"  {tgt}.update({{{items}}})"]
                continue
            lines += [f"  del {tgt}[{key(k)}]" for k in before if k not in now]
            lines += [f"  {tgt}[{key(k)}] = {render(v, f'{where}[{k!r}]')}"
                      for k, v in now.items() if before.get(k, _MISSING) is not v]
            continue
        now, before = attrs_of(t.copy), dict(t.initial)
        for k in before:
            if k not in now:
                lines.append(f"  delattr({tgt}, {k!r})")
        for k, v in now.items():
            if before.get(k, _MISSING) is not v:
                lines.append(f"  setattr({tgt}, {k!r}, {render(v, f'{where}.{k}')})")
    return lines


def mutated_paths(changed) -> list:
    """Provenance paths of the containers the epilogue changes (a retrace on every call is reported with them)."""
    return [t.leaf.path for t in changed]
