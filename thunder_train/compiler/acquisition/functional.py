"""Functionalization during tracing: in-place updates become new values.

The computation trace is functional (design §6).  The tracer keeps, for every
proxy that names a *buffer* (an input tensor, or any tensor the function
created), its **current value**:

* an in-place op (``p.add_(g)``, ``x[0] = 1``, ``torch._foreach_mul_``,
  ``copy_``) records its out-of-place form and makes the result the buffer's
  current value — no mutation is recorded where it happens;
* every later torch call reads current values (``Buffers.read``), so data flow
  in the trace is exact and autograd, DCE and executors see a pure program;
* views (``x[0]``, ``x.view(...)``, ``x.t()``, ``x.detach()``) remember their base
  and how they were made: writing into a view writes the corresponding
  elements of the base, and reading a view after its base changed re-derives
  it from the base's new value (a view made under ``no_grad`` is detached and stays a view; a whole
  ``view_as_real`` of a complex base is written back as ``view_as_complex``);
* when tracing ends, ``final_writes`` yields one ``(new value, input)`` pair per
  input buffer whose value changed — acquisition turns each into exactly one
  ``prims.copy_`` at the end of the computation.  A value written back into the
  buffer it came from produces no copy.
"""
from __future__ import annotations

import operator

import dataclasses
from typing import Callable

from ..proxies import TensorProxy, size_value


@dataclasses.dataclass
class View:
    base: TensorProxy  # the buffer the view's elements live in (never itself a view)
    make: Callable  # base value -> view value (records the view ops again)
    version: int  # the base's version the view's current value was derived from
    # view value -> the base's value holding it, for a view of the whole base in another dtype (view_as_real),
    # whose elements no position map can write back; None for the others
    unmake: Callable | None = None
    # The traced view's layout is not eager's (``w[e]`` at a 0-d integer tensor: a view whose offset is a value):
    # writes go back by positions only, never by the layout (``_band_of``)
    by_positions: bool = False
    # The eager calls that make the view of the real base: ``(torch function, other args, kwargs)`` applied in turn
    # (proxies in the arguments are values of the program); None where a call is not known (output_aliases.py)
    steps: tuple | None = None
    # Writes counted on the view's version counter when it was made (None: not known): one since then makes eager's
    # autograd make the view's node again from the base's (``node_made_again``)
    made_at: int | None = None


class Buffers:
    """Current values of buffers and view relations, for one trace."""

    def __init__(self):
        self._current: dict = {}  # id(buffer) -> current value proxy
        self._version: dict = {}  # id(base) -> number of writes so far
        self._views: dict = {}  # id(view proxy) -> View
        self._keep: dict = {}  # id -> proxy: keeps ids stable while tracing
        self._alias_of: dict = {}  # id(alias) -> the value it aliases (acquisition/leaf_values.py)
        # Eager's version counters (saved_versions.py): a view shares its base's, ``.data`` starts its own.
        self._group: dict = {}  # id(view) -> the proxy naming its counter (its base, or a ``.data`` view)
        self._members: dict = {}  # id(counter proxy) -> the views sharing that counter
        self._own: dict = {}  # id(base) -> its ``.data`` views (same memory, counters of their own)
        self._through_view: dict = {}  # id(value) -> value: a base's value made by a write through one of its views
        self._by_call: dict = {}  # id(value) -> (value, (in-place torch call, args, kwargs)) that wrote it directly
        self._counted: dict = {}  # id(counter proxy) -> writes that moved eager's version counter (``node_made_again``)

    # ---- reading ----
    def read(self, p):
        """The current value of the buffer ``p`` names (``p`` itself if never written)."""
        view = self._views.get(id(p))
        if view is not None:
            version = self._version.get(id(view.base), 0)
            if view.version != version:
                self._current[id(p)] = view.make(self.read(view.base))
                view.version = version
        return self._current.get(id(p), p)

    def is_written(self, p) -> bool:
        return id(p) in self._current

    # ---- views ----
    def add_view(self, view, source, make_from_source: Callable, unmake: Callable | None = None,
                 by_positions: bool = False, steps: tuple | None = None) -> None:
        """``view`` was made from ``source`` by ``make_from_source(source_value)`` (and ``unmake(view_value)`` gives
        ``source``'s value back, for a whole-tensor view in another dtype).  ``by_positions``: see ``View``;
        ``steps``: the eager calls ``(func, other args, kwargs)`` that made it from ``source`` (``View.steps``)."""
        if type(view) is not TensorProxy or view is source:
            return
        outer = self._views.get(id(source))
        if outer is None:
            base, make = source, make_from_source
        else:
            base, inner = outer.base, outer.make
            make = lambda b, inner=inner, f=make_from_source: f(inner(b))  # noqa: E731
            unmake = None
            by_positions = by_positions or outer.by_positions
            steps = None if steps is None or outer.steps is None else outer.steps + steps
        self._keep[id(view)] = view
        self._keep[id(base)] = base
        group = self._group.get(id(source), source)
        self._views[id(view)] = View(base, make, self._version.get(id(base), 0), unmake, by_positions, steps,
                                     self._counted.get(id(group), 0))
        self._join(view, group)

    def detached_view(self, alias, view) -> None:
        """``alias`` is ``view`` detached (made under no_grad): a view of the same base, re-derived detached."""
        v = self._views.get(id(view))
        if v is None:
            return
        from ..transforms.autograd import detach_float_tensors

        self._keep[id(alias)] = alias
        self._views[id(alias)] = View(v.base, lambda b, make=v.make: detach_float_tensors(make(b)), v.version, v.unmake,
                                      v.by_positions, v.steps)
        self._join(alias, self._group.get(id(view), v.base))

    def pin_views(self, base) -> list:
        """``base`` now names other memory (``base.data = v``): the views made of it so far keep the values they hold
        and are its views no more, as eager's keep the old storage (they still share its version counter).  Returns
        them."""
        pinned = []
        for k, view in list(self._views.items()):
            if view.base is base:
                v = self._keep[k]
                self._current[k] = self.read(v)
                del self._views[k]
                pinned.append(v)
        self._own.pop(id(base), None)
        return pinned

    # ---- version counters (saved_versions.py) ----
    def _join(self, view, group) -> None:
        old = self._group.get(id(view))
        if old is not None:
            self._members[id(old)] = [m for m in self._members[id(old)] if m is not view]
        self._group[id(view)] = group
        self._keep[id(group)] = group
        self._members.setdefault(id(group), []).append(view)

    def own_counter(self, view) -> None:
        """``view`` (``t.data``) has a version counter of its own, as have the views made from it."""
        if id(view) in self._views:
            self._join(view, view)
            self._own.setdefault(id(self._views[id(view)].base), []).append(view)

    def memory_values(self, dst) -> list:
        """The values now held by every tensor sharing ``dst``'s memory, whatever its counter."""
        return [v for _, v in self.memory_buffers(dst)]

    def memory_buffers(self, dst) -> list:
        """``(tensor, value it holds now)`` for every tensor sharing ``dst``'s memory, whatever its counter."""
        base = self.base_of(dst)
        base = dst if base is None else base
        cur = self._current
        out = []
        for g in [base] + self._own.get(id(base), []):
            group = self._group.get(id(g), g)
            out += [(t, cur.get(id(t), t)) for t in [group] + [v for v in self._members.get(id(group), ()) if v is not group]]
        return out

    def counter_of(self, t):
        """The tensor naming ``t``'s version counter."""
        return self._group.get(id(t), t)

    def counter_values(self, dst) -> list:
        """The values now held by every tensor sharing ``dst``'s version counter (what a write to ``dst`` makes stale)."""
        group = self._group.get(id(dst), dst)
        cur = self._current
        return [cur.get(id(group), group)] + [cur.get(id(v), v) for v in self._members.get(id(group), ()) if v is not group]

    def has_views(self, p) -> bool:
        return any(v.base is p for v in self._views.values())

    def rebind(self, buf, value) -> None:
        """``buf`` now names ``value``, whose shape or strides may differ (t_(), squeeze_(), ...)."""
        self._set(buf, value)

    def alias(self, buf, value, of) -> None:
        """``buf`` now reads as ``value``, which holds the same data as ``of`` (a ``stop_gradient`` alias; None:
        ``value`` is an earlier value of ``buf``).  Its write-back writes the data, not the alias."""
        if of is not None:
            self._alias_of[id(value)] = of
            self._keep[id(value)] = value
        self._set(buf, value)

    def version(self, p) -> int:
        """How many writes ``p``'s memory (its base's, for a view) has had."""
        base = self.base_of(p)
        return self._version.get(id(base if base is not None else p), 0)

    def layout_is_traced(self, p) -> bool:
        """Whether the view ``p``'s traced layout is eager's view of its base (not one written back by positions)."""
        view = self._views.get(id(p))
        return view is not None and not view.by_positions

    def view_steps(self, p):
        """The eager calls making the view ``p`` of its base (``View.steps``), or None where not known."""
        view = self._views.get(id(p))
        return None if view is None else view.steps

    def call_was(self, p, func) -> None:
        """The last eager call making the view ``p`` was ``func`` (same arguments): a composed op that records its torch
        calls, as ``unsafe_split`` records ``split``, names the call eager made (``View.steps``)."""
        view = self._views.get(id(p))
        if view is None or not view.steps:
            return
        steps = list(view.steps)
        last = max(i for i, (f, _, _) in enumerate(steps) if f.__class__ is not operator.itemgetter)
        steps[last] = (func,) + tuple(steps[last][1:])
        view.steps = tuple(steps)

    def node_made_again(self, p) -> bool:
        """Whether ``p`` is a view whose version counter moved since it was made (or not known when it was made): a
        write to it, its base or another view sharing the counter (not through ``.data``, which has its own); eager's
        autograd then makes the view's node again from the base's (traced_grad_fn.py)."""
        view = self._views.get(id(p))
        return view is not None and (
            view.made_at is None or view.made_at != self._counted.get(id(self._group.get(id(p), p)), 0))

    def written_through_view(self, value) -> bool:
        return id(value) in self._through_view

    def made_by_call(self, dst, call) -> None:
        """``dst`` (not a view) was just written directly by ``call``: eager's in-place ``(func, args, kwargs)``."""
        if id(dst) not in self._views:
            value = self.read(dst)
            self._by_call[id(value)] = (value, call)

    def call_of(self, value):
        """The in-place call that made ``value`` (``made_by_call``), or None."""
        found = self._by_call.get(id(value))
        return None if found is None else found[1]

    def base_of(self, p):
        view = self._views.get(id(p))
        return None if view is None else view.base

    # ---- writing ----
    def write(self, dst, value, counted: bool = True) -> None:
        """``dst`` now holds ``value`` (same shape and dtype).  ``counted``: eager's write moves ``dst``'s version
        counter (not the base's new value after a write through ``.data``, which moved the ``.data`` one)."""
        if counted:
            group = self._group.get(id(dst), dst)
            self._counted[id(group)] = self._counted.get(id(group), 0) + 1
        view = self._views.get(id(dst))
        if view is None:
            self._set(dst, value)
            return
        from .. import clang, dtypes, prims

        base = view.base
        if view.unmake is not None:  # the whole base in another dtype: its new value from the view's
            self._set(base, view.unmake(value))
            self._current[id(dst)] = value
            self._keep[id(dst)] = dst
            view.version = self._version[id(base)]
            return
        if base._tt_dtype is not dst._tt_dtype:
            from ..errors import TracingError

            raise TracingError(
                f"an in-place update of a {dst._tt_dtype.name} view of a {base._tt_dtype.name} tensor (z.real, z.imag, "
                "a part of view_as_real(z), Tensor.view(dtype)) inside a compiled function is not supported: "
                "thunder_train writes views back by value (a whole view_as_real(z) is supported). Build the new tensor "
                "out of place (torch.complex(new_real, z.imag), ...).")
        base_value = self.read(base)
        band = None if view.by_positions else _band_of(dst, base)
        if band is not None:  # a band of one dim (DeepSeek-V3's q[..., :8].copy_(q_pass)): no positions
            self._set(base, clang.with_band(base_value, value, *band))
            self._through_view[id(self._current[id(base)])] = self._current[id(base)]
            self._current[id(dst)] = value
            self._keep[id(dst)] = dst
            view.version = self._version[id(base)]
            return
        # Where the view's elements sit in the base: make the view of a tensor of positions.
        positions = clang.reshape(
            prims.iota(base.numel_(), start=0, step=1, device=base._tt_device, dtype=dtypes.int64), base._tt_shape
        )
        positions = view.make(positions)
        flat = prims.index_put(clang.reshape(base_value, (-1,)), (clang.reshape(positions, (-1,)),), clang.reshape(value, (-1,)), False)
        self._set(base, clang.reshape(flat, base._tt_shape))
        self._through_view[id(self._current[id(base)])] = self._current[id(base)]
        self._current[id(dst)] = value
        self._keep[id(dst)] = dst
        view.version = self._version[id(base)]

    def _set(self, buf, value) -> None:
        self._keep[id(buf)] = buf
        self._current[id(buf)] = value
        self._version[id(buf)] = self._version.get(id(buf), 0) + 1

    # ---- the end of tracing ----
    def final_writes(self, inputs) -> list:
        """``(value, input)`` for every input buffer whose final value is not the input itself."""
        out = []
        for p in inputs:
            if type(p) is TensorProxy and id(p) in self._current:
                v = self.read(p)
                while id(v) in self._alias_of:
                    v = self._alias_of[id(v)]
                if v is not p:
                    out.append((v, p))
        return out


def _band_of(view, base):
    """``(dim, start, stop)`` when ``view``'s layout makes it the band ``start:stop`` of one dim of a row-major ``base``
    (the same strides, the same sizes but along ``dim``), else None."""
    sizes = (*view._tt_shape, *base._tt_shape, view._tt_storage_offset, base._tt_storage_offset)
    if not all(type(n) is int for n in sizes) or not base._tt_rowmajor or base._tt_storage_offset != 0:
        return None
    if view.ndim_ != base.ndim_ or tuple(view._tt_strides) != tuple(base._tt_strides):
        return None
    dims = [d for d, (m, n) in enumerate(zip(view._tt_shape, base._tt_shape)) if m != n]
    if len(dims) != 1:
        return None
    d = dims[0]
    start, rem = divmod(view._tt_storage_offset, base._tt_strides[d])
    stop = start + view._tt_shape[d]
    return (d, start, stop) if rem == 0 and 0 < view._tt_shape[d] and stop <= base._tt_shape[d] else None


# ---------------------------------------------------------------------------
# Object identity of results
# ---------------------------------------------------------------------------
def fresh_results(func, args, kwargs, out):
    """Results that are an argument proxy where eager returns a new tensor object get one.

    At trace level ``x.view_as(x)``, ``x.permute(0, 1)`` or ``torch.roll(x, 0)`` compute nothing and
    return ``x``; eager returns a new tensor (a view for view ops, a copy otherwise), while
    ``x.contiguous()`` or ``F.dropout(x, training=False)`` return ``x`` itself.  Which one eager does
    is read from running ``func`` on meta tensors (torch's own rule); a new view becomes
    ``prims.reshape(x, x.shape)`` (a real alias at run time), a new copy ``prims.clone(x)``.
    """
    import torch

    from .. import prims
    from ..pytree import tree_flatten, tree_map, tree_unflatten

    flat_out, spec = tree_flatten(out)
    arg_ids = {id(a) for a in tree_flatten((args, kwargs))[0] if type(a) is TensorProxy}
    if not any(type(o) is TensorProxy and id(o) in arg_ids for o in flat_out):
        return out
    metas, owner = {}, {}  # id(proxy) -> meta tensor; id(meta tensor) -> proxy

    def to_meta(x):
        if type(x) is TensorProxy:
            m = metas.get(id(x))
            if m is None:
                shape = tuple(size_value(s) for s in x._tt_shape)
                m = metas[id(x)] = torch.empty(shape, dtype=x._tt_dtype.torch, device="meta")
                owner[id(m)] = x
            return m
        return x

    try:
        margs, mkwargs = tree_map(to_meta, (args, kwargs))
        with torch._C.DisableTorchFunction():
            mout = tree_flatten(func(*margs, **mkwargs))[0]
    except Exception:  # noqa: BLE001 - no meta kernel: keep the trace-level answer
        return out
    if len(mout) != len(flat_out):
        return out
    new = []
    for o, m in zip(flat_out, mout):
        if type(o) is TensorProxy and id(o) in arg_ids and owner.get(id(m)) is not o:
            is_view = isinstance(m, torch.Tensor) and any(m._base is mi or _same_storage(m, mi) for mi in metas.values())
            o = prims.reshape(o, tuple(o._tt_shape)) if is_view else prims.clone(o)
        new.append(o)
    return tree_unflatten(new, spec)


def _same_storage(a, b) -> bool:
    try:
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata
    except Exception:  # noqa: BLE001
        return False
