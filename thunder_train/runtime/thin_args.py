"""How ``thin_call`` passes the bound tensors to the computation.

A training step's computation takes every parameter and optimizer-state tensor as a positional argument
(3,000 for a 1,000-parameter AdamW step), most of them bound as constants of ``thin_call``, interleaved
with the values read per call (hyper-parameters, the batch).  Writing the call as
``f(*_run0, lr, ..., *_run1, x, y)`` builds a list and then a tuple of all of them on every call: two
passes over 3,000 objects that the previous step pushed out of the CPU caches (about 40 µs).

When the computation is a generated function (``compiler/codegen.py``: positional parameters only, no
decorator), the binding compiles its source once more with the per-call parameters first and the bound
ones last, and gives the bound ones as the function's defaults: the call passes only the per-call values
(``f(lr, ..., x, y)``) and CPython fills in the rest from the defaults, as it fills in positional
arguments.  An epilogue or output wrapper that passes its inputs on unchanged is made again around the reordered
computation; any other callable (a wrapper with epilogue targets, a captured CUDA graph) is called the interleaved
way.
"""
from __future__ import annotations

import inspect
import itertools
import linecache
import types

_counter = itertools.count()
# Runs of more bound arguments than this go through the defaults (fewer are passed by name: no tuple is built).
MIN_BOUND = 8


def _reordered_code(fn, is_bound: tuple, cache: dict):
    """The code of ``fn`` with its bound parameters moved last (cached per code and layout), or None."""
    code = getattr(fn, "__code__", None)
    src = getattr(fn, "__thunder_source__", None)
    if type(fn) is not types.FunctionType or code is None or src is None or fn.__closure__ or fn.__defaults__ \
            or fn.__kwdefaults__ or code.co_kwonlyargcount or code.co_argcount != len(is_bound) \
            or code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS):
        return None
    key = (code, is_bound)
    if key in cache:
        return cache[key]
    lines = src.split("\n")
    head = f"def {code.co_name}("
    d = next((j for j, line in enumerate(lines) if line.startswith(head)), None)
    if d is None or any(line.startswith("@") for line in lines[:d]):
        cache[key] = None
        return None
    params = code.co_varnames[:code.co_argcount]
    order = [p for p, b in zip(params, is_bound) if not b] + [p for p, b in zip(params, is_bound) if b]
    lines[d] = f"{head}{', '.join(order)}):"
    new_src = "\n".join(lines)
    filename = f"<thunder_train {code.co_name} (thin mode: bound inputs as defaults) {next(_counter)}>"
    linecache.cache[filename] = (len(new_src), None, new_src.splitlines(True), filename)
    module = compile(new_src, filename, "exec")
    new = next((c for c in module.co_consts if isinstance(c, types.CodeType) and c.co_name == code.co_name), None)
    cache[key] = None if new is None else (new, new_src)
    return cache[key]


def _generated_call(fn, names: list, bound: dict, cache: dict):
    """``(callable, argument names)`` for ``thin_call`` to call ``callable(*names)``, or None (interleaved call).

    ``names`` are the computation's arguments in order: names in ``bound`` are constants of the binding."""
    is_bound = tuple(n in bound for n in names)
    if sum(is_bound) <= MIN_BOUND:
        return None
    made = _reordered_code(fn, is_bound, cache)
    if made is None:
        return None
    code, src = made
    new = types.FunctionType(code, fn.__globals__, fn.__name__, tuple(bound[n] for n, b in zip(names, is_bound) if b))
    new.__thunder_source__ = src
    return new, [n for n, b in zip(names, is_bound) if not b]


def computation_call(fn, names: list, bound: dict, cache: dict):
    """``_generated_call`` of ``fn``, or, where ``fn`` wraps a computation passing it its inputs unchanged (an
    epilogue, an output rebuild: ``inner`` and ``rewrap``, compiler/pipeline.py), the same wrapper around the
    reordered computation."""
    inner = getattr(fn, "inner", None)
    if inner is None:
        return _generated_call(fn, names, bound, cache)
    made = computation_call(inner, names, bound, cache)
    return None if made is None else (fn.rewrap(made[0]), made[1])


def adapter(names: list, bound: dict, cache: dict, packed_args):
    """A function that turns ``fn`` (a computation taking ``names``) into what a reordered ``thin_call`` calls.

    Applied by ``Slot`` (slot.py) to whatever the entry runs: at binding, and when a fused program replaces it."""
    per_call = [n for n in names if n not in bound]

    def adapt(fn):
        made = computation_call(fn, names, bound, cache)
        if made is not None and made[1] == per_call:
            return made[0]
        # The interleaved call, with the per-call values as this function's parameters (_a0, _a1, ...).
        slots = iter(range(len(per_call)))
        g = dict(bound)
        call = ", ".join(packed_args([n if n in bound else f"_a{next(slots)}" for n in names], g))
        ns = {**g, "_target": fn}
        params = ", ".join(f"_a{k}" for k in range(len(per_call)))
        exec(compile(f"def adapted({params}):\n  return _target({call})\n", "<thunder_train thin adapter>", "exec"), ns)
        return ns["adapted"]

    return adapt
