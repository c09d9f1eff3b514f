"""Gradients of ops run opaquely: PyTorch's own autograd of the op, at run time.

An op the compiler does not know runs through torch (``compiler/opaque.py``).  When an input it
reads requires grad, it is recorded as ``(out, graph) = torch_autograd_<op>(...)`` instead: the
forward runs the op with autograd enabled on detached inputs, returns its outputs detached, and
``graph`` — a zero-element tensor carrying the autograd graph — is saved for the backward like any
other value.  The gradient rule records ``opaque_vjp(graph, *cotangents)``, which calls
``torch.autograd.grad`` on that graph.  So the op's backward is exactly eager's, it saves exactly
what eager's autograd saves (random ops such as dropout2d keep their mask, nothing is recomputed),
and the whole-step, thin and ``tt.compile(module)`` paths all differentiate through it.
``compile_stats(cf).opaque_ops`` names such ops with "(gradient by torch autograd)".
Native gradient rules stay the fast path; this is the path for everything else.
"""
from __future__ import annotations

import itertools

import torch
from torch.autograd.graph import get_gradient_edge

from .. import context, devices, dtypes, opaque
from ..dense import dense_layout
from ..proxies import TensorProxy, contiguous_strides
from ..pytree import tree_flatten, tree_unflatten
from ..symbols import BoundSymbol, Symbol
from .autograd import Forward, _is_tensor, cotangent_like, is_float_tensor
from ..grad_rules import register_vjp

NOTE = "gradient by torch autograd"


class _Entry(torch.autograd.Function):
    """The op's differentiable input: a view of the value whose node (the gradient's capture point) holds nothing.

    A leaf (``x.detach().requires_grad_()``) is held by its ``AccumulateGrad`` node, so the graph kept the value's
    memory until its backward, where eager frees it once nothing reads it (the LSTM's embedded tokens, 3 KiB of the
    zoo step's peak).  The gradient is captured at this node's edge (``get_gradient_edge``), whose backward never
    runs; its other input is a zero-element leaf.  Writing into the view in place raises before anything is written
    (torch refuses it for a custom Function's view), as it did for the leaf.  One node makes the views of all the op's
    differentiated inputs (one output each): a custom Function's call costs tens of microseconds of Python, and
    GRU's nine inputs paid it nine times a step."""

    @staticmethod
    def forward(ctx, anchor, *xs):
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *gs):
        return (None,) * (len(gs) + 1)


class _Input:
    """What ``opaque_vjp`` needs of a differentiated input: its gradient edge and its layout (not its memory)."""

    __slots__ = ("edge", "shape", "stride", "dtype", "device", "layout", "value")

    def __init__(self, t, edge, value=None):
        self.edge, self.shape, self.dtype, self.device, self.layout = edge, t.shape, t.dtype, t.device, t.layout
        self.stride = t.stride() if t.layout == torch.strided else None
        self.value = value  # a leaf that is not strided (sparse): kept, as its zeros are made from it


def _entry_points(flat, positions):
    """(flat arguments with the differentiated ones replaced by graph entries, their ``_Input`` records)."""
    leaves = list(flat)
    detached = [flat[i].detach() for i in positions]
    strided = [x for x in detached if x.layout == torch.strided]
    if strided:
        with torch.enable_grad():  # (the program runs without grad)
            views = iter(_Entry.apply(torch.empty(0, requires_grad=True), *strided))
    inputs = []
    for i, x in zip(positions, detached):
        if x.layout == torch.strided:
            t = next(views)
            inputs.append(_Input(t, get_gradient_edge(t)))
        else:
            t = x.requires_grad_()
            inputs.append(_Input(t, t, t))
        leaves[i] = t
    return leaves, inputs


class AutogradRun:
    """Runs ``func`` with autograd on the inputs at ``positions``; returns ``(outputs, graph handle)``."""

    def __init__(self, func, positions, short):
        self.func = func
        self.positions = positions
        # Printed in executed traces as ``_op_autograd_<op>(...)`` (torch_executor.ImplSymbol).
        self.__name__ = short
        self.__qualname__ = f"autograd.{short}"
        self.__module__ = "thunder_train"

    def __call__(self, *args, **kwargs):
        flat, spec = tree_flatten((args, kwargs))
        leaves, inputs = _entry_points(flat, self.positions)
        a, k = tree_unflatten(leaves, spec)
        with torch.enable_grad():
            out = self.func(*a, **k)
        del a, k, leaves
        flat_out, out_spec = tree_flatten(out)
        graph_outs = [o if isinstance(o, torch.Tensor) and o.requires_grad else None for o in flat_out]
        handle = torch.empty(0, dtype=torch.uint8)
        # The graph is held by its outputs' edges (node, output number), not by the outputs: an output tensor held here
        # kept its memory to the backward after the program's last read of it (eager frees it then, unless the op's
        # node saved it, which the graph then holds as eager's does): DeepSeek-V3's two ``_grouped_mm`` outputs.
        edges = [None if o is None else get_gradient_edge(o) for o in graph_outs]
        handle._tt_autograd_graph = (inputs, edges)
        result = tree_unflatten([o.detach() if g is not None else o for o, g in zip(flat_out, graph_outs)], out_spec)
        return result, handle


def opaque_vjp(handle, cotangents, last=False):
    """Gradients of the inputs the forward differentiated, from its saved autograd graph.

    ``last``: no later line of the program runs a backward through this graph (``free_graphs_at_last_vjp``): torch's
    autograd frees each node's saved tensors as it goes, as eager's backward does (a GRU's per-step activations).
    Otherwise, or where the backward that runs this program was asked to retain its graph, the graph is kept."""
    inputs, outs = handle._tt_autograd_graph
    pairs = [(o, c) for o, c in zip(outs, cotangents) if o is not None and c is not None]
    grads = (torch.autograd.grad([o for o, _ in pairs], [i.edge for i in inputs], [c for _, c in pairs],
                                 allow_unused=True, retain_graph=not last or keep_graph())
             if pairs else [None] * len(inputs))
    for i, g in zip(inputs, grads):
        if g is not None and i.layout == torch.strided and g.layout != torch.strided:
            # Its proxy is strided, and native code downstream reads it as such: refuse rather than densify it.
            raise RuntimeError(
                f"thunder_train: torch's autograd gave a {g.layout} gradient for a strided tensor of an opaque op; "
                "thunder_train follows sparse gradients only into sparse tensors (eager would keep this one sparse). "
                "Compute this part outside the compiled function or under torch.no_grad().")
    return tuple(_laid_out(i, g) for i, g in zip(inputs, grads))


def _gradient_strides(sizes, strides):
    """The strides an opaque op's input gradient is recorded with (``_cotangent``) and given (``_laid_out``): the
    input's where they are dense (AccumulateGrad's rule for a leaf's ``.grad``; a transposed expert weight's gradient
    comes so from ``_grouped_mm``), else row-major."""
    return tuple(strides) if dense_layout(tuple(sizes), tuple(strides)) else contiguous_strides(tuple(sizes))


def _cotangent(a):
    """``autograd.cotangent_like`` with the strides of ``_gradient_strides`` (known sizes and strides)."""
    ct = cotangent_like(a)
    if type(ct) is not TensorProxy or not all(type(n) is int for n in (*a._tt_shape, *a._tt_strides)):
        return ct
    strides = _gradient_strides(a._tt_shape, a._tt_strides)
    if strides == tuple(ct._tt_strides):
        return ct
    return TensorProxy(ct._tt_name, shape=ct._tt_shape, dtype=ct._tt_dtype, device=ct._tt_device, strides=strides)


def _laid_out(i, g):
    """``i``'s gradient laid out as its proxy records it (``_cotangent``), whatever torch's autograd gave (LSTM's
    input gradient comes time-major); a missing one zeros.  Eager's layout of an intermediate gradient is invisible,
    and a leaf's ``.grad`` takes the leaf's layout anyway."""
    if i.layout != torch.strided:
        return torch.zeros_like(i.value) if g is None else g
    strides = _gradient_strides(i.shape, i.stride)
    if g is not None and all(a == b for n, a, b in zip(g.shape, g.stride(), strides) if n != 1):
        return g  # (a dimension of size one addresses nothing)
    out = torch.empty_strided(i.shape, strides, dtype=i.dtype if g is None else g.dtype, device=i.device)
    return out.zero_() if g is None else out.copy_(g)


opaque_vjp.__qualname__ = "autograd.vjp"
opaque_vjp.__module__ = "thunder_train"


def keep_graph() -> bool:
    """Whether this runs inside a backward asked to retain its graph: the backward trace of ``tt.compile(module)``
    (compiler/autograd_function.py) runs again at a second ``backward(retain_graph=True)``.  PyTorch tells it only
    privately; where it does not, the graph is kept (correct results, later freeing)."""
    if torch._C._current_graph_task_id() == -1:  # not inside a backward: the whole step's own program
        return False
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if query is None else bool(query())


class AutogradOpaqueSymbol(opaque.OpaqueSymbol):
    """An opaque op whose inputs require grad: also returns its autograd graph for the backward."""

    output_grad_flags = True  # its output proxies' requires_grad are eager's (autograd.Forward reads them)

    def __init__(self, func, positions):
        super().__init__(func)
        short = "".join(c if c.isalnum() else "_" for c in self.name.removeprefix("torch."))
        # One symbol per (op, differentiated positions): printed names must differ.
        short += "".join(f"_{i}" for i in positions)
        self.torch_impl = AutogradRun(func, positions, short)
        # torch's autograd runs around the op: what it allocates inside the line is unknown
        self.scratch_bytes, self.torch_fresh = None, frozenset()
        self.fn = _any_arguments
        ident = "torch_autograd_" + short
        self._print_name, self._globals = ident, {ident: self.torch_impl}
        self.id = f"opaque.{self.name}"


def _any_arguments(*args, **kwargs):
    """Signature of an opaque op's bound arguments (gradient rules bind them by name)."""


class _VJPSymbol(Symbol):
    """A line that runs PyTorch's backward of an opaque op (``impl``: ``opaque_vjp`` or ``memory_vjp``)."""

    # torch's autograd allocates the backward's temporaries and gradients inside the line, sizes no rule here knows:
    # a call may peak there (DeepSeek-V3's routed experts' ``GroupedMmBackward0``), and kept buffers must not raise it
    torch_unknown_scratch = True

    def __init__(self, impl):
        super().__init__(impl.__name__, _any_arguments, module="opaque", is_prim=True, tags=("opaque",))
        self.torch_impl = impl
        self.id = f"grad_rules.{impl.__name__}"  # "grad_rules." keeps it out of the "run opaquely" wording

    @property
    def print_name(self) -> str:
        return self.torch_impl.__name__

    def codegen_globals(self) -> dict:
        return {self.torch_impl.__name__: self.torch_impl}


OPAQUE_VJP = _VJPSymbol(opaque_vjp)
_symbols: dict = {}


def _make_rule(positions, vjp=OPAQUE_VJP, extra=()):
    """The gradient rule of an opaque line run with torch's autograd: one ``vjp`` line (``opaque_vjp``, or
    ``memory_vjp`` with ``extra`` = (tags, now)) giving the gradients of the flat arguments at ``positions``."""
    def rule(g, output, *, args, kwargs):
        out, handle = output
        flat_out = tree_flatten(out)[0]
        g_out = g[0] if isinstance(g, (tuple, list)) and len(g) == 2 else None
        flat_ct = tree_flatten(g_out)[0] if g_out is not None else [None] * len(flat_out)
        cts = tuple(c if _is_tensor(o) and _is_tensor(c) else None for o, c in zip(flat_out, flat_ct))
        flat_in = tree_flatten((args, kwargs))[0]
        ins = [flat_in[i] for i in positions]
        grads = tuple(_cotangent(a) for a in ins)
        context.get_trace().add(BoundSymbol(vjp, (handle, cts, *extra), {}, grads, ()))
        flat_grads = [None] * len(flat_in)
        for i, gr in zip(positions, grads):
            flat_grads[i] = gr
        n_args = len(tree_flatten(args)[0])
        return {"args": flat_grads[:n_args], "kwargs": flat_grads[n_args:]}

    return rule


def autograd_symbol(func, positions):
    key = (func, positions)
    sym = _symbols.get(key)
    if sym is None:
        sym = _symbols[key] = AutogradOpaqueSymbol(func, positions)
        register_vjp(sym)(_make_rule(positions))
    return sym


def gradient_positions(flat_args) -> tuple:
    """Positions of the float tensors that require grad or depend on an input that does."""
    floats = [i for i, a in enumerate(flat_args) if is_float_tensor(a)]
    if not floats:
        return ()
    if all(flat_args[i]._tt_requires_grad for i in floats):
        return tuple(floats)
    st = context.tracer_state()
    if st is None:
        return ()
    leaves = [st.buffers.read(p) for p in st.walker.input_proxies() if is_float_tensor(p) and p._tt_requires_grad]
    on_path = Forward(list(context.get_trace().bound_symbols), leaves).needs_grad
    return tuple(i for i in floats if flat_args[i]._tt_requires_grad or id(flat_args[i]) in on_path)


class DirectOpaqueSymbol(opaque.OpaqueSymbol):
    """An opaque op on the gradient path whose gradient rule is declared with it (``opaque.direct_vjp``): it runs as
    torch runs it, and its backward is trace lines (eager's formula with torch's kernels), not torch's autograd."""

    def __init__(self, func, rule):
        super().__init__(func)
        self.fn = _any_arguments  # its arguments bound by name for the rule
        register_vjp(self)(_direct_rule(rule))


def _direct_rule(rule):
    def vjp(g, output, *, args, kwargs):
        flat_in = tree_flatten((args, kwargs))[0]
        grads = rule(g, output, args, kwargs) if _is_tensor(g) else {}
        flat_grads = [grads.get(i) for i in range(len(flat_in))]
        n_args = len(tree_flatten(args)[0])
        return {"args": flat_grads[:n_args], "kwargs": flat_grads[n_args:]}

    return vjp


_direct_symbols: dict = {}


def record(func, args, kwargs, out, positions):
    """Records ``(out, graph) = torch_autograd_<op>(...)``, or the op's plain call where its gradient rule is declared
    with it (``opaque.direct_vjps``) and applies; returns the name compile_stats lists."""
    rule = opaque.direct_vjps.get(func)
    if rule is not None and rule.applies(args, kwargs, positions):
        sym = _direct_symbols.get(func)
        if sym is None:
            sym = _direct_symbols[func] = DirectOpaqueSymbol(func, rule)
        context.get_trace().add(BoundSymbol(sym, args, kwargs, out, ()))
        return f"{sym.name} (gradient by its backward formula)"
    sym = autograd_symbol(func, positions)
    handle = TensorProxy(shape=(0,), dtype=dtypes.uint8, device=devices.from_torch("cpu"))  # AutogradRun makes it on CPU
    trc = context.get_trace()
    trc.add(BoundSymbol(sym, args, kwargs, (out, handle), ()))
    return f"{sym.name} ({NOTE})"


opaque.record_differentiable = record
opaque.gradient_positions = gradient_positions


# ---- saved tensors read from memory written through ``.data`` (acquisition/saved_versions.py) ----
# Eager's backward uses what a saved tensor's memory holds when it runs; a write through ``.data`` changes it without
# moving the version counter.  Such an op runs here with torch's autograd, and its backward is given the values the
# memory holds then in place of the saved tensors at ``tags``: ("in", flat argument index) or ("out", flat output index).
class _MemoryRun(AutogradRun):
    """``AutogradRun`` whose saved tensors at ``tags`` can be replaced before the backward (``memory_vjp``)."""

    def __init__(self, func, positions, short, tags):
        super().__init__(func, positions, short)
        self.tags = tags

    def __call__(self, *args, **kwargs):
        records, swap = [], {}

        def pack(t):
            r = [None, t, None]
            records.append(r)
            return r

        def unpack(r):
            if r[0] is None or r[0] not in swap:
                return r[1]
            return _same_view(r[1], r[2], swap[r[0]])

        flat, spec = tree_flatten((args, kwargs))
        leaves, inputs = _entry_points(flat, self.positions)
        a, k = tree_unflatten(leaves, spec)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = self.func(*a, **k)
        flat_out, out_spec = tree_flatten(out)
        for r in records:
            for tag in self.tags:
                ref = leaves[tag[1]] if tag[0] == "in" else flat_out[tag[1]]
                if r[1] is ref or torch._C._is_alias_of(r[1], ref):
                    r[0], r[2] = tag, ref
        graph_outs = [o if isinstance(o, torch.Tensor) and o.requires_grad else None for o in flat_out]
        handle = torch.empty(0, dtype=torch.uint8)
        handle._tt_autograd_graph = (inputs, graph_outs)
        handle._tt_swap = swap
        result = tree_unflatten([o.detach() if g is not None else o for o, g in zip(flat_out, graph_outs)], out_spec)
        return result, handle


def _same_view(saved, ref, now):
    """``now`` (the value ``ref``'s memory holds) seen as ``saved`` sees ``ref`` (``linear`` saves ``weight.t()``)."""
    if saved is ref or (saved.size() == ref.size() and saved.stride() == ref.stride()
                        and saved.storage_offset() == ref.storage_offset()):
        return now
    base = torch.empty_strided(ref.size(), ref.stride(), dtype=now.dtype, device=now.device)
    base.copy_(now)
    return base.as_strided(saved.size(), saved.stride(), saved.storage_offset() - ref.storage_offset())


def memory_vjp(handle, cotangents, tags, now, last=False):
    """``opaque_vjp`` with the saved tensors at ``tags`` replaced by ``now`` (what their memory holds)."""
    handle._tt_swap.update(zip(tags, now))
    try:
        return opaque_vjp(handle, cotangents, last)
    finally:
        handle._tt_swap.clear()


memory_vjp.__qualname__ = "autograd.memory_vjp"
memory_vjp.__module__ = "thunder_train"


MEMORY_VJP = _VJPSymbol(memory_vjp)
_memory_lines = itertools.count()


class _MemoryOpaqueSymbol(AutogradOpaqueSymbol):
    output_grad_flags = False  # it replaces a native line: every float output on the path carries gradient
    follows_memory = True  # (acquisition/saved_versions.py does not check it again)

    def __init__(self, func, positions, tags, original, now):
        super().__init__(func, positions)
        short = f"{self.torch_impl.__name__}_memory{next(_memory_lines)}"  # one per line: its rule holds that line's values
        self.torch_impl = _MemoryRun(func, positions, short, tags)
        ident = "torch_autograd_" + short
        self._print_name, self._globals = ident, {ident: self.torch_impl}
        self.original = original  # the line it replaces (saved_versions asks what that saved)
        self.vjp_positions, self.saved_tags, self.now = positions, tags, dict(zip(tags, now))
        self.follow({})

    def follow(self, now: dict) -> None:
        """Backwards recorded from now on read ``now[tag]`` in place of the saved tensor at ``tag`` (the values before
        for the other tags); those recorded already keep theirs."""
        self.now.update(now)
        register_vjp(self)(_make_rule(self.vjp_positions, MEMORY_VJP, (self.saved_tags, tuple(self.now[t] for t in self.saved_tags))))


def with_saved_from_memory(b, func, positions, tags, now):
    """Line ``b`` run by torch's ``func`` with autograd (differentiating the flat arguments at ``positions``), whose
    backward reads ``now`` in place of the saved tensors at ``tags`` (``follow`` changes them for later backwards)."""
    sym = _MemoryOpaqueSymbol(func, positions, tags, b, now)
    handle = TensorProxy(shape=(0,), dtype=dtypes.uint8, device=devices.from_torch("cpu"))
    return BoundSymbol(sym, b.args, b.kwargs, (b.output, handle), ())


def free_graphs_at_last_vjp(trc):
    """The last line of ``trc`` that runs a backward through each opaque op's graph frees the graph's saved tensors
    as it goes (``last=True``), as eager's backward does; earlier ones (``retain_graph=True`` in the function) keep it."""
    last = {}
    for i, b in enumerate(trc.bound_symbols):
        if getattr(b.sym, "fn", None) in (opaque_vjp, memory_vjp):  # the line as the torch executor runs it
            last[id(b.args[0])] = i
    if not last:
        return trc
    new = trc.derive(trc.header)
    at = set(last.values())
    new.bound_symbols = [b.replace(kwargs={**b.kwargs, "last": True}) if i in at else b
                         for i, b in enumerate(trc.bound_symbols)]
    return new
