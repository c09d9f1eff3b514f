"""Prologues: find every input the computation reads and check what it was specialised on.

A prologue is two generated functions, both printed by ``tt.last_prologue_traces``:

``extract(*args, **kwargs)``
    follows the provenance path of every leaf (``args[0]._modules['fc1']._parameters['weight']``)
    and returns all leaf values as one tuple.  A leaf that is missing (a dict key, a
    parameter that no longer exists) raises ``LookupError``/``AttributeError``, which the
    cache treats as "this entry's structure does not match".
``guard_key(*leaf_values)``
    returns the tuple of every property the trace was specialised on: tensor shape, dtype,
    device and ``requires_grad``, identity between aliased inputs, types and values of
    Python constants, container types/lengths/keys, module identity, ``training``,
    structure and public scalar attributes, and the identity of other objects.

The check is ``guard_key(*extract(...)) == entry.key``.  Because the key is a value, every
cache entry with the same leaf structure shares one ``extract``/``guard_key`` pair and the
lookup is one dictionary access however many entries exist (``compiled.py``).  When keys
differ, ``describe_diffs`` names each differing property from the ``labels`` — the same
"path.what: expected → actual" the errors and retrace reasons print.
"""
from __future__ import annotations

import re

import dataclasses
import itertools
import linecache
import math
import types

import torch

from .memory_overlap import overlapping_pairs
from .prims import SCALAR_INFIX
from .proxies import NumberProxy, SizeProxy, is_checked, size_value
from .symbolic_layouts import layout_key
from .acquisition.instance_reads import Contents, Held, attr_of, by_contents, held_key, plain_key, step_of
from .acquisition.provenance import CAPTURED_ROOTS, attribute_checks, name_from_path, path_str, per_call_mask  # noqa: F401 (thin.py)
from . import prologue_state as checks

_counter = itertools.count()


class GeneratedFunction:
    """Python source compiled to a function; source registered with linecache for tracebacks."""

    def __init__(self, name: str, header: str, lines: list, globals_: dict):
        self.name = name
        self.source = "\n".join([f"# {h}" if h else "#" for h in header.splitlines()] + lines) + "\n"
        filename = f"<thunder_train {name} {next(_counter)}>"
        linecache.cache[filename] = (len(self.source), None, self.source.splitlines(True), filename)
        ns = dict(globals_)
        exec(compile(self.source, filename, "exec"), ns)
        self.fn = ns[name]
        self.fn.__thunder_source__ = self.source

    def python_source(self) -> str:
        return self.source

    def python_callable(self):
        return self.fn

    def __str__(self):
        return self.source

    __repr__ = __str__


class Consts:
    """Names for non-literal constants used by generated code."""

    def __init__(self, prefix="_k"):
        self.d: dict = {}
        self.prefix = prefix

    def __call__(self, value) -> str:
        if value is None or type(value) in (bool, int, str):
            return repr(value)
        if type(value) is float and math.isfinite(value):
            return repr(value)
        if type(value) is tuple and all(type(v) is int for v in value):
            return repr(value)
        for k, v in self.d.items():
            if v is value:
                return k
        name = f"{self.prefix}{len(self.d)}"
        self.d[name] = value
        return name


@dataclasses.dataclass(frozen=True)
class Label:
    path: str  # "args[0].fc1.weight"
    what: str  # "shape", "dtype", "value", "object", ...


def _float_key(v):
    """NaN never equals itself; key it by a marker so a NaN constant still hits the cache."""
    return "nan" if v != v else v


def leafness_spec(leaf, var: str) -> list:
    """The guard on an input tensor's ``is_leaf`` (or its node's type) where the function read ``is_leaf`` or
    ``grad_fn`` (``leaf.snapshot``, set by acquisition/traced_grad_fn.py); thin mode checks the same expression."""
    if leaf.snapshot == "grad_fn":
        return [("grad_fn", f"type({var}.grad_fn)", type(leaf.value.grad_fn))]
    if leaf.snapshot == "is_leaf":
        return [("is_leaf", f"{var}.is_leaf", leaf.value.is_leaf)]
    return []


def guard_specs(leaf, var: str, var_of_leaf) -> list:
    """``(what, expression, expected)`` for every property of one leaf the trace depends on."""
    v = leaf.value
    k = leaf.kind
    if k == "tensor":
        if leaf.alias_of is not None:
            return [("identity", f"{var} is {var_of_leaf(leaf.alias_of)}", True)]
        if v.layout != torch.strided:  # a sparse tensor (an opaque value, acquisition/sparse.py): no strides
            return [
                ("layout", f"{var}.layout", v.layout),
                ("shape", f"{var}.shape", tuple(v.shape)),
                ("sparse dims", f"({var}.sparse_dim(), {var}.dense_dim())", (v.sparse_dim(), v.dense_dim())),
                ("dtype", f"{var}.dtype", v.dtype),
                ("device", f"{var}.device", v.device),
                ("requires_grad", f"{var}.requires_grad", v.requires_grad),
            ]
        # The function read ``is_leaf`` or ``grad_fn`` of the input (acquisition/traced_grad_fn.py).
        leafness = leafness_spec(leaf, var)
        if is_symbolic(leaf):
            return symbolic_shape_specs(leaf, var) + [
                # Not the strides: they change with the sizes. Their form (dense in an order, or a slice) does not.
                ("layout", f"_layout_key({var})", layout_key(v)),
                ("dtype", f"{var}.dtype", v.dtype),
                ("device", f"{var}.device", v.device),
                ("requires_grad", f"{var}.requires_grad", v.requires_grad),
            ] + leafness
        return [
            ("shape", f"{var}.shape", tuple(v.shape)),
            # The trace assumed this memory layout (stride() answers, view legality, gradient layouts).
            ("stride", f"{var}.stride()", v.stride()),
            ("dtype", f"{var}.dtype", v.dtype),
            ("device", f"{var}.device", v.device),
            ("requires_grad", f"{var}.requires_grad", v.requires_grad),
        ] + leafness
    if k == "dtensor":
        # A DTensor read through its shard (the next leaf): its global shape, layout and requires_grad.
        shape, placements, rg = leaf.snapshot
        return [("type", f"type({var})", type(v)), ("shape", f"tuple({var}.shape)", shape),
                ("placements", f"tuple({var}.placements)", placements), ("requires_grad", f"{var}.requires_grad", rg)]
    if k == "absent":
        # Specialised on "nothing here" (a .grad that is None, a parameter without optimizer state).
        return [("is None", f"{var} is None", True)]
    if k == "number":
        # A runtime input (an optimizer's lr): only its type is part of the key, never its value.
        return [("type", f"type({var})", type(v))]
    if k == "optimizer":  # (and its own attributes its step read)
        return [("object", f"id({var})", id(v))] + _instance_read_specs(leaf.snapshot or {}, var)
    if k == "constant":
        val = f"_float_key({var})" if type(v) is float else var
        return [("type", f"type({var})", type(v)), ("value", val, _float_key(v) if type(v) is float else v)]
    if k == "seq":
        return [("type", f"type({var})", type(v)), ("len", f"len({var})", leaf.snapshot)]
    if k == "dict":
        return [("type", f"type({var})", type(v)), ("keys", f"tuple({var})", leaf.snapshot)]
    if k == "dataclass":
        return [("type", f"type({var})", type(v))]
    if k == "namespace":  # a plain object whose attributes are leaves of their own
        return [("type", f"type({var})", type(v))] + attribute_checks(leaf, var)
    if k in ("method", "partial"):  # a bound method / functools.partial: its __self__ / args and keywords are leaves
        return [("type", f"type({var})", type(v)), ("function", f"id({var}.{_CALLEE[k]})", id(getattr(v, _CALLEE[k])))]
    if k == "module":
        snap = leaf.snapshot or {"training": v.training, "dict_len": len(v.__dict__), "attrs": ()}
        specs = [
            ("object", f"id({var})", id(v)),
            # (its class: ``m.__class__ = X`` keeps the object and changes its forward; parametrizations do it)
            ("class", f"type({var})", type(v)),
            # (and its class's forward: ``nn.ReLU.forward = f`` after the first call patches every instance's)
            ("forward", f"type({var}).forward", type(v).forward),
            ("training", f"{var}.training", snap["training"]),
            ("structure", f"(len({var}._parameters), len({var}._buffers), len({var}._modules), len({var}.__dict__))",
             (len(v._parameters), len(v._buffers), len(v._modules), snap["dict_len"])),
        ]
        for table, name in snap.get("nones", ()):
            specs.append((f"{name} is None", f"{var}.{table}.get({name!r}) is None", True))
        for name, val in snap["attrs"]:
            expr = f"{var}.__dict__.get({name!r}, _MISSING)"
            if type(val) is float:
                specs.append((f"attr {name}", f"_float_key({expr})", _float_key(val)))
            else:
                specs.append((f"attr {name}", expr, val))
        return specs + _instance_read_specs(snap, var)
    if k == "object":
        return [("object", f"id({var})", id(v))]
    raise AssertionError(k)


_CALLEE = {"method": "__func__", "partial": "func"}


def _instance_read_specs(snap, var) -> list:
    """What the function read from a module's or optimizer's own attributes (acquisition/instance_reads.py):
    private scalars and plain containers keyed by value; objects it held by identity, and what was read from them."""
    specs = []
    for name, key in snap.get("read", ()):
        _read_specs(specs, name, f"{var}.__dict__.get({name!r}, _MISSING)", key)
    return specs


def _read_specs(specs, label, expr, key) -> None:
    if type(key) is Contents:  # a held container's items, objects among them by identity
        specs.append((f"attr {label}", f"_held_key({expr})", key.key))
        return
    if type(key) is not Held:
        specs.append((f"attr {label}", f"_plain_key({expr})", key))
        return
    if not by_contents(key.obj):  # (a container: by its contents, its first step)
        specs.append((f"held {label}", f"id({expr})", id(key.obj)))  # (the key keeps the object alive: no id reused)
    for name, k in key.attrs:
        if type(name) is str:
            _read_specs(specs, f"{label}.{name}", f"_attr_of({expr}, {name!r})", k)
        elif name.kind == "contents":
            _read_specs(specs, label, expr, k)
        else:  # (an item's, a slot's, a bound method's object)
            _read_specs(specs, label + name.label(), f"_step_of({expr}, {name.kind!r}, {name.arg!r})", k)


# ---------------------------------------------------------------------------
# Symbolic sizes (dynamic=True)
# ---------------------------------------------------------------------------
def is_symbolic(leaf) -> bool:
    return leaf.proxy is not None and type(leaf.proxy) is not NumberProxy and any(
        type(s) is SizeProxy for s in getattr(leaf.proxy, "_tt_shape", ()))


def symbolic_shape_specs(leaf, var) -> list:
    """Rank and the constant sizes; a symbolic size only needs to stay ≥ 2 (0 and 1 were specialised)."""
    specs = [("rank", f"len({var}.shape)", leaf.value.ndim)]
    for i, s in enumerate(leaf.proxy._tt_shape):
        if type(s) is SizeProxy:
            specs.append((f"size {i} > 1", f"{var}.shape[{i}] > 1", True))
        else:
            specs.append((f"size {i}", f"{var}.shape[{i}]", s))
    return specs


def render_size(x, var_of_proxy) -> str:
    """Python source for a size in terms of the prologue's variables (``x.shape[0] * 4``)."""
    if not is_checked(x):
        return repr(size_value(x))
    o = x.origin
    if o[0] == "dim":
        return f"{var_of_proxy[id(o[1])]}.shape[{o[2]}]"
    if o[0] == "input":
        return var_of_proxy[id(x)]
    op, args = o[1], o[2:]
    if op == "mul" and len(args) == 2 and any(type(a) is int and a == 1 for a in args):
        return render_size(args[1] if type(args[0]) is int and args[0] == 1 else args[0], var_of_proxy)
    parts = [render_size(a, var_of_proxy) for a in args]
    if op in SCALAR_INFIX and len(parts) == 2:
        return f"({parts[0]} {SCALAR_INFIX[op]} {parts[1]})"
    if op in ("maximum", "minimum"):
        return f"{'max' if op == 'maximum' else 'min'}({', '.join(parts)})"
    if op == "neg":
        return f"(-{parts[0]})"
    if op == "abs":
        return f"abs({parts[0]})"
    raise NotImplementedError(f"size arithmetic {op} cannot be checked in the prologue")


def size_check_specs(size_checks, var_of_proxy) -> list:
    """``(label, expression, expected)`` for every decision taken on symbolic sizes while tracing."""
    out, seen = [], set()
    for op, a, b, result in size_checks:
        expr = f"{render_size(a, var_of_proxy)} {op} {render_size(b, var_of_proxy)}"
        if expr in seen:
            continue
        seen.add(expr)
        out.append((expr, f"({expr})", result))
    return out


class _Missing:
    def __repr__(self):
        return "<missing>"


_MISSING = _Missing()


@dataclasses.dataclass(frozen=True, eq=False)
class Prologue:
    """The generated extraction and guard-key functions for one leaf structure, and what thin mode's checks
    (runtime/thin_checks.py) read besides the leaves."""

    extract: GeneratedFunction
    guard_key_fn: GeneratedFunction
    labels: tuple  # one Label per element of the guard key
    structure: str  # the generated source: equal structure ⇔ shareable prologue
    var_names: list  # variable name of each leaf, in leaf order
    label_leaf: tuple  # leaf index of each guard-key element
    check_globals: dict = dataclasses.field(default_factory=dict)  # names decision checks use (thin mode needs them)
    # (guard-key index, expression) per decision: the expected value is each entry's own key (entries share prologues).
    decision_checks: tuple = ()
    size_checks: tuple = ()  # (expression, result) per decision taken on symbolic sizes or hyper-parameters
    decision_leaves: tuple = ()  # leaf indices the decisions' programs read
    written: tuple = ()  # leaf indices updated in place (thin mode checks per-call storage against them)
    # (guard-key index, class or module, name) per method or function the key holds: thin mode checks them against
    # each entry's own key (entries share prologues; a class's patched method retraces into another entry).
    method_checks: tuple = ()

    def key_of(self, args, kwargs) -> tuple:
        return self.guard_key_fn.fn(*self.extract.fn(*args, **kwargs))


def leaf_vars(leaves, arg_names=()) -> list:
    """A readable unique variable name per leaf, derived from its path (``x``, ``model_fc1_weight``)."""
    used = {"args", "kwargs", "_MISSING", "_float_key", "_plain_key", "_attr_of", "_held_key", "_step_of", "_layout_key", "torch", "len", "type", "id", "tuple",
            "float"}
    names = []
    for leaf in leaves:
        base = name_from_path(leaf.path, "v")
        root = leaf.path[0]
        if root.kind == "arg" and root.key < len(arg_names):
            base = arg_names[root.key] + base[len(f"arg{root.key}"):]
        if base.startswith("_"):
            base = "v" + base
        name, i = base, 1
        while name in used or not name.isidentifier():
            name = f"{base}_{i}"
            i += 1
        used.add(name)
        names.append(name)
    return names


def extraction_lines(leaves, names, indices, indent="  ", consts=None) -> list:
    """Lines that assign ``names[i]`` for every leaf index in ``indices`` (parents first)."""
    index_of_path = {leaf.path: i for i, leaf in enumerate(leaves)}
    lines = []
    for i in indices:
        leaf = leaves[i]
        step = leaf.path[-1]
        if step.kind == "const":
            # A tensor the function reached through an object it does not walk: passed by reference.
            if consts is None:
                raise ValueError("extraction of captured tensors needs a Consts table")
            expr = consts(leaf.value)
        elif step.kind in CAPTURED_ROOTS and len(leaf.path) == 1:
            # Read again on every call from the function's globals dict or closure cell (rebinding is seen).
            if consts is None:
                raise ValueError("extraction of globals and closure cells needs a Consts table")
            expr = step.expr(consts(step.ref))
        elif len(leaf.path) == 1:
            expr = step.expr("")
        else:
            expr = step.expr(names[index_of_path[leaf.path[:-1]]])
        lines.append(f"{indent}{names[i]} = {expr}")
    return lines


def _referenced(leaf) -> str:
    """What ``extraction_lines`` refers to by reference for ``leaf`` (its id), or ''."""
    step = leaf.path[-1] if leaf.path else None
    if step is not None and step.kind == "const":
        return f"captured tensor {id(leaf.value)}"
    if step is not None and step.kind in CAPTURED_ROOTS and len(leaf.path) == 1:
        return f"read from {id(step.ref)}"
    return ""


def _storage_overlaps(written, others) -> tuple:
    """Pairs (i, j) where the written input ``i`` shares memory with the other input ``j`` (memory_overlap.py)."""
    return overlapping_pairs(written, others)


def build_prologue(leaves, arg_names=(), written=(), size_checks=(), decisions=(), called_names=()) -> tuple:
    """Generate the prologue for ``leaves``; returns ``(Prologue, expected_key)``.

    ``written``: leaf indices of the inputs the computation updates in place.
    The key then also says that no per-call input (an argument not reached
    through a module or optimizer) shares storage with one of them: a batch
    that is a view of a parameter would otherwise be read after it was updated.
    ``decisions``: Python values the trace computed from per-call inputs
    (``compiler/acquisition/decisions.py``): the key holds each one, recomputed.
    ``called_names``: ``(class or module, ((name, value), ...))`` of the user's methods the trace may have run
    (acquisition/captured.py ``Scanner.guarded_methods``) and of the module-level functions that ran torch ops
    (acquisition/called_functions.py): the key holds each as its class or module gives it now.
    """
    names = leaf_vars(leaves, arg_names)
    index_of = {id(leaf): i for i, leaf in enumerate(leaves)}

    def var_of_leaf(leaf):
        return names[index_of[id(leaf)]]

    consts = Consts()
    ex_lines = ["def extract(*args, **kwargs):"]
    ex_lines += extraction_lines(leaves, names, range(len(leaves)), consts=consts)
    ex_lines.append(f"  return ({''.join(n + ', ' for n in names)})")

    labels, exprs, expected, label_leaf = [], [], [], []
    for i, leaf in enumerate(leaves):
        where = path_str(leaf.path)
        for what, expr, exp in guard_specs(leaf, names[i], var_of_leaf):
            if what.startswith("attr "):
                labels.append(Label(f"{where}.{what[5:]}", "value"))
            elif what.startswith("held "):  # an object a module holds, by identity
                labels.append(Label(f"{where}.{what[5:]}", "object"))
            else:
                labels.append(Label(where, what))
            exprs.append(expr)
            expected.append(exp)
            label_leaf.append(i)
    owners = Consts("_owner")  # (the classes and modules whose names the key holds)
    method_checks = []
    for holder, named in called_names:
        module = isinstance(holder, types.ModuleType)
        where = holder.__name__ if module else f"{holder.__module__}.{holder.__qualname__}"
        for name, fn in named:
            labels.append(Label(where, f"{'function' if module else 'method'} {name}"))
            exprs.append(f"getattr({owners(holder)}, {name!r}, None)")
            expected.append(fn)
            label_leaf.append(0)
            method_checks.append((len(labels) - 1, holder, name))
    size_exprs = []
    if size_checks:
        var_of_proxy = {id(leaf.proxy): names[i] for i, leaf in enumerate(leaves)
                        if leaf.kind in ("tensor", "number") and leaf.alias_of is None}
        first = next((i for i, leaf in enumerate(leaves) if is_symbolic(leaf) or leaf.kind == "number"), 0)
        leaf_of_var = {v: i for i, v in enumerate(names)}
        for text, expr, result in size_check_specs(size_checks, var_of_proxy):
            labels.append(Label("sizes", text))  # decisions on symbolic sizes and hyper-parameters
            exprs.append(expr)
            expected.append(result)
            # The leaf whose size or value the check reads (the batch, not the first number found): thin mode
            # tells a new per-call input from a change of what it bound by this (runtime/cache.py).
            read = [leaf_of_var[w] for w in re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text) if w in leaf_of_var]
            label_leaf.append(read[0] if read else first)
            size_exprs.append((expr, result))
    decision_sources = []
    dec = Consts("_decision")  # its own names: thin mode's generated code uses them too
    decision_checks = []
    decision_leaves: set = set()  # leaf indices the decisions' programs read (thin mode names them)
    if decisions:
        var_of_proxy = {id(leaf.proxy): names[i] for i, leaf in enumerate(leaves)
                        if leaf.kind in ("tensor", "number") and leaf.alias_of is None}
        leaf_of_var = {v: i for i, v in enumerate(names)}
        for d in decisions:
            decision_leaves.update(leaf_of_var[var_of_proxy[id(p)]] for p in d.inputs)
            fn = dec(d.fn)
            call = _DECISION_EXPR[d.convert].format(f"{fn}({''.join(var_of_proxy[id(p)] + ', ' for p in d.inputs)})")
            labels.append(Label("decision", d.text))
            exprs.append(call)
            expected.append(_float_key(d.result) if d.convert == "float" else d.result)
            label_leaf.append(index_of[id(next(leaf for leaf in leaves if leaf.proxy is d.inputs[0]))] if d.inputs else 0)
            decision_checks.append((len(labels) - 1, call))  # thin mode: compared with its entry's key every call
            decision_sources.append(d.source)
    if written:
        per_call = per_call_mask(leaves)
        others = [i for i, leaf in enumerate(leaves) if per_call[i] and leaf.kind == "tensor" and leaf.alias_of is None]
        if others:
            w = "".join(names[i] + ", " for i in written)
            o = "".join(names[i] + ", " for i in others)
            labels.append(Label("inputs updated in place", "storage shared with an argument"))
            exprs.append(f"_storage_overlaps(({w}), ({o}))")
            expected.append(())
            label_leaf.append(written[0])
    if len(written) > 1:
        # Inputs updated in place share no storage (aliased ones are refused when tracing); ``p.data = q.data``
        # after the first call would make two of them one: the full path sees it here (thin mode by data pointer: thin_checks._storage).
        w = "".join(names[i] + ", " for i in written)
        labels.append(Label("inputs updated in place", "storage shared with another updated input"))
        exprs.append(f"_storage_overlaps(({w}), ({w}))")
        expected.append(())
        label_leaf.append(written[0])
    gk_lines = [f"def guard_key({', '.join(names)}):"]
    gk_lines.append("  return (")
    for lab, e in zip(labels, exprs):
        gk_lines.append(f"    {e},  # {lab.path}: {lab.what}")
    gk_lines.append("  )")
    # extract refers to objects by reference (``v_ = _k0``: a tensor the function reached through an object it does
    # not walk; a globals dict or closure cell): a program traced for other ones (a replaced ``self._mask``) must not
    # share this prologue, which would hand it the old ones.
    captured = [f"# {names[i]}: {ref}" for i, leaf in enumerate(leaves) if (ref := _referenced(leaf))]
    captured += [f"# {n}: {id(c)}" for n, c in owners.d.items()]  # (a prologue for other classes or modules is another)
    structure = "\n".join(ex_lines + gk_lines + decision_sources + captured)
    g = {"_MISSING": _MISSING, "_float_key": _float_key, "_plain_key": plain_key, "_attr_of": attr_of,
         "_held_key": held_key, "_step_of": step_of, "_layout_key": layout_key, "_storage_overlaps": _storage_overlaps, "_as_list": _as_list,
         "torch": torch, **consts.d, **dec.d, **owners.d}
    extract = GeneratedFunction("extract", "Prologue part 1: extraction (unpack every leaf by provenance)", ex_lines, g)
    gk = GeneratedFunction(
        "guard_key",
        "Prologue part 2: checks (everything the trace was specialised on; must equal the entry's key)",
        gk_lines, g,
    )
    pro = Prologue(extract, gk, tuple(labels), structure, names, tuple(label_leaf),
                   check_globals={"_as_list": _as_list, **dec.d}, decision_checks=tuple(decision_checks),
                   size_checks=tuple(size_exprs), decision_leaves=tuple(sorted(decision_leaves)), written=tuple(written),
                   method_checks=tuple(method_checks))
    return pro, tuple(expected)


# How the recomputed value of a decision is keyed (``{}``: the call of the decision's program).
_DECISION_EXPR = {"bool": "bool({})", "int": "int({})", "float": "_float_key(float({}))", "index": "({}).__index__()",
                  "list": "_as_list({})"}


def _as_list(v):
    return v.tolist() if isinstance(v, torch.Tensor) else v


# ---------------------------------------------------------------------------
# Describing differences
# ---------------------------------------------------------------------------
def fmt_value(what: str, v) -> str:
    if v is _MISSING:
        return "<missing>"
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, torch.device):
        return str(v)
    if isinstance(v, type):
        return v.__name__
    if isinstance(v, torch.Size):
        return repr(tuple(v))
    return repr(v)


def describe_diffs(labels, expected: tuple, actual: tuple, limit: int = 3) -> list:
    """``["args[2].shape: (64, 128) → (32, 128)", ...]`` for the first ``limit`` differences."""
    out = []
    for lab, e, a in zip(labels, expected, actual):
        if e == a:
            continue
        if lab.what == "object":
            out.append(f"{lab.path}: a different object than the one compiled for")
        elif lab.path in ("sizes", "decision"):
            out.append(f"{lab.what} was {e!r}, now {a!r}" if lab.path == "decision" else f"{lab.what} was {e}, now {a}")
        elif lab.what == "is None":
            out.append(f"{lab.path}: {'None' if e else 'set'} → {'None' if a else 'set'}")
        elif lab.what.startswith(("method ", "function ")):
            out.append(f"{lab.path}.{lab.what.split(' ', 1)[1]} was replaced after compiling")
        elif lab.what == "identity":
            out.append(f"{lab.path}: no longer the same tensor as the input it aliased when compiled")
        else:
            out.append(f"{lab.path}.{lab.what}: {fmt_value(lab.what, e)} → {fmt_value(lab.what, a)}")
        if len(out) >= limit:
            break
    return out


def count_diffs(expected: tuple, actual: tuple) -> int:
    return sum(1 for e, a in zip(expected, actual) if e != a)


# ---------------------------------------------------------------------------
# Global state the trace depends on
# ---------------------------------------------------------------------------
GLOBAL_LABELS = (
    Label("torch", "grad_enabled"),
    Label("torch", "default_dtype"),
    Label("torch", "autocast(cpu)"),
    Label("torch", "autocast(cuda)"),
)


def current_global_state() -> tuple:
    cpu, cuda = checks.autocast_state()
    return (torch.is_grad_enabled(), torch.get_default_dtype(), cpu, cuda)
