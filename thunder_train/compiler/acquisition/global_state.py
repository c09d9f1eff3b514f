"""Process-wide torch state a traced function changes: refused, never silently dropped.

Tracing runs the user's Python once; later calls run only the recorded tensor program.  A call
that changes process-wide state (``torch.manual_seed``, ``torch.set_default_dtype``,
``torch.set_grad_enabled(False)`` as a plain call, ``torch.use_deterministic_algorithms``, ...)
would therefore happen on the first call only: later calls would draw different random numbers
than eager, or leave the state as it was.  So

* reseeding the random number generators (``torch.manual_seed``, ``torch.seed``,
  ``torch.set_rng_state`` and their ``torch.random``/``torch.cuda`` forms) raises at once — a
  reseed never changes anything the trace could see, so it cannot be specialised on;
* any other state in ``_STATE`` that the function leaves changed when it returns raises, naming it
  (a change that is undone before returning, as ``with torch.set_grad_enabled(False):`` does, is
  traced like any other region);
* the state is restored when tracing fails, so a refused call leaves the process as it was.
"""
from __future__ import annotations

import contextlib

import torch

from .. import context
from ..errors import TracingError


def _backend_flag(obj, attr):
    return (lambda: getattr(obj, attr)), (lambda v: setattr(obj, attr, v))


def _deterministic_get():
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _deterministic_set(v):
    torch.use_deterministic_algorithms(v[0], warn_only=v[1])


# name shown to the user -> (getter, setter)
_STATE = {
    "torch.is_grad_enabled() (torch.set_grad_enabled as a plain call)": (torch.is_grad_enabled, torch._C._set_grad_enabled),
    "torch.get_default_dtype() (torch.set_default_dtype)": (torch.get_default_dtype, torch.set_default_dtype),
    "torch.get_default_device() (torch.set_default_device)": (torch.get_default_device, torch.set_default_device),
    "torch.are_deterministic_algorithms_enabled() (torch.use_deterministic_algorithms)": (_deterministic_get, _deterministic_set),
    "torch.is_anomaly_enabled() (torch.autograd.set_detect_anomaly as a plain call)": (torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    "torch.get_float32_matmul_precision() (torch.set_float32_matmul_precision)": (
        torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    "torch.get_num_threads() (torch.set_num_threads)": (torch.get_num_threads, torch.set_num_threads),
    "torch.backends.cudnn.deterministic": _backend_flag(torch.backends.cudnn, "deterministic"),
    "torch.backends.cudnn.benchmark": _backend_flag(torch.backends.cudnn, "benchmark"),
    "torch.backends.cuda.matmul.allow_tf32": _backend_flag(torch.backends.cuda.matmul, "allow_tf32"),
}

# (module, name) of the Python functions that reseed a generator
_RESEEDS = [(torch, "manual_seed"), (torch, "seed"), (torch, "set_rng_state"),
            (torch.random, "manual_seed"), (torch.random, "seed"), (torch.random, "set_rng_state"),
            (torch.cuda, "manual_seed"), (torch.cuda, "manual_seed_all"), (torch.cuda, "seed"), (torch.cuda, "seed_all"),
            (torch.cuda, "set_rng_state"), (torch.cuda, "set_rng_state_all")]

_RESEED_MSG = (
    "{name}() inside a compiled function: it would run once, while tracing, and later calls would draw different "
    "random numbers than eager. Seed outside the compiled function (before calling it), or pass random tensors in."
)


def _refusing(name, original, st):
    def reseed(*args, **kwargs):
        if context.tracer_state() is not st:  # another thread, or a pass after acquisition
            return original(*args, **kwargs)
        raise TracingError(_RESEED_MSG.format(name=name))

    reseed.__wrapped__ = original
    return reseed


def _rng_state():
    return torch.get_rng_state(), torch.initial_seed()


@contextlib.contextmanager
def global_state_unchanged():
    """While the user's function runs under tracing: reseeding raises; state left changed raises at the end."""
    st = context.tracer_state()
    before = {k: get() for k, (get, _) in _STATE.items()}
    rng = _rng_state()
    patched = []
    for mod, name in _RESEEDS:
        original = getattr(mod, name, None)
        if original is not None:
            patched.append((mod, name, original))
            setattr(mod, name, _refusing(f"{mod.__name__}.{name}", original, st))
    ok = False
    try:
        yield
        ok = True
    finally:
        for mod, name, original in patched:
            setattr(mod, name, original)
        changed = [k for k, (get, _) in _STATE.items() if get() != before[k]]
        for k in changed:
            _STATE[k][1](before[k])
        rng_after = _rng_state()
        rng_changed = rng_after[1] != rng[1] or not torch.equal(rng_after[0], rng[0])
        if rng_changed:
            torch.set_rng_state(rng[0])
        if ok and rng_changed:
            raise TracingError(
                "the compiled function reseeded or advanced torch's default random number generator outside the traced "
                "program (torch.default_generator.manual_seed(...), a real tensor's random op, ...): that would happen "
                "only while tracing. Seed outside the compiled function.")
        if ok and changed:
            raise TracingError(
                f"the compiled function leaves {', '.join(changed)} changed when it returns: the change would happen only "
                "on the first call (while tracing), not on later calls. Set it outside the compiled function, or undo it "
                "before returning (use the context-manager form, e.g. `with torch.set_grad_enabled(False):`).")
