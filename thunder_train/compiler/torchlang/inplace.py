"""In-place Tensor methods (``add_``, ``mul_``, ``zero_``, ``__setitem__``, ...).

Each symbol has a ``functional`` form: the new value of the destination,
computed out of place.  While tracing, the tracer records only that form and
makes the result the destination's current value (``compiler/acquisition/functional.py``);
the mutation itself becomes one ``prims.copy_`` at the end of the computation.
The symbol's own decomposition (functional form + ``prims.copy_``) is what runs
when a printed trace calls it on real tensors.
"""
from __future__ import annotations

import builtins

import torch

from .. import clang, dtypes, prims
from ..proxies import TensorProxy
from . import activations, elementwise as ew, indexing
from .registry import torchsymbol


def _new_value(out, a, cast=False):
    """``out`` converted and broadcast to the destination's dtype and shape, as torch does for in-place ops.

    ``cast``: any dtype converts (``copy_`` casts, as ``a.copy_(b)`` does in eager: float into int truncates);
    otherwise a result of a higher category than the destination is eager's error for in-place arithmetic."""
    if type(out) is not TensorProxy:
        out = prims.full(a._tt_shape, out, device=a._tt_device, dtype=a._tt_dtype)
    if out._tt_dtype is not a._tt_dtype:
        if out._tt_dtype.category > a._tt_dtype.category and not cast:
            raise RuntimeError(f"result type {out._tt_dtype.torch} can't be cast to the desired output type {a._tt_dtype.torch}")
        out = prims.convert_element_type(out, a._tt_dtype)
    if out._tt_shape != a._tt_shape:
        target = clang.broadcast_shapes(out._tt_shape, a._tt_shape)
        if target != tuple(a._tt_shape):  # the result would not fit the destination
            raise RuntimeError(f"output with shape {list(a._tt_shape)} doesn't match the broadcast shape {list(target)}")
        out = clang.expand(out, a._tt_shape)
    return out


converted_value = _new_value  # the dispatcher's generic in-place path uses the same rule


def _functional(sym, new_value):
    """Attach the functional form: ``sym.functional(dst, *args) -> new value of dst``."""
    sym.functional = new_value
    return sym


def _inplace(name, outplace, extra_methods=()):
    def new_value(a, *args, **kwargs):
        return _new_value(outplace(a, *args, **kwargs), a)

    def fn(a, *args, **kwargs):
        return prims.copy_(new_value(a, *args, **kwargs), a)

    fn.__name__ = name
    fn.__doc__ = f"Tensor.{name}: {outplace.name} written into the input."
    sym = _functional(torchsymbol(methods=(name,) + tuple(extra_methods), name=name, tags=("inplace",))(fn), new_value)
    # The out-of-place op's in-place form, with the same arguments (re-inplacing, executors/reinplace.py).
    outplace.inplace_variant = sym
    return sym


add_ = _inplace("add_", ew.add, ("__iadd__",))
sub_ = _inplace("sub_", ew.sub, ("__isub__",))
mul_ = _inplace("mul_", ew.mul, ("__imul__",))
div_ = _inplace("div_", ew.div, ("__itruediv__",))
pow_ = _inplace("pow_", ew.pow)
neg_ = _inplace("neg_", ew.neg)
exp_ = _inplace("exp_", ew.exp)
sqrt_ = _inplace("sqrt_", ew.sqrt)
clamp_ = _inplace("clamp_", ew.clamp)
clamp_min_ = _inplace("clamp_min_", ew.clamp_min)
clamp_max_ = _inplace("clamp_max_", ew.clamp_max)
lerp_ = _inplace("lerp_", ew.lerp)
addcmul_ = _inplace("addcmul_", ew.addcmul)
addcdiv_ = _inplace("addcdiv_", ew.addcdiv)
sigmoid_ = _inplace("sigmoid_", ew.sigmoid)
tanh_ = _inplace("tanh_", ew.tanh)
relu_ = _inplace("relu_", activations.relu)
masked_fill_ = _inplace("masked_fill_", indexing.masked_fill)


def _keeps_grad(a, value):
    """An in-place fill of a tensor that requires grad still requires grad in eager (its gradient is zero):
    the new value keeps ``a`` in the graph."""
    # (whether an intermediate requires grad is known only from the inputs it depends on, so under grad mode
    # every float fill keeps it; torch.no_grad regions, optimizer steps, skip the extra where)
    if not (torch.is_grad_enabled() and a._tt_dtype.is_float):
        return value
    always = prims.full(a._tt_shape, True, device=a._tt_device, dtype=dtypes.bool8)
    return prims.where(always, value, a)


def _zero_value(a):
    return _keeps_grad(a, prims.full(a._tt_shape, 0, device=a._tt_device, dtype=a._tt_dtype))


@torchsymbol(torch.zero_, methods=("zero_",), name="zero_", torch_impl=torch.Tensor.zero_, tags=("inplace",))
def zero_(a):
    return prims.copy_(_zero_value(a), a)


def _fill_value(a, value):
    if type(value) is TensorProxy:
        return _new_value(value, a)
    return _keeps_grad(a, prims.full(a._tt_shape, value, device=a._tt_device, dtype=a._tt_dtype))


@torchsymbol(methods=("fill_",), name="fill_", tags=("inplace",))
def fill_(a, value):
    return prims.copy_(_fill_value(a, value), a)


def _copy_value(a, src, non_blocking=False):
    if type(src) is TensorProxy and src._tt_device != a._tt_device:
        raise NotImplementedError(
            f"copy_ from {src._tt_device} into {a._tt_device} inside a compiled function is not supported yet; "
            "move the tensor before calling it"
        )
    return _new_value(src, a, cast=True)


@torchsymbol(methods=("copy_",), name="copy_", tags=("inplace",))
def copy_(a, src, non_blocking=False):
    return prims.copy_(_copy_value(a, src), a)


_functional(zero_, _zero_value)
_functional(fill_, _fill_value)
_functional(copy_, _copy_value)


@torchsymbol(methods=("__setitem__",), name="setitem", tags=("inplace", "fallible"))
def setitem(a, key, value):
    """``a[key] = value``: an index_put on the flattened positions that ``a[key]`` selects."""
    return prims.copy_(_setitem_value(a, key, value), a)


def _setitem_value(a, key, value):
    band = _one_band(a, key)
    if band is not None:  # a[..., i:j] = v: the parts of a before and after the band around v, no index tensors
        dim, start, stop = band
        value = clang.expand(clang.maybe_convert(value, a._tt_dtype) if type(value) is TensorProxy else
                             prims.full((), value, device=a._tt_device, dtype=a._tt_dtype),
                             tuple(stop - start if d == dim else n for d, n in enumerate(a._tt_shape)))
        return clang.with_band(a, value, dim, start, stop)
    positions = prims.iota(a.numel_(), start=0, step=1, device=a._tt_device, dtype=dtypes.int64)
    positions = indexing.getitem(clang.reshape(positions, a._tt_shape), key)
    if type(value) is not TensorProxy:
        value = prims.full(positions._tt_shape, value, device=a._tt_device, dtype=a._tt_dtype)
    value = clang.expand(clang.maybe_convert(value, a._tt_dtype), positions._tt_shape)
    flat = prims.index_put(clang.reshape(a, (-1,)), (clang.reshape(positions, (-1,)),), clang.reshape(value, (-1,)), False)
    return clang.reshape(flat, a._tt_shape)


def _one_band(a, key):
    """``(dim, start, stop)`` when ``a[key]`` is one band ``start:stop`` (step 1, not empty, not all of it) of one dim
    of ``a`` with every other dim whole (``a[..., :8]``, ``a[:, 2:5]``), written by ``clang.with_band``; else None."""
    if type(a) is not TensorProxy or not builtins.all(type(n) is int for n in a._tt_shape):
        return None
    key = key if isinstance(key, tuple) else (key,)
    if builtins.any(k is not Ellipsis and not isinstance(k, slice) for k in key) or builtins.sum(k is Ellipsis for k in key) > 1:
        return None
    n_real = builtins.sum(1 for k in key if k is not Ellipsis)
    if n_real > a.ndim_:
        return None
    i = next((j for j, k in enumerate(key) if k is Ellipsis), len(key))
    key = key[:i] + (slice(None),) * (a.ndim_ - n_real) + key[i + 1:]
    bands = []
    for d, k in enumerate(key):
        if builtins.any(v is not None and type(v) is not int for v in (k.start, k.stop, k.step)):
            return None
        start, stop, step = k.indices(a._tt_shape[d])
        if (start, stop, step) != (0, a._tt_shape[d], 1):
            bands.append((d, start, stop, step))
    if len(bands) != 1 or bands[0][3] != 1 or bands[0][2] <= bands[0][1]:
        return None
    d, start, stop, _ = bands[0]
    return d, start, stop


_functional(setitem, _setitem_value)

