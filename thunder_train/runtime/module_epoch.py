"""The module epoch: one integer that every change of a module a thin binding holds bumps.

Thin mode compares it on every call instead of reading the module tree (docs/thin_mode.md): torch's
global registration hooks, plus wrappers of ``nn.Module.__setattr__``/``__delattr__``/``_apply``/
``register_parameter``, bump it for watched modules only.  They are installed when the first module is watched
(the first thin binding), so a process that never binds pays nothing on eager code; after that, an unwatched module's
``__setattr__`` pays one extra Python call and set lookup (about 0.1-0.3 µs on a ~2.5 µs call).
"""
from __future__ import annotations

import weakref

import torch


# ---------------------------------------------------------------------------
# The module epoch: bumped whenever a watched module (one a thin binding holds) changes in a way
# the guard key sees: it registers a parameter, buffer or submodule (torch's global registration
# hooks: ``m.weight = nn.Parameter(...)``, ``load_state_dict(..., assign=True)``, ``m.fc = ...``), a
# public attribute or ``training`` is assigned or deleted (``m.eval()``, ``m.p = 0.2``), or
# ``_apply`` converts its tensors (``.to(dtype/device)``, ``.half()``, ``.double()``, ``.cuda()``).
# One integer comparison per thin call covers every module of the tree, wherever it was found.
# ---------------------------------------------------------------------------
class _Epoch:
    n = 0
    why = ""


# Only modules some thin binding bound (by id; dropped when the module dies): building or training an
# unrelated model does not invalidate.
_watched: set = set()


def _bump(module, why):
    if id(module) in _watched:
        _Epoch.n += 1
        _Epoch.why = why


def _registered(module, name, *_):
    _bump(module, f"{type(module).__name__}.{name} was registered or replaced")
    return None


def watch(modules) -> None:
    for m in modules:
        if id(m) not in _watched:
            if not _installed:
                _install()  # before the module is watched: no change after this point goes unseen
            _watched.add(id(m))
            weakref.finalize(m, _watched.discard, id(m))


_installed = False

# torch has no hook for plain attribute assignment, deletion, ``_apply`` or a parameter set to None: the four
# methods are wrapped once, at the first watch (the methods current then are the ones wrapped). The wrappers do the
# original's work and then one set lookup; names starting with "_" (bookkeeping that Lightning and others set every
# step) are not guarded and do not bump.
_Module = torch.nn.Module
_setattr = _delattr = _apply = _register_parameter = None


def _watching_setattr(self, name, value):
    if id(self) not in _watched:
        return _setattr(self, name, value)
    d = self.__dict__
    old = d.get(name, _NOTHING)
    _setattr(self, name, value)
    new = d.get(name, _NOTHING)
    # Assigning the value it already has (Lightning's model.train() each epoch) changes nothing; nor does
    # swapping one function held by the instance for another (Lightning's DDP wrapper patches ``forward`` around
    # every step, and puts back the bound method it read).  A function first set on the instance shadows its
    # class's (``m.forward = ...``): thin mode ran the traced forward.
    if new is not old and (name[:1] != "_" or name in ("_parameters", "_buffers", "_modules")) \
            and not (old is not _NOTHING and _is_routine(old) and _is_routine(new)):
        _bump(self, f"{type(self).__name__}.{name} was assigned")
    elif name == "__class__":  # (``m.__class__ = X``: not in the instance's __dict__, another forward)
        _bump(self, f"the class of a {type(self).__name__} was assigned")


def _is_routine(v) -> bool:
    return v is _NOTHING or (callable(v) and not isinstance(v, (torch.nn.Module, torch.Tensor, type)))


_NOTHING = object()


def _watching_delattr(self, name):
    if id(self) not in _watched:
        return _delattr(self, name)
    registered = name in self._parameters or name in self._buffers or name in self._modules
    old = self.__dict__.get(name, _NOTHING)
    _delattr(self, name)
    if registered or (name[:1] != "_" and old is not _NOTHING):  # (a function deleted: its class's shows again)
        _bump(self, f"{type(self).__name__}.{name} was deleted")


def _watching_register_parameter(self, name, param):
    _register_parameter(self, name, param)
    # torch's registration hooks run for a Parameter only: ``m.bias = None`` (which calls this) bumped nothing,
    # and thin mode ran the program with the bias it had bound.
    if param is None:
        _bump(self, f"{type(self).__name__}.{name} was set to None")


def _watching_apply(self, fn, *args, **kwargs):
    out = _apply(self, fn, *args, **kwargs)
    _bump(self, f"{type(self).__name__}'s tensors were converted (.to(), .half(), .double(), ...)")
    return out


def _install() -> None:
    global _installed, _setattr, _delattr, _apply, _register_parameter
    _setattr, _delattr, _apply = _Module.__setattr__, _Module.__delattr__, _Module._apply
    _register_parameter = _Module.register_parameter
    mm = torch.nn.modules.module
    mm.register_module_parameter_registration_hook(_registered)
    mm.register_module_buffer_registration_hook(_registered)
    mm.register_module_module_registration_hook(_registered)
    for name, fn, orig in (("__setattr__", _watching_setattr, _setattr), ("__delattr__", _watching_delattr, _delattr),
                           ("_apply", _watching_apply, _apply),
                           ("register_parameter", _watching_register_parameter, _register_parameter)):
        fn.__wrapped__ = orig
        fn.__doc__ = orig.__doc__
        setattr(_Module, name, fn)
    _installed = True


def epoch() -> int:
    return _Epoch.n
