"""Autocast inside the tracer: the casts eager autocast would do, recorded in the trace.

PyTorch's autocast (``torch.autocast``) works in the dispatcher (the
``AutocastCPU`` / ``AutocastCUDA`` keys), below the torch-function level where
the tracer intercepts calls, so it never sees a traced op.  Instead, the tracer
calls ``cast_inputs`` for every torch call the user's code makes (not for calls
made inside a decomposition): when autocast is enabled for the device of the
op's tensors it converts the inputs the way autocast would, with
``prims.convert_element_type`` lines (differentiable: their gradient converts
back, so parameter gradients keep the parameters' dtype, as in eager).  The trace
then says exactly which dtype every op runs in.

Policies, per device (the ops of torch 2.13's ``aten/src/ATen/autocast_mode.{h,cpp}``
that have a torch-language symbol):

- ``LOWER``: eligible inputs are cast to the autocast dtype (matmuls, linear,
  convolutions, attention);
- ``FP32``: eligible inputs are cast to float32 (losses; on CUDA also
  exp/log/pow/... and the norms);
- ``FP32_UNLESS_DTYPE``: CUDA's ``fp32_set_opt_dtype`` / ``fp32_append_dtype``
  ops (softmax, sum, cumsum, norm, ...): without an explicit ``dtype`` argument
  and with an eligible first input, that input is cast to float32 (what
  ``dtype=torch.float32`` does);
- ``PROMOTE``: eligible inputs are cast to the widest of their float types
  (``float32`` if any is, else the autocast dtype);
- ``BANNED``: ``binary_cross_entropy`` on CUDA raises, like eager.

An input is *eligible* when it is a floating-point tensor on the autocast device
and not float64.  Some entries are not in torch's lists but follow from how
eager runs them: a Python or ``CompositeImplicitAutograd`` op whose inner ops
autocast (``einsum`` reaches ``bmm`` on the CPU, ``square`` is ``pow`` and
``cross_entropy`` is ``log_softmax`` + ``nll_loss`` on CUDA, ...).

Running the computation.  The executed program is the trace, already explicit
about dtypes, so it must not be autocast a second time: a second pass would also
catch ops eager autocast never sees (prims of a decomposition, a region under
``torch.autocast(..., enabled=False)`` inside the function, gradient rules that
compute in float32 on purpose, opaque ops whose metadata was computed without
autocast) and make values differ from what the trace says.  So when a trace was
recorded with autocast active (or inside any ``torch.autocast`` context), the
computation is decorated with ``@torch.autocast(<device>, enabled=False)``; it
prints on top of the trace.  Calls without autocast pay nothing.  The backward
(``ThunderFunction.backward``) runs in whatever autocast state the caller of
``loss.backward()`` has, like a custom ``torch.autograd.Function``; PyTorch
recommends calling it outside the autocast region.

Known limits: ops run opaquely (``compile_stats(cf).opaque_ops``) are not
autocast; devices other than CPU and CUDA.  Eager autocast's weight-cast cache
is not reproduced: each use of a weight gets its own conversion, the same values
within one call; across calls of a parameter-updating step inside one cached
region eager would reuse stale casts, and ``runtime/autocast_region.py`` refuses
such a second call (``AutocastCacheError``).
"""
from __future__ import annotations

import inspect

import torch

from .. import context, dtypes, prims
from ..proxies import TensorProxy

LOWER, FP32, FP32_UNLESS_DTYPE, PROMOTE, BANNED, EINSUM = "lower", "fp32", "fp32_unless_dtype", "promote", "banned", "einsum"

# Each torch-language symbol declares its policy per device where it is defined:
# ``@torchsymbol(F.linear, autocast={"cpu": LOWER, "cuda": LOWER})`` (``Symbol.autocast``); symbols without
# one are not autocast.  The policies follow torch 2.13's lists (see the module docstring).
_DEVICES = ("cuda", "cpu")  # dispatcher priority: AutocastCUDA before AutocastCPU


def _enabled_devices() -> tuple:
    return tuple(d for d in _DEVICES if torch.is_autocast_enabled(d))


def _nesting() -> int:
    """How many ``torch.autocast`` contexts are open (enabled or not)."""
    n = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return n - 1


def cast_inputs(sym, func, args, kwargs):
    """``(args, kwargs)`` with the conversions autocast would apply to a top-level call of ``sym``.

    Called by the tracer just before it calls ``sym``; a no-op when autocast is
    off, and for calls made inside a decomposition (their inputs were cast at
    the top-level call, as eager autocast does not re-cast inside an op).
    """
    enabled = _enabled_devices()
    nested = _nesting() > 0
    if not enabled and not nested:
        return args, kwargs
    trc = context.get_trace()
    if trc is None or len(trc._scopes) != 1:
        return args, kwargs
    _run_without_autocast(trc, enabled, nested)
    if not enabled:
        return args, kwargs
    policies = getattr(getattr(sym, "sym", sym), "autocast", None) or {}  # _NamedResult wraps a symbol; metadata queries have none
    types = {t._tt_device.type for t in _tensors(args, kwargs)}
    for device in enabled:
        if device in types:
            policy = policies.get(device)
            if policy is None:
                return args, kwargs
            return _apply(policy, device, sym, func, args, kwargs)
    return args, kwargs


def _run_without_autocast(trc, enabled, nested):
    """Decorate the computation so that autocast does not act on the (already explicit) program again.

    Inside a ``torch.autocast`` context the state at the call may differ from
    the state seen here (``enabled=False`` regions inside the function), so
    every available device is covered then; disabling an already disabled
    device is a no-op.
    """
    devices = set(enabled)
    if nested:
        devices |= {"cpu", *(("cuda",) if torch.cuda.is_available() else ())}
    for d in sorted(devices):
        line = f'@torch.autocast("{d}", enabled=False)'
        if line not in trc.decorators:
            trc.decorators.append(line)


# ---------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------
def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if type(a) is TensorProxy:
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if type(b) is TensorProxy:
                    yield b


def _eligible(t, device) -> bool:
    return type(t) is TensorProxy and t._tt_device.type == device and t._tt_dtype.is_float and t._tt_dtype is not dtypes.float64


def _map_tensors(fn, args, kwargs):
    def one(a):
        if type(a) is TensorProxy:
            return fn(a)
        if isinstance(a, (list, tuple)) and any(type(b) is TensorProxy for b in a):
            return type(a)(fn(b) if type(b) is TensorProxy else b for b in a)
        return a

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


class _Caster:
    """Records the conversions of one call, with one comment saying why."""

    def __init__(self, device, dtype, sym, func, note):
        self.device, self.dtype, self.note = device, dtype, note
        self.what = _callable_name(func, sym)
        self.first = True

    def __call__(self, t):
        if not _eligible(t, self.device) or t._tt_dtype is self.dtype:
            return t
        scope = context.get_trace()._scopes[-1]
        n = len(scope)
        out = prims.convert_element_type(t, self.dtype)
        if self.first and len(scope) > n:
            scope[-1].comment = f"autocast({self.device}, {dtypes.from_torch(torch.get_autocast_dtype(self.device)).name}): {self.what} {self.note}"
            self.first = False
        return out


def _apply(policy, device, sym, func, args, kwargs):
    low = dtypes.from_torch(torch.get_autocast_dtype(device))
    if policy == BANNED:
        raise RuntimeError(
            f"{_callable_name(func, sym)} is unsafe to autocast (eager PyTorch refuses it too): combine the sigmoid with "
            "the loss and use torch.nn.functional.binary_cross_entropy_with_logits, or run it under "
            f'torch.autocast("{device}", enabled=False) with float32 inputs'
        )
    if policy == EINSUM:
        policy = LOWER if _einsum_contracts(args) else None
        if policy is None:
            return args, kwargs
    if policy == LOWER:
        cast = _Caster(device, low, sym, func, f"runs in {low.name}")
        return _map_tensors(cast, args, kwargs)
    if policy == FP32:
        cast = _Caster(device, dtypes.float32, sym, func, "runs in float32")
        return _map_tensors(cast, args, kwargs)
    if policy == FP32_UNLESS_DTYPE:
        if _bound(sym, args, kwargs).get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args):
            return args, kwargs  # an explicit output dtype is respected
        first = next(iter(_tensors(args, kwargs)), None)
        if first is None or not _eligible(first, device):
            return args, kwargs
        cast = _Caster(device, dtypes.float32, sym, func, "runs in float32 (as with dtype=torch.float32)")
        return _map_tensors(lambda t: cast(t) if t is first else t, args, kwargs)
    if policy == PROMOTE:
        target = _promote_type(low, device, _tensors(args, kwargs))
        cast = _Caster(device, target, sym, func, f"runs in the widest input float type, {target.name}")
        return _map_tensors(cast, args, kwargs)
    raise AssertionError(policy)


def _promote_type(low, device, tensors):
    """autocast's ``promote_type``: float32 if any eligible input is, else the autocast dtype; float64 is ignored."""
    current = low
    for t in tensors:
        if not (t._tt_device.type == device and t._tt_dtype.is_float) or t._tt_dtype is dtypes.float64:
            continue
        if current is dtypes.float32 or t._tt_dtype is dtypes.float32:
            current = dtypes.float32
        elif t._tt_dtype is not low:
            raise RuntimeError(f"autocast: cannot promote {t._tt_dtype.name} together with {low.name} (eager raises too)")
    return current


def _einsum_contracts(args) -> bool:
    """Whether eager's einsum contracts two operands with ``bmm`` (and so autocasts) on the CPU.

    Two operands sharing an index that is summed away (size > 1 in both) are
    contracted with bmm; an outer or elementwise product is a ``mul``, and a
    single operand is only summed, neither of which autocasts.
    """
    if not args or not isinstance(args[0], str):
        return False
    ops = args[1:]
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = tuple(ops[0])
    eq = args[0].replace(" ", "")
    if "->" not in eq or "..." in eq or len(ops) != 2 or not all(type(o) is TensorProxy for o in ops):
        return True if len(ops) >= 2 else False
    lhs, out = eq.split("->")
    subs = lhs.split(",")
    if len(subs) != 2:
        return False
    sizes = [dict(zip(s, o._tt_shape)) for s, o in zip(subs, ops)]
    return any(c not in out and sizes[0][c] != 1 and sizes[1][c] != 1 for c in set(subs[0]) & set(subs[1]))


_signatures: dict = {}


def _bound(sym, args, kwargs) -> dict:
    sym = getattr(sym, "sym", sym)  # a _NamedResult entry wraps its symbol
    sig = _signatures.get(sym)
    if sig is None:
        sig = _signatures[sym] = inspect.signature(sym.fn)
    try:
        return dict(sig.bind(*args, **kwargs).arguments)
    except TypeError:
        return dict(kwargs)


def _callable_name(func, sym) -> str:
    from ..opaque import callable_name

    try:
        return callable_name(func)
    except Exception:  # pragma: no cover - naming is best effort
        return getattr(sym, "name", "op")


__all__ = ["cast_inputs", "LOWER", "FP32", "FP32_UNLESS_DTYPE", "PROMOTE", "BANNED", "EINSUM"]
