"""Module-level functions the traced code ran torch ops in: guarded by name in their module.

The scan of captured names (captured.py) follows the user's own code only; a library's code is run while tracing,
never read.  A library function the model calls by its module's global name (transformers'
``modeling_llama.apply_rotary_pos_emb``, a loss helper) replaced after the first call (a kernel-patching library
applied late, a notebook's monkeypatch) was not seen: eager ran the new function, the program the traced one.

While tracing, each torch op the tracer handles notes the innermost Python frame outside torch and thunder_train
(``note_caller``); where that frame runs a module-level function, found under its own name in its module, the pair
``(module, name)`` and the function (or the callable object the module holds under that name) are kept
(``TracerState.called_functions``), and so is the name in the module of the frame's caller where that module
imported it.  The guard key holds ``getattr(module, name)`` for each, as it holds the user's methods (prologue
``method_checks``): a replaced one retraces.  Not seen: a library function that calls no torch op itself (only
others that do), one reached other than by its module's name (a function stored in a dict or on an object), a
library class's method other than ``forward``.
"""
from __future__ import annotations

import os
import sys
import types

import torch

_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_MAX_FRAMES = 12  # the tracer's own frames and torch's Python wrappers (F.layer_norm) between the op and its caller


def note_caller(st) -> None:
    """Keep the module-level function whose frame called the torch op being handled (see the module docstring)."""
    f = sys._getframe(2)
    for _ in range(_MAX_FRAMES):
        if f is None:
            return
        path = f.f_code.co_filename
        if not (path.startswith(_PACKAGE) or path.startswith(_TORCH) or path.startswith("<")):
            break
        f = f.f_back
    else:
        return
    if f is None:
        return
    code = f.f_code
    key = (id(f.f_globals), code.co_name)
    seen = st.called_functions
    if key in seen:
        return
    fn = f.f_globals.get(code.co_name)
    module = sys.modules.get(f.f_globals.get("__name__", ""))
    if module is None or getattr(module, code.co_name, None) is not fn:
        seen[key] = None
        return
    # The function itself, or a callable object its module calls it through under its name (transformers wraps
    # ``apply_rotary_pos_emb`` in a module that may swap in a hub kernel): replacing either is rebinding the name.
    plain = type(fn) is types.FunctionType
    ok = _runs(fn, code) if plain else callable(fn) and not isinstance(fn, (type, types.ModuleType))
    seen[key] = (module, code.co_name, fn) if ok else None
    caller = f.f_back
    if ok and caller is not None and caller.f_globals is not f.f_globals and caller.f_globals.get(code.co_name) is fn:
        # (the name as the caller's module imported it: ``modeling_llama.create_causal_mask``, from masking_utils)
        by = sys.modules.get(caller.f_globals.get("__name__", ""))
        if by is not None and getattr(by, code.co_name, None) is fn:
            seen[(id(caller.f_globals), code.co_name)] = (by, code.co_name, fn)


def _runs(fn, code) -> bool:
    """``fn`` runs ``code``, itself or through ``functools.wraps`` wrappers (a decorator's ``__wrapped__`` chain)."""
    for _ in range(_MAX_FRAMES):
        if getattr(fn, "__code__", None) is code:
            return True
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return False
    return False


def guarded(st) -> tuple:
    """``(module, ((name, function), ...))`` of the functions kept, in a deterministic order."""
    by_module: dict = {}
    for found in st.called_functions.values():
        if found is not None:
            by_module.setdefault(found[0], []).append((found[1], found[2]))
    return tuple((m, tuple(sorted(named, key=lambda nf: nf[0])))
                 for m, named in sorted(by_module.items(), key=lambda kv: kv[0].__name__))
