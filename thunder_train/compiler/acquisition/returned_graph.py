"""What a function that calls ``backward()`` inside returns carries eager's autograd flags.

After ``loss.backward()`` inside the function its gradients are values of the program, which runs without PyTorch
autograd (``transforms/no_grad.py``), so its results come back without a graph.  Eager's ``loss`` still requires
grad and has a ``grad_fn`` (user code branches on ``loss.requires_grad``, Lightning checks it), and a second
``loss.backward()`` raises eager's error for a freed graph.  Here every returned tensor that eager's would give a
``grad_fn`` gets one (``computed_requires_grad``: on the gradient path, not computed under ``no_grad``):

* a view of an input that requires grad (``m.weight[0]``, ``p.t()``) is made again from the real input with
  ``as_strided`` at the traced layout, with grad enabled: as eager's, it requires grad, is a view of the parameter
  (an in-place write to it raises eager's error for a view of a leaf), and a backward through it reaches the
  parameter's ``.grad``;
* any other such value goes through ``FreedGraph``, one autograd node whose backward raises: eager's own message for
  a graph freed by a backward (values the backward inside went through without ``retain_graph``), or says that the
  compiled program kept no graph (values computed after that backward, or with ``retain_graph=True``, which eager
  could still differentiate).  A view of a computed value comes out as a tensor of its own on the same memory and
  version counter, so an in-place write to it works as in eager (a backward through it raises either way).

Values that eager's would not give a ``grad_fn`` (a detached value, one computed under ``no_grad``, gradients,
returned parameters) are left as they are.

``returned_view_calls`` gives eager's view calls of the returned views (the pieces of ``split``/``unbind``/``chunk``
among them, which eager's autograd marks as outputs of a function returning several views and refuses an in-place
write to): the node that connects a call to PyTorch autograd makes them again with those calls
(compiler/autograd_function.py).
"""
from __future__ import annotations

import operator

import torch

from .. import prims
from ..errors import SECOND_BACKWARD_MESSAGE
from ..proxies import TensorProxy, is_proxy
from ..pytree import tree_flatten
from . import traced_autograd
from .traced_autograd import computed_requires_grad
from .traced_grad_fn import eager_node_name

NOT_KEPT_MESSAGE = (
    "thunder_train: this tensor was returned by a compiled function that calls backward() inside it; the compiled "
    "program computes its gradients itself and keeps no autograd graph for its results, so a backward through this "
    "tensor after the call (which eager would run) is not supported. Compute the value outside the compiled "
    "function, or do this backward inside it.")


def _freed_by_backward(st) -> set:
    """Ids of values whose graph a backward inside freed in eager: the values it went through without
    ``retain_graph`` (inputs aside: a leaf's node keeps nothing) and every value computed from one of them.
    (``st.backward_roots``: ``traced_autograd.record_roots``.)"""
    reached = {id(o) for outs, retain in st.backward_roots if not retain for o in outs}
    if not reached:
        return reached
    lines = st.trace.bound_symbols
    for b in reversed(lines):
        if b.sym is prims.stop_gradient or not any(id(o) in reached for o in b.flat_outputs()):
            continue
        reached.update(id(a) for a in b.flat_args() if type(a) is TensorProxy)
    reached -= {id(p) for p in st.walker.input_proxies()}
    for b in lines:  # forward: what was computed from a freed value has it in its graph
        if b.sym is not prims.stop_gradient and any(id(a) in reached for a in b.flat_args()):
            reached.update(id(o) for o in b.flat_outputs() if type(o) is TensorProxy)
    return reached


def rebuild(st, out, names, extra, taken) -> tuple[list, list]:
    """Epilogue lines and ``(flat index, expression)`` results for the returned tensors eager's would give a
    ``grad_fn`` (``taken``: flat indices already rebuilt by ``output_aliases``)."""
    buffers, walker = st.buffers, st.walker
    freed, rows, exprs, pieces = None, [], [], []
    for i, o in enumerate(tree_flatten(out)[0]):
        if i in taken or type(o) is not TensorProxy or walker.leaf_of(o) is not None or not computed_requires_grad(st, o):
            continue
        base = buffers.base_of(o)
        bleaf = walker.leaf_of(base) if base is not None else None
        if (bleaf is not None and bleaf.kind == "tensor" and base._tt_requires_grad and buffers.layout_is_traced(o)
                and o._tt_dtype is base._tt_dtype
                and all(type(n) is int for n in (*o._tt_shape, *o._tt_strides, o._tt_storage_offset))):
            layout = (tuple(o._tt_shape), tuple(o._tt_strides), o._tt_storage_offset - base._tt_storage_offset)
            steps = buffers.view_steps(o)
            calls = f", {names(steps, 'view_calls')}" if _plain(steps) else ""
            exprs.append((i, f"{names(view_with_grad, 'view_with_grad')}({names(bleaf.value, base._tt_name, bleaf)}, "
                             f"{layout[0]!r}, {layout[1]!r}, {layout[2]}{calls})"))
            continue
        if freed is None:
            freed = _freed_by_backward(st)
        steps = _piece_calls(buffers, o)
        if steps is not None and bleaf is None:
            # A piece of split/unbind/chunk of a computed value: made again from that value by eager's calls, so a
            # write into it is eager's error for one of several views (the value goes through the node, not returned)
            pieces.append((i, steps, base))
            o = base
        rows.append((i if steps is None else None, extra(o), SECOND_BACKWARD_MESSAGE
                     if id(buffers.read(o)) in freed or id(o) in freed else NOT_KEPT_MESSAGE, o))
    if not rows:
        return [], exprs
    values = ", ".join(e for _, e, _, _ in rows)
    path = traced_autograd.gradient_path(st)
    made = FreedGraphs(tuple(m for _, _, m, _ in rows),
                       tuple(None if buffers.node_made_again(o) else eager_node_name(st, buffers.read(o), path) for _, _, _, o in rows))
    lines = [f"  with_graph = {names(made, 'freed_graphs')}(({values},))"]
    row_of = {id(o): k for k, (_, _, _, o) in reversed(list(enumerate(rows)))}
    exprs += [(i, f"{names(made_by_calls, 'made_by_calls')}(with_graph[{row_of[id(base)]}], {names(steps, 'view_calls')})")
              for i, steps, base in pieces]
    return lines, exprs + [(i, f"with_graph[{k}]") for k, (i, _, _, _) in enumerate(rows) if i is not None]


def _piece_calls(buffers, o):
    """Eager's view calls making ``o`` from its base where one returns several views (``split``), with plain arguments
    and the traced layout eager's; else None."""
    steps = buffers.view_steps(o)
    if not _plain(steps) or not any(f.__class__ is operator.itemgetter for f, _, _ in steps) \
            or not buffers.layout_is_traced(o):
        return None
    return steps


def _plain(steps) -> bool:
    """Whether there are view calls and every argument of them is a plain value (no proxy): the epilogue can replay
    them on the real tensors."""
    return bool(steps) and not any(is_proxy(a) for _, args, kw in steps for a in tree_flatten((args, kw))[0])


def made_by_calls(value, calls):
    """``value``'s view made by eager's ``calls`` with grad enabled (autograd records each, as eager's)."""
    with torch.enable_grad():
        for f, args, kwargs in calls:
            value = f(value, *args, **kwargs)
    return value


def returned_view_calls(st, out, trc_output) -> dict:
    """Output name -> ``(eager's view calls from the value's base, whether one of them returns several views)`` for
    each returned view that requires grad and whose calls are known (``functional.View.steps``) with plain arguments.
    A piece of ``split``/``unbind``/``chunk``/``tensor_split`` (a step taking one result of a tuple) is marked by
    eager's autograd as one of several views, which refuse an in-place write; ``unsafe_split``'s pieces are made by it,
    as eager's, which are not views.  The node that connects a call to PyTorch autograd makes such views again
    outside with these calls (compiler/autograd_function.py), so they carry eager's node (``SelectBackward0``, not
    ``AsStridedBackward0``) and eager's answer to a write."""
    user_out, trc_out = tree_flatten(out)[0], tree_flatten(trc_output)[0]
    if len(user_out) != len(trc_out):
        return {}
    found = {}
    for u, t in zip(user_out, trc_out):
        if type(u) is not TensorProxy or type(t) is not TensorProxy or not computed_requires_grad(st, u):
            continue
        steps = st.buffers.view_steps(u)
        if not _plain(steps):
            continue
        found[t._tt_name] = (steps, any(f.__class__ is operator.itemgetter for f, _, _ in steps))
    return found


def view_with_grad(base, shape, strides, offset, calls=None):
    """A view of the input ``base`` at the traced layout, recorded by autograd (eager's view of a parameter): made by
    eager's own view calls where known and they give that layout (eager's node: ``SelectBackward0``)."""
    with torch.enable_grad():
        if calls is not None:
            v = made_by_calls(base, calls)
            if (isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(shape) and v.stride() == tuple(strides)
                    and v.storage_offset() == base.storage_offset() + offset):
                return v
        return base.as_strided(shape, strides, base.storage_offset() + offset)


_ANCHOR = torch.zeros((), requires_grad=True)  # the node's input: its outputs require grad (no gradient reaches it)


class FreedGraph(torch.autograd.Function):
    """One node for a call's results whose graph eager would have: its backward raises (``apply(messages, values)``)."""

    @staticmethod
    def forward(ctx, anchor, messages, values):
        ctx.messages = messages
        ctx.set_materialize_grads(False)
        # A view of another tensor is given as a tensor of its own on the same memory and version counter: a custom
        # Function's view outputs refuse in-place writes, which eager allows on a view of a computed value.
        return tuple(v.detach() if v._base is not None else v for v in values)

    @staticmethod
    def backward(ctx, *grads):
        for g, message in zip(grads, ctx.messages):
            if g is not None:
                raise RuntimeError(message)
        raise RuntimeError(ctx.messages[0])


_named_nodes: dict = {None: FreedGraph}


def _node_class(names):
    """``FreedGraph`` whose node is named as eager's (``names``: ``(class name, name())``; None: ``FreedGraphBackward``)."""
    cls = _named_nodes.get(names)
    if cls is None:
        cls = _named_nodes[names] = type(f"FreedGraph{names[0]}", (FreedGraph,), {})
        cls._backward_cls.__name__ = cls._backward_cls.__qualname__ = names[0]
    return cls


class FreedGraphs:
    """``freed_graph`` for one epilogue's returned values (their messages and eager's node names known when the
    epilogue is generated): the nodes' classes and grouping found once, not on every call (an epilogue runs this each
    training step; the general function's bookkeeping was half of its ~15 us there)."""

    def __init__(self, messages: tuple, node_names: tuple):
        self.messages, self.node_names = messages, node_names
        groups: dict = {}  # node names -> positions, where the values are distinct objects (the usual case)
        for k in range(len(messages)):
            groups.setdefault(node_names[k] if k < len(node_names) else None, []).append(k)
        self.plan = tuple((_node_class(names), tuple(ks), tuple(messages[k] for k in ks)) for names, ks in groups.items())
        self.single = self.plan[0][0] if len(messages) == 1 else None

    def __call__(self, values: tuple) -> tuple:
        if self.single is None and len({id(v) for v in values}) != len(values):
            return freed_graph(values, self.messages, self.node_names)  # one tensor returned twice: one object
        was = torch.is_grad_enabled()
        torch._C._set_grad_enabled(True)  # the trace found these values require grad (grad mode is in the guard key)
        try:
            if self.single is not None:
                return self.single.apply(_ANCHOR, self.messages, values)
            out = [None] * len(values)
            for cls, ks, messages in self.plan:
                for k, v in zip(ks, cls.apply(_ANCHOR, messages, tuple(values[k] for k in ks))):
                    out[k] = v
            return tuple(out)
        finally:
            torch._C._set_grad_enabled(was)


def freed_graph(values: tuple, messages: tuple, node_names: tuple = ()) -> tuple:
    """``values`` requiring grad through nodes whose backward raises ``messages[k]`` for ``values[k]``, one node per
    eager node name (``node_names[k]``: ``type(t.grad_fn).__name__`` is eager's, ``NllLossBackward0``); the same
    tensor given twice comes back as one object, as eager returns it."""
    first: dict = {}
    groups: dict = {}  # node names -> [(value, message)]
    for k, (v, m) in enumerate(zip(values, messages)):
        if id(v) not in first:
            group = groups.setdefault(node_names[k] if k < len(node_names) else None, [])
            first[id(v)] = (group, len(group))
            group.append((v, m))
    made = {}
    with torch.enable_grad():  # the trace found these values require grad (grad mode is part of the guard key)
        for names, group in groups.items():
            made[id(group)] = _node_class(names).apply(_ANCHOR, tuple(m for _, m in group), tuple(v for v, _ in group))
    return tuple(made[id(first[id(v)][0])][first[id(v)][1]] for v in values)
