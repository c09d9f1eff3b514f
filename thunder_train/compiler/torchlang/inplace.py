"""In-place Tensor methods (``add_``, ``mul_``, ``zero_``, ``__setitem__``, ...).

Each is its out-of-place symbol followed by ``prims.copy_`` into the input,
and returns the proxy for the updated buffer.  Executed in trace order they
are exact; the functionalization pass (whole-step issue) rewrites later reads.
"""
from __future__ import annotations

from .. import clang, dtypes, prims
from ..proxies import TensorProxy
from . import elementwise as ew, nn, shapes
from .registry import torchsymbol


def _write_back(out, a):
    if type(out) is not TensorProxy:
        out = prims.full(a._tt_shape, out, device=a._tt_device, dtype=a._tt_dtype)
    if out._tt_dtype is not a._tt_dtype:
        if out._tt_dtype.category > a._tt_dtype.category:
            raise RuntimeError(f"result type {out._tt_dtype.torch} can't be cast to the desired output type {a._tt_dtype.torch}")
        out = prims.convert_element_type(out, a._tt_dtype)
    if out._tt_shape != a._tt_shape:
        out = clang.expand(out, a._tt_shape)
        if out._tt_shape != a._tt_shape:
            raise RuntimeError(f"output with shape {a._tt_shape} doesn't match the broadcast shape {out._tt_shape}")
    return prims.copy_(out, a)


def _inplace(name, outplace, extra_methods=()):
    def fn(a, *args, **kwargs):
        return _write_back(outplace(a, *args, **kwargs), a)

    fn.__name__ = name
    fn.__doc__ = f"Tensor.{name}: {outplace.name} written into the input."
    return torchsymbol(methods=(name,) + tuple(extra_methods), name=name, tags=("inplace",))(fn)


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
relu_ = _inplace("relu_", nn.relu)
masked_fill_ = _inplace("masked_fill_", shapes.masked_fill)


@torchsymbol(methods=("zero_",), name="zero_", tags=("inplace",))
def zero_(a):
    return prims.copy_(prims.full(a._tt_shape, 0, device=a._tt_device, dtype=a._tt_dtype), a)


@torchsymbol(methods=("fill_",), name="fill_", tags=("inplace",))
def fill_(a, value):
    if type(value) is TensorProxy:
        return _write_back(value, a)
    return prims.copy_(prims.full(a._tt_shape, value, device=a._tt_device, dtype=a._tt_dtype), a)


@torchsymbol(methods=("copy_",), name="copy_", tags=("inplace",))
def copy_(a, src, non_blocking=False):
    return _write_back(src, a)


@torchsymbol(methods=("__setitem__",), name="setitem", tags=("inplace",))
def setitem(a, key, value):
    """``a[key] = value``: an index_put on the flattened positions that ``a[key]`` selects."""
    positions = prims.iota(a.numel_(), start=0, step=1, device=a._tt_device, dtype=dtypes.int64)
    positions = shapes.getitem(clang.reshape(positions, a._tt_shape), key)
    if type(value) is not TensorProxy:
        value = prims.full(positions._tt_shape, value, device=a._tt_device, dtype=a._tt_dtype)
    value = clang.expand(clang.maybe_convert(value, a._tt_dtype), positions._tt_shape)
    flat = prims.index_put(clang.reshape(a, (-1,)), (clang.reshape(positions, (-1,)),), clang.reshape(value, (-1,)), False)
    return prims.copy_(clang.reshape(flat, a._tt_shape), a)

