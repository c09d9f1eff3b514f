"""Reverse-mode autograd on traces: a joint forward+backward trace, split in two.

``build_forward_backward(trc)`` takes a computation trace (after DCE) whose
inputs require grad and returns

- the **joint** trace: the forward bound symbols followed by the backward ones,
  recorded by calling each symbol's gradient rule (``compiler/grad_rules.py``) in
  reverse order.  Its inputs are the computation's inputs plus one cotangent
  per differentiable output; it returns ``(outputs, input_grads)``.  DCE runs
  on it, so backward work nobody needs and forward work only the backward
  needed both disappear together.
- the **forward** trace: the forward part of the joint trace.  It returns
  ``(outputs, saved_values)`` (its function keeps the name ``computation``).
- the **backward** trace: ``backward(*saved_values, *cotangents)`` returns one
  gradient per computation input (``None`` where it does not require grad).

Composite symbols without a gradient rule are differentiated through their
decomposition.  When the backward then needs one of the composite's internal
values (dropout's mask, for example) the forward runs the decomposition too, so
that value exists; otherwise the forward still runs the composite whole (one
``torch.nn.functional`` call), and only its inputs and outputs are saved.

Saved values: everything the backward reads from the forward.  Cheap ops whose
output the backward reads (broadcasts, reshapes, dtype conversions, ``full``)
are recomputed in the backward when that does not increase the number of saved
values, which keeps the saved set small.
"""
from __future__ import annotations

import dataclasses

from .. import context, prims, symbols
from ..proxies import TensorProxy, is_proxy, is_unbacked
from ..sparse_proxy import SparseProxy
from ..pytree import tree_flatten, tree_unflatten
from ..symbols import BoundSymbol, Symbol
from ..trace import Trace
from . import sparse_grads
from .dce import dce
from .memory import plan_split
from ..grad_rules import NoGradientRuleError, bind_arguments, differentiable, get_rule


def _is_tensor(x) -> bool:
    """A value gradients can reach: a strided tensor, or a sparse one (an opaque value whose lines run with torch's
    autograd, acquisition/sparse.py; its gradient is a ``SparseProxy`` too, read only by opaque lines)."""
    return type(x) is TensorProxy or type(x) is SparseProxy


def is_float_tensor(x) -> bool:
    """A tensor gradients can flow through: floating point or complex (eager differentiates both)."""
    return _is_tensor(x) and (x._tt_dtype.is_float or x._tt_dtype.is_complex)


def requires_grad_inputs(trc) -> list:
    return [a for a in trc.args if is_float_tensor(a) and a._tt_requires_grad]


@dataclasses.dataclass
class ForwardBackward:
    joint: Trace
    forward: Trace  # returns (outputs, saved)
    backward: Trace  # backward(*saved, *cotangents) -> grads, one per computation input
    outputs: list  # unique proxies the forward returns (tensors and numbers), in order
    differentiable: list  # per output: does it carry gradient?
    saved: list  # proxies the backward reads from the forward
    cotangents: list  # one per differentiable output
    plan: object = None  # transforms/memory.py ``MemoryPlan``: what the backward computes again instead of reading it


def _summed(grads):
    """The sum of the gradients that are not None (None if none is)."""
    total = None
    for g in grads:
        if g is not None:
            total = g if total is None else prims.add(total, g)
    return total


# ---------------------------------------------------------------------------
# Forward: which values need gradients, which composites are decomposed
# ---------------------------------------------------------------------------
class Forward:
    """The forward bound symbols at the level the backward differentiates them.

    A composite on the gradient path without a gradient rule is replaced by its
    subsymbols (recursively); ``expanded`` remembers which, so the forward can
    run it whole again if the backward needs none of its internal values.
    """

    def __init__(self, bsyms, leaves):
        self.needs_grad = {id(a) for a in leaves}
        self.read: set = set()  # ids of every value a line so far reads (a new leaf nothing read yet joins cheaply)
        self.bsyms: list = []
        self.expanded: set = set()
        for bsym in bsyms:
            self._add(bsym)

    def on_path(self, bsym) -> bool:
        return differentiable(bsym.sym) and any(_is_tensor(a) and id(a) in self.needs_grad for a in bsym.flat_args())

    def add_leaf(self, leaf_id) -> bool:
        """Take one more leaf (by id) into the path found so far; False if a line so far read it (the path must be
        found anew)."""
        if leaf_id in self.needs_grad:
            return True
        if leaf_id in self.read:
            return False
        self.needs_grad.add(leaf_id)
        return True

    def _add(self, bsym):
        self.read.update(map(id, bsym.flat_args()))
        on_path = self.on_path(bsym)
        float_outs = [o for o in bsym.flat_outputs() if is_float_tensor(o)]
        if getattr(bsym.sym, "output_grad_flags", False):
            # The symbol knows which outputs eager differentiates (an opaque op's meta run): the others
            # (native_layer_norm's mean and rstd) carry no gradient.
            float_outs = [o for o in float_outs if o._tt_requires_grad]
        if on_path and float_outs and bsym.subsymbols and get_rule(bsym) is None:
            self.expanded.add(id(bsym))
            for sub in bsym.subsymbols:
                symbols.set_inner_layout(sub, bsym)
                self._add(sub)
            return
        self.bsyms.append(bsym)
        if on_path:
            self.needs_grad.update(id(o) for o in float_outs)


# ---------------------------------------------------------------------------
# Backward: reverse pass over the forward bound symbols
# ---------------------------------------------------------------------------
class Cotangents:
    def __init__(self):
        self._ct: dict = {}

    def get(self, p):
        return self._ct.get(id(p))

    def add(self, p, g):
        if g is None:
            return
        if tuple(g._tt_shape) != tuple(p._tt_shape) or g._tt_dtype is not p._tt_dtype:
            raise RuntimeError(
                f"thunder_train internal error: gradient for {p._tt_name} has {g.type_string()}, expected {p.type_string()}"
            )
        prev = self._ct.get(id(p))
        if prev is None:
            self._ct[id(p)] = g
        elif type(p) is SparseProxy:
            self._ct[id(p)] = sparse_grads.accumulate(prev, g)
        else:
            self._ct[id(p)] = prims.add(prev, g)


def cotangent_like(p, name=None):
    """A gradient value for ``p``: strided for a strided tensor; for a sparse one a ``SparseProxy`` of its layout,
    which stands for whatever layout torch's autograd gives it at run time (sparse or strided, as eager's)."""
    if type(p) is SparseProxy:
        return sparse_grads.gradient_of(p, name)
    return TensorProxy(name, shape=p._tt_shape, dtype=p._tt_dtype, device=p._tt_device)


def _describe(bsym) -> str:
    name = bsym.sym.id
    if bsym.sym.runs_opaquely and not name.startswith("grad_rules."):  # (opaque_grad's own vjp symbol)
        return f"{name.removeprefix('opaque.')} (run opaquely, torch op unknown to thunder_train)"
    return name


def backward_pass(fwd: Forward, cts: Cotangents):
    for bsym in reversed(fwd.bsyms):
        outs = [o for o in bsym.flat_outputs() if _is_tensor(o)]
        if not any(cts.get(o) is not None for o in outs) or not fwd.on_path(bsym):
            continue
        rule = get_rule(bsym)
        if not bsym.sym.runs_opaquely and not _complex_ready(bsym, outs):
            # Native rules are written for real tensors (no conjugates); the dispatcher runs complex calls on the
            # gradient path through torch's autograd, so this is a path it did not cover: refuse, never differ.
            raise NoGradientRuleError(
                f"cannot compute gradients: {_describe(bsym)} reads or makes a complex tensor on the gradient path, "
                "and thunder_train differentiates complex tensors only through torch's autograd of out-of-place torch "
                "calls. Use the out-of-place form of the op, or compute this part under torch.no_grad().")
        if rule is None:
            raise NoGradientRuleError(
                f"cannot compute gradients: {_describe(bsym)} has no gradient rule "
                f"(it produces {', '.join(o._tt_name for o in outs)}, which a differentiable output depends on). "
                "Add one with @register_vjp next to the op's definition (thunder_train/compiler/torchlang/; "
                "a prim's next to it in thunder_train/compiler/prims/), "
                "or compute this part under torch.no_grad() / on detached tensors."
            )
        flat_out, spec = tree_flatten(bsym.output)
        g = tree_unflatten([cts.get(o) if _is_tensor(o) else None for o in flat_out], spec)
        args = bind_arguments(bsym)
        if "fused_backward" in bsym.sym.tags and _is_tensor(bsym.output) and _is_tensor(g):
            grads = _as_vjp_symbol(bsym, rule, g, args, fwd.needs_grad)
        else:
            grads = rule(g, bsym.output, **args)
        for name, grad in grads.items():
            if grad is None:
                continue
            values, _ = tree_flatten(args[name])
            grad_leaves, _ = tree_flatten(grad)
            for v, gv in zip(values, grad_leaves):
                if _is_tensor(v) and id(v) in fwd.needs_grad and gv is not None:
                    cts.add(v, gv)


# Prims whose gradient rules are linear with real coefficients (moves, selections, sums): eager's gradient of
# complex values too, with no conjugate to take.  (The write-back of an update through an indexed view of a
# complex tensor records them directly.)
_COMPLEX_LINEAR = {f"prims.{n}" for n in (
    "reshape", "squeeze", "broadcast_in_dim", "transpose", "slice", "cat", "pad", "flip", "take", "gather",
    "scatter_add", "index_put", "add", "sub", "neg", "sum", "where", "convert_element_type", "clone", "grad_layout")}


def _complex_ready(bsym, outs) -> bool:
    """False for a native op on complex values whose rule may lack a conjugate (or mixes real and complex)."""
    diff = [t for t in (*bsym.flat_args(), *outs) if is_float_tensor(t)]
    if not any(t._tt_dtype.is_complex for t in diff):
        return True
    return bsym.sym.id in _COMPLEX_LINEAR and all(t._tt_dtype.is_complex for t in diff)


# Composites tagged "fused_backward" (declared with the op) record their gradient as one
# ``<name>_vjp`` symbol: its subsymbols are the rule's prims (what decomposing executors run), and
# the torch executor claims it whole and runs PyTorch's own fused backward kernels
# (executors/torch_impls.py ``TorchVJP``).
_vjp_symbols: dict = {}


def vjp_symbol(sym) -> Symbol:
    s = _vjp_symbols.get(sym)
    if s is None:
        s = _vjp_symbols[sym] = Symbol(f"{sym.name}_vjp", None, module="vjp")
        s.forward_symbol = sym
    return s


def _as_vjp_symbol(bsym, rule, g, args, needs_grad):
    """Run ``rule`` in a nested scope and record what it recorded as one ``<name>_vjp`` bound symbol."""
    trc = context.get_trace()
    trc.push_scope()
    # Torch's own backward ("fused_backward") runs this rule whole: the layouts inside it are computed only if not.
    whole = True
    trc.claimed_depth += whole
    try:
        grads = rule(g, bsym.output, **args)
    finally:
        subs = trc.pop_scope()
        trc.claimed_depth -= whole
    made = {id(o) for b in subs for o in b.flat_outputs()}
    arg_leaves = tree_flatten((bsym.args, bsym.kwargs))[0]
    outs, wanted = [], []  # gradient proxies; for each, the positions of its input among bsym's flat args
    seen = []  # the differentiated inputs, in the order of outs
    ok = bool(subs)
    for name, grad in grads.items():
        if grad is None:
            continue
        for v, gv in zip(tree_flatten(args[name])[0], tree_flatten(grad)[0]):
            if gv is None or not _is_tensor(v) or id(v) not in needs_grad:
                continue
            if name in bsym.sym.not_differentiated_by_torch:
                ok = False
            if id(gv) not in made or any(gv is o for o in outs):
                ok = False
            if any(v is w for w in seen):
                # One tensor passed as two differentiated arguments (sdpa(x, x, x)): torch's backward gives only
                # their sum, the rule one gradient per argument; its own prims give those.
                ok = False
            seen.append(v)
            outs.append(gv)
            wanted.append(tuple(i for i, a in enumerate(arg_leaves) if a is v))
    if not ok or not outs:
        for b in subs:
            if whole and symbols.layout_hook is not None and not trc.claimed_depth:
                symbols.layout_hook(b)
            trc.add(b)
        return grads
    vsym = vjp_symbol(bsym.sym)
    # Values the rule reads besides the op's arguments (its output, for softmax): listed so that
    # saved-value selection and freeing see them; the torch implementation ignores them.
    in_args = {id(a) for a in arg_leaves} | {id(g)}
    reads = tuple(p for p in _proxies_read(subs) if id(p) not in in_args)
    vb = BoundSymbol(vsym, (g, reads) + tuple(bsym.args), dict(bsym.kwargs), tuple(outs), tuple(subs))
    vb.torch_fn = (bsym.torch_fn or getattr(bsym.sym, "torch_impl", None), tuple(wanted))
    if symbols.layout_hook is not None and not trc.claimed_depth:
        symbols.layout_hook(vb)  # the gradients as torch's backward lays them out (not always row-major)
    trc.add(vb)
    return grads


# ---------------------------------------------------------------------------
# The split
# ---------------------------------------------------------------------------
def _proxies_read(bsyms, extra=()) -> list:
    """Proxies the bound symbols read (plus ``extra``) that they do not define, in first-use order."""
    defined, read, seen = set(), [], set()
    for b in bsyms:
        for a in b.flat_args():
            if is_proxy(a) and id(a) not in defined and id(a) not in seen:
                seen.add(id(a))
                read.append(a)
        defined.update(id(o) for o in b.flat_outputs() if is_proxy(o))
    for a in extra:
        if is_proxy(a) and id(a) not in defined and id(a) not in seen:
            seen.add(id(a))
            read.append(a)
    return read


def _data_dependent_sizes(bsyms, saved) -> list:
    """Data-dependent sizes (``u0``: the length ``bincount`` or ``nonzero`` gave) in the shapes the backward's lines
    use but do not compute: the forward reads them (``prims.shape``) where the op runs, so they are saved like values
    (a lowered line may spell a shape it only reads from a tensor, as ``broadcast_in_dim``'s view shape)."""
    have = {id(p) for p in saved}
    have.update(id(o) for b in bsyms for o in b.flat_outputs() if is_proxy(o))
    out = []
    for b in bsyms:
        for t in (*b.flat_args(), *b.flat_outputs()):
            for s in getattr(t, "_tt_shape", ()) if _is_tensor(t) else ():
                if is_unbacked(s) and id(s) not in have:
                    have.add(id(s))
                    out.append(s)
    return out


def _recompute_cheap(saved: list, fwd_bsyms: list) -> tuple[list, list]:
    """Replace saved outputs of cheap ops by their inputs when that does not grow the saved set."""
    producer = {id(o): b for b in fwd_bsyms for o in b.flat_outputs() if is_proxy(o)}
    position = {id(b): i for i, b in enumerate(fwd_bsyms)}
    saved = list(saved)
    moved: dict = {}
    changed = True
    while changed:
        changed = False
        for p in list(saved):
            b = producer.get(id(p))
            # Tag "cheap_to_recompute" (declared with the op): recomputed in the backward rather than saved,
            # when that saves no extra value.
            if b is None or "cheap_to_recompute" not in b.sym.tags:
                continue
            have = {id(s) for s in saved}
            new_inputs = list({id(x): x for x in b.flat_args() if is_proxy(x) and id(x) not in have}.values())
            if len(new_inputs) > 1:
                continue
            saved = [s for s in saved if s is not p] + new_inputs
            moved[id(b)] = b
            changed = True
    recompute = sorted(moved.values(), key=lambda b: position[id(b)])
    return saved, recompute


def _internal_ids(bsym) -> set:
    ids = set()
    for sub in bsym.subsymbols:
        ids.update(id(o) for o in sub.flat_outputs() if is_proxy(o))
        ids |= _internal_ids(sub)
    return ids - {id(o) for o in bsym.flat_outputs() if is_proxy(o)}


def emit_forward(bsyms, expanded, saved_ids, out):
    """Each composite whole unless the backward reads one of its internal values."""
    for b in bsyms:
        if id(b) in expanded and _internal_ids(b) & saved_ids:
            emit_forward(b.subsymbols, expanded, saved_ids, out)
        else:
            out.append(b)


def build_forward_backward(trc, memory_budget: float | None = None, stand_ins=()) -> ForwardBackward | None:
    """The joint trace and its split; None when no output carries gradient.  What the forward saves is planned as
    in a whole step (transforms/memory.py ``plan_split``: checkpoint regions, cheap values, ``memory_budget``).
    ``stand_ins``: (input, [values]) whose gradients add to the input's, as eager's graph reaches the leaf from ops
    after an update it does not record (``with torch.no_grad(): w.mul_(2)``, ``w.data = v``; leaf_values.py)."""
    extra = {id(a): [v for v in vals if v is not a] for a, vals in stand_ins}
    fwd = Forward(trc.bound_symbols, requires_grad_inputs(trc) + [v for vals in extra.values() for v in vals])
    flat_out, _ = tree_flatten(trc.output)
    outputs = list({id(o): o for o in flat_out if is_proxy(o)}.values())
    differentiable = [is_float_tensor(o) and id(o) in fwd.needs_grad for o in outputs]
    if not any(differentiable):
        return None

    joint = trc.derive("Joint forward and backward (autograd)")
    joint.bound_symbols.extend(fwd.bsyms)
    cts = Cotangents()
    cotangents = []
    with context.tracing(joint):
        for o, d in zip(outputs, differentiable):
            if d:
                c = cotangent_like(o, joint.make_name("ct"))
                cotangents.append(c)
                cts.add(o, c)
        backward_pass(fwd, cts)
        grads = tuple(_summed([cts.get(a)] + [cts.get(v) for v in extra.get(id(a), ())])
                      if is_float_tensor(a) and a._tt_requires_grad else None for a in trc.args)
    joint.args = list(trc.args) + cotangents
    joint.output = (trc.output, grads)
    joint = dce(joint, header="Joint forward and backward (autograd), after dead code elimination")

    fwd_ids = {id(b) for b in fwd.bsyms}
    fwd_part = [b for b in joint.bound_symbols if id(b) in fwd_ids]
    bwd_part = [b for b in joint.bound_symbols if id(b) not in fwd_ids]
    # The memory plan: checkpointed values, cheap values and a budget's are recomputed by the backward.
    bwd_part, plan = plan_split(fwd_part, bwd_part, outputs, {id(a) for a in trc.args}, joint.make_name, memory_budget)
    ct_ids = {id(c) for c in cotangents}
    saved = [p for p in _proxies_read(bwd_part, grads) if id(p) not in ct_ids]
    saved, recompute = _recompute_cheap(saved, fwd_part)
    saved += _data_dependent_sizes(recompute + bwd_part, saved)

    forward = trc.derive("Forward (autograd): the computation, also returning the values the backward reads")
    # fn_name stays "computation": the executed forward is the entry's computation.
    emit_forward(trc.bound_symbols, fwd.expanded, {id(p) for p in saved}, forward.bound_symbols)
    forward.output = (tuple(outputs), tuple(saved))
    forward = dce(forward, header=forward.header)

    backward = joint.derive("Backward (autograd): gradients of the inputs from saved values and output cotangents")
    backward.fn_name = "backward"
    backward.args = list(saved) + cotangents
    backward.bound_symbols.extend(recompute + bwd_part)
    backward.output = grads
    # Not no_grad (the backward runs inside autograd's engine), but the autocast-off decorator of an
    # autocast trace stays: the backward's dtypes are explicit too.
    backward.decorators = [d for d in trc.decorators if "autocast" in d]
    return ForwardBackward(joint, forward, backward, outputs, differentiable, saved, cotangents, plan)


def detach_float_tensors(out):
    """``prims.stop_gradient`` on every float tensor in ``out`` (the tracer calls this in no_grad regions)."""
    from ..pytree import tree_map

    return tree_map(lambda x: prims.stop_gradient(x) if is_float_tensor(x) else x, out)


__all__ = ["ForwardBackward", "build_forward_backward", "requires_grad_inputs", "detach_float_tensors", "Forward", "Cotangents", "backward_pass", "emit_forward", "is_float_tensor"]
