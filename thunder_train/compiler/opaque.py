"""Torch operations the compiler does not know: run them opaquely.

Output metadata comes from running the op on meta tensors; at execution the
torch executor calls the original torch callable.  Each use is recorded so
``compile_stats`` can list them; in strict mode they are an error instead.
"""
from __future__ import annotations

import operator

import torch

from . import context, devices
from .errors import UnsupportedOpError  # noqa: F401  (defined with the other user-facing errors)
from .generators_kept import generators_untouched
from .proxies import TensorProxy, is_tensor_proxy, meta_tensor
from .pytree import tree_flatten, tree_unflatten, tree_map
from .symbols import Symbol, BoundSymbol


_NAMESPACES = (
    ("torch", torch),
    ("torch.nn.functional", torch.nn.functional),
    ("torch.Tensor", torch.Tensor),
    ("torch.special", torch.special),
    ("torch.linalg", torch.linalg),
    ("torch.fft", torch.fft),
    ("torch._C._nn", torch._C._nn),
)


def callable_name(func) -> str:
    """The shortest public path to a torch callable, e.g. 'torch.matmul'."""
    if isinstance(func, torch._ops.OpOverload):  # an ATen overload: torch.ops.aten.tanh_backward.default
        return f"torch.ops.{func.namespace}.{func._opname}.{func._overloadname}"
    short = getattr(func, "__name__", None)
    if short:
        for prefix, ns in _NAMESPACES:
            if getattr(ns, short, None) is func:
                return f"{prefix}.{short}"
    mod = getattr(func, "__module__", None) or ""
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    if qual.startswith(("TensorBase.", "_TensorBase.")):
        qual = "Tensor." + qual.split(".", 1)[1]
    if qual.startswith("Tensor."):
        return "torch." + qual
    if mod.startswith("torch._C._nn"):
        return "torch._C._nn." + qual
    if mod.startswith("torch") and mod not in ("torch._C", "torch._C._VariableFunctions", "torch.functional"):
        return f"{mod}.{qual}"
    return f"torch.{qual}" if "." not in qual else qual


class OpaqueSymbol(Symbol):
    """A symbol standing for an unknown torch callable, executed by torch as is."""

    # Its output proxies' requires_grad come from the meta run, i.e. eager's: autograd.Forward reads them
    # (an output eager does not differentiate carries no gradient).
    output_grad_flags = True
    # torch runs it as is: whatever it allocates and frees inside the line is unknown here, so kept buffers must not
    # raise it (executors/buffers.py), unless the op declares its scratch (``scratch_rule``)
    torch_unknown_scratch = True

    def __init__(self, func):
        name = callable_name(func)
        super().__init__(name, func, module="opaque", is_prim=True, tags=("opaque",))
        self.torch_impl = func
        # An op whose kernel's allocations are declared: its scratch, and its results are new tensors
        # (executors/out_forms.py; else taken to share their arguments' memory, which the kept buffers' plan counts not)
        self.scratch_bytes = scratch_rules.get(func)
        if self.scratch_bytes is not None:
            self.torch_fresh = frozenset({func})
        self.id = f"opaque.{name}"
        self._print_name, self._globals = printable_reference(func, name)

    @property
    def print_name(self) -> str:
        return self._print_name

    def codegen_globals(self) -> dict:
        return self._globals

    @property
    def draws_random(self) -> bool:
        """torch tags the op's aten overloads ``nondeterministic_seeded`` (``torch.poisson``)."""
        packet = getattr(torch.ops.aten, self.name.rsplit(".", 1)[-1], None)
        if packet is None:
            return False
        try:
            overloads = [getattr(packet, o) for o in packet.overloads()]
        except Exception:  # noqa: BLE001 - not an op packet: nothing known
            return False
        return any(torch.Tag.nondeterministic_seeded in getattr(o, "tags", ()) for o in overloads)

    @property
    def has_side_effect(self) -> bool:
        # In-place torch methods (add_, __setitem__, ...) mutate their inputs; one applied to a copy
        # (``works_on_copy``: acquisition/inplace.py's CopyThenInplace, maybe inside an autograd run) does not.
        impl = self.torch_impl
        if any(getattr(x, "works_on_copy", False) for x in (impl, getattr(impl, "func", None))):
            return False
        n = self.name
        return n.endswith("_") and not n.endswith("__") or n.endswith(("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"))


def printable_reference(func, name: str):
    """(source text, globals) that refer to ``func`` in generated code."""
    if name.startswith("torch."):
        obj = torch
        for part in name.split(".")[1:]:
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is func:
            return name, {"torch": torch}
    ident = "_op_" + "".join(c if c.isalnum() else "_" for c in name)
    return ident, {ident: func}


_opaque_symbols: dict = {}


def opaque_symbol(func) -> OpaqueSymbol:
    """The one symbol of ``func`` run opaquely."""
    sym = _opaque_symbols.get(func)
    if sym is None:
        sym = _opaque_symbols[func] = OpaqueSymbol(func)
    return sym


def _declaring(table: dict):
    """A decorator factory: ``@declare(func, ...)`` enters the decorated rule in ``table`` for each ``func``."""
    def declare(*funcs):
        def register(rule):
            for f in funcs:
                table[f] = rule
            return rule
        return register
    return declare


# Output rules for torch ops that have no meta kernel (``F.ctc_loss``), declared with the op in the torch language
# (``@meta_rule(func)``): ``rule(*meta_args, **meta_kwargs)`` returns the meta tensors the op would return
# (``requires_grad`` as eager's), computed from the arguments' metadata alone.
meta_rules: dict = {}
meta_rule = _declaring(meta_rules)

# Scratch rules for torch ops run opaquely whose kernel's temporaries are known (``@scratch_rule(func)``, declared
# with the op in the torch language): ``rule(*args, **kwargs)`` returns the bytes the kernel allocates and frees inside
# the call, from the arguments' proxies, or None where they are unknown for these arguments (``Symbol.scratch_bytes``;
# the kept buffers' plan counts them, executors/buffers.py).
scratch_rules: dict = {}
scratch_rule = _declaring(scratch_rules)

# Layout rules for torch ops run opaquely whose meta kernel lays the result out otherwise than a device's kernel
# (``@device_layout_rule(func)``, declared with the op in the torch language): ``rule(device, args, kwargs, meta_out)``
# returns the strides of the op's one tensor result on ``device`` (the proxies' arguments), or None (the meta
# kernel's).
device_layout_rules: dict = {}
device_layout_rule = _declaring(device_layout_rules)


# Gradient rules for ops that run opaquely, declared with the op in the torch language (``@direct_vjp(func)``):
# ``rule(g, out, args, kwargs)`` returns {flat argument position: gradient} made of trace lines (eager's
# backward formula with torch's own kernels), so the op runs without torch's autograd around it
# (transforms/opaque_grad.py, which records it so where ``rule.applies(args, kwargs, positions)``).
direct_vjps: dict = {}


def direct_vjp(*funcs, applies):
    def deco(rule):
        rule.applies = applies
        for f in funcs:
            direct_vjps[f] = rule
        return rule

    return deco


# Installed by transforms/opaque_grad.py: ``gradient_positions(flat_args)`` -> positions of the inputs a
# gradient flows into; ``record_differentiable(func, args, kwargs, out, positions)`` records the op with
# its autograd graph and returns the name compile_stats lists.
gradient_positions = None
record_differentiable = None


def _to_meta(x, requires_grad=False):
    if type(x) is TensorProxy:
        # torch needs plain sizes: a symbolic or data-dependent size becomes a decision on its value (checked by
        # the prologue or, for a size values decide, by the program where it computes it), as eager uses it
        shape = tuple(s if type(s) is int else operator.index(s) for s in x._tt_shape)
        strides, offset = getattr(x, "_tt_strides", None), getattr(x, "_tt_storage_offset", 0)
        if strides is not None and all(type(v) is int for v in (*strides, offset)) and len(strides) == len(shape):
            # Laid out as the input is: an op's result may follow its input's layout (``index_put`` of a transposed
            # tensor keeps its strides), and the trace must record the layout the op gives at run time.
            t = meta_tensor(x, shape)
            return t.requires_grad_(requires_grad) if requires_grad else t
        return torch.empty(shape, dtype=x._tt_dtype.torch, device="meta", requires_grad=requires_grad)
    if isinstance(x, torch.Tensor):
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    return x


def run_on_meta(fn, args, kwargs):
    """``fn(*args, **kwargs)`` on meta arguments, as the compiler asks torch about an op: torch functions not
    overridden, new tensors on the meta device, a ``device`` given replaced by it (else the run is real there:
    ``randint_like(x, 10, device="cpu")`` on a meta ``x`` made a CPU tensor and drew from the CPU generator), and
    no draw from a global generator (a rule that runs a random op on real tensors must not draw either)."""
    if kwargs.get("device") is not None:
        kwargs = {**kwargs, "device": "meta"}
    with torch._C.DisableTorchFunction(), torch.device("meta"), generators_untouched():
        return fn(*args, **kwargs)


def _why_meta_failed(e) -> str:
    text = str(e)
    if isinstance(e, NotImplementedError) or "Meta" in text or "meta kernel" in text or "fake impl" in text:
        return ("torch has no meta kernel for it, so its output's metadata cannot be learned without running it; this "
                "is the case for ops whose output shape depends on tensor values (nonzero, boolean masking, unique, "
                ".item()). Compute this part outside the compiled function, or open an issue asking for the op.")
    return ("The op rejected these arguments' shapes, dtypes or layouts on meta tensors (eager may accept them): pass "
            "arguments of the result's shape, or call it outside the compiled function.")


def call_opaque(func, args, kwargs, *, strict: bool, positions=None):
    """Records ``func(*args, **kwargs)`` run by torch; returns its output proxies.  ``positions``: the flat arguments a
    gradient may flow into, where the caller knows them (a gradient rule's own lines), else found on the trace."""
    name = callable_name(func)
    if strict:
        raise UnsupportedOpError(
            f"{name} is not supported by thunder_train's torch language and strict=True forbids running it opaquely. "
            "Compile with strict=False to run it through torch, or open an issue asking for the op."
        )
    flat, spec = tree_flatten((args, kwargs))
    proxies = [x for x in flat if is_tensor_proxy(x)]
    # Inputs a gradient would flow into (they require grad or depend on one that does).
    diff = positions if positions is not None else (
        gradient_positions(flat) if gradient_positions is not None and torch.is_grad_enabled() else ())
    meta_args, meta_kwargs = tree_unflatten([_to_meta(x, i in diff) for i, x in enumerate(flat)], spec)
    try:
        meta_out = run_on_meta(meta_rules.get(func, func), meta_args, meta_kwargs)
    except UnsupportedOpError:
        raise  # a rule's own refusal, saying what to do
    except Exception as e:
        raise UnsupportedOpError(
            f"{name} is not supported by thunder_train, and running it on meta tensors to learn its output failed: {e}. "
            + _why_meta_failed(e)) from e
    if proxies:
        device = proxies[0]._tt_device
    else:
        d = kwargs.get("device")
        device = devices.from_torch(d) if d is not None else devices.from_torch(None)

    layout = device_layout_rules.get(func)
    strides = layout(device, args, kwargs, meta_out) if layout is not None and isinstance(meta_out, torch.Tensor) else None

    def to_proxy(x):
        if isinstance(x, torch.Tensor):
            return TensorProxy(shape=tuple(x.shape), dtype=x.dtype, device=device, requires_grad=x.requires_grad,
                               strides=strides or x.stride(), storage_offset=0 if strides else x.storage_offset())
        return x

    out = tree_map(to_proxy, meta_out)
    if not any(is_tensor_proxy(v) for v in tree_flatten(out)[0]):
        # Metadata-only answers (bool, int, dtype ...) need no trace line.
        if not proxies:
            return meta_out
        return out
    trc = context.get_trace()
    if diff and any(isinstance(v, torch.Tensor) and v.requires_grad for v in tree_flatten(meta_out)[0]):
        name = record_differentiable(func, args, kwargs, out, diff)
    else:
        trc.add(BoundSymbol(opaque_symbol(func), args, kwargs, out, ()))
    st = context.tracer_state()
    if st is not None and name not in st.opaque_ops:
        st.opaque_ops.append(name)
    return out
