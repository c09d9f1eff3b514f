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

Cheap automatic detection, checked on every thin call, drops the binding and runs the full
path again: a parameter, buffer or submodule registered anywhere (torch's global
registration hooks bump an epoch counter when the module is one a binding holds), a different top-level module/object, a
top-level module switched between train and eval, a change of grad mode, a bound parameter frozen or unfrozen
(when the program runs with grad or computes gradients), an optimizer's ``load_state_dict``/``add_param_group``.
"""
from __future__ import annotations

import dataclasses
import weakref

import torch

from ..compiler.acquisition.provenance import path_str
from .errors import ThinModeError
from ..compiler.distributed import is_ddp
from ..compiler.proxies import SizeProxy
from .prologue import per_call_mask, is_symbolic, fmt_value, Consts, GeneratedFunction, _float_key, describe_diffs, extraction_lines, current_global_state, GLOBAL_LABELS


# ---------------------------------------------------------------------------
# The registration epoch: bumped whenever a watched module (one a thin binding
# holds) registers a parameter, buffer or submodule (assignment ``m.weight = nn.Parameter(...)``,
# ``load_state_dict(..., assign=True)``, ``m.fc = nn.Linear(...)``).
# ---------------------------------------------------------------------------
class _Epoch:
    n = 0


# Only modules some thin binding bound: building an unrelated model does not invalidate.
_watched: "weakref.WeakSet" = weakref.WeakSet()


def _bump(module, *_):
    if module in _watched:
        _Epoch.n += 1
    return None


def watch(modules) -> None:
    for m in modules:
        _watched.add(m)


_mm = torch.nn.modules.module
_mm.register_module_parameter_registration_hook(_bump)
_mm.register_module_buffer_registration_hook(_bump)
_mm.register_module_module_registration_hook(_bump)


def epoch() -> int:
    return _Epoch.n


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


def build_thin_call(entry, prologue, leaves, vals, prev_vals, *, nargs, kwnames, global_state, handlers, stats, binding_holder, check_every):
    """Generate ``thin_call`` for ``entry`` from the leaf values of two consecutive validated calls."""
    names = prologue.var_names
    per_call = per_call_mask(leaves)
    index_of_path = {leaf.path: i for i, leaf in enumerate(leaves)}
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
    extract = extraction_lines(leaves, names, pc_idx, indent="    ", consts=consts)
    per_call_mismatch, changed = [], []  # conditions

    def tensor_cond(var, v, leaf=None):
        if leaf is not None and is_symbolic(leaf):
            # dynamic=True: the rank and constant sizes must match; symbolic sizes only stay ≥ 2.
            sizes = " or ".join(f"{var}.shape[{i}] < 2" if type(s) is SizeProxy else f"{var}.shape[{i}] != {s}"
                                for i, s in enumerate(leaf.proxy._tt_shape))
            shape_cond = f"len({var}.shape) != {v.ndim} or {sizes}"
        else:
            shape_cond = f"{var}.shape != {consts(tuple(v.shape))}"
        return (f"{shape_cond} or {var}.dtype is not {consts(v.dtype)} "
                f"or {var}.device != {consts(v.device)} or {var}.requires_grad is not {v.requires_grad}")

    demoted_lines, demoted_conds = [], []
    comp_arg = {}
    static_idx = []
    for i in pc_idx:
        leaf, var, v = leaves[i], names[i], leaves[i].value
        k = leaf.kind
        # A global or closure value the caller rebound: a change to recompile for, not a broken contract.
        mismatch = changed if leaf.path[0].kind in ("global", "closure") else per_call_mismatch
        if k == "tensor":
            if leaf.alias_of is None:
                mismatch.append(tensor_cond(var, v, leaf))
            else:
                j = index_of_leaf[id(leaf.alias_of)]
                other = names[j] if per_call[j] else bind(j)
                mismatch.append(f"{var} is not {other}")
        elif k == "constant":
            if type(v) is float and v != v:
                mismatch.append(f"type({var}) is not float or {var} == {var}")
            else:
                mismatch.append(f"type({var}) is not {consts(type(v))} or {var} != {consts(v)}")
        elif k in ("seq", "dict"):
            mismatch.append(f"type({var}) is not {consts(type(v))} or len({var}) != {len(v)}")
        elif k == "dataclass":
            mismatch.append(f"type({var}) is not {consts(type(v))}")
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
            # add_param_group appends to the same list: its length tells.
            changed.append(f"{var} is not {bind(i)} or {var}.state is not {consts(opt.state)} "
                           f"or {var}.param_groups is not {consts(opt.param_groups)} "
                           f"or len({var}.param_groups) != {len(opt.param_groups)}")
        elif k == "absent":
            mismatch.append(f"{var} is not None")
        elif k == "number":
            mismatch.append(f"type({var}) is not {consts(type(v))}")
    for i in sorted(used):
        if per_call[i]:
            comp_arg[i] = names[i]
            continue
        if vals[i] is prev_vals[i] and leaves[i].kind != "number":
            comp_arg[i] = bind(i)
            static_idx.append(i)
            continue
        # Changed between the two validated calls (or a runtime number): re-read it from its nearest
        # unchanged ancestor (a param group dict whose 'betas' tuple a scheduler replaces each step).
        leaf = leaves[i]
        depth = len(leaf.path) - 1
        while depth > 0:
            p = index_of_path.get(leaf.path[:depth])
            if p is None:
                depth = 0
                break
            if vals[p] is prev_vals[p] and leaves[p].kind in ("module", "object", "optimizer", "dict", "seq", "dataclass"):
                break
            depth -= 1
        if depth == 0:
            raise CannotBind(f"{path_str(leaf.path)} and its container changed between the two validated calls")
        expr = bind(p)
        for step in leaf.path[depth:]:
            expr = step.expr(expr)
        demoted_lines.append(f"    {names[i]} = {expr}")
        if leaf.kind == "number":
            # A runtime number (lr) is read every call: a scheduler's update is never stale.
            demoted_conds.append(f"type({names[i]}) is not {consts(type(leaf.value))}")
        else:
            demoted_conds.append(tensor_cond(names[i], leaf.value))
        comp_arg[i] = names[i]
    for i, leaf in enumerate(leaves):
        if leaf.kind == "tensor" and leaf.alias_of is not None and not per_call[i]:
            j = index_of_leaf[id(leaf.alias_of)]
            if per_call[j]:
                # A module tensor that was the same object as a batch tensor: rare; keep the full path.
                raise CannotBind(f"{path_str(leaf.path)} aliases the per-call input {path_str(leaves[j].path)}")

    # Freezing or unfreezing a parameter (requires_grad_) between steps changes what the program must
    # compute (which gradients, which updates): one tuple comparison per call over the bound parameters.
    # Not needed for a program bound (and checked) to run without grad that computes no gradients itself.
    computes_grads = global_state[0] or entry.has_backward
    params = [i for i in static_idx if isinstance(vals[i], torch.nn.Parameter) and leaves[i].alias_of is None] if computes_grads else []
    if params:
        flags = consts(tuple(vals[i].requires_grad for i in params))
        demoted_conds.append(f"({''.join(f'{bind(i)}.requires_grad, ' for i in params)}) != {flags}")

    # The program assumed some .grad was None (e.g. zero_grad(set_to_none=True) ends each step). One
    # cheap probe catches the common violation — an eager backward() between compiled steps.
    for i, leaf in enumerate(leaves):
        if leaf.kind == "absent" and leaf.path[-1].kind == "attr" and leaf.path[-1].key == "grad" and not per_call[i]:
            parent = index_of_path.get(leaf.path[:-1])
            if parent is not None and leaves[parent].kind == "tensor":
                demoted_conds.append(f"{bind(parent)}.grad is not None")
                break

    grad = global_state[0]
    lines = ["def thin_call(*args, **kwargs):", "  _stats.calls += 1"]
    if check_every:
        lines += ["  _b.countdown -= 1", "  if _b.countdown <= 0:", "    return _periodic(args, kwargs)"]
    lines += [f"  if _Epoch.n != {epoch()} or _is_grad_enabled() is not {grad}:", "    return _changed(args, kwargs)"]
    lines += [f"  if len(args) != {nargs} or len(kwargs) != {len(kwnames)}:", "    return _mismatch(args, kwargs)"]
    lines += ["  try:"] + (extract or ["    pass"])
    for c in changed:
        lines += [f"    if {c}:", "      return _changed(args, kwargs)"]
    for c in per_call_mismatch:
        lines += [f"    if {c}:", "      return _mismatch(args, kwargs)"]
    lines += demoted_lines
    for c in demoted_conds:
        lines += [f"    if {c}:", "      return _changed(args, kwargs)"]
    for expr, expected in getattr(prologue, "size_checks", ()):
        # A decision taken on sizes or hyper-parameters goes the other way: this program does not apply.
        lines += [f"    if {expr} is not {expected}:", "      return _changed(args, kwargs)"]
    for j, expr in prologue.decision_checks:
        # A Python decision on per-call inputs (decisions.py) goes another way: another program.
        lines += [f"    if {expr} != {consts(entry.key[j])}:", "      return _changed(args, kwargs)"]
    lines += ["  except (LookupError, AttributeError, TypeError):", "    return _mismatch(args, kwargs)"]
    call_args = ", ".join(comp_arg[i] for i in entry.input_idx)
    lines.append(f"  return _computation({call_args})")

    g = {
        "_stats": stats, "_Epoch": _Epoch, "_is_grad_enabled": torch.is_grad_enabled, "_float_key": _float_key,
        "_computation": entry.computation, "_b": binding_holder,
        "_changed": handlers["changed"], "_mismatch": handlers["mismatch"], "_periodic": handlers["periodic"],
        **consts.d, **bound, **prologue.check_globals,
    }
    header = (
        f"Thin mode: bound {len(static_idx)} static tensor(s); per call: extract and check "
        f"{sum(1 for i in pc_idx if leaves[i].kind == 'tensor')} per-call tensor(s), then the computation"
        + (f"\nfull prologue every {check_every} calls" if check_every else "")
    )
    return GeneratedFunction("thin_call", header, lines, g), tuple(static_idx)


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
