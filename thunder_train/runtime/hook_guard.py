"""Hooks are part of what a compiled function assumes.

Tracing runs the hooks present then: a forward hook's tensor work is in the program, a backward or
optimizer hook is refused (``compiler/acquisition/python_effects.py``, ``walker.py``).  A hook added or
removed later would otherwise go unseen, so every hook registry a program depends on is guarded:

* module hook dicts (forward, forward-pre, backward, backward-pre) of every module leaf, the global
  module hook dicts, the gradient-hook dicts of every tensor leaf, the step-hook dicts of every
  optimizer leaf and the global optimizer hook dicts;
* each dict is compared by identity, length and last key (torch's hook handles have increasing ids,
  so adding, removing or replacing a hook changes one of the three): ``signature``;
* cheaply: every ``RemovableHandle`` torch makes or removes (every public ``register_*hook`` and
  ``handle.remove()``) bumps ``version()``; the full path recomputes a signature only when the version
  moved since the entry's last check, and a thin binding is dropped through the module epoch
  (``module_epoch.py``), which its ``thin_call`` compares on every call.

Editing a hook dict directly (``m._forward_hooks.clear()``) bypasses the handles: the full path still sees
it (the signature), a thin binding does not until ``revalidate()``.

A fully_shard (FSDP2) unit's configuration is guarded the same way: its ``set_*`` switches
(``set_requires_gradient_sync(False)``, ``set_reshard_after_forward``, a divide factor, ...) decide what the traced
program does, so each unit's ``fsdp.config_key`` is part of the signature, and ``FSDPModule``'s setters bump the
version when they change a key (wrapped when the first entry holding a unit is made).
"""
from __future__ import annotations

import torch
from torch.nn.modules import module as _module_mod
from torch.optim import optimizer as _optim_mod
from torch.utils import hooks as _torch_hooks

from ..compiler import context
from ..compiler.acquisition.fsdp import config_key, fsdp_hook_ids, is_fsdp_module
from . import module_epoch

_MODULE_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_TENSOR_DICTS = ("_backward_hooks", "_post_accumulate_grad_hooks")
_OPTIMIZER_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
_GLOBAL_DICTS = ((_module_mod, "_global_forward_hooks"), (_module_mod, "_global_forward_pre_hooks"),
                 (_module_mod, "_global_backward_hooks"), (_module_mod, "_global_backward_pre_hooks"),
                 (_optim_mod, "_global_optimizer_pre_hooks"), (_optim_mod, "_global_optimizer_post_hooks"))


class _Version:
    n = 0


def version() -> int:
    return _Version.n


def _changed() -> None:
    if context.tracer_state() is not None or context.making_own_hooks():
        # A handle made or removed while this thread traces: the tracer's own stand-ins (python_effects.py), or a
        # hook the traced function registers, which the new entry's signature (taken after tracing) includes.  Or
        # the compiler's own hook on a node it makes (compiler/autograd_function.py).
        return
    _Version.n += 1
    if module_epoch._watched:  # a thin binding exists: its next call re-validates on the full path
        module_epoch._Epoch.n += 1
        module_epoch._Epoch.why = "a hook was registered or removed"


def _install() -> None:
    handle = _torch_hooks.RemovableHandle
    init, remove = handle.__init__, handle.remove

    def counting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _changed()

    def counting_remove(self):
        remove(self)
        _changed()

    for name, fn, orig in (("__init__", counting_init, init), ("remove", counting_remove, remove)):
        fn.__wrapped__ = orig
        fn.__doc__ = orig.__doc__
        setattr(handle, name, fn)


_install()


def _fsdp_keys(m) -> tuple:
    return tuple(config_key(u) for u in m.modules() if is_fsdp_module(u))


_fsdp_installed = False


def _install_fsdp_setters() -> None:
    """Wrap every ``FSDPModule.set_*``: a call that changes some unit's ``config_key`` bumps the version (and drops
    thin bindings), like a hook registered or removed."""
    global _fsdp_installed
    if _fsdp_installed:
        return
    _fsdp_installed = True
    from torch.distributed.fsdp import FSDPModule

    def wrap(orig):
        def counting_setter(self, *args, **kwargs):
            before = _fsdp_keys(self)
            out = orig(self, *args, **kwargs)
            if _fsdp_keys(self) != before:
                _changed()
            return out

        counting_setter.__wrapped__ = orig
        counting_setter.__doc__ = orig.__doc__
        counting_setter.__name__ = orig.__name__
        return counting_setter

    for name in [n for n in vars(FSDPModule) if n.startswith("set_") and callable(vars(FSDPModule)[n])]:
        setattr(FSDPModule, name, wrap(vars(FSDPModule)[name]))


def _dict_sig(d):
    if not d:
        return None if d is None else 0
    return (id(d), len(d), next(reversed(d)))


def signature(leaves, vals) -> tuple:
    """Every hook registry the leaves of one call (and the process) hold, in a comparable form."""
    sig = [_dict_sig(getattr(mod, name, None)) for mod, name in _GLOBAL_DICTS]
    for leaf, v in zip(leaves, vals):
        names = _MODULE_DICTS if leaf.kind == "module" else _OPTIMIZER_DICTS if leaf.kind == "optimizer" else \
            _TENSOR_DICTS if isinstance(v, torch.Tensor) else ()
        for name in names:
            sig.append(_dict_sig(getattr(v, name, None)))
        if leaf.kind == "module" and is_fsdp_module(v):
            _install_fsdp_setters()
            sig.append(config_key(v))
    return tuple(sig)


def describe(before: tuple, after: tuple) -> str:
    n_global = len(_GLOBAL_DICTS)
    for i, (a, b) in enumerate(zip(before, after)):
        if a != b:
            if i < n_global:
                return f"the global hooks {_GLOBAL_DICTS[i][1]} changed"
            if isinstance(a, tuple) and a[:1] == ("fully_shard",):
                return "the configuration of a fully_shard unit changed (one of FSDPModule's set_* switches)"
            return "a hook of a module, tensor or optimizer the function uses was registered or removed"
    return "the hooks changed"


def _user_forward_hooks(m) -> bool:
    """Forward hooks other than fully_shard's own (which the program replaces: compiler/acquisition/fsdp.py)."""
    mine = fsdp_hook_ids(m)
    return any(k not in mine for k in m._forward_hooks) or any(k not in mine for k in m._forward_pre_hooks)


def forward_hooks_note(leaves, vals) -> str | None:
    """A warning's text when forward hooks ran while tracing (None without any)."""
    hooked = [v for leaf, v in zip(leaves, vals) if leaf.kind == "module" and _user_forward_hooks(v)]
    if not hooked and not (_module_mod._global_forward_hooks or _module_mod._global_forward_pre_hooks):
        return None
    where = f"on {type(hooked[0]).__name__}" + (f" and {len(hooked) - 1} more modules" if len(hooked) > 1 else "") \
        if hooked else "registered globally"
    return (f"forward hooks {where} ran once, while tracing: their tensor work is part of the compiled program, but "
            "their Python side effects (appending to a list, printing, counting calls) happen once per trace, not once "
            "per call. Return what a hook records from the model instead, or keep such hooks outside the compiled "
            "function. Adding or removing a hook retraces.")


class HookCheck:
    """An entry's hooks as traced, re-read when any hook changed since the last check (``version()``)."""

    __slots__ = ("sig", "version")

    def __init__(self, leaves, vals):
        self.sig = signature(leaves, vals)
        self.version = version()

    def changed(self, leaves, vals) -> str | None:
        """None when the hooks are as traced; else what changed."""
        if self.version == _Version.n:
            return None
        now = signature(leaves, vals)
        if now != self.sig:
            return describe(self.sig, now)
        self.version = _Version.n
        return None


def recheck(entries) -> None:
    """The next full-path call of each entry re-reads its hooks whatever the version says (``revalidate()``)."""
    for e in entries:
        if e.hooks is not None:
            e.hooks.version = -1
