"""Connecting compiled gradients to PyTorch autograd.

When a compiled function is called with grad enabled and some input tensor
requires grad, its cache entry runs through ``ThunderFunction``, a
``torch.autograd.Function``: the forward runs the compiled forward trace and
keeps the values the backward reads; the backward runs the compiled backward
trace.  To PyTorch the whole compiled region is one node of the autograd
graph, so ``loss.backward()``, ``torch.autograd.grad``, tensor hooks,
``retain_graph`` and gradient accumulation into ``.grad`` behave as in eager.

Saved values.  Saved *outputs* of the node go through ``ctx.save_for_backward``
(PyTorch avoids the output → node → output reference cycle for them).  All
other saved values are kept in a list on ``ctx`` that the backward takes over:
the generated backward unpacks the list, empties it and deletes each value
after its last use, so saved activations are freed as the backward consumes
them rather than when the whole node finishes.  With ``retain_graph=True`` the
backward works on a copy and the list is kept.  A second backward without
``retain_graph`` raises PyTorch's own error message, and saved inputs modified
in place before the backward are reported like eager does.
"""
from __future__ import annotations

import functools
import weakref

import torch
from torch._C import _functions

from .acquisition.returned_graph import view_with_grad
from .context import own_hooks
from .errors import SECOND_BACKWARD_MESSAGE, NoGradientRuleError
from .memory_overlap import overlapping_pairs
from .proxies import is_proxy
from .pytree import tree_flatten, tree_unflatten
from .transforms import autograd as ag
from .transforms.opaque_grad import keep_graph

_TWICE = (b"the backward of a compiled module (tt.compile(model)) is not differentiable, and this backward needs the "
          b"gradient of its gradients (create_graph=True: a gradient penalty such as R1 or WGAN-GP, MAML, a Hessian-vector "
          b"product). Compile the whole training step instead (tt.compile(step), with the backward inside), which "
          b"differentiates its own backward, or call the module without tt.compile for this loss.")


def _differentiable_once(backward):
    """torch's ``once_differentiable``, but for every backward run with ``create_graph=True``: torch's marks the
    gradients only where an incoming gradient requires grad, so a penalty on ``autograd.grad(out.sum(), x,
    create_graph=True)`` (incoming gradient: ones) got gradients without a graph, and the penalty's dependence on the
    parameters was silently dropped.  Here each gradient leads to a node that raises ``_TWICE`` when differentiated."""

    def wrapper(ctx, *output_grads):
        with torch.no_grad():
            outputs = backward(ctx, *output_grads)
        if not torch.is_grad_enabled():
            return outputs
        marked = [k for k, g in enumerate(outputs) if isinstance(g, torch.Tensor) and (g.is_floating_point() or g.is_complex())]
        if not marked:
            return outputs
        aliases = [outputs[k].detach().requires_grad_() for k in marked]
        # The inputs still alive join the node, so that a later grad with respect to them (a Hessian-vector product:
        # autograd.grad(g @ v, params)) reaches it and raises _TWICE, not "appears to not have been used in the graph".
        inputs = [x for x in (r() for r in ctx.tt_inputs) if x is not None]
        errs = _functions.DelayedError(_TWICE, len(aliases) + len(inputs))(*aliases, *inputs)
        errs = errs if isinstance(errs, tuple) else (errs,)
        out = list(outputs)
        for k, e in zip(marked, errs):
            out[k] = e
        return tuple(out)

    wrapper.__name__ = backward.__name__
    return wrapper


class ThunderFunction(torch.autograd.Function):
    """One autograd node for a compiled region: ``apply(program, *inputs)``."""

    @staticmethod
    def forward(ctx, program, *inputs):
        outs, saved = program.forward(*inputs)
        outs, saved = _own_views(outs, saved, inputs, program.differentiable, program.pieces)
        ctx.tt_groups, bases = _shared_views(outs, inputs, program.differentiable, program.pieces)
        ctx.program = program
        ctx.tt_inputs = [weakref.ref(x) for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
        out_ids = {id(o) for o in outs if isinstance(o, torch.Tensor)}
        is_out = [isinstance(s, torch.Tensor) and id(s) in out_ids for s in saved]
        ctx.save_for_backward(*[s for s, o in zip(saved, is_out) if o])
        ctx.tt_grads = []  # the incoming gradients, handed over before the engine calls the backward
        with own_hooks():  # (not a user's hook: thin mode's hook guard does not count it)
            ctx.register_prehook(functools.partial(_hand_over, ctx.tt_grads))
        ctx.tt_is_out = is_out
        ctx.tt_saved = [None if o else s for s, o in zip(saved, is_out)]
        input_ids = {id(x) for x in inputs if isinstance(x, torch.Tensor)}
        ctx.tt_versions = [(i, s._version) for i, s in enumerate(saved) if isinstance(s, torch.Tensor) and id(s) in input_ids]
        ctx.mark_non_differentiable(
            *[o for o, d in zip(outs, program.differentiable) if isinstance(o, torch.Tensor) and not d]
        )
        if program.output_errors:  # which outputs a gradient reaches decides whether the backward raises
            ctx.set_materialize_grads(False)
            ctx.tt_outs = [(o.shape, o.dtype, o.device) if isinstance(o, torch.Tensor) else None for o in outs]
        return (*outs, *bases)

    @staticmethod
    @_differentiable_once
    def backward(ctx, *output_grads):
        program = ctx.program
        if ctx.tt_grads:  # the gradients themselves; the engine passed stand-ins (``_hand_over``), or materialized a
            # missing one (zeros; None under ``set_materialize_grads(False)``)
            output_grads = tuple(g if t is None else t for t, g in zip(ctx.tt_grads, output_grads))
            ctx.tt_grads.clear()
        if ctx.tt_saved is None:
            raise RuntimeError(SECOND_BACKWARD_MESSAGE)
        from_torch = iter(ctx.saved_tensors)  # raises PyTorch's error if it already freed them
        saved = [next(from_torch) if o else s for s, o in zip(ctx.tt_saved, ctx.tt_is_out)]
        for i, version in ctx.tt_versions:
            if saved[i]._version != version:
                t = saved[i]
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace operation: "
                    f"[{t.type()} {list(t.shape)}] is at version {t._version}; expected version {version} instead. "
                    f"(thunder_train: the compiled region saved its input {program.saved_names[i]!r})"
                )
        if ctx.tt_groups:
            output_grads = _view_cotangents(list(output_grads), ctx.tt_groups)
        if program.output_errors:
            for g, error in zip(output_grads, program.output_errors):
                if g is not None and error is not None:
                    raise type(error)(str(error))  # eager's backward through this output raises
            output_grads = [torch.zeros(m[0], dtype=m[1], device=m[2]) if g is None and m is not None else g
                            for g, m in zip(output_grads, ctx.tt_outs)]
        if saved and not keep_graph():
            ctx.tt_saved = None  # the backward below owns the values now and frees them as it goes
        # The backward takes the cotangents in the list it empties, after the saved values: no other reference here
        saved.extend(g for g, d in zip(output_grads, program.differentiable) if d)
        del output_grads
        grads = program.backward(saved)
        return (None, *grads)


def _hand_over(box, grads):
    """The node's pre-hook (after tensor hooks and ``retain_grad``, which see the gradients): the gradients go into
    ``box`` and the engine calls the backward with zero-memory stand-ins, so the engine holds no reference to them
    while the backward runs and each is freed after the backward program's last use of it (eager frees an output's
    gradient once the op reading it is differentiated).  Not when the backward builds a graph (``create_graph``):
    the backward's gradients must be the real ones there."""
    if torch.is_grad_enabled():
        return None
    if any(isinstance(g, torch.Tensor) and g.layout is not torch.strided for g in grads):
        return None  # a sparse gradient's stand-in would have to be sparse too: the engine keeps these
    box[:] = grads
    return tuple(g if not isinstance(g, torch.Tensor) else torch.zeros((), dtype=g.dtype, device=g.device).expand(g.shape)
                 for g in grads)


def _own_views(outs, saved, inputs, differentiable, pieces=None):
    """Differentiable outputs that are views of a value computed inside (``h[0]``, ``h.t()``), where no other output
    shares that value's memory, come out as tensors of their own on the same memory and version counter.  A custom
    Function's view outputs refuse in-place writes, which eager allows on a view of a computed value; here nothing
    else sees the memory, so autograd loses nothing.  Views of inputs or outputs are made again outside
    (``_views_made_outside``), and so are views sharing a base with another output and pieces of ``split``/``unbind``
    (``pieces``: eager refuses a write to them), from the base made an output (``_shared_views``)."""
    viewed = [o._base for o, d in zip(outs, differentiable) if d and isinstance(o, torch.Tensor) and o._base is not None]
    if not viewed:
        return outs, saved
    taken = {id(x) for x in inputs if isinstance(x, torch.Tensor)}
    taken |= {id(x._base) for x in inputs if isinstance(x, torch.Tensor) and x._base is not None}
    taken |= {id(o) for o in outs if isinstance(o, torch.Tensor)}
    count: dict = {}
    for b in viewed:
        count[id(b)] = count.get(id(b), 0) + 1
    own = {}
    for k, (o, d) in enumerate(zip(outs, differentiable)):
        if (d and isinstance(o, torch.Tensor) and o._base is not None and id(o._base) not in taken
                and count[id(o._base)] == 1 and not (pieces and pieces[k] and pieces[k][1])):
            own[id(o)] = o.detach()
    if not own:
        return outs, saved
    return [own.get(id(o), o) for o in outs], [own.get(id(s), s) for s in saved]


def _shared_views(outs, inputs, differentiable, pieces=None):
    """Differentiable outputs that are views of one value computed inside, two or more per value (``h[0], h[1]``,
    ``h[0], h.t()``), or a piece of ``split``/``unbind`` (``pieces``), the value neither an input nor an output: the
    value becomes an extra output of the node, the views are made again from it outside (``_views_made_outside``)
    and its gradient is handed to the views' slots in the backward (``_view_cotangents``: where views may share
    elements, each element's gradient to the first view holding it, so the program's backward counts it once).
    Views in another dtype or with a zero stride stay views of the node's output (an in-place write to one is
    PyTorch's error)."""
    groups: dict = {}
    for k, (o, d) in enumerate(zip(outs, differentiable)):
        if d and isinstance(o, torch.Tensor) and o._base is not None:
            groups.setdefault(id(o._base), (o._base, []))[1].append(k)
    if not groups:
        return (), ()
    taken = {id(x) for x in (*inputs, *outs) if isinstance(x, torch.Tensor)}
    taken |= {id(x._base) for x in inputs if isinstance(x, torch.Tensor) and x._base is not None}
    found, bases = [], []
    for base, ks in groups.values():
        views = [outs[k] for k in ks]
        if ((len(ks) < 2 and not (pieces and pieces[ks[0]] and pieces[ks[0]][1])) or id(base) in taken
                or any(v.dtype != base.dtype for v in views) or any(0 in v.stride() for v in views)):
            continue
        layouts = [(k, outs[k].size(), outs[k].stride(), outs[k].storage_offset() - base.storage_offset()) for k in ks]
        found.append((len(outs) + len(bases), base.size(), base.stride(), layouts, bool(overlapping_pairs(views, views))))
        bases.append(base)
    return tuple(found), tuple(bases)


def _view_cotangents(output_grads, groups):
    """The gradient of each extra output (a value several returned views share) handed to the views' slots."""
    for slot, size, stride, layouts, overlap in groups:
        g = output_grads[slot]
        if g is None:
            continue
        laid = torch.empty_strided(size, stride, dtype=g.dtype, device=g.device)
        laid.copy_(g)
        # Views that may share elements (h[0] and h.t()): each element's gradient goes to the first view holding it.
        claimed = torch.empty_strided(size, stride, dtype=torch.bool, device=g.device).zero_() if overlap else None
        for k, vsize, vstride, offset in layouts:
            view = laid.as_strided(vsize, vstride, laid.storage_offset() + offset)
            if claimed is not None:
                mask = claimed.as_strided(vsize, vstride, claimed.storage_offset() + offset)
                view = view.masked_fill(mask, 0)
                mask.fill_(True)
            output_grads[k] = view if output_grads[k] is None else output_grads[k] + view
    return output_grads[:len(output_grads) - len(groups)]


def _views_made_outside(results, inputs, pieces=None):
    """Results that are views of an input of the node or of another of its results, made again from that tensor
    outside the node (``as_strided`` at the same layout; a piece of ``split``/``unbind``/``chunk`` by eager's own calls,
    ``pieces``, which torch marks as one of several views).  As eager's view of a parameter (``m.weight[0]``) or of a
    returned value (``h, h[0]``) it is a view of that tensor, an in-place write to it gets eager's answer (allowed,
    or eager's error for a view of a leaf or a piece of a multi-view call), and its gradient goes to that tensor (the
    node's output gets none)."""
    if not any(isinstance(r, torch.Tensor) and r._base is not None for r in results):
        return results
    bases = {id(x) for x in (*inputs, *results) if isinstance(x, torch.Tensor)}
    return tuple(_made_again(r, pieces[k][0] if pieces and k < len(pieces) and pieces[k] else None)
                 if isinstance(r, torch.Tensor) and r.requires_grad and r._base is not None and id(r._base) in bases
                 and r.dtype == r._base.dtype
                 else r for k, r in enumerate(results))


def _made_again(r, steps):
    """The view ``r`` of ``r._base`` made again from it: by eager's calls where known and they give ``r``'s layout."""
    base = r._base
    return view_with_grad(base, r.size(), r.stride(), r.storage_offset() - base.storage_offset(), steps)


class AutogradProgram:
    """A cache entry's computation when gradients are needed: calls ``ThunderFunction``.

    ``fw`` and ``bw`` are the executed forward and backward traces (compiler/pipeline.py makes them
    from ``fb``, the forward/backward split of ``trc``).
    """

    def __init__(self, trc, fb: ag.ForwardBackward, fw, bw, output_errors=(), pieces=()):
        # per output, the error eager's backward through it raises (a saved value written in place), or None
        self.output_errors = list(output_errors) if any(output_errors) else None
        # per output, (eager's view calls, a piece of split/unbind/chunk) where it is a view made again outside, or None
        self.pieces = list(pieces) if any(pieces) else None
        self.forward = fw.python_callable()
        self.backward = bw.python_callable()
        self.differentiable = fb.differentiable
        self.saved_names = [p.name for p in fb.saved]
        self._outputs = fb.outputs
        self._out_leaves, self._out_spec = tree_flatten(trc.output)

    def __call__(self, *inputs):
        results = _views_made_outside(ThunderFunction.apply(self, *inputs), inputs, self.pieces)
        by_id = {id(p): r for p, r in zip(self._outputs, results)}
        return tree_unflatten([by_id[id(x)] if is_proxy(x) else x for x in self._out_leaves], self._out_spec)


class NoBackwardProgram:
    """Forward as compiled; the backward raises the error that prevented building it (eager reports it there too)."""

    def __init__(self, trc, computation, error: Exception):
        self._computation = computation
        self._error = error
        self._out_leaves, self._out_spec = tree_flatten(trc.output)
        self._positions = {}
        for i, x in enumerate(self._out_leaves):
            if is_proxy(x):
                self._positions.setdefault(id(x), i)
        needs = ag.Forward(trc.bound_symbols, ag.requires_grad_inputs(trc)).needs_grad
        self._outputs = list({id(x): x for x in self._out_leaves if is_proxy(x)}.values())
        self.differentiable = [ag.is_float_tensor(o) and id(o) in needs for o in self._outputs]
        self.saved_names = []
        self.output_errors = None
        self.pieces = None

    def forward(self, *inputs):
        leaves, _ = tree_flatten(self._computation(*inputs))
        return tuple(leaves[self._positions[id(o)]] for o in self._outputs), ()

    def backward(self, values):
        raise type(self._error)(str(self._error))  # NoGradientRuleError, or eager's saved-version error

    def __call__(self, *inputs):
        results = _views_made_outside(ThunderFunction.apply(self, *inputs), inputs)
        by_id = {id(p): r for p, r in zip(self._outputs, results)}
        return tree_unflatten([by_id[id(x)] if is_proxy(x) else x for x in self._out_leaves], self._out_spec)


def may_need_autograd(trc) -> bool:
    """Whether a call would route ``trc`` through ``ThunderFunction``: grad enabled and an input requires grad."""
    return torch.is_grad_enabled() and bool(ag.requires_grad_inputs(trc))
