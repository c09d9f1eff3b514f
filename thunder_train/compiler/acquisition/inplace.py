"""Functionalization glue of the dispatcher: in-place ops, ``out=`` and views.

An in-place op records its out-of-place form and the result becomes the
destination's current value (``compiler/acquisition/functional.py``'s ``Buffers``); a
view remembers how it was made from its base so writes through it reach the
base.
"""
from __future__ import annotations

import operator

import torch

from .. import opaque, prims
from ..clang import maybe_convert
from ..errors import TracingError
from ..dense import is_non_overlapping_and_dense
from ..proxies import TensorProxy
from ..pytree import tree_flatten, tree_map
from ..transforms.autograd import detach_float_tensors
from .saved_versions import StaleOwnInput, own_saved_input, record_write
from .data_assignment import check_old_memory_write
from .inplace_overlap import check_partial_overlap
from . import view_creation
from .opaque_views import eager_view_outputs
from .metadata_inplace import (RESIZES_SELF, SUPPORTED as METADATA_SUPPORTED, check_data_write, metadata_inplace,
                               resized_meta, resizing_inplace)


def is_view(entry) -> bool:
    """The op's result shares storage with its first argument in eager PyTorch (tagged ``"view"`` where it is
    defined): writing into the result writes into the argument, and the result follows later writes to it.
    A dispatch entry wrapping a symbol (a composed ``narrow``, a named-result op) answers for that symbol."""
    return "view" in getattr(getattr(entry, "sym", entry), "tags", ())


def read_current(st, args, kwargs):
    read = st.buffers.read
    return tree_map(lambda x: read(x) if type(x) is TensorProxy else x, (args, kwargs))


def back_to_buffers(orig_args, args, out):
    """A symbol that returned its (current-valued) input returns the user's object, as eager does (``x.contiguous() is x``)."""
    if type(out) is TensorProxy:
        for o, a in zip(orig_args, args):
            if out is a and o is not a:
                return o
    return out


def record_views(st, sym, source, rest, kwargs, out, func=None):
    """``out`` (``sym(source, *rest, **kwargs)``, eager's ``func``) is a view of ``source``."""
    by_positions = False
    if sym.name == "getitem":
        keys = [k for k in tree_flatten(rest)[0] if isinstance(k, torch.Tensor)]
        if any(k.ndim != 0 or k.dtype.is_floating_point or k.dtype.is_complex or k.dtype == torch.bool for k in keys):
            return  # advanced indexing copies
        # A 0-d integer tensor indexes as an int does (eager's w[e] is a view of w), at a position known at run time
        by_positions = bool(keys)
    if sym.name in _MAY_COPY and func is not None and not _eager_views(st, func, source, rest, kwargs):
        return  # eager's reshape of this layout copies: a value of its own, which later writes to source miss
    step = None if func is None else (func, tuple(rest), dict(kwargs))
    view_creation.record(st, sym, source, out)
    if type(out) is TensorProxy:
        st.buffers.add_view(out, source, lambda v: sym(v, *rest, **kwargs), by_positions=by_positions,
                            steps=None if step is None else (step,))
    elif isinstance(out, (tuple, list)):
        for i, o in enumerate(out):
            st.buffers.add_view(o, source, lambda v, i=i: sym(v, *rest, **kwargs)[i],
                                steps=None if step is None else (step, (operator.itemgetter(i), (), {})))


# View ops whose eager result is a copy where the layout does not allow a view (x.t().reshape(-1))
_MAY_COPY = {"reshape", "reshape_as", "flatten"}


def _eager_views(st, func, source, rest, kwargs) -> bool:
    """Whether eager's ``func(source, ...)`` is a view, asked of torch's meta rule on ``source``'s layout (a view
    whose traced layout is not eager's, or no meta answer: taken as a view, as before)."""
    if source._tt_rowmajor or st.buffers.base_of(source) is not None and not st.buffers.layout_is_traced(source):
        return True
    answer = eager_view_outputs(func, (source,) + tuple(rest), kwargs)
    return answer is None or bool(answer)


def inplace(st, sym, orig_args, args, kwargs):
    """An in-place op: record its out-of-place form; the result becomes the destination's value."""
    dst = orig_args[0]
    with _inplace_op(st, getattr(sym, "torch_impl", None), dst, args, kwargs, orig_args):
        new = sym.functional(*args, **kwargs)
        if isinstance(dst, (list, tuple)):
            for d, v in zip(dst, new):
                write(st, sym, d, v)
        else:
            write(st, sym, dst, new)
    return dst


class _inplace_op:
    """Marks where an in-place op's own lines begin: they read the values it overwrites (saved_versions.py).
    ``fn(*args, **kwargs)``: the torch in-place op (current values), asked whether it saves for its own backward an
    argument its write makes stale (``y.mul_(y)``)."""

    def __init__(self, st, fn=None, dst=None, args=(), kwargs=None, orig_args=None):
        self.st, self.fn, self.dst, self.args, self.kwargs = st, fn, dst, args, kwargs or {}
        self.orig_args = orig_args

    def __enter__(self):
        self.outer = self.st.inplace_start
        if self.outer is None and type(self.dst) is TensorProxy and self.st.view_creation:
            view_creation.check_write(self.st, self.dst, self._requires_grad, [
                a for a in tree_flatten((self.args, self.kwargs))[0] if type(a) is TensorProxy and a is not self.dst])
        if self.outer is None:
            if self.orig_args is not None and not (torch.is_grad_enabled() and getattr(self.dst, "_tt_requires_grad", False)
                                                   and self.st.walker.is_input(self.dst)):  # (eager's leaf error first)
                check_partial_overlap(self.st, self.fn, self.orig_args, self.kwargs)
            self.st.inplace_start = len(self.st.trace.bound_symbols)
            self.own = own_saved_input(self.st, self.fn, self.dst, self.args, self.kwargs, self._requires_grad)

    def _requires_grad(self, a) -> bool:
        return requires_grad_now(self.st, a)

    def __exit__(self, exc_type, *exc):
        if self.outer is None and exc_type is None and self.fn is not None and type(self.dst) is TensorProxy:
            # eager's grad_fn of the written tensor is the in-place call's node (traced_grad_fn.py)
            self.st.buffers.made_by_call(self.dst, (self.fn, self.args, self.kwargs))
            new = self.st.buffers.read(self.dst)
            self.st.inplace_calls[id(new)] = (self.fn, self.args, self.kwargs, new)
        if self.outer is None:
            start, self.st.inplace_start = self.st.inplace_start, None
            if self.own is not None and exc_type is None:
                self.st.stale_values.append(StaleOwnInput(start, len(self.st.trace.bound_symbols), getattr(
                    self.fn, "__name__", "the in-place op"), getattr(self.dst, "_tt_name", "a tensor"), self.own))


def requires_grad_now(st, a) -> bool:
    """Whether eager's tensor for proxy ``a`` requires grad at this point of the function."""
    from .traced_autograd import computed_requires_grad

    return a._tt_requires_grad if st.walker.is_input(a) else computed_requires_grad(st, a)


def _is_leaf(st, a) -> bool:
    """Whether eager's tensor for input proxy ``a`` is a leaf (guarded from now on, as traced_grad_fn.py guards a
    read of ``is_leaf``)."""
    leaf = st.walker.leaf_of(a)
    if leaf is None or leaf.kind != "tensor":
        return True
    if leaf.alias_of is None and leaf.snapshot != "grad_fn":
        leaf.snapshot = "is_leaf"
    return bool(getattr(leaf.value, "is_leaf", True))


def _check_input_write(st, dst) -> None:
    """An in-place write in grad mode into an input that requires grad, or into a view of one: eager's error where it
    is a leaf; refused where it is not (an activation computed outside: eager would add the write to that tensor's
    autograd history, which the program cannot reach, so a backward through it would miss the write)."""
    inputs = st.walker
    target = dst if dst._tt_requires_grad and inputs.is_input(dst) else None
    if target is None:
        base = st.buffers.base_of(dst)
        if base is None or not (base._tt_requires_grad and inputs.is_input(base)) or not requires_grad_now(st, dst):
            return
        target = base
    view = target is not dst
    if _is_leaf(st, target):
        if not view:
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
        raise RuntimeError("a view of a leaf Variable that requires grad is being used in an in-place operation "
                           "(eager PyTorch raises this error too). Write under torch.no_grad(), or into a clone.")
    raise TracingError(
        f"an in-place write in grad mode into {'a view of ' if view else ''}{inputs.leaf_of(target).where}, a tensor "
        "that requires grad and was computed outside the compiled function (not a leaf): eager would add the write to "
        "its autograd history, which the compiled program cannot reach, so a backward through it would miss the "
        "write. Clone it inside the function first (`x = x.clone()`), or pass it detached. Nothing was changed.")


def check_out_differentiable(st, name, tensors, dst) -> None:
    """Eager's refusal of an ``out=`` call in grad mode where an argument or the destination requires grad."""
    if torch.is_grad_enabled() and any(requires_grad_now(st, t) for t in (*tensors, dst) if type(t) is TensorProxy):
        raise RuntimeError(f"{name}(): functions with out=... arguments don't support automatic differentiation, but "
                           "one of the arguments requires grad (eager PyTorch raises this error too). Use the "
                           "returned value, or call it under torch.no_grad().")


def write(st, sym, dst, value):
    check_data_write(st, dst)
    check_old_memory_write(st, dst)
    if torch.is_grad_enabled():
        _check_input_write(st, dst)
    bsyms = st.trace.bound_symbols
    last = bsyms[-1] if bsyms else None
    if last is not None and any(o is value for o in last.flat_outputs()) and last.comment is None:
        last.comment = f"{sym.name}: the new value of {dst._tt_name}"
    if not torch.is_grad_enabled() and st.grad_enabled:
        value = no_grad_region(st, value)
    if (type(value) is TensorProxy and type(dst) is TensorProxy and value._tt_shape == dst._tt_shape
            and value._tt_strides != dst._tt_strides and is_non_overlapping_and_dense(dst)):
        # An in-place op keeps its destination's layout (a channels-last buffer stays channels-last after
        # fill_ / zero_ / copy_), whatever layout the out-of-place form gives its result.
        value = prims.grad_layout(value, dst)
    kept = _graph_kept(st, dst)
    record_write(st, dst, sym.name)
    st.buffers.write(dst, value)
    if kept is not None:
        base, old = kept
        st.buffers.write(base, prims.unseen_write(st.buffers.read(base), old), counted=False)
    if st.leaf_values is not None:
        base = st.buffers.base_of(dst)
        st.leaf_values.written(dst if base is None else base)


def _graph_kept(st, dst):
    """``(base, its value)`` before a write autograd does not see (under ``no_grad``, or through ``.data``/
    ``.detach()``: a view whose value no longer carries the base's gradient) into a computed value that requires
    grad: eager changes the values and keeps the graph, so a later backward still reaches what the old value was
    computed from.  None for every other write (inputs and new leaves have no graph to keep: leaf_values.py)."""
    base = st.buffers.base_of(dst)
    base = dst if base is None else base
    if type(base) is not TensorProxy or not base._tt_dtype.is_float or st.walker.leaf_of(base) is not None:
        return None
    if not (st.grad_enabled or torch.is_grad_enabled()):
        return None
    old = st.buffers.read(base)
    changes = st.requires_grad_changes
    if id(base) in changes and base._tt_requires_grad:
        return None  # a leaf made inside the function
    from .traced_autograd import computed_requires_grad

    if not computed_requires_grad(st, old):
        return None
    if not torch.is_grad_enabled() or not computed_requires_grad(st, st.buffers.read(dst)):
        return base, old
    return None


def converted_to(value, dst):
    if type(value) is not TensorProxy or value._tt_shape != dst._tt_shape:
        raise TracingError(f"out=: the result ({getattr(value, 'type_string', lambda: value)()}) does not match the out tensor ({dst.type_string()})")
    return maybe_convert(value, dst._tt_dtype)


def functionalize(st, sym, orig_args, args, kwargs):
    """A symbol that returns a result and also updates some arguments (``batch_norm``'s running stats)."""
    with _inplace_op(st):
        return _functionalize(st, sym, orig_args, args, kwargs)


def _functionalize(st, sym, orig_args, args, kwargs):
    out, writes = sym.functionalize(*args, **kwargs)
    # Writes name the current values they were given; write to the user's objects (also inside lists).
    back = {id(a): o for o, a in zip(tree_flatten(orig_args)[0], tree_flatten(args)[0]) if type(o) is TensorProxy}
    bsyms = st.trace.bound_symbols
    last = bsyms[-1] if bsyms else None
    if len(writes) > 1 and last is not None and last.comment is None and any(o is writes[0][1] for o in last.flat_outputs()):
        last.comment = f"{sym.name}: the new values of {len(writes)} tensors"
    for dst, value in writes:
        write(st, sym, back.get(id(dst), dst), value)
    return no_grad_region(st, out, sym)



def no_grad_region(st, out, sym=None):
    """Results computed under ``torch.no_grad()`` inside the function carry no gradient (``prims.stop_gradient``)."""
    if torch.is_grad_enabled() or not st.grad_enabled or len(st.trace._scopes) != 1:
        return out
    if sym is not None and "inplace" in sym.tags:
        return out
    detached = detach_float_tensors(out)
    st.made_without_grad.update(id(d) for o, d in zip(tree_flatten(out)[0], tree_flatten(detached)[0]) if d is not o)
    if st.buffers is not None:
        # A view made here (x[0], x.diagonal(), ...) stays a view of its base: an update through it reaches the base.
        for o, d in zip(tree_flatten(out)[0], tree_flatten(detached)[0]):
            if d is not o:
                st.buffers.detached_view(d, o)
                view_creation.carry(st, o, d)
    return detached


# ---------------------------------------------------------------------------
# In-place ops without a symbol: the out-of-place form, then one write-back
# ---------------------------------------------------------------------------
# In-place methods that change a tensor's shape or other metadata rather than its values: a proxy's
# metadata is fixed, so they have no "out-of-place form + write-back" and are refused.
METADATA_INPLACE = {
    "resize_", "resize_as_", "set_", "as_strided_", "squeeze_", "unsqueeze_", "t_", "transpose_", "swapdims_",
    "swapaxes_", "detach_", "share_memory_", "sparse_resize_", "sparse_resize_and_clear_", "as_strided_scatter_",
    "map_", "map2_", "apply_", "record_stream", "pin_memory_",
}


def inplace_name(func):
    """The out-of-place name of an in-place torch callable (``abs_`` -> ``abs``, ``__iand__`` -> ``__and__``), or None."""
    name = getattr(func, "__name__", "") or ""
    if name.startswith("__i") and name.endswith("__") and len(name) > 5:
        return "__" + name[3:]
    if name.endswith("_") and not name.endswith("__"):
        return name[:-1]
    return None


class CopyThenInplace:
    """``func`` applied to a copy of its first argument: eager's in-place result, computed out of place.

    The fallback for in-place ops whose out-of-place form the compiler does not know (or that have
    none: ``uniform_``, ``fill_diagonal_``, ``scatter_reduce_``): it runs opaquely, so values, dtype
    rules and autograd are eager's own.
    """

    _cache: dict = {}
    works_on_copy = True  # no input changes: not a side effect (its result can decide a size, DCE may drop it)

    def __init__(self, func):
        self.func = func
        name = getattr(func, "__name__", "op")
        self.__name__ = name
        self.__qualname__ = f"on_copy.{name}"
        self.__module__ = "thunder_train"

    @classmethod
    def of(cls, func):
        c = cls._cache.get(func)
        if c is None:
            c = cls._cache[func] = cls(func)
        return c

    def __call__(self, dst, *args, **kwargs):
        if isinstance(dst, (list, tuple)):
            copy = [t.clone() for t in dst]
            self.func(copy, *args, **kwargs)
            return copy
        copy = dst.clone()
        out = self.func(copy, *args, **kwargs)
        return copy if out is None else out  # __setitem__ returns nothing: its result is the updated copy


for _name in RESIZES_SELF:  # their meta kernels refuse the resize eager does: the output rule says it
    opaque.meta_rules[CopyThenInplace.of(getattr(torch.Tensor, _name))] = resized_meta(getattr(torch.Tensor, _name))


class _Named:
    tags = frozenset()

    def __init__(self, name):
        self.name = name


def generic_inplace(st, func, orig_args, args, kwargs, dispatch, run_opaque):
    """``X_(dst, ...)`` (or ``dst op= ...``): compute ``X(dst, ...)`` and make it ``dst``'s new value.

    ``X`` is the out-of-place form where the torch language knows it (so the op stays native); otherwise
    the in-place op runs opaquely on a copy (``CopyThenInplace``).  ``dispatch(fn, args, kwargs)`` runs a
    known torch callable through the dispatcher, ``run_opaque(fn, args, kwargs)`` runs one opaquely.
    """
    from ..torchlang import registry
    from ..torchlang.inplace import converted_value

    name = getattr(func, "__name__", "")
    dst = orig_args[0]
    if name in METADATA_SUPPORTED and type(dst) is TensorProxy:
        return metadata_inplace(st, func, orig_args, args, kwargs, run_opaque)
    if name in RESIZES_SELF and type(dst) is TensorProxy:
        # eager's own kernel on a copy (its values where self is resized follow no broadcasting rule)
        value = run_opaque(CopyThenInplace.of(func), args, kwargs)
        if value._tt_shape != dst._tt_shape:
            return resizing_inplace(st, func, orig_args, value)
        write(st, _Named(name), dst, value)
        return dst
    if name in METADATA_INPLACE:
        raise TracingError(
            f"Tensor.{name} changes the shape or metadata of a tensor in place, which thunder_train does not support "
            f"inside a compiled function; use its out-of-place form ({name[:-1]}) and the returned tensor"
        )
    out_name = inplace_name(func)
    outplace = None
    if out_name is not None:
        owner = torch.Tensor if "Tensor" in (getattr(func, "__qualname__", "") or "") or name.startswith("__") else torch
        outplace = getattr(owner, out_name, None)
    with _inplace_op(st, func, dst, args, kwargs, orig_args):
        known = registry.lookup(outplace) if outplace is not None else None
        if getattr(known, "written_in_place", None) is not None:  # its in-place form differentiates otherwise
            value = known.written_in_place(*args, **kwargs)
        elif known is not None:
            value = dispatch(outplace, orig_args, kwargs)
        else:
            value = run_opaque(CopyThenInplace.of(func), args, kwargs)
        op = _Named(name)
        if isinstance(dst, (list, tuple)):
            for d, v in zip(dst, value):
                write(st, op, d, converted_value(v, d))
        else:
            if type(value) is not TensorProxy:
                raise TracingError(f"{name}: its out-of-place form returned {type(value).__name__}, not a tensor")
            write(st, op, dst, converted_value(value, dst))
    return dst


def opaque_out(st, func, orig_kwargs, args, kwargs, run_opaque):
    """``func(..., out=dst)`` for an op without a symbol: run it without ``out``, write the result into ``dst``."""
    dst = orig_kwargs["out"]
    kwargs = {k: v for k, v in kwargs.items() if k != "out"}
    value = run_opaque(func, args, kwargs)
    if isinstance(dst, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(dst):
            raise TracingError(f"{getattr(func, '__name__', func)}(..., out=...): the result does not match the out tensors")
        for d, v in zip(dst, value):
            write(st, _Named("out="), d, converted_to(v, d))
    else:
        write(st, _Named("out="), dst, converted_to(value, dst))
    return dst
