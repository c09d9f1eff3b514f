"""``loss.backward()``, ``torch.autograd.grad`` and ``.grad`` inside a traced function.

When the traced function calls ``loss.backward()``, the gradient rules run
right there (``transforms/autograd.py``): the backward becomes part of the
same trace, after the forward that produced ``loss``, and the gradients are
ordinary values the rest of the function (``clip_grad_norm_``,
``optimizer.step()``) reads.

``.grad`` follows PyTorch's accumulation rules, tracked per parameter by
``GradState``:

* a parameter whose ``.grad`` is ``None`` gets the new gradient as a fresh
  tensor (assigned by the epilogue after the computation);
* an existing ``.grad`` is accumulated into *in place* (the same tensor
  object keeps the sum, written back with one ``copy_``), like eager's
  AccumulateGrad;
* parameters the loss does not depend on, and tensors that do not require
  grad, are left alone; ``p.grad = None`` / ``zero_grad()`` are recorded.

The initial ``.grad`` of an input is read lazily — only parameters whose
``.grad`` the function touches get a prologue leaf (``model.fc.weight.grad``:
a tensor, or the constant ``None``), so compiling a plain forward does not
specialise on gradients.
"""
from __future__ import annotations

import torch

from .. import context, prims
from ..errors import SECOND_BACKWARD_MESSAGE, TracingError
from .ambient import refuse_anomaly_at_backward
from .distributed import reduce_gradients
from .saved_versions import check_saved, lines_rewritten, record_data_assignment
from ..proxies import TensorProxy
from ..sparse_proxy import SparseProxy
from ..transforms import sparse_grads
from ..transforms.autograd import Cotangents, Forward, backward_pass, emit_forward, is_float_tensor
from ..transforms.remat import BACKWARD


def _install():
    from ..torchlang import tensor_methods

    tensor_methods.computed_requires_grad = computed_requires_grad


class GradState:
    """The ``.grad`` of every tensor the traced function touched: initial and current."""

    def __init__(self, st):
        self.st = st  # the TracerState (acquisition/state.py)
        self.initial: dict = {}  # id(param) -> proxy | None
        self.current: dict = {}  # id(param) -> proxy | None
        self.params: dict = {}  # id(param) -> param proxy (the user-visible object)

    def _ensure(self, p):
        if id(p) not in self.current:
            g = self.st.walker.grad_leaf(p)
            self.initial[id(p)] = g
            self.current[id(p)] = g
            self.params[id(p)] = p

    def get(self, p):
        self._ensure(p)
        return self.current[id(p)]

    def set(self, p, value):
        if value is not None and (type(value) is SparseProxy or type(p) is SparseProxy):
            if type(value) is not type(p) or value._tt_layout != p._tt_layout:
                raise RuntimeError(f"assigned grad has data of a different type: {value.type_string()} for a tensor of "
                                   f"{p.type_string()}")
        elif value is not None and type(value) is not TensorProxy:
            raise TypeError(f"assigned grad expected to be a Tensor or None but got grad of type {type(value).__name__}")
        if value is not None and (value._tt_shape != p._tt_shape or value._tt_dtype is not p._tt_dtype):
            raise RuntimeError(
                f"assigned grad has data of a different size or type: {value.type_string()} for a parameter of {p.type_string()}"
            )
        self._ensure(p)
        self.current[id(p)] = value

    def accumulate(self, p, g):
        """PyTorch's AccumulateGrad: a new tensor when ``.grad`` is None, else ``grad += g`` in place."""
        cur = self.get(p)
        if cur is None:
            self.current[id(p)] = g
        elif type(p) is SparseProxy or type(cur) is SparseProxy:
            raise TracingError(
                f"a backward inside the compiled function accumulates into the existing .grad of the sparse tensor "
                f"{p._tt_name}: eager adds it in place, which thunder_train does not do for a sparse value (an opaque "
                "value, never updated in place). Set its .grad to None before the call (optimizer.zero_grad()), or "
                "run this backward outside the compiled function. Nothing was changed.")
        else:
            buffers = self.st.buffers
            buffers.write(cur, prims.add(buffers.read(cur), g))

    def replace(self, params, fn):
        """New values for the current ``.grad`` of ``params``: ``fn(values) -> values`` (DDP's averaging).

        A ``.grad`` tensor that is an input of the function is updated in place, as eager's reducer does.
        """
        buffers = self.st.buffers
        grads = [self.get(p) for p in params]
        for p, g, v in zip(params, grads, fn([buffers.read(g) for g in grads])):
            if self.st.walker.is_input(g):
                buffers.write(g, v)
            else:
                self.current[id(p)] = v

    def changes(self) -> list:
        """``(param, new grad or None)`` for every parameter whose ``.grad`` is a different object now."""
        return [(self.params[k], v) for k, v in self.current.items() if v is not self.initial[k]]


def grad_leaves(st) -> list:
    """(user-visible tensor, [values standing for it]) of every input tensor that requires grad now (``st``: the
    TracerState).  The values are those it held while it required grad (``acquisition/leaf_values.py``): a
    gradient reaching any of them reaches the tensor, as eager's graph recorded at each op."""
    lv = st.leaf_values
    out = []
    for p in st.walker.input_proxies():
        if is_float_tensor(p) and p._tt_requires_grad:
            out.append((p, lv.stand_ins(p) if lv is not None else [st.buffers.read(p)]))
    return out + new_leaves(st)


def computed_requires_grad(st, a) -> bool:
    """Eager's ``requires_grad`` of a value computed inside the function: an op's output requires grad when one of
    its inputs does and grad mode is on (``prims.stop_gradient`` marks what ``no_grad`` computed)."""
    if type(a) is not TensorProxy or not is_float_tensor(a) or st.walker.leaf_of(a) is not None:
        return False
    if not (st.grad_enabled or torch.is_grad_enabled()):
        return False  # called under no_grad: nothing computed requires grad (as record_backward)
    value = st.buffers.read(a)
    if id(value) in st.made_without_grad and all(v is not value for _, vals in grad_leaves(st) for v in vals):
        # made under no_grad and no leaf's value (an optimizer's new state: asked at each write into it; the path
        # would be extended over the whole step for each of them)
        return False
    return id(value) in _gradient_path_now(st)


def _gradient_path_now(st) -> set:
    """``gradient_path(st)``, extended line by line since the last question: the path is a left fold over the
    trace's lines, so while the lines so far are unchanged only the new lines are added.  (Asked at every write into
    a computed value: recomputing it each time made first calls quadratic.)  New values standing for leaves (an
    optimizer's update of a parameter) join it when no line so far read them; a leaf dropped, or a new one a line
    read, finds the path anew."""
    lines = st.trace.bound_symbols
    seeds = {id(v) for _, vals in grad_leaves(st) for v in vals}
    cached = getattr(st, "_gradient_path_cache", None)
    if cached is not None:
        lines_id, seeded, n, last, fwd = cached
        if (lines_id == id(lines) and n <= len(lines) and (n == 0 or lines[n - 1] is last) and seeded <= seeds
                and all(fwd.add_leaf(i) for i in seeds - seeded)):
            for b in lines[n:]:
                fwd._add(b)
            st._gradient_path_cache = (id(lines), seeds, len(lines), lines[-1] if lines else None, fwd)
            return fwd.needs_grad
    fwd = Forward(list(lines), [v for _, vals in grad_leaves(st) for v in vals])
    st._gradient_path_cache = (id(lines), seeds, len(lines), lines[-1] if lines else None, fwd)
    return fwd.needs_grad


def assign_data(st, t, v):
    """``t.data = v`` on a tensor made inside the function (a projected adversarial perturbation,
    ``delta.data = delta.clamp(-eps, eps)``): ``t`` holds ``v``'s values from now on, without ``v``'s history, and
    keeps its flag and ``.grad``.  Eager makes the two share memory; an in-place write to either afterwards would
    show in both, which the functional trace does not follow: ``check_data_assignments`` refuses that.  An input
    ``t`` (a parameter, a buffer): ``data_assignment.py``."""
    if type(v) is not TensorProxy:
        raise TypeError(f"Tensor.data must be a Tensor, not {type(v).__name__}")
    if type(t) is not TensorProxy:
        raise TracingError(
            "setting Tensor.data inside the compiled function on a tensor it does not trace (a library object's own "
            "tensor) is not supported: do the assignment outside the compiled function.")
    if st.buffers.base_of(t) is not None:
        raise TracingError(
            "setting Tensor.data on a view inside the compiled function is not supported (eager changes only the "
            "view object): assign to the tensor itself, or write the view in place under torch.no_grad() "
            "(view.copy_(v)).")
    if st.walker.leaf_of(t) is not None:
        from .data_assignment import assign_input_data

        return assign_input_data(st, t, v, lambda value: computed_requires_grad(st, value))
    value = st.buffers.read(v)
    if (value._tt_shape, value._tt_dtype, value._tt_device, value._tt_strides) != (t._tt_shape, t._tt_dtype, t._tt_device, t._tt_strides):
        raise TracingError(
            f"t.data = v inside a compiled function with another shape, dtype, device or layout ({value.type_string()} "
            f"for {t.type_string()}) is not supported: make the new tensor with the new values instead.")
    # A new assignment to ``t`` ends its sharing with the last ``v`` (eager: ``t`` points at other memory).
    st.data_assignments[:] = [a for a in st.data_assignments if a[0] is not t]
    old = st.buffers.read(t)
    # A computed ``t`` keeps its graph, as in eager: later uses read v's values, gradients reach t's history.
    keeps_graph = (torch.is_grad_enabled() and not (id(t) in st.requires_grad_changes and t._tt_requires_grad)
                   and computed_requires_grad(st, old))
    record_data_assignment(st, t, old)
    new = prims.stop_gradient(value)
    st.buffers.write(t, prims.unseen_write(new, old) if keeps_graph else new)
    st.data_assignments.append((t, v, st.buffers.version(t), st.buffers.version(v)))


def check_data_assignments(st):
    """An in-place write, after ``t.data = v``, to ``t`` or ``v``: eager writes both (shared memory)."""
    for t, v, vt, vv in st.data_assignments:
        if st.buffers.version(t) != vt or st.buffers.version(v) != vv:
            raise TracingError(
                f"after t.data = v inside the compiled function, {'t' if st.buffers.version(t) != vt else 'v'} was "
                "written in place: eager's t and v share memory, which the compiled program does not follow. Assign "
                "a new tensor instead (t.data = v.clone()), or write t itself in place (t.copy_(v) under no_grad).")


def new_leaves(st) -> list:
    """(tensor, [its value]) of every tensor made inside the function and set to require grad
    (``x.clone().requires_grad_()``: an adversarial example, a gradient penalty's interpolate): a leaf as in eager,
    whose ``.grad`` a backward inside the function sets."""
    changes = getattr(st, "requires_grad_changes", None)
    if not changes:
        return []
    walker = st.walker
    return [(a, [st.buffers.read(a)]) for a, _ in changes.values()
            if a._tt_requires_grad and is_float_tensor(a) and walker.leaf_of(a) is None]


def _wrt_groups(st, tensors) -> list:
    """For each tensor of ``autograd.grad(..., inputs=tensors)``: the values its gradient is the sum over."""
    lv = st.leaf_values
    out = []
    for t in tensors:
        if lv is not None and lv.tracks(t) and t._tt_requires_grad:
            out.append(lv.stand_ins(t))
        else:
            out.append([st.buffers.read(t) if type(t) is TensorProxy else t])
    return out


def _summed(groups, grads) -> list:
    """One gradient per group: the sum of its values' gradients (None if none reached them)."""
    out, i = [], 0
    for vals in groups:
        total = None
        for g in grads[i:i + len(vals)]:
            if g is not None:
                if total is None:
                    total = g
                else:
                    total = sparse_grads.accumulate(total, g) if type(g) is SparseProxy else prims.add(total, g)
        out.append(total)
        i += len(vals)
    return out


def gradient_path(st) -> set:
    """Ids of the values so far that depend on an input requiring grad (what a backward would reach), kept up to
    date line by line (cheap to ask again while tracing)."""
    return _gradient_path_now(st)


def record_backward(st, outputs, cotangents, wrt_values) -> list:
    """Record the backward of ``outputs`` into the trace; returns one gradient (or None) per ``wrt_values``."""
    trc = st.trace
    st.has_backward = True
    leaves = [v for _, vals in grad_leaves(st) for v in vals] + [v for v in wrt_values if v is not None]
    n = len(trc.bound_symbols)
    fwd = Forward(list(trc.bound_symbols), leaves)
    # A function called under torch.no_grad()/inference_mode() computes nothing that requires grad, as in
    # eager (unless it enables grad itself around both the forward and this backward).
    no_grad = not st.grad_enabled and not torch.is_grad_enabled()
    for i, o in enumerate(outputs):
        if type(o) is not TensorProxy or id(o) not in fwd.needs_grad or (no_grad and not st.walker.is_input(o)):
            raise RuntimeError(f"element {i} of tensors does not require grad and does not have a grad_fn")
    cts = Cotangents()
    for o, c in zip(outputs, cotangents):
        if c is None:
            if o._tt_shape:
                raise RuntimeError("grad can be implicitly created only for scalar outputs")
            c = prims.full((), 1.0, device=o._tt_device, dtype=o._tt_dtype)
        elif type(c) is not TensorProxy or c._tt_shape != o._tt_shape:
            raise RuntimeError(f"Mismatch in shape: grad_output has {getattr(c, 'shape', c)} and output has {o._tt_shape}")
        cts.add(o, c if c._tt_dtype is o._tt_dtype else prims.convert_element_type(c, o._tt_dtype))
    if check_saved(st, trc.bound_symbols, fwd.needs_grad, outputs, follow_memory=st.buffers.read):
        fwd = Forward(list(trc.bound_symbols), leaves)  # a line now reads memory written through .data
    backward_pass(fwd, cts)
    for b in trc.bound_symbols[n:]:
        b.region = BACKWARD  # the memory planner's backward lines (transforms/remat.py)
    # Composites differentiated through their decomposition: run the decomposition in the
    # forward when the backward reads one of its internal values (dropout's mask).
    read = {id(a) for b in trc.bound_symbols[n:] for a in b.flat_args()}
    forward: list = []
    starts = []  # where each forward line's lines begin now: the in-place writes on record move with them
    for b in trc.bound_symbols[:n]:
        starts.append(len(forward))
        emit_forward([b], fwd.expanded, read, forward)
    trc.bound_symbols[:n] = forward
    lines_rewritten(st, starts, len(forward))
    # The lines so far were rewritten: the path goes on from the backward's lines when ``fwd`` saw only the leaves
    # (the rewritten forward computes the values it saw), else it is found anew.
    seeds = {id(v) for _, vals in grad_leaves(st) for v in vals}
    whole = {id(v) for v in leaves} == seeds and forward
    st._gradient_path_cache = (id(trc.bound_symbols), seeds, len(forward), forward[-1], fwd) if whole else None
    return [None if v is None else cts.get(v) for v in wrt_values]


def refuse_freed_graph(st, outs) -> None:
    """Eager's error for a second backward from a value an earlier backward inside the function started from without
    ``retain_graph`` (``loss.backward()`` twice); before, the second backward ran.  Only the same value: whether a
    backward from another value reaches a freed node with saved tensors is eager's graph's detail (a GAN step's
    generator loss, through a fake batch the discriminator's loss read detached, is not)."""
    roots = {id(o) for values, retain in st.backward_roots if not retain for o in values}
    if any(type(o) is TensorProxy and id(o) in roots for o in outs):
        raise RuntimeError(SECOND_BACKWARD_MESSAGE + " (eager PyTorch raises this error too)")


def record_roots(st, outputs, retain_graph) -> None:
    """A backward inside the function from ``outputs`` (current values); ``retain_graph``: eager keeps the graph
    (what it freed decides the error a later backward through a returned value raises: returned_graph.py)."""
    st.backward_roots.append(([o for o in outputs if type(o) is TensorProxy], bool(retain_graph)))


def _as_list(x):
    if x is None:
        return None
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]


def _fresh(st, g, taken: set):
    """A gradient that becomes a new ``.grad`` must be its own tensor (eager never shares one between parameters)."""
    if id(g) in taken or st.walker.is_input(g):
        g = prims.clone(g)
    taken.add(id(g))
    return g


def _refuse_inside_an_op(st):
    """Inside an op's own recording (a custom Function's forward or backward recomputing under enable_grad and
    differentiating that, also while ``tt.compile(model)`` builds its backward): the lines it would differentiate
    are not the program's.  Before, torch's "does not require grad" or an internal ``AttributeError``."""
    trc = context.get_trace()
    if st.buffers is None or trc is None or len(trc._scopes) != 1:
        raise TracingError(
            "torch.autograd.grad or backward() inside a custom torch.autograd.Function's forward or backward is not "
            "supported in a compiled function or module. Write the Function's backward with its derivative's ops "
            "(no autograd call inside), or call the Function outside the compiled function.")


def _refuse_non_leaf_input(st, p) -> None:
    """A backward inside the function reaches the input ``p``: eager accumulates into ``p.grad`` only for a leaf; from
    a non-leaf (``x = src * 2`` passed in, a module attribute assigned a computed tensor) it goes on into the graph that
    computed it, which the compiled program cannot reach.  Refused, and each input it reached is guarded on being a
    leaf from now on (prologue.leafness_spec, thin_checks), so a later call with a non-leaf retraces and is refused."""
    leaf = st.walker.leaf_of(p)
    if leaf is None or leaf.kind != "tensor":
        return  # a tensor made to require grad inside the function: a leaf
    if leaf.alias_of is None and leaf.snapshot != "grad_fn":
        leaf.snapshot = "is_leaf"
    real = leaf.value
    if getattr(real, "is_leaf", True):
        return
    raise TracingError(
        f"{leaf.where} is a non-leaf tensor (grad_fn {type(real.grad_fn).__name__}) that a backward inside the compiled "
        "function differentiates: eager's backward would go on into the graph that computed it (to the tensors it was "
        "computed from), which the compiled program cannot reach. Compute the tensor inside the compiled function, "
        "pass it detached (`.detach()`, or `.detach().requires_grad_()` and backpropagate its `.grad` yourself), or "
        "compile the model (`tt.compile(model)`) and call backward outside. Nothing was changed.")


def backward(st, tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None):
    """``torch.autograd.backward`` / ``Tensor.backward`` while tracing (``st``: the TracerState)."""
    refuse_anomaly_at_backward()
    _refuse_inside_an_op(st)
    buffers = st.buffers
    outs = [buffers.read(t) for t in _as_list(tensors)]
    cts = _as_list(grad_tensors) or [None] * len(outs)
    cts = [None if c is None else buffers.read(c) for c in cts]
    params = grad_leaves(st)
    if inputs is not None:
        wanted = {id(t) for t in _as_list(inputs)}
        params = [(p, v) for p, v in params if id(p) in wanted]
        if len(params) != len(wanted):
            raise NotImplementedError("backward(inputs=...) inside a compiled function supports leaf tensors that are inputs of the function")
    refuse_freed_graph(st, outs)
    groups = [vals for _, vals in params]
    grads = _summed(groups, record_backward(st, outs, cts, [v for vals in groups for v in vals]))
    for (p, _), g in zip(params, grads):
        if g is not None:
            _refuse_non_leaf_input(st, p)
    record_roots(st, outs, retain_graph or create_graph)
    taken: set = set()
    for (p, _), g in zip(params, grads):
        if g is None:
            continue
        if type(g) is SparseProxy:  # a sparse leaf's (transforms/sparse_grads.py): read by opaque lines only
            if create_graph:
                raise TracingError(f"backward(create_graph=True) through the sparse tensor {p._tt_name} is not supported "
                                   "inside a compiled function; run it outside. Nothing was changed.")
            st.grads.accumulate(p, g if st.grads.get(p) is not None else sparse_grads.new_grad(g))
            continue
        if st.grads.get(p) is None:
            # A new .grad: eager's AccumulateGrad lays it out like the parameter (fused optimizer kernels rely on it).
            g = prims.grad_layout(_fresh(st, g, taken), p)
        # Without create_graph a gradient is a constant to any later backward (eager: no grad_fn).
        st.grads.accumulate(p, g if create_graph else prims.stop_gradient(g))
    # DistributedDataParallel's gradient averaging, which eager runs from autograd hooks.
    reduce_gradients(st, {id(p) for (p, _), g in zip(params, grads) if g is not None})
    return None


def grad(st, outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False, only_inputs=True,
         allow_unused=None, is_grads_batched=False, materialize_grads=False):
    """``torch.autograd.grad`` while tracing: returns the gradients, leaves ``.grad`` alone."""
    refuse_anomaly_at_backward()
    if is_grads_batched:
        raise NotImplementedError("torch.autograd.grad(is_grads_batched=True) is not supported inside a compiled function")
    _refuse_inside_an_op(st)
    buffers = st.buffers
    ins = _as_list(inputs)
    outs = [buffers.read(t) for t in _as_list(outputs)]
    cts = _as_list(grad_outputs) or [None] * len(outs)
    cts = [None if c is None else buffers.read(c) for c in cts]
    refuse_freed_graph(st, outs)
    groups = _wrt_groups(st, ins)
    values = [vals[-1] if vals else buffers.read(t) for vals, t in zip(groups, ins)]
    on_path = None  # ids on the gradient path, computed once if an input is not itself a leaf requiring grad
    for i, v in enumerate(values):
        if type(v) is TensorProxy and not v._tt_requires_grad and on_path is None:
            on_path = gradient_path(st)
        if type(v) is SparseProxy and v._tt_requires_grad:
            continue  # a sparse leaf: its gradient from the opaque lines' autograd (transforms/sparse_grads.py)
        if type(v) is not TensorProxy or not v._tt_requires_grad and id(v) not in on_path and not getattr(ins[i], "_tt_requires_grad", False):
            raise RuntimeError(f"One of the differentiated Tensors (input {i}) does not require grad")
    grads = _summed(groups, record_backward(st, outs, cts, [v for vals in groups for v in vals]))
    record_roots(st, outs, retain_graph or create_graph)
    # Without create_graph the returned gradients are constants to any later backward (eager: no grad_fn).
    if not create_graph:
        # (a sparse gradient is made by an opaque line no later backward differentiates)
        grads = [g if g is None or type(g) is SparseProxy else prims.stop_gradient(g) for g in grads]
    result = []
    for i, (v, g) in enumerate(zip(values, grads)):
        if g is None:
            if materialize_grads and type(v) is SparseProxy:
                raise TracingError("torch.autograd.grad(materialize_grads=True) for an unused sparse tensor is not "
                                   "supported inside a compiled function; use allow_unused=True and handle None.")
            if materialize_grads:
                g = prims.full(v._tt_shape, 0, device=v._tt_device, dtype=v._tt_dtype)
            elif not allow_unused:
                raise RuntimeError(
                    f"One of the differentiated Tensors (input {i}) appears to not have been used in the graph. "
                    "Set allow_unused=True if this is the desired behavior."
                )
        result.append(g)
    return tuple(result)


_install()
