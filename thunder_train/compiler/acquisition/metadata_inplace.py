"""In-place methods that change a tensor's shape or strides: ``squeeze_``, ``unsqueeze_``, ``t_``,
``transpose_`` (``swapdims_``, ``swapaxes_``), ``as_strided_``, ``resize_``, ``resize_as_``.

The tensor object keeps its identity (the method returns it); its value is rebound to the out-of-place
result, so later reads (``x.shape``, ops on ``x``) see the new metadata.  For an input, the data does
not change: no write-back is emitted, and the epilogue replays the same method on the real input after
the computation, so the caller's tensor ends with eager's metadata.  What this cannot express is refused:
a tensor with views (or that is a view), an input that requires grad, an input whose data is also
updated in place, ``resize_`` that grows, symbolic sizes.  ``resize_`` to a contiguous tensor's own shape changes
nothing and is traced as nothing (quantization observers resize their buffers before ``copy_`` on every call).

In-place ops that resize their destination as a side effect of their kernel (``RESIZES_SELF``: ``addbmm_``) are
here too: the destination takes the result's shape and values, and the epilogue resizes an input and copies in.
"""
from __future__ import annotations

import torch

from ..errors import TracingError
from ..proxies import TensorProxy, contiguous_strides, is_proxy
from ..pytree import tree_flatten
from ..torchlang import registry
from .saved_versions import record_write

# In-place ops whose CPU kernels write through their out= form with ``out=self``, so a ``self`` that only
# broadcasts to the result is resized to it (``torch.ones(1).addbmm_(b1, b2)`` becomes 5x10, and a (5, 1) self
# adds its first element everywhere); their meta kernels refuse that.  The values come from eager's kernel run
# on a copy (inplace.CopyThenInplace), the shape from the out-of-place op (``resized_meta``).
RESIZES_SELF = {"addbmm_"}
SUPPORTED = {"squeeze_", "unsqueeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "as_strided_", "resize_",
             "resize_as_"}


def _refuse(name, why):
    raise TracingError(f"Tensor.{name} inside a compiled function: {why}. Use its out-of-place form "
                       f"({name[:-1] if name != 'resize_' else 'reshape'}) and the returned tensor instead.")


def metadata_inplace(st, func, orig_args, args, kwargs, run_opaque):
    name = func.__name__
    dst, cur = orig_args[0], args[0]
    rest, kw = tuple(args[1:]), dict(kwargs)
    if any(is_proxy(a) and type(a) is not TensorProxy for a in tree_flatten((rest, kw))[0]):
        _refuse(name, "its sizes are symbolic (dynamic=True)")
    buffers, walker = st.buffers, st.walker
    if _keeps_its_size(name, cur, rest, kw) and not (walker.is_input(dst) and dst._tt_requires_grad
                                                     and torch.is_grad_enabled()):
        return dst  # eager's no-op: an observer's ``min_val.resize_(new.shape)`` before ``copy_`` on every call
    if buffers.base_of(dst) is not None or buffers.has_views(dst):
        _refuse(name, "the tensor shares its storage with a view, whose metadata would not follow")
    is_input = walker.is_input(dst)
    if is_input:
        if dst._tt_requires_grad and torch.is_grad_enabled():
            _refuse(name, "the input requires grad")
        if buffers.is_written(dst) and id(dst) not in st.metadata_inputs:
            _refuse(name, "the input's data is also updated in place")
    if name == "resize_as_":
        other = rest[0]
        if kw.get("memory_format") not in (None, torch.contiguous_format):
            _refuse(name, "memory_format= is not supported")
        name, rest, kw = "resize_", (tuple(other.shape),), {}
    if name in ("swapdims_", "swapaxes_"):
        name = "transpose_"
    if name == "resize_":
        size = tuple(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) else tuple(rest)
        n = 1
        for s in size:
            n *= int(s)
        if cur._tt_strides != contiguous_strides(cur._tt_shape) or n > cur.numel_():
            _refuse(func.__name__, "only resizing a contiguous tensor to as many or fewer elements is supported")
        flat = registry.lookup(torch.reshape)(cur, (-1,))
        value = registry.lookup(torch.reshape)(flat[:n] if n < cur.numel_() else flat, size)
        replay = ("resize_", (size,), {})
    elif name == "as_strided_":
        if buffers.is_written(dst):
            _refuse(name, "the tensor was updated in place before, so its storage is not eager's")
        value = run_opaque(torch.as_strided, (cur,) + rest, kw)
        replay = (name, tuple(tuple(a) if isinstance(a, (list, torch.Size)) else a for a in rest), kw)
    else:
        sym = registry.lookup(getattr(torch, name[:-1]))
        value = sym(cur, *rest, **kw)
        replay = (name, rest, kw)
    buffers.rebind(dst, value)
    if is_input:
        st.metadata_inputs[id(dst)] = dst
        st.metadata_replays.append((dst, replay))
    return dst


def _keeps_its_size(name, cur, rest, kw) -> bool:
    """``resize_``/``resize_as_`` to the contiguous tensor's own shape, which changes neither metadata nor data."""
    if name == "resize_as_":
        if not isinstance(rest[0], torch.Tensor) or kw.get("memory_format") not in (None, torch.contiguous_format):
            return False
        size = tuple(rest[0].shape)
    elif name == "resize_" and not kw:
        size = tuple(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) else tuple(rest)
    else:
        return False
    return (all(type(s) is int for s in size) and size == tuple(cur._tt_shape)
            and tuple(cur._tt_strides) == tuple(contiguous_strides(cur._tt_shape)))


def resized_meta(func):
    """Meta rule of ``func`` (in ``RESIZES_SELF``) run on a copy: its in-place meta result, or, where the meta kernel
    refuses to resize, the out-of-place result (contiguous, as eager's resized tensor is)."""
    outplace = getattr(torch, func.__name__[:-1])

    def rule(self, *args, **kwargs):
        out = outplace(self, *args, **kwargs)
        if out.shape == self.shape:
            return func(self.clone(), *args, **kwargs)
        return out.to(self.dtype)

    return rule


def resizing_inplace(st, func, orig_args, value):
    """``self.X_(...)`` (``X_`` in ``RESIZES_SELF``) whose result does not have ``self``'s shape: ``self`` takes the
    result's shape and values.  For an input, the epilogue resizes the caller's tensor and copies the value in."""
    name = func.__name__
    dst = orig_args[0]
    walker = st.walker
    if st.buffers.base_of(dst) is not None or st.buffers.has_views(dst):
        _refuse(name, "it resizes the tensor, which shares its storage with a view")
    if walker.is_input(dst):
        if dst._tt_requires_grad and torch.is_grad_enabled():
            _refuse(name, "it resizes an input that requires grad")
        if st.buffers.is_written(dst) and id(dst) not in st.metadata_inputs:
            _refuse(name, "it resizes an input whose data is also updated in place")
    if value._tt_dtype != dst._tt_dtype:
        _refuse(name, f"the result's dtype {value._tt_dtype} is not the tensor's {dst._tt_dtype}")
    record_write(st, dst, name)  # a value saved for the backward is stale now, as after any in-place write
    st.buffers.rebind(dst, value)
    if walker.is_input(dst):
        st.metadata_inputs[id(dst)] = dst
        st.metadata_replays.append((dst, ("resize_", (tuple(value._tt_shape),), {})))
        st.metadata_replays.append((dst, ("copy_", (value,), {})))
    return dst


def check_data_write(st, dst):
    """A data update of an input whose metadata changed: its write-back would use the old metadata."""
    if id(dst) in st.metadata_inputs:
        raise TracingError(
            f"{dst._tt_name}: an input whose shape was changed in place (squeeze_, t_, resize_, ...) is then updated "
            "in place; thunder_train cannot write that back. Use the out-of-place form (x = x.t()) and update the result."
        )
