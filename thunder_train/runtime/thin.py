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

``thin_checks.py`` generates ``thin_call`` (one builder per kind of leaf); this module holds the binding's
record (``ThinBinding``) and the errors its handlers raise (binding.py calls them).
"""
from __future__ import annotations

import dataclasses

from ..compiler.acquisition.provenance import path_str
from ..compiler.errors import ThinModeError
from ..compiler.prologue import GLOBAL_LABELS, GeneratedFunction, current_global_state, describe_diffs, fmt_value, per_call_mask
from .module_epoch import _Epoch, epoch, watch  # noqa: F401  (binding.py uses thin.watch/epoch)
from .thin_checks import CannotBind, _packed_args, build_thin_call  # noqa: F401  (binding.py, tests)


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
    modes: tuple = (0, 0)  # the function and dispatch modes' stack lengths when bound (acquisition/ambient.py)


def _annotate(path: str, arg_names) -> str:
    """``args[1].shape`` → ``args[1] (batch).shape`` so the message names the parameter."""
    if path.startswith("args["):
        end = path.index("]")
        i = int(path[5:end])
        if i < len(arg_names):
            return f"{path[:end + 1]} ({arg_names[i]}){path[end + 1:]}"
    return path


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
