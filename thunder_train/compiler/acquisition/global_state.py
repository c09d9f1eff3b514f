"""Process-wide torch state a traced function changes: traced as lines of the program, or refused; never
silently dropped.

Tracing runs the user's Python once; later calls run only the recorded tensor program.  A call
that changes process-wide state (``torch.set_default_dtype``,
``torch.set_grad_enabled(False)`` as a plain call, ``torch.use_deterministic_algorithms``, ...)
would therefore happen on the first call only: later calls would leave the state as it was.  So

* seeding, reading and setting the random generators' state (``torch.manual_seed``,
  ``torch.get_rng_state``/``set_rng_state``, their ``torch.random``/``torch.cuda`` forms, and so
  ``torch.random.fork_rng`` and checkpoint's ``preserve_rng_state``) become lines of the program
  (``prims/generators.py``), run on every call where eager runs them; ``torch.seed()`` (entropy
  from the operating system) raises at once;
* any other state in ``_STATE`` that the function leaves changed when it returns raises, naming it
  (a change that is undone before returning, as ``with torch.set_grad_enabled(False):`` does, is
  traced like any other region);
* the state is restored when tracing fails, so a refused call leaves the process as it was.
"""
from __future__ import annotations

import contextlib
import random
import sys
import threading

import torch

from .. import context, devices, prims
from ..errors import TracingError
from ..proxies import TensorProxy, is_int


def _backend_flag(obj, attr):
    return (lambda: getattr(obj, attr)), (lambda v: setattr(obj, attr, v))


def _deterministic_get():
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _deterministic_set(v):
    torch.use_deterministic_algorithms(v[0], warn_only=v[1])


def _matmul_precision():
    from ..torchlang.matmul_precision import _precision

    return _precision()  # None where torch names none (per-backend settings set apart)


# name shown to the user -> (getter, setter)
_STATE = {
    "torch.is_grad_enabled() (torch.set_grad_enabled as a plain call)": (torch.is_grad_enabled, torch._C._set_grad_enabled),
    "torch.get_default_dtype() (torch.set_default_dtype)": (torch.get_default_dtype, torch.set_default_dtype),
    "torch.get_default_device() (torch.set_default_device)": (torch.get_default_device, torch.set_default_device),
    "torch.are_deterministic_algorithms_enabled() (torch.use_deterministic_algorithms)": (_deterministic_get, _deterministic_set),
    "torch.is_anomaly_enabled() (torch.autograd.set_detect_anomaly as a plain call)": (torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    "torch.get_float32_matmul_precision() (torch.set_float32_matmul_precision)": (
        _matmul_precision, lambda v: v is not None and torch.set_float32_matmul_precision(v)),
    "torch.get_num_threads() (torch.set_num_threads)": (torch.get_num_threads, torch.set_num_threads),
    "torch.backends.cudnn.deterministic": _backend_flag(torch.backends.cudnn, "deterministic"),
    "torch.backends.cudnn.benchmark": _backend_flag(torch.backends.cudnn, "benchmark"),
    "torch.backends.cuda.matmul.allow_tf32": _backend_flag(torch.backends.cuda.matmul, "allow_tf32"),
}
# name in _STATE -> (module, function) that sets it: noted while a thread traces when another thread calls it, so
# that a change made by another thread meanwhile is not put back over theirs (grad mode and the default device are
# torch's per thread; the backend flags are attributes, set without a call)
_SETTERS = {
    "torch.get_default_dtype() (torch.set_default_dtype)": (torch, "set_default_dtype"),
    "torch.are_deterministic_algorithms_enabled() (torch.use_deterministic_algorithms)": (
        torch, "use_deterministic_algorithms"),
    "torch.is_anomaly_enabled() (torch.autograd.set_detect_anomaly as a plain call)": (torch, "set_anomaly_enabled"),
    "torch.get_float32_matmul_precision() (torch.set_float32_matmul_precision)": (torch, "set_float32_matmul_precision"),
    "torch.get_num_threads() (torch.set_num_threads)": (torch, "set_num_threads"),
}


def _global_draws():
    """(module, name) of the functions drawing from Python's and numpy's global generators (their module-level
    functions are methods of one hidden instance), noted while a thread traces when another thread calls them."""
    out = [(random, n) for n, f in vars(random).items() if getattr(f, "__self__", None) is random._inst]
    npr = sys.modules.get("numpy.random")  # not ``numpy.random`` of numpy: that would import it (~12 ms)
    if npr is not None:
        shared = getattr(getattr(npr, "mtrand", None), "_rand", None)
        out += [(npr, n) for n, f in vars(npr).items() if shared is not None
                and getattr(f, "__self__", None) is shared]
    return out

def _cuda_device(device):
    d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return devices.Device("cuda", d.index)


def _state_value(name, state):
    if type(state) is not TensorProxy:
        raise TracingError(
            f"{name}() inside a compiled function was given a {type(state).__name__} made while tracing, not a state "
            "read by torch.get_rng_state() or a tensor input: pass the saved state in as an argument (or read it from "
            "a global), so that every call sets it.")
    return state


def _seed_value(seed):
    return seed if is_int(seed) else int(seed)  # eager's int(seed)


def _cpu_manual_seed(seed):
    prims.manual_seed(_seed_value(seed), "all")
    return torch.default_generator


# (module, name) -> what it does while this thread traces: a line of the program (prims/generators.py), so that
# every call seeds, reads and restores the generators where eager does (fork_rng and checkpoint's
# preserve_rng_state are built on these names and come along).
_TRACED = {
    (torch, "manual_seed"): _cpu_manual_seed,
    (torch.random, "manual_seed"): _cpu_manual_seed,
    (torch, "get_rng_state"): lambda: prims.get_rng_state(devices.cpu),
    (torch.random, "get_rng_state"): lambda: prims.get_rng_state(devices.cpu),
    (torch, "set_rng_state"): lambda new_state: prims.set_rng_state(_state_value("torch.set_rng_state", new_state), devices.cpu),
    (torch.random, "set_rng_state"): lambda new_state: prims.set_rng_state(
        _state_value("torch.random.set_rng_state", new_state), devices.cpu),
    (torch.cuda, "manual_seed"): lambda seed: prims.manual_seed(_seed_value(seed), "cuda"),
    (torch.cuda, "manual_seed_all"): lambda seed: prims.manual_seed(_seed_value(seed), "cuda_all"),
    (torch.cuda, "get_rng_state"): lambda device="cuda": prims.get_rng_state(_cuda_device(device)),
    (torch.cuda, "get_rng_state_all"): lambda: [prims.get_rng_state(devices.Device("cuda", i))
                                                for i in range(torch.cuda.device_count())],
    (torch.cuda, "set_rng_state"): lambda new_state, device="cuda": prims.set_rng_state(
        _state_value("torch.cuda.set_rng_state", new_state), _cuda_device(device)),
    (torch.cuda, "set_rng_state_all"): lambda new_states: [prims.set_rng_state(
        _state_value("torch.cuda.set_rng_state_all", s), devices.Device("cuda", i)) for i, s in enumerate(new_states)],
}

# (module, name) of the functions that seed from the operating system's entropy: no two calls agree, so the
# program cannot draw what eager draws after them
_REFUSED = [(torch, "seed"), (torch.random, "seed"), (torch.cuda, "seed"), (torch.cuda, "seed_all")]

_SEEDING = {f"{m.__name__}.{n}" for m, n in list(_TRACED) + _REFUSED}

_RESEED_MSG = (
    "{name}() inside a compiled function seeds from the operating system's entropy, which no compiled program can "
    "reproduce. Call it outside the compiled function, or seed with torch.manual_seed(n) inside."
)


def _noting(name, original, st, elsewhere):
    def fn(*args, **kwargs):
        if context.tracer_state() is not st:
            elsewhere.note(name)
        return original(*args, **kwargs)

    fn.__wrapped__ = original
    return fn


def _refusing(name, original, st, elsewhere):
    def reseed(*args, **kwargs):
        if context.tracer_state() is not st:  # another thread, or a pass after acquisition
            elsewhere.note(name)
            return original(*args, **kwargs)
        raise TracingError(_RESEED_MSG.format(name=name))

    reseed.__wrapped__ = original
    return reseed


class _OtherThreads:
    """The generator functions other threads called while this thread traced (they pass through our patches)."""

    def __init__(self):
        self.owner, self.calls = threading.get_ident(), set()  # a set: another thread may draw millions

    def note(self, name):
        if threading.get_ident() != self.owner:
            self.calls.add(name)


def _traced(name, traced, original, st, elsewhere):
    def fn(*args, **kwargs):
        if context.tracer_state() is not st:  # eager code in another thread, or a pass after acquisition
            elsewhere.note(name)
            return original(*args, **kwargs)
        return traced(*args, **kwargs)

    fn.__wrapped__ = original
    return fn


def _rng_state():
    return torch.get_rng_state(), torch.initial_seed()


# numpy's global generator before ``numpy.random`` is imported: it does not exist yet, and is made when the module is
# (torch imports numpy, not numpy.random; importing it costs ~12 ms, half a tiny function's first call).  numpy 2
# seeds it from a ``SeedSequence`` its bit generator keeps (``seed_seq``; None once ``np.random.seed`` reseeded it),
# which says what state the import made: older numpy is imported to read the state, as before.
_NOT_IMPORTED = "not imported"


def _python_generators() -> dict:
    """The state of Python's and numpy's global random generators (numpy's as ``_NOT_IMPORTED`` where the process has
    not imported ``numpy.random``)."""
    out = {"random": random.getstate()}
    np = sys.modules.get("numpy")
    if np is None:
        return out
    npr = sys.modules.get("numpy.random")
    if npr is None and not np.__version__.startswith("1."):
        out["numpy.random"] = _NOT_IMPORTED
    else:
        out["numpy.random"] = np.random.get_state(legacy=False)
    return out


def _numpy_state_as_imported(npr):
    """The state numpy's global generator had when ``numpy.random`` was imported; None once it was reseeded."""
    bit_generator = getattr(getattr(getattr(npr, "mtrand", None), "_rand", None), "_bit_generator", None)
    seed_seq = getattr(bit_generator, "seed_seq", None)
    if seed_seq is None:
        return None
    return {"bit_generator": "MT19937", "state": npr.MT19937(seed_seq).state["state"], "has_gauss": 0, "gauss": 0.0}


def _python_generators_moved(before, keep) -> list:
    """The names of the generators in ``before`` whose state moved; each is put back, except those in ``keep``.
    ``numpy.random`` imported while tracing (by the function or a library it calls) moved if its generator is not
    as the import made it (a draw, a seed)."""
    moved = []
    for name, old in before.items():
        if name == "random":
            if random.getstate() != old:
                moved.append("random (Python's random module: random.random, random.betavariate, ...)")
                if name not in keep:
                    random.setstate(old)
            continue
        npr = sys.modules.get("numpy.random")
        if npr is None:
            continue
        new = npr.get_state(legacy=False)
        if old is _NOT_IMPORTED:
            old = _numpy_state_as_imported(npr)
            if old is None:  # imported and reseeded while tracing: moved, with no state before it to put back
                moved.append("numpy.random (np.random.seed)")
                continue
        if new["state"]["pos"] != old["state"]["pos"] or new["has_gauss"] != old["has_gauss"] \
                or not (new["state"]["key"] == old["state"]["key"]).all():
            moved.append("numpy.random (np.random.beta, np.random.rand, ...)")
            if name not in keep:
                npr.set_state(old)
    return moved


def _other_threads() -> bool:
    """Whether a thread other than this one and thunder_train's fusion worker (which draws nothing) runs: its
    draws would move the generator while this thread traces."""
    me = threading.current_thread()
    return any(t is not me and t.name != "thunder_train-fusion" for t in threading.enumerate())


_NOT_PUT_BACK = (" The generator was left as it is now, not put back: another thread drew from it meanwhile (putting it "
                 "back would hand that thread the same numbers again).")


@contextlib.contextmanager
def global_state_unchanged():
    """While the user's function runs under tracing: reseeding raises; state left changed raises at the end."""
    st = context.tracer_state()
    before = {k: get() for k, (get, _) in _STATE.items()}
    rng = _rng_state()
    python_generators = _python_generators()
    patched = []
    elsewhere = _OtherThreads()
    for (mod, name), traced in list(_TRACED.items()) + [(k, None) for k in _REFUSED]:
        original = getattr(mod, name, None)
        if original is not None:
            patched.append((mod, name, original))
            full = f"{mod.__name__}.{name}"
            setattr(mod, name, _refusing(full, original, st, elsewhere) if traced is None
                    else _traced(full, traced, original, st, elsewhere))
    for mod, name in list(_SETTERS.values()) + _global_draws():
        original = getattr(mod, name, None)
        if original is not None:
            patched.append((mod, name, original))
            setattr(mod, name, _noting(f"{mod.__name__}.{name}", original, st, elsewhere))
    ok = False
    try:
        yield
        ok = True
    finally:
        for mod, name, original in patched:
            setattr(mod, name, original)
        changed = [k for k, (get, _) in _STATE.items() if get() != before[k]]
        theirs = [k for k in changed if k in _SETTERS and f"torch.{_SETTERS[k][1]}" in elsewhere.calls]
        for k in changed:
            if k not in theirs:
                _STATE[k][1](before[k])
        rng_after = _rng_state()
        # Tracing records the user's random ops and the generator-state functions above as lines; what moved the
        # generator now ran for real (torch.default_generator.manual_seed, a random op on a real tensor). A new
        # seed is that unless another thread seeded through torch's functions meanwhile; a state that only advanced
        # may be another thread's draws (the generator is theirs too), so that counts only when no other thread
        # runs. Either way the state is put back and the call refused.
        others_seeded = any(c in _SEEDING for c in elsewhere.calls)
        reseeded = rng_after[1] != rng[1] and not others_seeded
        rng_changed = reseeded or not others_seeded and not _other_threads() and not torch.equal(rng_after[0], rng[0])
        if rng_changed:
            torch.set_rng_state(rng[0])
        # Unlike torch's generator, checked with other threads running too (a data loader's or logger's thread): a
        # silent constant is worse than the rare false alarm of another thread drawing from the global generator.
        # Not put back where another thread drew through the module's functions meanwhile: undoing that would hand
        # it the same numbers again.
        others_drew = {c.rpartition(".")[0] for c in elsewhere.calls} & set(python_generators)
        drawn = _python_generators_moved(python_generators, keep=others_drew)
        if ok and drawn:
            raise TracingError(
                f"the compiled function drew from {' and '.join(drawn)} while tracing: the program would use the "
                "numbers drawn then as constants on every call, where eager draws new ones. Draw them outside the "
                "compiled function and pass them in as tensors (`lam = torch.tensor(random.betavariate(a, a))`), or "
                "draw with torch inside (torch.rand, torch.randperm, torch.distributions), which the program draws "
                "on every call. (Another thread drawing from it during this first call raises this too: give that "
                "thread a generator of its own, random.Random() or np.random.default_rng().)"
                + (_NOT_PUT_BACK if others_drew else ""))
        if ok and rng_changed:
            raise TracingError(
                "the compiled function reseeded or advanced torch's default random number generator outside the traced "
                "program (torch.default_generator.manual_seed(...), a real tensor's random op, ...): that would happen "
                "only while tracing. Seed outside the compiled function.")
        if ok and changed:
            raise TracingError(
                f"the compiled function leaves {', '.join(changed)} changed when it returns: the change would happen only "
                "on the first call (while tracing), not on later calls. Set it outside the compiled function, or undo it "
                "before returning (use the context-manager form, e.g. `with torch.set_grad_enabled(False):`)."
                + (f" ({', '.join(theirs)}: left as it is now, not put back: another thread set it meanwhile.)"
                   if theirs else ""))


@contextlib.contextmanager
def parametrizations_computed_where_read(modules):
    """A parametrized tensor (``torch.nn.utils.parametrize``) of ``modules`` read while this thread traces is computed
    in the trace where it is read, never taken from or put into the cache of ``parametrize.cached()``: that cache
    is process-wide (``_cache_enabled``, ``_cache``), and a block entered around the compiled call or by another
    thread would hand the trace eager tensors computed before, or keep the traced one, a proxy that then escapes
    into eager code.  torch's names are left alone (setting them aside raced with another thread's ``cached()``:
    its count could end at -1, caching forever).  Instead each parametrized module's own class (torch makes one per
    module) reads its property through ``context.tracer_state()`` meanwhile: other threads run torch's getter, cache
    included; a ``cached()`` inside the function counts as in eager and the trace computes each read (the same
    values)."""
    from torch.nn.utils import parametrize

    st = context.tracer_state()
    replaced = []
    for m in modules:
        if not parametrize.is_parametrized(m):
            continue
        cls = type(m)
        for name in m.parametrizations:
            prop = cls.__dict__.get(name)
            if type(prop) is property:
                replaced.append((cls, name, prop))
                setattr(cls, name, property(_computed_in_trace(prop.fget, name, st), prop.fset, None, prop.__doc__))
    try:
        yield
    finally:
        for cls, name, prop in reversed(replaced):
            setattr(cls, name, prop)


def _computed_in_trace(getter, name, st):
    def get(module):
        if context.tracer_state() is not st:  # another thread, or a pass after acquisition: torch's getter
            return getter(module)
        return module.parametrizations[name]()

    get.__wrapped__ = getter
    return get
