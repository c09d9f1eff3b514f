"""Thin mode: after a validated call, bind the static leaves and generate ``thin_call``.

Leaves fall in two classes (see docs/thin_mode.md):

* **per-call** leaves are reached from the arguments through tuples, lists, dicts and
  dataclasses only — the batch, Python scalars, the top-level model object itself.
  ``thin_call`` extracts them on every call and checks the cheap properties (tensor shape,
  dtype, device, ``requires_grad``; constant type and value; container type and length).
  A mismatch raises ``ThinModeError`` naming the argument — never a silent wrong result.
  Globals and closure cells the function reads are per-call leaves too, read again from
  the globals dict or cell; a failed check on one (a rebound name) drops the binding and
  runs the full path instead (docs/captured_inputs.md).
* **static** leaves have a module (or other object) among their ancestors: parameters,
  buffers, submodules.  A static tensor that was the *same object* on the two validated
  calls that led to binding is bound as a constant of ``thin_call``; one that changed between
  them (e.g. a ``.grad`` recreated each step) is re-read from its bound parent every call.

Every assumption of the binding has a per-call check (the table in docs/thin_mode.md): the module
epoch (``module_epoch.py``) for the module tree, one C++ metadata check of the bound parameters and
dict versions of the optimizer state (``bulk.py``; bulk Python comparisons where torch lacks them), a
bulk identity comparison for ``.grad``, the live ``param_groups`` re-read, global state compared.
A changed assumption re-validates (full path); a per-call input that does not match raises
``ThinModeError``; an error of the computation on inputs that changed unseen is named as such.
"""
from __future__ import annotations

import dataclasses
import itertools
import operator

import torch

from ..compiler.acquisition.provenance import CAPTURED_ROOTS, attribute_checks, path_str
from ..compiler.errors import ThinModeError
from ..compiler.acquisition.distributed import is_ddp
from ..compiler.errors import DecisionMismatch
from ..compiler.proxies import SizeProxy
from . import bulk, thin_args
from ..compiler.prologue_state import autocast_state
from ..compiler.prologue import per_call_mask, is_symbolic, fmt_value, Consts, GeneratedFunction, _float_key, describe_diffs, extraction_lines, current_global_state, GLOBAL_LABELS, _storage_overlaps


from .module_epoch import _Epoch, epoch, watch  # noqa: F401  (compiled.py uses thin.watch/epoch)


class CannotBind(Exception):
    """The validated calls do not allow a thin binding yet (the message says why)."""


@dataclasses.dataclass
class ThinBinding:
    entry: object
    vals: tuple  # leaf values of the call that bound
    static_idx: tuple  # leaf indices bound as constants
    fn: GeneratedFunction
    bound_at_call: int
    check_every: int
    countdown: int
    global_state: tuple
    epoch: int


def _annotate(path: str, arg_names) -> str:
    """``args[1].shape`` → ``args[1] (batch).shape`` so the message names the parameter."""
    if path.startswith("args["):
        end = path.index("]")
        i = int(path[5:end])
        if i < len(arg_names):
            return f"{path[:end + 1]} ({arg_names[i]}){path[end + 1:]}"
    return path


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


def build_thin_call(entry, prologue, leaves, vals, prev_vals, *, nargs, kwnames, global_state, handlers, stats, binding_holder, check_every,
                    graphed=False, python_checks=False):
    """Generate ``thin_call`` for ``entry`` from the leaf values of two consecutive validated calls.

    Every assumption the guard key makes has a per-call check here (docs/thin_mode.md has the table):
    per-call leaves are extracted and checked; an optimizer's ``param_groups`` are re-read from the live
    dicts (hyper-parameters, tuples included, and its non-float options compared); its ``state`` is
    compared by identity in bulk; ``.grad`` and ``requires_grad`` of the bound tensors in bulk; modules
    through the epoch (registration, attribute assignment, ``_apply``); global state directly.
    The checked call runs ``entry.slot.thin`` (slot.py).  Returns the generated function, the leaf indices
    bound as constants and the argument order for ``Slot.bind_thin`` (None: the computation's own;
    ``graphed``: the CUDA graph runs, called in the computation's order).
    """
    names = prologue.var_names
    per_call = per_call_mask(leaves)
    index_of_path = {leaf.path: i for i, leaf in enumerate(leaves)}
    kind_of = {leaf.path: leaf.kind for leaf in leaves}
    index_of_leaf = {id(leaf): i for i, leaf in enumerate(leaves)}
    consts = Consts("_k")
    bound: dict = {}

    def bind(i) -> str:
        name = f"_s{i}"
        bound[name] = vals[i]
        return name

    used = set(entry.input_idx)
    for i, leaf in enumerate(leaves):
        if leaf.kind == "tensor" and leaf.alias_of is not None:
            used.add(i)

    pc_idx = [i for i in range(len(leaves)) if per_call[i]]
    # State read again every call (globals, closure cells, class attributes, attributes of plain objects): a value
    # missing there, like one that differs, re-validates; a missing part of the arguments is a mismatch.
    state = {i for i in pc_idx if _state_leaf(leaves[i], kind_of)}
    extract = extraction_lines(leaves, names, [i for i in pc_idx if i not in state], indent="    ", consts=consts)
    state_extract = extraction_lines(leaves, names, [i for i in pc_idx if i in state], indent="      ", consts=consts)
    if state_extract:
        extract += ["    try:"] + state_extract + ["    except (LookupError, AttributeError, TypeError):", "      raise _Changed"]
    per_call_mismatch, changed = [], []  # conditions

    def tensor_cond(var, v, leaf=None):
        if leaf is not None and is_symbolic(leaf):
            # dynamic=True: the rank and constant sizes must match; symbolic sizes only stay ≥ 2.
            sizes = " or ".join(f"{var}.shape[{i}] < 2" if type(s) is SizeProxy else f"{var}.shape[{i}] != {s}"
                                for i, s in enumerate(leaf.proxy._tt_shape))
            shape_cond = f"len({var}.shape) != {v.ndim} or {sizes}"
            if v.is_contiguous():
                shape_cond += f" or not {var}.is_contiguous()"
        else:
            # The program assumed this memory layout (stride() answers, view legality, kernels' layouts).
            shape_cond = f"{var}.shape != {consts(tuple(v.shape))} or {var}.stride() != {consts(v.stride())}"
        return (f"{shape_cond} or {var}.dtype is not {consts(v.dtype)} "
                f"or {var}.device != {consts(v.device)} or {var}.requires_grad is not {v.requires_grad}")

    def value_cond(var, leaf, v):
        """The check of a non-tensor leaf's guard-key properties (type, value, length)."""
        k = leaf.kind
        if k == "constant":
            if v is None or type(v) is bool:
                return f"{var} is not {v!r}"
            if type(v) is float and v != v:
                return f"type({var}) is not float or {var} == {var}"
            return f"type({var}) is not {consts(type(v))} or {var} != {consts(v)}"
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
        if k == "absent":
            return f"{var} is not None"
        if k == "number":
            return f"type({var}) is not {consts(type(v))}"
        return None

    static_lines, static_conds = [], []  # re-read from live containers every call (after the per-call checks)
    # Per-parameter metadata and optimizer-state dicts checked in C++ where this torch allows (bulk.py), else in Python.
    fast = frozenset() if python_checks else bulk.supported()
    bulk_meta, bulk_dicts = [], []
    comp_arg = {}
    static_idx = []
    # Per-call tensors (the batch): one C++ metadata check of all of them (bulk.py); only when it fails are the
    # Python conditions evaluated, which decide as before (the C++ check is stricter: it also compares dispatch keys).
    pc_batch = []
    for i in pc_idx:
        leaf, var, v = leaves[i], names[i], leaves[i].value
        k = leaf.kind
        # A global or closure value the caller rebound: a change to recompile for, not a broken contract.
        # A global, closure cell or default the caller rebound, or an attribute of a plain object (state, like a
        # module's): a change to recompile for, not a broken contract.
        mismatch = changed if i in state else per_call_mismatch
        if k == "tensor":
            if leaf.alias_of is None and mismatch is per_call_mismatch and "meta" in fast and not is_symbolic(leaf):
                pc_batch.append((var, v, tensor_cond(var, v, leaf)))
            elif leaf.alias_of is None:
                mismatch.append(tensor_cond(var, v, leaf))
            else:
                j = index_of_leaf[id(leaf.alias_of)]
                other = names[j] if per_call[j] else bind(j)
                mismatch.append(f"{var} is not {other}")
        elif k == "module":
            cond = f"{var} is not {bind(i)} or {var}.training is not {vals[i].training}"
            if is_ddp(vals[i]):  # no_sync() decides whether the traced backward averages gradients
                cond += f" or {var}.require_backward_grad_sync is not {vals[i].require_backward_grad_sync}"
            changed.append(cond)
        elif k == "object":
            changed.append(f"{var} is not {bind(i)}")
        elif k == "optimizer":
            # load_state_dict replaces param_groups and state: what thin mode bound would be stale.
            opt = vals[i]
            changed.append(f"{var} is not {bind(i)} or {var}.state is not {consts(opt.state)} "
                           f"or {var}.param_groups is not {consts(opt.param_groups)} "
                           f"or len({var}.param_groups) != {len(opt.param_groups)}")
        else:
            c = value_cond(var, leaf, v)
            if c is not None:
                mismatch.append(c)

    # Optimizers: param_groups are re-read from the live dicts on every call (a scheduler's lr, a new
    # betas tuple, a toggled maximize); params by identity; state by identity of its dicts and tensors.
    reread = set()
    for o, leaf in enumerate(leaves):
        if leaf.kind != "optimizer":
            continue
        opt = vals[o]
        if not per_call[o]:
            static_lines.append(f"    {names[o]} = {bind(o)}")
            static_conds.append(f"{names[o]}.state is not {consts(opt.state)} or {names[o]}.param_groups is not "
                                f"{consts(opt.param_groups)} or len({names[o]}.param_groups) != {len(opt.param_groups)}")
        mine = [i for i, lf in enumerate(leaves) if i != o and _owner(lf, kind_of) == leaf.path]
        for i in mine:
            lf = leaves[i]
            if _under_state(lf) or lf.kind == "tensor":
                continue
            reread.add(i)
            static_lines += extraction_lines(leaves, names, [i], indent="    ")
            c = value_cond(names[i], lf, lf.value)
            if lf.kind == "seq" and lf.path[-1].kind == "key" and lf.path[-1].key == "params":
                members = [j for j in mine if leaves[j].path[:-1] == lf.path]
                c += " or " + same_objects(names[i], [vals[j] for j in members], consts)
            if c is not None:
                static_conds.append(c)
            if lf.kind == "number":
                comp_arg[i] = names[i]
        if any(_under_state(leaves[i]) for i in mine):
            state = opt.state
            dicts = list(state.values())
            demoted_state = [i for i in mine if _under_state(leaves[i]) and leaves[i].path[-1].kind == "key"
                             and vals[i] is not prev_vals[i]]
            if demoted_state or any(type(d) is not dict for d in dicts):
                raise CannotBind(f"{path_str(leaves[demoted_state[0]].path) if demoted_state else 'optimizer state'} "
                                 "is a different object on each call")
            if "dict" in fast and isinstance(state, dict):
                # Any insertion, deletion or replaced value bumps a dict's version: one C++ pass.
                bulk_dicts += [state] + dicts
            else:
                s = f"{names[o]}.state"
                static_conds.append(f"len({s}) != {len(state)} or " + same_objects(f"_list({s})", list(state), consts))
                static_lines.append(f"    _sv{o} = _list({s}.values())")
                static_conds.append(same_state_dicts(f"_sv{o}", dicts, consts))

    for i in sorted(used):
        if per_call[i] or i in comp_arg:
            comp_arg.setdefault(i, names[i])
            continue
        if vals[i] is prev_vals[i] and leaves[i].kind != "number":
            comp_arg[i] = bind(i)
            static_idx.append(i)
            continue
        # Changed between the two validated calls (or a runtime number): re-read it from its nearest
        # unchanged ancestor (a module attribute replaced each step).
        leaf = leaves[i]
        depth = len(leaf.path) - 1
        while depth > 0:
            p = index_of_path.get(leaf.path[:depth])
            if p is None:
                depth = 0
                break
            if vals[p] is prev_vals[p] and leaves[p].kind in ("module", "object", "optimizer", "dict", "seq", "dataclass", "namespace", "method", "partial"):
                break
            depth -= 1
        if depth == 0:
            raise CannotBind(f"{path_str(leaf.path)} and its container changed between the two validated calls")
        expr = bind(p)
        for step in leaf.path[depth:]:
            expr = step.expr(expr)
        static_lines.append(f"    {names[i]} = {expr}")
        if leaf.kind == "number":
            # A runtime number is read every call: a new value is never stale.
            static_conds.append(f"type({names[i]}) is not {consts(type(leaf.value))}")
        else:
            static_conds.append(tensor_cond(names[i], leaf.value))
        comp_arg[i] = names[i]
    for i, leaf in enumerate(leaves):
        if leaf.kind == "tensor" and leaf.alias_of is not None and not per_call[i]:
            j = index_of_leaf[id(leaf.alias_of)]
            if per_call[j]:
                # A module tensor that was the same object as a batch tensor: rare; keep the full path.
                raise CannotBind(f"{path_str(leaf.path)} aliases the per-call input {path_str(leaves[j].path)}")

    # Freezing or unfreezing a parameter (requires_grad_) between steps changes what the program must
    # compute (which gradients, which updates): one bulk comparison per call over the bound tensors.
    # Not needed for a program bound (and checked) to run without grad that computes no gradients itself.
    computes_grads = global_state[0] or entry.has_backward
    bound_tensors = [i for i in static_idx if leaves[i].kind == "tensor" and leaves[i].alias_of is None]
    laid_out = [i for i in bound_tensors if isinstance(vals[i], torch.nn.Parameter)]
    if "meta" in fast:
        # Each bound parameter's shape, strides, dtype, device and requires_grad (freeze/unfreeze, and
        # ``p.data = other``, which keeps the object but may change what the program assumed).
        bulk_meta += [vals[i] for i in laid_out]
    else:
        params = laid_out if computes_grads else []
        if params:
            static_conds.append(f"_list(map(_rg, {consts([vals[i] for i in params])})) != "
                                f"{consts([vals[i].requires_grad for i in params])}")
        # ``p.data = other`` keeps the bound object but may change its layout, which the program (gradient
        # layouts, fused optimizer kernels) assumed: one bulk comparison per call over the bound parameters.
        if laid_out:
            static_conds.append(f"_list(map(_stride, {consts([vals[i] for i in laid_out])})) != "
                                f"{consts([vals[i].stride() for i in laid_out])}")

    # .grad of every bound tensor whose .grad the program read: None (set_to_none) or the bound tensor.
    owners, grads = [], []
    for i, leaf in enumerate(leaves):
        if leaf.path[-1].kind == "attr" and leaf.path[-1].key == "grad" and not per_call[i] and leaf.kind in ("absent", "tensor"):
            parent = index_of_path.get(leaf.path[:-1])
            if parent is None or leaves[parent].kind != "tensor" or parent not in static_idx:
                continue
            if leaf.kind == "absent":
                grads.append(None)
            elif i in static_idx or (vals[i] is prev_vals[i] and i not in used):
                grads.append(vals[i])
            else:
                continue  # re-read and checked every call above
            owners.append(vals[parent])
    if owners:
        static_conds.append(same_objects(f"_list(map(_grad, {consts(owners)}))", grads, consts))
    # A few parameters are checked in the per-call tensors' C++ call (one call less); many in a call of their
    # own, which takes the bound tuple as it is (``f(x, *params)`` would copy it every call).
    meta_k = consts(tuple(bulk_meta)) if bulk_meta else None
    joint_meta = bool(pc_batch) and 0 < len(bulk_meta) <= _JOINT_META_MAX
    try:
        if pc_batch:
            pc_meta = bulk.tensor_meta_check([v for _, v, _ in pc_batch] + (bulk_meta if joint_meta else []))
        if bulk_meta:
            meta_check = bulk.tensor_meta_check(bulk_meta)
            if not joint_meta:
                static_lines.append(f"    # _meta_check: shape, strides, dtype, device and requires_grad of {len(bulk_meta)} parameter(s) in C++")
                static_conds.append(f"not _meta_check(*{meta_k})")
        if bulk_dicts:
            version = bulk.dict_version()
            static_lines.append(f"    # _dict_version: {len(bulk_dicts)} optimizer-state dict(s) (optimizer.state, each per-parameter dict) unmodified")
            static_conds.append(f"_list(map(_dict_version, {consts(tuple(bulk_dicts))})) != {consts([version(d) for d in bulk_dicts])}")
    except Exception:  # noqa: BLE001 - an object torch's guards do not take: the same checks in Python
        return build_thin_call(entry, prologue, leaves, vals, prev_vals, nargs=nargs, kwnames=kwnames, global_state=global_state,
                               handlers=handlers, stats=stats, binding_holder=binding_holder, check_every=check_every,
                               graphed=graphed, python_checks=True)

    # A per-call tensor sharing storage with an input the program updates in place (a batch that is a
    # view of a parameter, or two overlapping views passed together): the full path decides.
    written = prologue.written
    pc_tensors = [i for i in pc_idx if leaves[i].kind == "tensor" and leaves[i].alias_of is None]
    if written and pc_tensors:
        w_static = frozenset(vals[i].untyped_storage().data_ptr() for i in written if not per_call[i])
        w_pc = [names[i] for i in written if per_call[i]]
        o = "".join(names[i] + ", " for i in pc_tensors)
        cond = f"_shares_storage(({o}), {consts(w_static)})"
        if w_pc:
            cond += f" or _storage_overlaps(({''.join(n + ', ' for n in w_pc)}), ({o}))"
        static_conds.append(cond)

    grad = global_state[0]
    lines = ["def thin_call(*args, **kwargs):", "  _stats.calls += 1"]
    if check_every:
        lines += ["  _b.countdown -= 1", "  if _b.countdown <= 0:", "    return _periodic(args, kwargs)"]
    glob = f"_Epoch.n != {epoch()} or _is_grad_enabled() is not {grad} or _get_default_dtype() is not {consts(global_state[1])}"
    if global_state[2] is None and global_state[3] is None:
        glob += " or _any_autocast()"
    else:
        glob += f" or _autocast_state() != {consts(tuple(global_state[2:4]))}"
    lines += [f"  if {glob}:", "    return _changed(args, kwargs)"]
    lines += [f"  if len(args) != {nargs} or len(kwargs) != {len(kwnames)}:", "    return _mismatch(args, kwargs)"]
    # A failed check raises _Changed/_Mismatch inside the try; the handlers run outside it, so an error
    # of the full path they take is never mistaken for a failed check.
    lines += ["  try:"] + (extract or ["    pass"])
    for c in changed:
        lines += [f"    if {c}:", "      raise _Changed"]
    for c in per_call_mismatch:
        lines += [f"    if {c}:", "      raise _Mismatch"]
    if pc_batch:
        # One C++ call checks the per-call tensors and the bound parameters together; only when it fails are the
        # per-call conditions evaluated (a mismatch raises ThinModeError) and the parameters checked on their own.
        meta_args = ", ".join([var for var, _, _ in pc_batch] + ([f"_s{i}" for i in laid_out] if joint_meta else []))
        if joint_meta:
            lines.append(f"    # _pc_meta_check: the per-call tensors and {len(bulk_meta)} parameter(s) (shape, strides, dtype, device, requires_grad) in C++")
        lines.append(f"    if not _pc_meta_check({meta_args}):")
        for _, _, c in pc_batch:
            lines += [f"      if {c}:", "        raise _Mismatch"]
        if joint_meta:
            lines += [f"      if not _meta_check(*{meta_k}):", "        raise _Changed"]
    lines += ["  except _Changed:", "    return _changed(args, kwargs)",
              "  except (_Mismatch, LookupError, AttributeError, TypeError):", "    return _mismatch(args, kwargs)"]
    lines += ["  try:"] + (static_lines or ["    pass"])
    for c in static_conds:
        lines += [f"    if {c}:", "      raise _Changed"]
    # Decisions taken on sizes or hyper-parameters: this entry's own recorded results (entries that share
    # the prologue took other decisions).
    size_exprs = [e for e, _ in prologue.size_checks]
    expected = [e for lab, e in zip(prologue.labels, entry.key) if lab.path == "sizes"]
    for expr, result in zip(size_exprs, expected):
        lines += [f"    if {expr} is not {result}:", "      raise _Changed"]
    for i in prologue.decision_leaves:
        # A decision on an intermediate value reads static leaves too (parameters, optimizer state): name them.
        if per_call[i] or comp_arg.get(i) == names[i]:
            continue
        if i in comp_arg:
            lines.append(f"    {names[i]} = {comp_arg[i]}")
        elif vals[i] is prev_vals[i] and leaves[i].kind == "tensor":
            lines.append(f"    {names[i]} = {bind(i)}")
        else:
            raise CannotBind(f"a decision reads {path_str(leaves[i].path)}, which is a different object on each call")
    for j, expr in prologue.decision_checks:
        # A Python decision on per-call inputs (acquisition/decisions.py) goes another way: another program.
        lines += [f"    if {expr} != {consts(entry.key[j])}:", "      raise _Changed"]
    lines += ["  except Exception:  # _Changed, or a bound container that no longer has what was read",
              "    return _changed(args, kwargs)"]
    # The bound inputs as defaults of a reordered copy of the computation (thin_args.py), or an interleaved call.
    arg_names = [comp_arg[i] for i in entry.input_idx]
    slot = entry.slot
    made = None if graphed else thin_args.computation_call(slot.run, arg_names, bound, slot.thin_codes)
    if made is not None:
        call_args = ", ".join(made[1])
        adapt = thin_args.adapter(arg_names, dict(bound), slot.thin_codes, _packed_args)
    else:
        call_args = ", ".join(_packed_args(arg_names, bound))
        adapt = None
    # What runs is the slot's (slot.py): a fused program that replaces the torch one later is called the same way.
    lines += ["  try:", f"    return _slot.thin({call_args})",
              # A decision the program checks went the other way (nothing written): the entry for it runs.
              "  except _DecisionMismatch as e:", "    return _decided(args, kwargs, e)",
              "  except Exception as e:", "    _failed(args, kwargs, e)", "    raise"]

    g = {
        "_stats": stats, "_Epoch": _Epoch, "_is_grad_enabled": torch.is_grad_enabled, "_float_key": _float_key,
        "_get_default_dtype": torch.get_default_dtype, "_any_autocast": torch._C._is_any_autocast_enabled,
        "_autocast_state": autocast_state, "_all": all, "_list": list, "_is": operator.is_, "_grad": _GRAD, "_rg": _RG, "_stride": _STRIDE,
        "_values": dict.values, "_chain": itertools.chain.from_iterable, "_shares_storage": _shares_storage,
        "_storage_overlaps": _storage_overlaps, "_Changed": _Changed, "_Mismatch": _Mismatch,
        "_slot": slot, "_b": binding_holder,
        "_changed": handlers["changed"], "_mismatch": handlers["mismatch"], "_periodic": handlers["periodic"],
        "_failed": handlers["failed"], "_decided": handlers["decided"], "_DecisionMismatch": DecisionMismatch,
        "_meta_check": meta_check if bulk_meta else None, "_pc_meta_check": pc_meta if pc_batch else None, "_dict_version": bulk.dict_version() if bulk_dicts else None,
        **consts.d, **bound, **prologue.check_globals,
    }
    header = (
        f"Thin mode: bound {len(static_idx)} static tensor(s); per call: extract and check "
        f"{sum(1 for i in pc_idx if leaves[i].kind == 'tensor')} per-call tensor(s), re-read the optimizers' "
        "param_groups, compare state, .grad and requires_grad in bulk, then the computation"
        + (f"\nfull prologue every {check_every} calls" if check_every else "")
    )
    return GeneratedFunction("thin_call", header, lines, g), tuple(static_idx), adapt


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


# Up to this many bound parameters share the per-call tensors' metadata check (see build_thin_call).
_JOINT_META_MAX = 32


class _Changed(Exception):
    """A per-call check found that what the binding assumed changed: validate again (full path)."""


class _Mismatch(Exception):
    """A per-call input does not match the bound program: ThinModeError."""


_GRAD = operator.attrgetter("grad")
_RG = operator.attrgetter("requires_grad")
_STRIDE = torch.Tensor.stride


def _shares_storage(tensors, ptrs) -> bool:
    for t in tensors:
        if t.untyped_storage().data_ptr() in ptrs:
            return True
    return False


# ---------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------
def mismatch_error(entry, prologue, args, kwargs, arg_names, describe_struct_diff) -> ThinModeError:
    """The error for a per-call input that does not match the bound program."""
    advice = (
        ". The step was bound to inputs like those of its validated calls: pass inputs of the same "
        "shape/dtype/device (e.g. DataLoader(drop_last=True)), call step.revalidate() before a call with "
        "different inputs, or compile without thin=True."
    )
    try:
        actual = prologue.key_of(args, kwargs)
    except (LookupError, AttributeError, TypeError):
        actual = None
    if actual is not None:
        # Name the per-call input (the batch) first: that is what the caller controls.
        per_call = per_call_mask(entry.leaves)
        order = sorted(range(len(actual)), key=lambda j: not per_call[prologue.label_leaf[j]])
        for j in order:
            lab, e, a = prologue.labels[j], entry.key[j], actual[j]
            if e != a:
                where = _annotate(lab.path, arg_names)
                if lab.what in ("object", "identity"):
                    detail = _annotate(describe_diffs((lab,), (e,), (a,))[0], arg_names)
                else:
                    detail = f"{where}: {lab.what} expected {fmt_value(lab.what, e)}, got {fmt_value(lab.what, a)}"
                return ThinModeError(lab.path, lab.what, e, a, "thin mode: " + detail + advice)
    text = describe_struct_diff(entry.struct_key, args, kwargs)
    return ThinModeError("args", "structure", None, None, "thin mode: " + _annotate(text, arg_names) + advice)


def periodic_check(binding, prologue, leaves, args, kwargs, arg_names):
    """``check_every=N``: the full prologue plus identity of what was bound.  Returns leaf values or raises."""
    since = f"since thin mode bound its inputs at call {binding.bound_at_call}"
    advice = (
        "; after model.to(...), load_state_dict(..., assign=True), replacing parameters or changing global "
        "state (grad mode, autocast, default dtype) call step.revalidate()"
    )
    g = current_global_state()
    if g != binding.global_state:
        for lab, e, a in zip(GLOBAL_LABELS, binding.global_state, g):
            if e != a:
                raise ThinModeError(lab.path, lab.what, e, a, f"check_every: {lab.path}.{lab.what} changed {e!r} → {a!r} {since}{advice}", kind="check_every")
    try:
        vals = prologue.extract.fn(*args, **kwargs)
        key = prologue.guard_key_fn.fn(*vals)
    except (LookupError, AttributeError, TypeError) as ex:
        raise ThinModeError("args", "structure", "the bound structure", repr(ex),
                            f"check_every: the inputs no longer have the structure thin mode bound {since} ({ex!r}){advice}", kind="check_every") from None
    entry = binding.entry
    if key != entry.key:
        for lab, e, a in zip(prologue.labels, entry.key, key):
            if e != a:
                [text] = describe_diffs((lab,), (e,), (a,))
                raise ThinModeError(lab.path, lab.what, e, a, f"check_every: {_annotate(text, arg_names)} {since}{advice}", kind="check_every")
    for i in binding.static_idx:
        if vals[i] is not binding.vals[i]:
            where = path_str(leaves[i].path)
            raise ThinModeError(where, "object", "the bound tensor", "a different tensor",
                                f"check_every: {where} is a different tensor object than the one bound {since} "
                                f"(was it replaced without registration, e.g. m._parameters[...] = ...?){advice}", kind="check_every")
    return vals


def stale_binding_error(binding, args, kwargs, arg_names, exc):
    """A ``ThinModeError`` when the full prologue finds that what the binding assumed no longer holds, else None."""
    entry = binding.entry
    prologue = entry.prologue
    g = current_global_state()
    diffs = describe_diffs(GLOBAL_LABELS, binding.global_state, g)
    if not diffs:
        try:
            key = prologue.key_of(args, kwargs)
        except (LookupError, AttributeError, TypeError):
            diffs = ["the inputs no longer have the structure thin mode bound"]
        else:
            if key == entry.key:
                return None
            diffs = [_annotate(d, arg_names) for d in describe_diffs(prologue.labels, entry.key, key)]
    return ThinModeError("args", "stale binding", None, None,
                         f"thin mode: {'; '.join(diffs)} since thin mode bound its inputs at call {binding.bound_at_call} "
                         f"(changed without a step the binding sees, e.g. p.data = ...); the computation raised "
                         f"{type(exc).__name__}: {exc}. Call step.revalidate() after such a change.", kind="check_every")
