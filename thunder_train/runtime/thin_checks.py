"""The per-call checks of ``thin_call``: one small builder per kind of leaf, and the assembly of the source.

``build_thin_call`` (called by binding.py) generates ``thin_call`` for a cache entry from the leaf values of two
consecutive validated calls.  A ``_ThinSource`` collects what the generated function does, in the order it does
it (docs/thin_mode.md has the table of assumptions and their checks):

1. global state and the argument count (``_head``);
2. the per-call leaves (the batch, Python values, globals read again): extracted, then checked by the builder of
   their kind (``_PER_CALL``: tensors, modules, plain objects, optimizers, other values); a failed check raises
   ``_Mismatch`` (a ``ThinModeError`` for the caller) or ``_Changed`` (re-validate on the full path);
3. what the binding holds: optimizers' ``param_groups`` re-read from the live dicts and their state
   (``_optimizer``), the computation's inputs bound as constants or re-read from their nearest unchanged
   ancestor (``_static_input``), the bound parameters' layout and ``requires_grad`` (``_parameters``), ``.grad``
   (``_grads``), storage shared with inputs updated in place (``_storage``), decisions on sizes,
   hyper-parameters and per-call values (``_decisions``), each failure raising ``_Changed``;
4. the call of the entry's slot (slot.py): ``_slot.thin(...)``.

Per-parameter metadata and optimizer-state dicts are checked in C++ where this torch's guards take the bound
objects (bulk.py); ``_bulk_kinds`` asks once, before anything is generated, and otherwise every check is
generated in Python.  Everything read here is declared by the entry's ``Prologue`` (compiler/prologue.py) or
its leaves.
"""
from __future__ import annotations

import itertools
import operator

import torch

from ..compiler.acquisition.distributed import is_ddp
from ..compiler.acquisition.instance_reads import SCALAR_TYPES, Contents, Held, Same, attr_of, by_contents, held_key, step_of
from ..compiler.acquisition.provenance import CAPTURED_ROOTS, attribute_checks, path_str
from ..compiler.errors import DecisionMismatch
from ..compiler.prologue import (_MISSING, Consts, GeneratedFunction, _float_key, _storage_overlaps, extraction_lines,
                                 is_symbolic, leafness_spec, per_call_mask, plain_key)
from ..compiler.prologue_state import autocast_state
from ..compiler.proxies import SizeProxy
from ..compiler.symbolic_layouts import layout_key
from ..compiler import bulk
from . import thin_args
from .module_epoch import _Epoch, epoch

# Up to this many bound parameters share the per-call tensors' metadata check (see _bulk_checkers).
_JOINT_META_MAX = 32
# Leaf kinds whose object a re-read may start from when it did not change between the two validated calls.
_CONTAINERS = ("module", "object", "optimizer", "dict", "seq", "dataclass", "namespace", "method", "partial")


class CannotBind(Exception):
    """The validated calls do not allow a thin binding yet (the message says why)."""


class _Changed(Exception):
    """A per-call check found that what the binding assumed changed: validate again (full path)."""


class _Mismatch(Exception):
    """A per-call input does not match the bound program: ThinModeError."""


class _ThinSource:
    """One ``thin_call`` being generated: the leaves it reads, the objects it binds, and its checks by stage."""

    def __init__(self, entry, vals, prev_vals, fast):
        self.entry, self.prologue, self.leaves = entry, entry.prologue, entry.leaves
        self.vals, self.prev, self.fast = vals, prev_vals, fast
        self.names = self.prologue.var_names
        self.per_call = per_call_mask(self.leaves)
        self.index_of_path = {leaf.path: i for i, leaf in enumerate(self.leaves)}
        self.kind_of = {leaf.path: leaf.kind for leaf in self.leaves}
        self.index_of_leaf = {id(leaf): i for i, leaf in enumerate(self.leaves)}
        self.consts = Consts("_k")
        self.bound: dict = {}  # name -> object bound as a constant of thin_call
        self.used = set(entry.input_idx) | {i for i, leaf in enumerate(self.leaves)
                                            if leaf.kind == "tensor" and leaf.alias_of is not None}
        self.pc_idx = [i for i in range(len(self.leaves)) if self.per_call[i]]
        # State read again every call (globals, closure cells, class attributes, attributes of plain objects): a
        # value missing there, like one that differs, re-validates; a missing part of the arguments is a mismatch.
        self.state = {i for i in self.pc_idx if _state_leaf(self.leaves[i], self.kind_of)}
        self.changed, self.mismatch = [], []  # conditions on the per-call leaves
        self.pc_batch = []  # (variable, value, condition) of the per-call tensors checked in C++ first
        self.static_lines, self.static_conds = [], []  # what the binding holds, re-read and checked
        self.decision_lines = []
        self.bulk_meta, self.bulk_dicts = [], []  # parameters and optimizer-state dicts checked in C++
        self.comp_arg = {}  # leaf index -> the expression thin_call passes to the computation
        self.static_idx = []  # leaf indices bound as constants
        self.checkers = {"_meta_check": None, "_pc_meta_check": None, "_dict_version": None}
        self.meta_k, self.joint_meta, self.laid_out = None, False, []

    def bind(self, i) -> str:
        name = f"_s{i}"
        self.bound[name] = self.vals[i]
        return name


def build_thin_call(entry, vals, prev_vals, *, nargs, kwnames, global_state, handlers, stats, binding_holder, check_every,
                    graphed=False):
    """Generate ``thin_call`` for ``entry`` from the leaf values of two consecutive validated calls.

    Every assumption the guard key makes has a per-call check (docs/thin_mode.md has the table; the module
    docstring the stages).  The checked call runs ``entry.slot.thin`` (slot.py).  Returns the generated function,
    the leaf indices bound as constants and the argument order for ``Slot.bind_thin`` (None: the computation's
    own; ``graphed``: the CUDA graph runs, called in the computation's order).
    """
    prologue, leaves = entry.prologue, entry.leaves
    sparse = next((leaf for leaf, v in zip(leaves, vals) if leaf.kind == "tensor" and v.layout != torch.strided), None)
    if sparse is not None:  # its checks read strides and storage: the prologue checks a sparse input instead
        raise CannotBind(f"{path_str(sparse.path)} is a sparse tensor (its layout, shape, dtype and device are checked by "
                         "the full path's prologue on every call)")
    src = _ThinSource(entry, vals, prev_vals, _bulk_kinds(entry, vals, prev_vals))
    for i in src.pc_idx:
        into = src.changed if i in src.state else src.mismatch
        _PER_CALL.get(leaves[i].kind, _per_call_value)(src, i, into)
    for o, leaf in enumerate(leaves):
        if leaf.kind == "optimizer":
            _optimizer(src, o)
    for i in sorted(src.used):
        _static_input(src, i)
    _static_aliases(src)
    _module_reads(src)
    _module_forwards(src)
    _parameters(src, global_state[0] or entry.has_backward)
    _grads(src)
    _bulk_checkers(src)
    _storage(src)
    _decisions(src)
    call, adapt = _call(src, graphed)
    lines = (_head(src, nargs, kwnames, global_state, check_every, binding_holder.modes) + _per_call_block(src)
             + _static_block(src) + call)
    g = {
        "_stats": stats, "_Epoch": _Epoch, "_is_grad_enabled": torch.is_grad_enabled, "_float_key": _float_key,
        "_plain_key": plain_key, "_MISSING": _MISSING, "_dict_of": object.__getattribute__, "_held_key": held_key,
        "_step_of": step_of,
        "_get_default_dtype": torch.get_default_dtype, "_any_autocast": torch._C._is_any_autocast_enabled,
        "_function_modes": torch._C._len_torch_function_stack, "_dispatch_modes": torch._C._len_torch_dispatch_stack,
        "_saved_hooks": torch._C._autograd._top_saved_tensors_default_hooks, "_anomaly": torch.is_anomaly_enabled,
        "_anomaly_nan": torch.is_anomaly_check_nan_enabled, "_forward_ad": torch.autograd.forward_ad,
        "_transforms": torch._C._functorch.peek_interpreter_stack,
        "_autocast_state": autocast_state, "_all": all, "_list": list, "_is": operator.is_, "_grad": _GRAD, "_rg": _RG,
        "_stride": _STRIDE, "_data_ptr": _DATA_PTR, "_values": dict.values, "_chain": itertools.chain.from_iterable,
        "_shares_storage": _shares_storage, "_storage_overlaps": _storage_overlaps, "_Changed": _Changed,
        "_Mismatch": _Mismatch, "_slot": entry.slot, "_b": binding_holder, "_changed": handlers["changed"],
        "_mismatch": handlers["mismatch"], "_periodic": handlers["periodic"], "_failed": handlers["failed"],
        "_decided": handlers["decided"], "_DecisionMismatch": DecisionMismatch,
        **src.checkers, **src.consts.d, **src.bound, **prologue.check_globals,
    }
    header = (
        f"Thin mode: bound {len(src.static_idx)} static tensor(s); per call: extract and check "
        f"{sum(1 for i in src.pc_idx if leaves[i].kind == 'tensor')} per-call tensor(s), re-read the optimizers' "
        "param_groups, compare state, .grad and requires_grad in bulk, then the computation"
        + (f"\nfull prologue every {check_every} calls" if check_every else "")
    )
    return GeneratedFunction("thin_call", header, lines, g), tuple(src.static_idx), adapt


# ---- which checks run in C++ ----
def _bulk_kinds(entry, vals, prev_vals) -> frozenset:
    """The C++ checks (bulk.py) this binding uses: ``"meta"`` (tensor metadata) and ``"dict"`` (dict versions)
    where this torch has them and its guards take every object they would check, else none (all in Python)."""
    fast = bulk.supported()
    if not fast:
        return fast
    leaves = entry.leaves
    per_call, kind_of = per_call_mask(leaves), {leaf.path: leaf.kind for leaf in leaves}
    used = set(entry.input_idx)
    tensors = [leaf.value for i, leaf in enumerate(leaves)
               if per_call[i] and leaf.kind == "tensor" and leaf.alias_of is None and not is_symbolic(leaf)
               and not _state_leaf(leaf, kind_of)]
    tensors += [vals[i] for i in sorted(used) if not per_call[i] and leaves[i].kind == "tensor"
                and leaves[i].alias_of is None and vals[i] is prev_vals[i]]
    dicts = []
    for o, leaf in enumerate(leaves):
        state = vals[o].state if leaf.kind == "optimizer" else None
        if isinstance(state, dict) and any(_under_state(lf) and _owner(lf, kind_of) == leaf.path for lf in leaves):
            dicts += [state] + list(state.values())
    try:
        if "meta" in fast and tensors:
            bulk.tensor_meta_check(tensors)
        if "dict" in fast and dicts:
            version = bulk.dict_version()
            for d in dicts:
                version(d)
    except Exception:  # noqa: BLE001 - an object torch's guards do not take: the same checks in Python
        return frozenset()
    return fast


# ---- per-call leaves, by kind ----
def _tensor_cond(src, var, v, leaf=None) -> str:
    consts = src.consts
    if leaf is not None and is_symbolic(leaf):
        # dynamic=True: the rank and constant sizes must match; symbolic sizes only stay ≥ 2.
        sizes = " or ".join(f"{var}.shape[{i}] < 2" if type(s) is SizeProxy else f"{var}.shape[{i}] != {s}"
                            for i, s in enumerate(leaf.proxy._tt_shape))
        shape_cond = f"len({var}.shape) != {v.ndim} or {sizes}"
        # The layout's form, not its strides (they change with the sizes): symbolic_layouts.layout_key.
        shape_cond += f" or {consts(layout_key)}({var}) != {consts(layout_key(v))}"
    else:
        # The program assumed this memory layout (stride() answers, view legality, kernels' layouts).
        shape_cond = f"{var}.shape != {consts(tuple(v.shape))} or {var}.stride() != {consts(v.stride())}"
    # The Python type too: a parameter's proxy passes isinstance(_, nn.Parameter) while tracing, as in eager.
    return (f"{shape_cond} or {var}.dtype is not {consts(v.dtype)} "
            f"or {var}.device != {consts(v.device)} or {var}.requires_grad is not {v.requires_grad} "
            f"or type({var}) is not {consts(type(v))}")


def _value_cond(src, var, leaf, v) -> str | None:
    """The check of a non-tensor leaf's guard-key properties (type, value, length)."""
    consts, k = src.consts, leaf.kind
    if k == "constant":
        return _scalar_differs(var, v, consts)
    if k in ("seq", "dict"):  # the length when walked (the epilogue may have changed the container since)
        n = leaf.snapshot if k == "seq" else len(leaf.snapshot)
        return f"type({var}) is not {consts(type(v))} or len({var}) != {n}"
    if k == "dataclass":
        return f"type({var}) is not {consts(type(v))}"
    if k == "namespace":  # attributes added or removed: the attribute leaves are checked on their own
        cond = f"type({var}) is not {consts(type(v))}"
        if leaf.snapshot is not None:
            cond += f" or len({var}.__dict__) != {len(leaf.snapshot)}"
        if leaf.slots is not None:
            _, expr, filled = attribute_checks(leaf, var)[-1]
            cond += f" or {expr} != {consts(filled)}"
        return cond
    if k in ("method", "partial"):  # a bound method / functools.partial: the function by identity
        callee = "__func__" if k == "method" else "func"
        return f"type({var}) is not {consts(type(v))} or {var}.{callee} is not {consts(getattr(v, callee))}"
    if k == "dtensor":  # FSDP2's sharded tensors: the shard is a leaf of its own
        shape, placements, rg = leaf.snapshot
        return (f"type({var}) is not {consts(type(v))} or tuple({var}.shape) != {consts(shape)} "
                f"or tuple({var}.placements) != {consts(placements)} or {var}.requires_grad is not {rg}")
    if k == "absent":
        return f"{var} is not None"
    if k == "number":
        return f"type({var}) is not {consts(type(v))}"
    return None


def _leafness_cond(src, var, leaf) -> list:
    """``is_leaf`` (or the node's type) of a tensor whose ``is_leaf`` or ``grad_fn`` the function read: a leaf and
    a non-leaf have the same metadata, so neither the C++ check nor ``_tensor_cond`` sees it."""
    return [f"{expr} is not {src.consts(expected)}" for _, expr, expected in leafness_spec(leaf, var)]


def _per_call_tensor(src, i, into) -> None:
    # Per-call tensors (the batch): one C++ metadata check of all of them (bulk.py); only when it fails are the
    # Python conditions evaluated, which decide as before (the C++ check is stricter: it also compares dispatch keys).
    leaf, var = src.leaves[i], src.names[i]
    if leaf.alias_of is None:
        into += _leafness_cond(src, var, leaf)
    if leaf.alias_of is None and into is src.mismatch and "meta" in src.fast and not is_symbolic(leaf):
        src.pc_batch.append((var, leaf.value, _tensor_cond(src, var, leaf.value, leaf)))
    elif leaf.alias_of is None:
        into.append(_tensor_cond(src, var, leaf.value, leaf))
    else:
        j = src.index_of_leaf[id(leaf.alias_of)]
        into.append(f"{var} is not {src.names[j] if src.per_call[j] else src.bind(j)}")


def _per_call_module(src, i, into) -> None:
    var, m = src.names[i], src.vals[i]
    cond = f"{var} is not {src.bind(i)} or {var}.training is not {m.training}"
    if is_ddp(m):  # no_sync() decides whether the traced backward averages gradients
        cond += f" or {var}.require_backward_grad_sync is not {m.require_backward_grad_sync}"
    src.changed.append(cond)


def _per_call_object(src, i, into) -> None:
    src.changed.append(f"{src.names[i]} is not {src.bind(i)}")


def _per_call_optimizer(src, i, into) -> None:
    # load_state_dict replaces param_groups and state: what thin mode bound would be stale.
    var, opt, consts = src.names[i], src.vals[i], src.consts
    src.changed.append(f"{var} is not {src.bind(i)} or {var}.state is not {consts(opt.state)} "
                       f"or {var}.param_groups is not {consts(opt.param_groups)} "
                       f"or len({var}.param_groups) != {len(opt.param_groups)}")


def _per_call_value(src, i, into) -> None:
    leaf = src.leaves[i]
    c = _value_cond(src, src.names[i], leaf, leaf.value)
    if c is not None:
        into.append(c)


def _module_reads(src) -> None:
    """What the function read from modules (acquisition/instance_reads.py, in the guard key), compared on every
    call: private scalars and plain containers by value (assigning a private name bumps no module epoch, and a
    container changed in place, peft's ``merged_adapters.append``, is seen by no hook); objects a module holds by
    identity, and what was read from them by value, in turn."""
    for i, leaf in enumerate(src.leaves):
        read = (leaf.snapshot or {}).get("read", ()) if leaf.kind in ("module", "optimizer") else ()
        if not read:
            continue
        var, module = (src.names[i] if src.per_call[i] else src.bind(i)), src.vals[i]
        for j, (name, key) in enumerate(read):
            (src.changed if src.per_call[i] else src.static_conds).append(
                _read_cond(src, f"{var}.__dict__.get({name!r}, _MISSING)", module.__dict__.get(name, _MISSING), key,
                           f"_r{i}_{j}"))


def _module_forwards(src) -> None:
    """The ``forward`` of each module class the binding holds, compared on every call (one per class), and the user's
    methods of the class its code may call: a class's method replaced (``nn.ReLU.forward = f``, a library patching a
    model class, ``Block.helper = f``) bumps no module epoch."""
    classes = {type(leaf.value) for leaf in src.leaves if leaf.kind == "module"}
    for cls in sorted(classes, key=lambda c: (c.__module__, c.__qualname__)):
        src.static_conds.append(f"{src.consts(cls)}.forward is not {src.consts(cls.forward)}")
    for j, holder, name in src.prologue.method_checks:  # (the methods and functions the trace ran, as its key holds them)
        src.static_conds.append(f"getattr({src.consts(holder)}, {name!r}, None) != {src.consts(src.entry.key[j])}")


def _read_cond(src, expr, now, key, got) -> str:
    """True where ``expr`` gives no value or no longer ``now``'s (the value bound now) as ``key`` keys it: an ``or``
    chain, so a held object's attributes are read only once it is known to be the same object.  A held object's
    ``__dict__`` is read once, past its class's ``__getattribute__`` (transformers' configs have one in Python: 2 us a
    read); a container's items, ``__slots__`` members and a bound method's object through ``_step_of``."""
    if type(key) is Contents:  # (``expr`` is the container, already read: its items compared inline)
        return _key_differs(expr, key.key, src.consts, "_held_key")
    if type(key) is not Held:
        return f"({got} := {expr}) is _MISSING or {_key_differs(got, plain_key(now), src.consts)}"
    conds = [f"({got} := {expr}) is " + ("_MISSING" if by_contents(key.obj) else f"not {src.consts(key.obj)}")]
    own = None  # the variable holding the object's __dict__, once read
    for j, (n, k) in enumerate(key.attrs):
        if type(n) is str:
            inner = f"{own}.get({n!r}, _MISSING)" if own else f"({got}_d := _dict_of({got}, '__dict__')).get({n!r}, _MISSING)"
            own = f"{got}_d"
            conds.append(f"({_read_cond(src, inner, attr_of(key.obj, n), k, f'{got}_{j}')})")
        elif n.kind == "contents":
            conds.append(f"({_read_cond(src, got, key.obj, k, f'{got}_{j}')})")
        else:
            inner = f"_step_of({got}, {n.kind!r}, {n.arg!r})"
            conds.append(f"({_read_cond(src, inner, step_of(key.obj, n.kind, n.arg), k, f'{got}_{j}')})")
    return " or ".join(conds)


def _scalar_differs(var, v, consts) -> str:
    """True where ``var`` is not the Python scalar ``v`` (its type included; a NaN matches a NaN)."""
    if v is None or type(v) is bool:
        return f"{var} is not {v!r}"
    if type(v) is float and v != v:
        return f"type({var}) is not float or {var} == {var}"
    return f"type({var}) is not {consts(type(v))} or {var} != {consts(v)}"


def _key_differs(var, k, consts, keyer="_plain_key", depth=0) -> str:
    """True where ``var`` holds another value than the one keyed ``k`` (``plain_key``; ``held_key`` with
    ``keyer="_held_key"``: objects by identity), inline for scalars and for lists, tuples and string-keyed dicts (a
    dict lookup and a comparison per item: ~0.1 us a LayerNorm's ``normalized_shape`` against ~1 us keying it);
    keyed otherwise.  Built from the key, not a value: a container is checked by its contents, so the one bound may
    be another object than the one the trace read."""
    if type(k) is Same:
        return f"({var} is not {consts(k.obj)})"
    if type(k) in SCALAR_TYPES:
        return f"({_scalar_differs(var, k, consts)})"
    if type(k) is tuple and k == ("nan",):
        return f"({_scalar_differs(var, float('nan'), consts)})"
    if depth < 2 and type(k) is tuple and len(k) == 2 and k[0] in ("list", "tuple"):
        return "(" + " or ".join([f"type({var}) is not {k[0]}", f"len({var}) != {len(k[1])}"] + [
            _key_differs(f"{var}[{i}]", x, consts, keyer, depth + 1) for i, x in enumerate(k[1])]) + ")"
    if depth < 2 and type(k) is tuple and len(k) == 2 and k[0] == "dict" and all(type(a) is str for a, _ in k[1]):
        return "(" + " or ".join([f"type({var}) is not dict", f"len({var}) != {len(k[1])}"] + [
            _key_differs(f"{var}.get({a!r}, _MISSING)", x, consts, keyer, depth + 1) for a, x in k[1]]) + ")"
    return f"({keyer}({var}) != {consts(k)})"


_PER_CALL = {"tensor": _per_call_tensor, "module": _per_call_module, "object": _per_call_object,
             "optimizer": _per_call_optimizer}


# ---- what the binding holds ----
def _optimizer(src, o) -> None:
    """Optimizers: param_groups are re-read from the live dicts on every call (a scheduler's lr, a new betas tuple,
    a toggled maximize); params by identity; state by identity of its dicts and tensors."""
    leaves, names, vals, consts = src.leaves, src.names, src.vals, src.consts
    opt = vals[o]
    if not src.per_call[o]:
        src.static_lines.append(f"    {names[o]} = {src.bind(o)}")
        src.static_conds.append(f"{names[o]}.state is not {consts(opt.state)} or {names[o]}.param_groups is not "
                                f"{consts(opt.param_groups)} or len({names[o]}.param_groups) != {len(opt.param_groups)}")
    mine = [i for i, lf in enumerate(leaves) if i != o and _owner(lf, src.kind_of) == leaves[o].path]
    for i in mine:
        lf = leaves[i]
        if _under_state(lf) or lf.kind == "tensor":
            continue
        src.static_lines += extraction_lines(leaves, names, [i], indent="    ")
        c = _value_cond(src, names[i], lf, lf.value)
        if lf.kind == "seq" and lf.path[-1].kind == "key" and lf.path[-1].key == "params":
            members = [j for j in mine if leaves[j].path[:-1] == lf.path]
            c += " or " + same_objects(names[i], [vals[j] for j in members], consts)
        if c is not None:
            src.static_conds.append(c)
        if lf.kind == "number":
            src.comp_arg[i] = names[i]
    if any(_under_state(leaves[i]) for i in mine):
        _optimizer_state(src, o, mine)


def _optimizer_state(src, o, mine) -> None:
    leaves, vals = src.leaves, src.vals
    state = vals[o].state
    dicts = list(state.values())
    demoted = [i for i in mine if _under_state(leaves[i]) and leaves[i].path[-1].kind == "key"
               and vals[i] is not src.prev[i]]
    if demoted or any(type(d) is not dict for d in dicts):
        raise CannotBind(f"{path_str(leaves[demoted[0]].path) if demoted else 'optimizer state'} "
                         "is a different object on each call")
    if "dict" in src.fast and isinstance(state, dict):
        # Any insertion, deletion or replaced value bumps a dict's version: one C++ pass.
        src.bulk_dicts += [state] + dicts
    else:
        s = f"{src.names[o]}.state"
        src.static_conds.append(f"len({s}) != {len(state)} or " + same_objects(f"_list({s})", list(state), src.consts))
        src.static_lines.append(f"    _sv{o} = _list({s}.values())")
        src.static_conds.append(same_state_dicts(f"_sv{o}", dicts, src.consts))


def _static_input(src, i) -> None:
    """An input of the computation that is not per-call: bound as a constant when it was the same object on both
    validated calls, else re-read from its nearest unchanged ancestor (a module attribute replaced each step)."""
    leaves, vals, prev = src.leaves, src.vals, src.prev
    if src.per_call[i] or i in src.comp_arg:
        src.comp_arg.setdefault(i, src.names[i])
        return
    if vals[i] is prev[i] and leaves[i].kind != "number":
        src.comp_arg[i] = src.bind(i)
        src.static_idx.append(i)
        if leaves[i].kind == "tensor" and leaves[i].alias_of is None:  # (an in-place op between calls changes it)
            src.static_conds += _leafness_cond(src, src.comp_arg[i], leaves[i])
        return
    leaf = leaves[i]
    depth = len(leaf.path) - 1
    while depth > 0:
        p = src.index_of_path.get(leaf.path[:depth])
        if p is None:
            depth = 0
            break
        if vals[p] is prev[p] and leaves[p].kind in _CONTAINERS:
            break
        depth -= 1
    if depth == 0:
        raise CannotBind(f"{path_str(leaf.path)} and its container changed between the two validated calls")
    expr = src.bind(p)
    for step in leaf.path[depth:]:
        expr = step.expr(expr)
    src.static_lines.append(f"    {src.names[i]} = {expr}")
    if leaf.kind == "number":
        # A runtime number is read every call: a new value is never stale.
        src.static_conds.append(f"type({src.names[i]}) is not {src.consts(type(leaf.value))}")
    else:
        src.static_conds.append(_tensor_cond(src, src.names[i], leaf.value))
        src.static_conds += _leafness_cond(src, src.names[i], leaf)
    src.comp_arg[i] = src.names[i]


def _static_aliases(src) -> None:
    for i, leaf in enumerate(src.leaves):
        if leaf.kind == "tensor" and leaf.alias_of is not None and not src.per_call[i]:
            j = src.index_of_leaf[id(leaf.alias_of)]
            if src.per_call[j]:
                # A module tensor that was the same object as a batch tensor: rare; keep the full path.
                raise CannotBind(f"{path_str(leaf.path)} aliases the per-call input {path_str(src.leaves[j].path)}")


def _parameters(src, computes_grads) -> None:
    """Freezing or unfreezing a parameter (requires_grad_) between steps changes what the program must compute
    (which gradients, which updates), and ``p.data = other`` (or ``set_``) keeps the bound object but may change
    its layout, which the program assumed: gradient layouts and the fused optimizer kernels' layout comparison
    are decided from the traced layouts of parameters, gradients and optimizer state
    (compiler/executors/decided_layouts.py).  One bulk comparison per call over every bound tensor.
    ``requires_grad`` needs none for a program bound (and checked) to run without grad that computes no gradients
    itself."""
    leaves, vals, consts = src.leaves, src.vals, src.consts
    src.laid_out = [i for i in src.static_idx if leaves[i].kind == "tensor" and leaves[i].alias_of is None]
    if "meta" in src.fast:
        # Each bound parameter's shape, strides, dtype, device and requires_grad in C++.
        src.bulk_meta += [vals[i] for i in src.laid_out]
        return
    params = [i for i in src.laid_out if isinstance(vals[i], torch.nn.Parameter)] if computes_grads else []
    if params:
        src.static_conds.append(f"_list(map(_rg, {consts([vals[i] for i in params])})) != "
                                f"{consts([vals[i].requires_grad for i in params])}")
    if src.laid_out:
        src.static_conds.append(f"_list(map(_stride, {consts([vals[i] for i in src.laid_out])})) != "
                                f"{consts([vals[i].stride() for i in src.laid_out])}")


def _grads(src) -> None:
    """.grad of every bound tensor whose .grad the program read: None (set_to_none) or the bound tensor."""
    leaves, vals = src.leaves, src.vals
    owners, grads = [], []
    for i, leaf in enumerate(leaves):
        if leaf.path[-1].kind == "attr" and leaf.path[-1].key == "grad" and not src.per_call[i] and leaf.kind in ("absent", "tensor"):
            parent = src.index_of_path.get(leaf.path[:-1])
            if parent is None or leaves[parent].kind != "tensor" or parent not in src.static_idx:
                continue
            if leaf.kind == "absent":
                grads.append(None)
            elif i in src.static_idx or (vals[i] is src.prev[i] and i not in src.used):
                grads.append(vals[i])
            else:
                continue  # re-read and checked every call (_static_input)
            owners.append(vals[parent])
    if owners:
        src.static_conds.append(same_objects(f"_list(map(_grad, {src.consts(owners)}))", grads, src.consts))


def _bulk_checkers(src) -> None:
    """The C++ checks (``_bulk_kinds`` said torch takes these objects).  A few parameters are checked in the
    per-call tensors' C++ call (one call less); many in a call of their own, which takes the bound tuple as it is
    (``f(x, *params)`` would copy it every call)."""
    bulk_meta, bulk_dicts = src.bulk_meta, src.bulk_dicts
    src.meta_k = src.consts(tuple(bulk_meta)) if bulk_meta else None
    src.joint_meta = bool(src.pc_batch) and 0 < len(bulk_meta) <= _JOINT_META_MAX
    if src.pc_batch:
        src.checkers["_pc_meta_check"] = bulk.tensor_meta_check(
            [v for _, v, _ in src.pc_batch] + (bulk_meta if src.joint_meta else []))
    if bulk_meta:
        src.checkers["_meta_check"] = bulk.tensor_meta_check(bulk_meta)
        if not src.joint_meta:
            src.static_lines.append(f"    # _meta_check: shape, strides, dtype, device and requires_grad of {len(bulk_meta)} bound tensor(s) in C++")
            src.static_conds.append(f"not _meta_check(*{src.meta_k})")
    if bulk_dicts:
        version = src.checkers["_dict_version"] = bulk.dict_version()
        src.static_lines.append(f"    # _dict_version: {len(bulk_dicts)} optimizer-state dict(s) (optimizer.state, each per-parameter dict) unmodified")
        src.static_conds.append(f"_list(map(_dict_version, {src.consts(tuple(bulk_dicts))})) != "
                                f"{src.consts([version(d) for d in bulk_dicts])}")


def _storage(src) -> None:
    """Storage the program's in-place updates assume is their own.

    A per-call tensor sharing storage with an input the program updates in place (a batch that is a view of a
    parameter, or two overlapping views passed together), or two updated inputs made one storage between calls
    (``q.data = p.data``, ``p.set_(q)``, ``vector_to_parameters`` into aliased parameters, an optimizer-state tensor
    given another's storage): the functionalized program would update each from its old value, so the full path
    decides (it refuses aliased updates, or rebinds when the new storage is not shared).  The bound updated
    tensors' data pointers are compared with those at binding in one ``map`` (a new storage moves the pointer; their
    sizes and strides are the metadata check's); the few re-read every call are compared pairwise."""
    written, leaves, names, vals = src.prologue.written, src.leaves, src.names, src.vals
    bound_w = [i for i in written if i in src.static_idx]
    ts = tuple(vals[i] for i in bound_w)
    try:
        ptrs = list(map(_DATA_PTR, ts))
    except RuntimeError:  # a tensor without data (a storage resized to 0): compared pairwise every call instead
        ptrs = None
    if ts and ptrs is not None:
        src.static_lines.append(f"    # data pointers of {len(ts)} bound tensor(s) the program updates in place")
        src.static_conds.append(f"_list(map(_data_ptr, {src.consts(ts)})) != {src.consts(ptrs)}")
    reread_w = [i for i in written if not src.per_call[i] and (i not in src.static_idx or ptrs is None)]
    if reread_w:
        w_all = "".join(f"{src.comp_arg.get(i, names[i])}, " for i in written if not src.per_call[i])
        w_new = "".join(f"{src.comp_arg.get(i, names[i])}, " for i in reread_w)
        src.static_conds.append(f"_storage_overlaps(({w_new}), ({w_all}))")
    pc_tensors = [i for i in src.pc_idx if leaves[i].kind == "tensor" and leaves[i].alias_of is None]
    if not (written and pc_tensors):
        return
    w_static = frozenset(vals[i].untyped_storage().data_ptr() for i in written if not src.per_call[i])
    w_pc = [names[i] for i in written if src.per_call[i]]
    o = "".join(names[i] + ", " for i in pc_tensors)
    cond = f"_shares_storage(({o}), {src.consts(w_static)})"
    if w_pc:
        cond += f" or _storage_overlaps(({''.join(n + ', ' for n in w_pc)}), ({o}))"
    src.static_conds.append(cond)


def _decisions(src) -> None:
    """Decisions taken on sizes or hyper-parameters (this entry's own recorded results: entries that share the
    prologue took other decisions), and Python decisions on per-call inputs (acquisition/decisions.py)."""
    prologue, entry, names, vals, lines = src.prologue, src.entry, src.names, src.vals, src.decision_lines
    expected = [e for lab, e in zip(prologue.labels, entry.key) if lab.path == "sizes"]
    for (expr, _), result in zip(prologue.size_checks, expected):
        lines += [f"    if {expr} is not {result}:", "      raise _Changed"]
    for i in prologue.decision_leaves:
        # A decision on an intermediate value reads static leaves too (parameters, optimizer state): name them.
        if src.per_call[i] or src.comp_arg.get(i) == names[i]:
            continue
        if i in src.comp_arg:
            lines.append(f"    {names[i]} = {src.comp_arg[i]}")
        elif vals[i] is src.prev[i] and src.leaves[i].kind == "tensor":
            lines.append(f"    {names[i]} = {src.bind(i)}")
        else:
            raise CannotBind(f"a decision reads {path_str(src.leaves[i].path)}, which is a different object on each call")
    for j, expr in prologue.decision_checks:
        # A Python decision on per-call inputs goes another way: another program.
        lines += [f"    if {expr} != {src.consts(entry.key[j])}:", "      raise _Changed"]


# ---- the source, stage by stage ----
def _head(src, nargs, kwnames, global_state, check_every, modes) -> list:
    consts = src.consts
    lines = ["def thin_call(*args, **kwargs):", "  _stats.calls += 1"]
    # Modes, saved-tensor hooks and anomaly detection set up around the call (acquisition/ambient.py): their
    # stacks as bound (a default device's mode may be there); the full path refuses what it cannot honour.
    functions, dispatches = modes
    ambient = (f"_function_modes() != {functions} or _dispatch_modes() != {dispatches} or _saved_hooks(True) is not None "
               "or _forward_ad._current_level >= 0 or _transforms() is not None")
    if src.entry.has_backward:
        ambient += " or _anomaly() and _anomaly_nan()"
    lines += [f"  if {ambient}:", "    return _changed(args, kwargs)"]
    if check_every:
        lines += ["  _b.countdown -= 1", "  if _b.countdown <= 0:", "    return _periodic(args, kwargs)"]
    glob = (f"_Epoch.n != {epoch()} or _is_grad_enabled() is not {global_state[0]} "
            f"or _get_default_dtype() is not {consts(global_state[1])}")
    if global_state[2] is None and global_state[3] is None:
        glob += " or _any_autocast()"
    else:
        glob += f" or _autocast_state() != {consts(tuple(global_state[2:4]))}"
    lines += [f"  if {glob}:", "    return _changed(args, kwargs)"]
    lines += [f"  if len(args) != {nargs} or len(kwargs) != {len(kwnames)}:", "    return _mismatch(args, kwargs)"]
    return lines


def _raise_if(conds, exc, indent="    ") -> list:
    return [line for c in conds for line in (f"{indent}if {c}:", f"{indent}  raise {exc}")]


def _per_call_block(src) -> list:
    """Extract and check the per-call leaves.  A failed check raises _Changed/_Mismatch inside the try; the
    handlers run outside it, so an error of the full path they take is never mistaken for a failed check."""
    leaves, names = src.leaves, list(src.names)
    # A per-call leaf under a bound tensor (a Python attribute of a parameter the function read,
    # acquisition/tensor_attributes.py) is read from the bound tensor.
    index_of_path = {leaf.path: i for i, leaf in enumerate(leaves)}
    for i in src.pc_idx:
        parent = index_of_path.get(leaves[i].path[:-1])
        if parent is not None and not src.per_call[parent] and leaves[parent].kind == "tensor":
            names[parent] = src.bind(parent)
    extract = extraction_lines(leaves, names, [i for i in src.pc_idx if i not in src.state], indent="    ", consts=src.consts)
    state_extract = extraction_lines(leaves, names, [i for i in src.pc_idx if i in src.state], indent="      ", consts=src.consts)
    if state_extract:
        extract += ["    try:"] + state_extract + ["    except (LookupError, AttributeError, TypeError):", "      raise _Changed"]
    lines = ["  try:"] + (extract or ["    pass"])
    lines += _raise_if(src.changed, "_Changed") + _raise_if(src.mismatch, "_Mismatch")
    if src.pc_batch:
        # One C++ call checks the per-call tensors and the bound parameters together; only when it fails are the
        # per-call conditions evaluated (a mismatch raises ThinModeError) and the parameters checked on their own.
        joint = [f"_s{i}" for i in src.laid_out] if src.joint_meta else []
        if src.joint_meta:
            lines.append(f"    # _pc_meta_check: the per-call tensors and {len(src.bulk_meta)} bound tensor(s) (shape, strides, dtype, device, requires_grad) in C++")
        lines.append(f"    if not _pc_meta_check({', '.join([var for var, _, _ in src.pc_batch] + joint)}):")
        lines += _raise_if([c for _, _, c in src.pc_batch], "_Mismatch", "      ")
        if src.joint_meta:
            lines += [f"      if not _meta_check(*{src.meta_k}):", "        raise _Changed"]
    return lines + ["  except _Changed:", "    return _changed(args, kwargs)",
                    "  except (_Mismatch, LookupError, AttributeError, TypeError):", "    return _mismatch(args, kwargs)"]


def _static_block(src) -> list:
    lines = ["  try:"] + (src.static_lines or ["    pass"]) + _raise_if(src.static_conds, "_Changed") + src.decision_lines
    return lines + ["  except Exception:  # _Changed, or a bound container that no longer has what was read",
                    "    return _changed(args, kwargs)"]


def _call(src, graphed) -> tuple:
    """The call of what the entry's slot runs, with the bound inputs as defaults of a reordered copy of the
    computation (thin_args.py) or interleaved with the per-call ones; and the argument order for the slot."""
    arg_names = [src.comp_arg[i] for i in src.entry.input_idx]
    slot = src.entry.slot
    made = None if graphed else thin_args.computation_call(slot.run, arg_names, src.bound, slot.thin_codes)
    if made is not None:
        call_args = ", ".join(made[1])
        adapt = thin_args.adapter(arg_names, dict(src.bound), slot.thin_codes, _packed_args)
    else:
        call_args = ", ".join(_packed_args(arg_names, src.bound))
        adapt = None
    # What runs is the slot's (slot.py): a fused program that replaces the torch one later is called the same way.
    return ["  try:", f"    return _slot.thin({call_args})",
            # A decision the program checks went the other way (nothing written): the entry for it runs.
            "  except _DecisionMismatch as e:", "    return _decided(args, kwargs, e)",
            "  except Exception as e:", "    _failed(args, kwargs, e)", "    raise"], adapt


# ---- helpers ----
def _owner(leaf, kind_of):
    """Index path prefix of the nearest module/object/optimizer ancestor of ``leaf`` (None: reached from the arguments)."""
    for j in range(len(leaf.path) - 1, 0, -1):
        if kind_of.get(leaf.path[:j]) in ("module", "object", "optimizer"):
            return leaf.path[:j]
    return None


def _state_leaf(leaf, kind_of) -> bool:
    """Read from the function (a global, closure cell, default, class attribute) or an attribute of a walked object:
    state the caller may change between calls, not part of the call's contract."""
    return leaf.path[0].kind in CAPTURED_ROOTS or any(
        kind_of.get(leaf.path[:j]) in ("namespace", "method", "partial") for j in range(1, len(leaf.path) + 1))


def _under_state(leaf) -> bool:
    return any(st.kind == "optstate" for st in leaf.path)


def _packed_args(names: list, bound: dict) -> list:
    """The computation's arguments with each long run of bound constants passed as one starred tuple.

    A name per argument is a global lookup per bound tensor on every call (about 20 ns each, 60 µs for the
    3,000 inputs of a 1,000-parameter AdamW step); ``*_run0`` copies the run's pointers in C.  A short run is
    passed by name: a call with positional arguments only needs no argument tuple at all (6 parameters:
    about 70 ns instead of 140)."""
    out, run = [], []

    def flush():
        if len(run) > 8:
            name = f"_run{sum(1 for a in out if a.startswith('*'))}"
            bound[name] = tuple(bound[n] for n in run)
            out.append("*" + name)
        else:
            out.extend(run)
        run.clear()

    for n in names:
        if n in bound:
            run.append(n)
        else:
            flush()
            out.append(n)
    flush()
    return out


def _small(v) -> bool:
    """A tensor whose ``==`` with another tensor is a single truth value (not an error): compare it by identity."""
    return isinstance(v, torch.Tensor) and v.numel() <= 1


def same_objects(live: str, bound: list, consts) -> str:
    """Condition: the list ``live`` does not hold exactly the ``bound`` objects.

    List ``==`` is C code that takes the identity shortcut, about 1 ns an element. A different tensor
    in a slot compares elementwise: an error (caught: the check fails) unless it has one element,
    so lists holding such tensors are compared by identity (``map(is_)``, about 12 ns an element).
    """
    cond = f"{live} != {consts(list(bound))}"
    if any(_small(v) for v in bound):
        cond += f" or not _all(map(_is, {live}, {consts(list(bound))}))"
    return cond


def same_state_dicts(live: str, dicts: list, consts) -> str:
    """Condition: the per-parameter state dicts ``live`` differ from ``dicts`` (replaced, or a value replaced).

    The live dicts are compared with copies taken at binding: dict ``==`` compares keys and values
    (identity shortcut) in C. One-element tensors (``step``) are compared by identity on their own.
    """
    copies = [dict(d) for d in dicts]
    cond = f"{live} != {consts(copies)}"
    small_keys = {k for d in dicts for k, v in d.items() if _small(v)}
    for k in sorted(small_keys, key=str):
        if all(k in d for d in dicts):
            getter = consts(operator.itemgetter(k))
            cond += f" or not _all(map(_is, map({getter}, {live}), {consts([d[k] for d in dicts])}))"
        else:
            flat = [v for d in dicts for v in d.values()]
            cond += f" or not _all(map(_is, _chain(map(_values, {live})), {consts(flat)}))"
            break
    return cond


_GRAD = operator.attrgetter("grad")
_RG = operator.attrgetter("requires_grad")
_STRIDE = torch.Tensor.stride
_DATA_PTR = torch.Tensor.data_ptr


def _shares_storage(tensors, ptrs) -> bool:
    for t in tensors:
        p = t.untyped_storage().data_ptr()
        if p and p in ptrs:  # (0: a storage without bytes, shared with nothing)
            return True
    return False
