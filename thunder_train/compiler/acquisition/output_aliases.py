"""Returned tensors that share memory with an input, as eager's do.

The program is functional: ``x.add_(1); return x[0]`` computes the new ``x`` as a fresh value, returns a row of
it, and copies the new value into ``x`` at the end.  Eager's row is a view of ``x``: a later
``row.add_(100)`` by the caller changes ``x``, and the compiled row did not (a silently different result).  The
same holds for ``p.detach()`` or ``p.data.t()`` after an update of ``p``, and for ``v`` after ``p.data = v``
(``data_assignment.py``: ``v`` is ``p``'s memory afterwards).  And an input returned as it is must be that
object: through the autograd node a returned parameter came back as a view of it.

Here each such result is rebuilt by the epilogue from the real input after the write-backs:

* an input returned itself: the input object;
* a view of an input the program writes (its base, in ``Buffers``), not requiring grad: eager's view calls
  (``Buffers.view_steps``: ``x.t()``, then ``diagonal(1)``) replayed on the real input under no_grad, so torch gives
  eager's layout, ``_base`` and version counter, in any dtype and with sizes that vary between calls.  The traced
  layout alone is not always eager's: ``x.t().diagonal(1)`` runs opaquely on the computed ``x.t()`` (offset 1 against
  eager's 4), and ``w[e]`` at a 0-d index tensor sits at a position that is a value of the call (``e`` comes from the
  program).  A tensor with a version counter of its own (``t.data``, ``v`` after ``t.data = v``) is then set to the
  input's storage at that layout.

Where the calls are not known, or take sizes computed from symbolic ones, a view whose traced layout is eager's is
rebuilt from it (``base.as_strided``, the offset taken relative to the base's own); any other is refused with what to
do, as is a view whose index tensor is updated in place after the view was made.  A view that requires grad is left
as the program's value (it comes out of the autograd node).  A view of an input the program does not write is
already a view of it (the program computes it from the input).
"""
from __future__ import annotations

import torch

from ..proxies import TensorProxy, is_proxy
from ..errors import TracingError
from ..pytree import tree_flatten, tree_map, tree_unflatten
from .python_effects import needs_grad


def rebuild_lines(st, out, names, extra) -> list:
    """``(flat index, expression)`` for each result of ``out`` (the traced function's result) that is an input or
    a view sharing the memory of an input the program writes; ``names(obj, hint, leaf)`` names a call's object,
    ``extra(proxy)`` a value the program returns for the epilogue."""
    buffers, walker = st.buffers, st.walker
    written = {id(dst) for _, dst in buffers.final_writes(walker.input_proxies())}
    exprs = []
    for i, o in enumerate(tree_flatten(out)[0]):
        if type(o) is not TensorProxy:
            continue
        leaf = walker.leaf_of(o)
        if leaf is not None:
            if leaf.kind == "tensor":
                exprs.append((i, names(leaf.value, o._tt_name, leaf)))
            continue
        base = buffers.base_of(o)
        if base is None or id(base) not in written or id(base) in st.metadata_inputs or needs_grad(st, [o])[0]:
            continue
        bleaf = walker.leaf_of(base)
        if bleaf is None or bleaf.kind != "tensor":
            continue
        own = buffers.counter_of(o) is o  # t.data, or v after t.data = v: eager's has a version counter of its own
        real = names(bleaf.value, base._tt_name, bleaf)
        replay = _replay(st, o, own)
        if not isinstance(replay, str):  # eager's view calls, replayed on the real input
            exprs.append((i, f"{names(replay[0], 'eager_view')}({', '.join([real] + [extra(v) for v in replay[1]])})"))
            continue
        if not buffers.layout_is_traced(o):  # traced layout not eager's: see the module docstring
            steps_refused(bleaf, replay)
        fn = names(_same_memory if own else _view, "same_memory" if own else "view_of")
        whole = (o._tt_dtype is base._tt_dtype and tuple(o._tt_shape) == tuple(base._tt_shape)
                 and tuple(o._tt_strides) == tuple(base._tt_strides) and o._tt_storage_offset == base._tt_storage_offset)
        if whole:  # the whole input (detach(), .data, v after t.data = v): its layout read when the call runs
            exprs.append((i, f"{fn}({real}, None, None, 0)"))
            continue
        layout = (*o._tt_shape, *o._tt_strides, o._tt_storage_offset, base._tt_storage_offset)
        if o._tt_dtype is not base._tt_dtype or not all(type(n) is int for n in layout):
            raise TracingError(
                f"the compiled function returns a view of {bleaf.where} (in another dtype, or with sizes that vary "
                f"between calls) after updating {bleaf.where} in place: eager's result shares {bleaf.where}'s memory, "
                "so a later in-place write to it changes the input, which the compiled result would not follow. Return "
                "a copy (.clone()), or compile with dynamic=False.")
        exprs.append((i, f"{fn}({real}, {tuple(o._tt_shape)!r}, {tuple(o._tt_strides)!r}, "
                         f"{o._tt_storage_offset - base._tt_storage_offset})"))
    return exprs


def _replay(st, o, own):
    """``(ViewReplay, values it takes)`` making ``o`` from the real input as eager did, or why it cannot."""
    steps = st.buffers.view_steps(o)
    if steps is None:
        return "thunder_train does not know the torch calls that made it"
    values: list = []
    why: list = []

    def arg(a):
        if type(a) is TensorProxy:
            if st.buffers.is_written(a):
                why.append("a tensor the view was made with (an index) is updated in place after the view was made")
            values.append(a)
            return _Value(len(values) - 1)
        if is_proxy(a) or (isinstance(a, slice) and any(is_proxy(n) for n in (a.start, a.stop, a.step))):
            why.append("its sizes vary between calls (dynamic)")
        return a

    plain = tuple((f, tree_map(arg, rest), tree_map(arg, kw)) for f, rest, kw in steps)
    return why[0] if why else (ViewReplay(plain, own), values)


def steps_refused(bleaf, why):
    raise TracingError(
        f"the compiled function returns a view of {bleaf.where} after updating {bleaf.where} in place, and {why}: "
        f"eager's result shares {bleaf.where}'s memory, so a later in-place write to it changes the input, which the "
        "compiled result would not follow. Return a copy (.clone()), or make the view from the input directly.")


class _Value:
    """A tensor argument of a replayed view call: the ``i``-th value the program returns for it."""

    def __init__(self, i):
        self.i = i

    def __repr__(self):
        return f"values[{self.i}]"


class ViewReplay:
    """Eager's view calls ``(func, args, kwargs)`` replayed on a real tensor under no_grad (``own``: the result with
    a version counter of its own, as eager's ``t.data``)."""

    def __init__(self, steps, own):
        self.steps, self.own = steps, own
        self._plain = not any(type(a) is _Value for _, rest, kw in steps for a in tree_flatten((rest, kw))[0])

    def __call__(self, base, *values):
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # torch.no_grad()'s switch without its context objects (a few µs a call)
        try:
            v = base
            for f, rest, kw in self.steps:
                if not self._plain:
                    rest, kw = tree_map(lambda a: values[a.i] if type(a) is _Value else a, (rest, kw))
                v = f(v, *rest, **kw)
        finally:
            torch._C._set_grad_enabled(grad)
        if self.own:
            return _same_memory(base, v.shape, v.stride(), v.storage_offset() - base.storage_offset())
        return v

    def __repr__(self):
        calls = "".join(f".{getattr(f, '__name__', f)}{(*rest, *(f'{k}={a!r}' for k, a in kw.items()))}"
                        for f, rest, kw in self.steps)
        return f"<view{calls}>"


def _view(base, shape, strides, offset):
    """A view of ``base`` that does not require grad (sharing its version counter, as eager's views and
    ``detach()`` do); ``shape`` None: the whole of it."""
    if shape is None:
        return base.detach()  # eager's detach() is no view (``_is_view()``) either
    return base.detach().as_strided(shape, strides, base.storage_offset() + offset)


def _same_memory(base, shape, strides, offset):
    """A tensor on ``base``'s memory with a version counter of its own (eager's ``t.data``); ``shape`` None: the
    whole of it."""
    if shape is None:
        shape, strides = base.shape, base.stride()
    with torch.no_grad():
        return torch.empty(0, dtype=base.dtype, device=base.device).set_(
            base.untyped_storage(), base.storage_offset() + offset, shape, strides)


def replace_results(result, replacements: dict):
    """``result`` with its flat items at the keys of ``replacements`` replaced by the values."""
    leaves, spec = tree_flatten(result)
    for i, v in replacements.items():
        leaves[i] = v
    return tree_unflatten(leaves, spec)
