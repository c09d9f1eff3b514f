"""Provenance: how the prologue finds an input leaf again.

Every leaf the walker records carries a path of ``Step``s from a root: an
argument, a keyword argument, a global or closure cell the function reads
(``captured.py``), or a tensor reached some other way and passed by reference.  ``path_expr`` is the
Python expression the prologue evaluates; ``path_str`` is how errors and
prologue comments print it (``args[0].fc1.weight``).
"""
from __future__ import annotations

import dataclasses
from typing import Any


# ---------------------------------------------------------------------------
# Provenance: how the prologue finds a leaf again
# ---------------------------------------------------------------------------
# Roots read from the function rather than from the call's arguments (captured.py): the prologue reads them
# again on every call; thin mode re-validates (not raises) when one changed.
# "classattr": a class attribute the function read (class_attrs.py), looked up on the class again every call.
# "modattr": an attribute of a module of the user's code the function read (``utils.loss_fn``), from its globals dict.
CAPTURED_ROOTS = ("global", "closure", "default", "self", "classattr", "modattr")


@dataclasses.dataclass(frozen=True)
class Step:
    kind: str  # "arg", "kwarg", "global", "closure", "const", "item", "key", "attr", "param", "buffer", "module", "optstate"
    key: Any
    # Roots "global"/"closure": the globals dict or the cell the value is read from; the prologue
    # refers to it by reference (base = its name there). Not part of the path's identity.
    ref: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)

    def expr(self, base: str) -> str:
        k = self.kind
        if k == "arg":
            return f"args[{self.key}]"
        if k == "kwarg":
            return f"kwargs[{self.key!r}]"
        if k == "global":
            return f"{base}[{self.key!r}]"  # base: the globals dict
        if k == "modattr":
            return f"{base}[{self.key[1]!r}]"  # base: the module's globals dict; key (module name, attribute)
        if k == "closure":
            return f"{base}.cell_contents"  # base: the cell
        if k == "default":  # base: the function; key ("pos", index, name) or ("kw", name)
            return f"{base}.__defaults__[{self.key[1]}]" if self.key[0] == "pos" else f"{base}.__kwdefaults__[{self.key[1]!r}]"
        if k == "self":  # base: the bound method, or the compiled callable object itself
            return base if self.key == "object" else f"{base}.__self__"
        if k == "classattr":  # base: the class; key (its qualified name, attribute): resolved through the MRO
            return f"getattr({base}, {self.key[1]!r})"
        if k in ("item", "key"):
            return f"{base}[{self.key!r}]"
        if k == "attr":
            return f"{base}.{self.key}"
        if k == "param":
            return f"{base}._parameters[{self.key!r}]"
        if k == "buffer":
            return f"{base}._buffers[{self.key!r}]"
        if k == "module":
            return f"{base}._modules[{self.key!r}]"
        if k == "const":
            return base  # the prologue refers to the captured tensor directly
        if k == "optstate":
            g, i = self.key
            return f"{base}.state.get({base}.param_groups[{g}]['params'][{i}])"
        raise AssertionError(k)

    def pretty(self, base: str) -> str:
        """The path as a user reads it: ``args[0].fc1.weight`` rather than ``._modules[...]``."""
        if self.kind in ("attr", "param", "buffer", "module"):
            return f"{base}.{self.key}"
        if self.kind == "const":
            return f"<tensor #{self.key} read by the function through an object it does not walk>"
        if self.kind == "global":
            return f"globals[{self.key!r}]"
        if self.kind == "default":
            return f"defaults[{self.key[-1]!r}]"
        if self.kind == "self":
            return "self"
        if self.kind in ("classattr", "modattr"):
            return f"{self.key[0]}.{self.key[1]}"
        if self.kind == "closure":
            owner, name = self.key
            return f"closure[{name!r}]" if owner is None else f"{owner}.closure[{name!r}]"
        if self.kind == "optstate":
            return f"{base}.state[{base}.param_groups[{self.key[0]}]['params'][{self.key[1]}]]"
        return self.expr(base)


def path_expr(path) -> str:
    s = ""
    for st in path:
        s = st.expr(s)
    return s


def path_str(path) -> str:
    s = ""
    for st in path:
        s = st.pretty(s)
    return s


def name_from_path(path, fallback="t") -> str:
    parts = []
    for st in path:
        if st.kind in ("arg", "kwarg"):
            parts.append(st.key if isinstance(st.key, str) else f"arg{st.key}")
        elif st.kind == "global":
            parts.append(st.key)
        elif st.kind == "closure":
            parts.append(st.key[1])
        elif st.kind == "default":
            parts.append(st.key[-1])
        elif st.kind == "self":
            parts.append("self")
        elif st.kind in ("classattr", "modattr"):
            parts.append(f"{st.key[0]}_{st.key[1]}")
        elif st.kind in ("attr", "param", "buffer", "module", "key"):
            parts.append(str(st.key))
        elif st.kind == "item":
            parts.append(str(st.key))
        elif st.kind == "optstate":
            parts.append(f"state{st.key[0]}_{st.key[1]}")
    name = "_".join(parts).replace(".", "_")
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    if not name or name[0].isdigit():
        name = f"{fallback}_{name}"
    return name


@dataclasses.dataclass
class Leaf:
    """An input the computation reads, or a Python value it specialised on."""

    path: tuple
    kind: str  # "tensor", "number", "absent", "constant", "object", "module", "optimizer", "seq", "dict", "dataclass",
    # "namespace" (a plain object whose attributes are leaves)
    value: Any
    proxy: Any = None
    alias_of: "Leaf | None" = None
    # For modules: Python state read before tracing ran (compiler/prologue.py guards it). For lists/tuples: their
    # length, for dicts their keys, when walked (the epilogue may change the real container afterwards).
    snapshot: Any = None
    # For "namespace" leaves of objects with ``__slots__``: (every slot name, the names filled when walked).
    slots: Any = None

    def __post_init__(self):
        if self.snapshot is None and self.kind in ("seq", "dict"):
            self.snapshot = tuple(self.value) if self.kind == "dict" else len(self.value)

    @property
    def where(self) -> str:
        return path_str(self.path)


def attribute_checks(leaf, var: str) -> list:
    """``(what, expression, expected)`` for a walked object's set of attributes (a "namespace" leaf): the names in
    its ``__dict__`` and, for ``__slots__``, which slots are filled. Each attribute's value is a leaf of its own."""
    out = []
    if leaf.snapshot is not None:  # None: the object has no __dict__ (only slots)
        out.append(("attributes", f"tuple({var}.__dict__)", leaf.snapshot))
    if leaf.slots is not None:
        names, filled = leaf.slots
        out.append(("slots filled", f"tuple(n for n in {names!r} if hasattr({var}, n))", filled))
    return out


def _tensor_attribute(path, prefixes) -> bool:
    """A Python attribute of a tensor the function read (tensor_attributes.py), or something inside one: read on every
    thin call, since no module epoch sees it change (``.grad``, a tensor's own state, stays bound).  ``prefixes``:
    the kinds of the leaves at ``path[:1]``, ``path[:2]``, ..."""
    return any(k == "tensor" and path[j] != Step("attr", "grad") for j, k in enumerate(prefixes, 1))


def per_call_mask(leaves) -> list:
    """True for leaves reached without passing through a module or other object (the batch, not the model)."""
    kind_of = {leaf.path: leaf.kind for leaf in leaves}
    mask = []
    for leaf in leaves:
        prefixes = [kind_of.get(leaf.path[:j]) for j in range(1, len(leaf.path))]
        static = leaf.path[0].kind == "const" or (any(k in ("module", "object", "optimizer") for k in prefixes)
                                                  and not _tensor_attribute(leaf.path, prefixes))
        mask.append(not static)
    return mask
