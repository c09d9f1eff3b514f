"""Run one PyTorch OpInfo through ``tt.compile`` and compare with eager (used by test_opinfo.py and
``benchmarks/opinfo_report.py``).

For each OpInfo in ``torch.testing._internal.common_methods_invocations.op_db`` (CPU):

* **forward**: the op, method and in-place variants in float32, int64 and bool where the OpInfo supports
  them, on the first ``SAMPLES`` sample inputs.  Compared: values, dtypes, shapes, devices, container
  types (``torch.return_types``, tuple vs list), ``requires_grad`` of the outputs, whether an output is the
  input object (in-place identity) and every input tensor after the call (a lost or spurious in-place update).
* **gradients** (float32, OpInfos that support autograd): the gradients of a weighted sum of the outputs
  (fixed random weights; a plain ``sum()`` gives zero gradients for softmax-like ops; a complex output enters
  through its real and imaginary parts) with respect to every input that requires grad, taken with
  ``torch.autograd.grad`` through the compiled function.
* **random ops** (eager gives different values for two seeds) compare structure, shapes, dtypes, devices only;
  their gradients (both runs seeded alike) also values where the compiled call drew what eager drew.

A sample that eager itself rejects is skipped.  Each check ends as ``pass``, ``error`` (the compiled call
raised: a loud failure) or ``mismatch`` (it ran and gave something different: silently wrong).
"""
from __future__ import annotations

import dataclasses
import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_map

import thunder_train as tt

SAMPLES = 3  # sample inputs per OpInfo, dtype and variant (the first ones: OpInfos list simple cases first)
FORWARD_DTYPES = (torch.float32, torch.int64, torch.bool)
FWD_TOL = dict(rtol=1e-4, atol=1e-5)
GRAD_TOL = dict(rtol=1e-3, atol=1e-4)


@dataclasses.dataclass
class Result:
    name: str
    forward: str = "skip"  # "pass" | "error" | "mismatch" | "skip" (eager runs nothing)
    gradient: str = "skip"
    forward_reason: str = ""
    gradient_reason: str = ""
    opaque: set = dataclasses.field(default_factory=set)  # ops run opaquely in any sample

    @property
    def mismatch(self) -> bool:
        return "mismatch" in (self.forward, self.gradient)


def opinfo_id(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def all_opinfos() -> list:
    import sys

    from torch.testing._internal.common_methods_invocations import op_db

    # OpInfos of random ops call ``wrapper_set_seed`` (torch.manual_seed(42) inside the op) so that eager
    # runs repeat; here the op itself is under test, random ops compare structure only.
    for name, mod in list(sys.modules.items()):
        if name.startswith("torch.testing._internal") and getattr(mod, "wrapper_set_seed", None) is not None:
            mod.wrapper_set_seed = _unseeded
    return list(op_db)


def _unseeded(op, *args, **kwargs):
    return op(*args, **kwargs)


# Uninitialised memory: values are not comparable.
UNINITIALISED = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted")


class _Mismatch(Exception):
    pass


def _clone(x):
    def c(t):
        if isinstance(t, torch.Tensor):
            out = t.detach().clone()
            out.requires_grad_(t.requires_grad)
            return out
        return t

    return tree_map(c, x)


def _sample_parts(s):
    return (s.input,) + tuple(s.args), dict(s.kwargs)


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg[:160]}"


def _compare_structure(a, e, what, values, tol):
    if type(a) is not type(e):
        if not (isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor)):
            raise _Mismatch(f"{what}: type {type(a).__name__}, eager {type(e).__name__}")
    if isinstance(e, (tuple, list)):
        if len(a) != len(e):
            raise _Mismatch(f"{what}: {len(a)} items, eager {len(e)}")
        for i, (x, y) in enumerate(zip(a, e)):
            _compare_structure(x, y, f"{what}[{i}]", values, tol)
        return
    if isinstance(e, dict):
        if set(a) != set(e):
            raise _Mismatch(f"{what}: keys {sorted(a)}, eager {sorted(e)}")
        for k in e:
            _compare_structure(a[k], e[k], f"{what}[{k!r}]", values, tol)
        return
    if isinstance(e, torch.Tensor):
        for attr in ("dtype", "shape", "device", "requires_grad"):
            if getattr(a, attr) != getattr(e, attr):
                raise _Mismatch(f"{what}: {attr} {getattr(a, attr)}, eager {getattr(e, attr)}")
        if values:
            try:
                torch.testing.assert_close(a.detach(), e.detach(), equal_nan=True, **tol)
            except AssertionError as err:
                raise _Mismatch(f"{what}: values differ ({str(err).splitlines()[0]})") from None
        return
    if values and a != e and not (isinstance(e, float) and e != e and a != a):
        raise _Mismatch(f"{what}: {a!r}, eager {e!r}")


def _eager(fn, args, kwargs, seed):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _is_random(fn, args, kwargs):
    outs = []
    for seed in (1234, 4321):
        a, k = _clone((args, kwargs))
        outs.append(_eager(fn, a, k, seed))
    try:
        _compare_structure(outs[0], outs[1], "out", True, dict(rtol=0, atol=0))
        return False
    except _Mismatch:
        return True


def _compiled(fn, opaque):
    cf = tt.compile(lambda *a, **k: fn(*a, **k))

    def call(*a, **k):
        try:
            return cf(*a, **k)
        finally:
            opaque.update(tt.compile_stats(cf).opaque_ops)

    return call


def _forward_one(fn, args, kwargs, opaque, uninitialised=False):
    """None (eager rejects the sample), or raises _Mismatch / the compiled call's error."""
    e_args, e_kwargs = _clone((args, kwargs))
    try:
        expected = _eager(fn, e_args, e_kwargs, 0)
        random = uninitialised or _is_random(fn, args, kwargs)
    except Exception:
        return None
    c_args, c_kwargs = _clone((args, kwargs))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        actual = _compiled(fn, opaque)(*c_args, **c_kwargs)
    _compare_structure(actual, expected, "output", not random, FWD_TOL)
    _compare_structure((c_args, c_kwargs), (e_args, e_kwargs), "inputs after the call", not random, FWD_TOL)
    # An output that is an input object in eager (x.add_(1) is x) is that object here too.
    e_in = [id(t) for t in tree_flatten((e_args, e_kwargs))[0]]
    c_in = [id(t) for t in tree_flatten((c_args, c_kwargs))[0]]
    for i, (x, y) in enumerate(zip(tree_flatten(actual)[0], tree_flatten(expected)[0])):
        if isinstance(y, torch.Tensor) and (id(y) in e_in) != (id(x) in c_in):
            raise _Mismatch(f"output[{i}] is {'not ' if id(y) in e_in else ''}an input object, eager's is{'' if id(y) in e_in else ' not'}")
    return True


def _has_tensor(args, kwargs):
    return any(isinstance(t, torch.Tensor) for t in tree_flatten((args, kwargs))[0])


def _variants(op):
    out = [("op", op.op)]
    if op.method_variant is not None:
        out.append(("method", op.method_variant))
    if op.inplace_variant is not None:
        out.append(("inplace", op.inplace_variant))
    return out


def _run_checks(checks):
    """(status, reason) over a list of (label, thunk) checks; a mismatch outranks an error."""
    status, reason, ran = "skip", "", False
    for label, thunk in checks:
        try:
            r = thunk()
        except _Mismatch as m:
            return "mismatch", f"{label}: {m}"
        except Exception as e:  # noqa: BLE001 - the compiled call's error is the result
            if status != "error":
                status, reason = "error", f"{label}: {_short(e)}"
            ran = True
            continue
        if r is not None:
            ran = True
    if status == "error":
        return status, reason
    return ("pass" if ran else "skip"), ""


def check_forward(op, opaque) -> tuple:
    checks = []
    uninit = op.name in UNINITIALISED
    supported = op.supported_dtypes("cpu")
    for dtype in FORWARD_DTYPES:
        if dtype not in supported:
            continue
        try:
            samples = list(_first(op.sample_inputs("cpu", dtype, requires_grad=False), SAMPLES))
        except Exception:  # noqa: BLE001 - the OpInfo cannot make samples for this dtype
            continue
        for vname, fn in _variants(op):
            for i, s in enumerate(samples):
                args, kwargs = _sample_parts(s)
                label = f"{vname} {str(dtype).removeprefix('torch.')} sample {i}"
                checks.append((label, lambda fn=fn, args=args, kwargs=kwargs: _forward_one(fn, args, kwargs, opaque, uninit)))
    return _run_checks(checks)


def _first(it, n):
    for i, x in enumerate(it):
        if i >= n:
            return
        yield x


def _grad_one(op, s, opaque):
    args, kwargs = _sample_parts(s)
    fn = op.op
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    try:
        if not inputs:
            return None
        random = _is_random(fn, args, kwargs)
    except Exception:
        return None

    def grads(call, a, k):
        ins = [t for t in tree_flatten((a, k))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.manual_seed(0)
        out = s.output_process_fn_grad(call(*a, **k))
        leaves = [o for o in tree_flatten(out)[0]
                  if isinstance(o, torch.Tensor) and o.requires_grad and (o.dtype.is_floating_point or o.dtype.is_complex)]
        if not leaves:
            return out, None
        g = torch.Generator().manual_seed(7)
        # A complex output enters through its real and imaginary parts (a real loss, as any training uses).
        parts = [p for o in leaves for p in ((o.real, o.imag) if o.dtype.is_complex else (o,))]
        loss = sum((p * torch.rand(p.shape, generator=g, dtype=p.dtype)).sum() for p in parts)
        gs = torch.autograd.grad(loss, ins, allow_unused=True)
        return out, [torch.zeros_like(t) if d is None else d for t, d in zip(ins, gs)]

    e_args, e_kwargs = _clone((args, kwargs))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            e_out, e_grads = grads(fn, e_args, e_kwargs)
    except Exception:
        return None
    if e_grads is None:
        return None
    c_args, c_kwargs = _clone((args, kwargs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c_out, c_grads = grads(_compiled(fn, opaque), c_args, c_kwargs)
    # A random op is compared by value where the compiled call drew what eager drew from the same seed (then its
    # gradients must be eager's too); by structure where its draws differ.
    values = True
    if random:
        try:
            _compare_structure(c_out, e_out, "output", True, FWD_TOL)
        except _Mismatch:
            values = False
    _compare_structure(c_out, e_out, "output", values, FWD_TOL)
    if c_grads is None:
        raise _Mismatch("no output requires grad, eager's do")
    _compare_structure(c_grads, e_grads, "gradients", values, GRAD_TOL)
    return True


def check_gradient(op, opaque) -> tuple:
    if not op.supports_autograd or torch.float32 not in op.supported_backward_dtypes("cpu"):
        return "skip", ""
    try:
        samples = list(_first(op.sample_inputs("cpu", torch.float32, requires_grad=True), SAMPLES))
    except Exception:  # noqa: BLE001
        return "skip", ""
    return _run_checks([(f"float32 sample {i}", lambda s=s: _grad_one(op, s, opaque)) for i, s in enumerate(samples)])


def check(op) -> Result:
    r = Result(opinfo_id(op))
    r.forward, r.forward_reason = check_forward(op, r.opaque)
    r.gradient, r.gradient_reason = check_gradient(op, r.opaque)
    return r


# ---- the expected-failures file: "<opinfo id>  <forward|gradient|forward,gradient>  <reason>" ----
def read_expected(path) -> dict:
    out = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, kinds, *_ = line.split(None, 2) + [""]
            out[name] = set(kinds.split(","))
    return out


def failing_kinds(r: Result) -> set:
    return {k for k, v in (("forward", r.forward), ("gradient", r.gradient)) if v == "error"}


def expected_line(r: Result) -> str:
    kinds = sorted(failing_kinds(r))
    reason = r.forward_reason if "forward" in kinds else r.gradient_reason
    return f"{r.name}  {','.join(kinds)}  {reason}"
