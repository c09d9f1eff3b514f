"""Factories: empty, full, zeros, ones, arange, randn, rand, *_like, tensor; eye, logspace, tri[lu]_indices,
fill."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import clang, dtypes
from ..proxies import NumberProxy, TensorProxy, is_int, is_number, number_type
from .convert import to_dtype, to_device, size_args, default_device
from ..errors import TracingError
from .registry import composed, torchsymbol


def _dd(dtype, device, default_dtype=None):
    return (to_dtype(dtype) or default_dtype or dtypes.default_float()), (to_device(device) or default_device())


def _check_layout(layout, pin_memory=False):
    if layout not in (None, torch.strided):
        raise NotImplementedError(f"layout={layout} is not supported")


_FORMATS = (None, torch.contiguous_format, torch.preserve_format)


def _factory(*torch_fns, **kw):
    """``torchsymbol`` for a factory; its options are honoured or refused, never dropped.

    ``requires_grad=True`` makes a new leaf, as ``requires_grad_()`` on the new tensor (a backward inside the
    function sets its ``.grad``; returning a value that requires grad through it alone is refused:
    ``acquisition/python_effects.py``); ``layout``, ``pin_memory`` and ``memory_format`` other than the defaults raise
    ``NotImplementedError``, on which the dispatcher runs the call through torch (eager's result).
    """

    def deco(fn):
        import functools

        @functools.wraps(fn)
        def checked(*args, **kwargs):
            _check_layout(kwargs.get("layout"))
            if kwargs.get("pin_memory"):
                raise NotImplementedError(f"{fn.__name__}(pin_memory=True) has no decomposition")
            if kwargs.get("memory_format") not in _FORMATS:
                raise NotImplementedError(f"{fn.__name__}(memory_format={kwargs['memory_format']}) has no decomposition")
            out = fn(*args, **kwargs)
            if kwargs.get("requires_grad"):
                from .tensor_methods import set_requires_grad

                set_requires_grad(out, True)  # a new leaf, as ``requires_grad_()`` on the new tensor
            return out

        return torchsymbol(*torch_fns, explicit_defaults=True, **kw)(checked)

    return deco


@_factory(torch.empty)
def empty(*size, dtype=None, device=None, layout=None, requires_grad=False, pin_memory=False, memory_format=None, out=None):
    _check_layout(layout)
    dt, dev = _dd(dtype, device)
    return clang.empty(size_args(size), device=dev, dtype=dt)


def _fill_value_dtype(v):
    t = number_type(v)
    if t is bool:
        return dtypes.bool8
    if t is int:
        return dtypes.int64
    if t is complex:
        return dtypes.to_complex(dtypes.default_float())
    return dtypes.default_float()


@_factory(torch.full)
def full(size, fill_value, *, dtype=None, device=None, layout=None, requires_grad=False, pin_memory=False, out=None):
    _check_layout(layout)
    dt, dev = _dd(dtype, device, _fill_value_dtype(fill_value))
    return clang.full(size_args((size,)), fill_value, device=dev, dtype=dt)


@_factory(torch.zeros)
def zeros(*size, dtype=None, device=None, layout=None, requires_grad=False, pin_memory=False, out=None):
    dt, dev = _dd(dtype, device)
    return clang.zeros(size_args(size), device=dev, dtype=dt)


@_factory(torch.ones)
def ones(*size, dtype=None, device=None, layout=None, requires_grad=False, pin_memory=False, out=None):
    dt, dev = _dd(dtype, device)
    return clang.ones(size_args(size), device=dev, dtype=dt)


def _like(a, dtype, device):
    return (to_dtype(dtype) or a._tt_dtype), (to_device(device) or a._tt_device)


@_factory(torch.empty_like)
def empty_like(input, *, dtype=None, device=None, layout=None, requires_grad=False, memory_format=None, pin_memory=False):
    dt, dev = _like(input, dtype, device)
    return clang.empty(input._tt_shape, device=dev, dtype=dt)


@_factory(torch.full_like)
def full_like(input, fill_value, *, dtype=None, device=None, layout=None, requires_grad=False, memory_format=None, pin_memory=False):
    dt, dev = _like(input, dtype, device)
    return clang.full(input._tt_shape, fill_value, device=dev, dtype=dt)


@_factory(torch.zeros_like)
def zeros_like(input, *, dtype=None, device=None, layout=None, requires_grad=False, memory_format=None, pin_memory=False):
    dt, dev = _like(input, dtype, device)
    return clang.zeros(input._tt_shape, device=dev, dtype=dt)


@_factory(torch.ones_like)
def ones_like(input, *, dtype=None, device=None, layout=None, requires_grad=False, memory_format=None, pin_memory=False):
    dt, dev = _like(input, dtype, device)
    return clang.ones(input._tt_shape, device=dev, dtype=dt)


@_factory(methods=("new_zeros",))
def new_zeros(input, *size, dtype=None, device=None, layout=None, requires_grad=False, pin_memory=False):
    dt, dev = _like(input, dtype, device)
    return clang.zeros(size_args(size), device=dev, dtype=dt)


@_factory(methods=("new_ones",))
def new_ones(input, *size, dtype=None, device=None, layout=None, requires_grad=False, pin_memory=False):
    dt, dev = _like(input, dtype, device)
    return clang.ones(size_args(size), device=dev, dtype=dt)


@_factory(methods=("new_full",))
def new_full(input, size, fill_value, *, dtype=None, device=None, layout=None, requires_grad=False, pin_memory=False):
    dt, dev = _like(input, dtype, device)
    return clang.full(size_args((size,)), fill_value, device=dev, dtype=dt)


@_factory(methods=("new_empty",))
def new_empty(input, *size, dtype=None, device=None, layout=None, requires_grad=False, pin_memory=False):
    dt, dev = _like(input, dtype, device)
    return clang.empty(size_args(size), device=dev, dtype=dt)


@_factory(torch.arange)
def arange(start=0, end=None, step=1, *, dtype=None, device=None, layout=None, requires_grad=False, pin_memory=False, out=None):
    if end is None:
        start, end = 0, start
    if dtype is None:
        dt = dtypes.int64 if all(is_int(v) for v in (start, end, step)) else dtypes.default_float()
    else:
        dt = to_dtype(dtype)
    return clang.arange(start, end, step, device=to_device(device) or default_device(), dtype=dt)


@_factory(torch.linspace)
def linspace(start, end, steps, *, dtype=None, device=None, layout=None, requires_grad=False, out=None):
    dt = to_dtype(dtype) or dtypes.default_float()
    return clang.linspace(start, end, steps, device=to_device(device) or default_device(), dtype=dt)


@_factory(torch.randn)
def randn(*size, generator=None, dtype=None, device=None, layout=None, requires_grad=False, pin_memory=False, out=None):
    if generator is not None:
        raise NotImplementedError("randn(generator=...) is not supported inside a compiled function")
    dt, dev = _dd(dtype, device)
    return clang.randn(size_args(size), device=dev, dtype=dt)


@_factory(torch.rand)
def rand(*size, generator=None, dtype=None, device=None, layout=None, requires_grad=False, pin_memory=False, out=None):
    if generator is not None:
        raise NotImplementedError("rand(generator=...) is not supported inside a compiled function")
    dt, dev = _dd(dtype, device)
    return clang.uniform(size_args(size), device=dev, dtype=dt)


@_factory(torch.randn_like)
def randn_like(input, *, dtype=None, device=None, layout=None, requires_grad=False, memory_format=None, pin_memory=False):
    dt, dev = _like(input, dtype, device)
    return clang.randn(input._tt_shape, device=dev, dtype=dt)


@_factory(torch.rand_like)
def rand_like(input, *, dtype=None, device=None, layout=None, requires_grad=False, memory_format=None, pin_memory=False):
    dt, dev = _like(input, dtype, device)
    return clang.uniform(input._tt_shape, device=dev, dtype=dt)


@_factory(torch.tensor, torch.as_tensor)
def tensor(data, *, dtype=None, device=None, requires_grad=False, pin_memory=False):
    """A tensor from Python numbers (nested lists of constants)."""
    if type(data) is TensorProxy:
        return clang.maybe_convert(data, to_dtype(dtype) or data._tt_dtype)
    if is_number(data):
        dt = to_dtype(dtype) or _fill_value_dtype(data)
        return clang.full((), data, device=to_device(device) or default_device(), dtype=dt)
    # torch infers the shape and dtype; runtime numbers (item() results, sizes) stand in by their type
    # and are filled in as themselves, so their values are the call's, not the trace's.
    leaves, spec = tree_flatten(data)
    numbers = {i: x for i, x in enumerate(leaves) if isinstance(x, NumberProxy)}
    if numbers:
        stand_in = {bool: True, int: 1, float: 1.0, complex: 1j}
        data = tree_unflatten([stand_in[numbers[i].python_type] if i in numbers else x for i, x in enumerate(leaves)], spec)
    ref = torch.tensor(data, dtype=dtype, device="cpu")
    dt = dtypes.from_torch(ref.dtype)
    dev = to_device(device) or default_device()
    flat = ref.reshape(-1).tolist()
    if numbers:
        if len(flat) != len(leaves):
            raise TypeError("torch.tensor while tracing: runtime numbers (item() results, sizes) are supported in nested lists and tuples only")
        flat = [numbers.get(i, v) for i, v in enumerate(flat)]
    parts = [clang.full((1,), v, device=dev, dtype=dt) for v in flat]
    if not parts:
        return clang.empty(tuple(ref.shape), device=dev, dtype=dt)
    out = parts[0] if len(parts) == 1 else clang.cat(parts, 0)
    return clang.reshape(out, tuple(ref.shape))


@_factory(torch.scalar_tensor)
def scalar_tensor(s, *, dtype=None, device=None, layout=None, requires_grad=False, pin_memory=False):
    dt, dev = _dd(dtype, device)
    return clang.full((), s, device=dev, dtype=dt)


@_factory(methods=("new_tensor",))
def new_tensor(input, data, *, dtype=None, device=None, requires_grad=False, layout=None, pin_memory=False):
    """Like ``torch.tensor`` but defaulting to ``input``'s dtype and device."""
    dt, dev = _like(input, dtype, device)
    return tensor(data, dtype=dt.torch, device=dev.torch)


# ---------------------------------------------------------------------------
# Written as torch calls the torch language knows (registry.composed: traced as the user's own calls)
# ---------------------------------------------------------------------------
def eye(n, m=None, *, dtype=None, layout=None, device=None, requires_grad=False, pin_memory=False, out=None):
    if out is not None or layout not in (None, torch.strided) or pin_memory or requires_grad:
        raise NotImplementedError("eye with out=/layout/pin_memory/requires_grad is run by torch")
    m = n if m is None else m
    dtype = dtype or torch.get_default_dtype()
    return (torch.arange(n, device=device).unsqueeze(1) == torch.arange(m, device=device)).to(dtype)


composed("eye", eye, (torch.eye,))


def logspace(start, end, steps, base=10.0, *, dtype=None, layout=None, device=None, requires_grad=False, pin_memory=False, out=None):
    if out is not None or requires_grad or isinstance(start, torch.Tensor) or isinstance(end, torch.Tensor):
        raise NotImplementedError("logspace with tensor ends or out= is run by torch")
    dtype = dtype or torch.get_default_dtype()
    if not dtype.is_floating_point:
        raise NotImplementedError("integer logspace is run by torch")
    exps = torch.linspace(start, end, steps, dtype=torch.float64 if dtype is torch.float64 else torch.float32, device=device)
    return torch.pow(float(base), exps).to(dtype)


composed("logspace", logspace, (torch.logspace,))


def _tri_indices(upper):
    def fn(row, col, offset=0, *, dtype=torch.int64, device=None, layout=torch.strided, pin_memory=False):
        pairs = [(i, j) for i in range(row) for j in range(col) if (j - i >= offset if upper else j - i <= offset)]
        if not pairs:
            return torch.zeros((2, 0), dtype=dtype, device=device)
        return torch.tensor([[i for i, _ in pairs], [j for _, j in pairs]], dtype=dtype, device=device)

    return fn


composed("triu_indices", _tri_indices(True), (torch.triu_indices,))
composed("tril_indices", _tri_indices(False), (torch.tril_indices,))


def fill(input, value):
    if isinstance(value, torch.Tensor):
        if value.ndim != 0:
            raise RuntimeError(f"fill only supports 0-dimension value tensor but got tensor with {value.ndim} dimensions.")
        value = value.to(input.dtype)
    # where() keeps input in the graph: the result requires grad like eager's (its gradient into input is zero)
    return torch.where(torch.ones_like(input, dtype=torch.bool), value, input)


composed("fill", fill, (torch.fill,))
