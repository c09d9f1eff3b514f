"""Primitive operations.

A prim has a meta function only: given proxies it validates its inputs and
returns output proxies.  No tensor data exists at trace time.  Prims are
strict — elementwise inputs have one shape and one dtype, reductions take
explicit dims — so that executors implement a small, simple set; clang builds
the conveniences (broadcasting, type promotion, -1 in reshape) on top.

Facts about a prim hang off its symbol: its tags (``"fusible"``,
``"side_effect"``, ...) and what it is on Python numbers are declared here;
its gradient rule (``Symbol.grad_rule``) is registered in
``transforms/grad_rules.py`` and its torch implementation in
``executors/torch_executor.py`` (an executor adds its own implementations).
"""
from __future__ import annotations

import builtins
import math
import operator
import sys

from . import codegen, dtypes, proxies
from .proxies import CheckedFloat, NumberProxy, SizeProxy, TensorProxy, is_checked
from .symbols import Symbol

Number = (int, float, bool, complex)

_all: dict = {}


def _prim(fn=None, *, name=None, tags=()):
    def deco(f):
        sym = Symbol(name or f.__name__.lstrip("_").removesuffix("_meta"), f, module="prims", is_prim=True, tags=tags)
        _all[sym.name] = sym
        return sym

    return deco(fn) if fn is not None else deco


class PrimError(ValueError):
    """An input a prim cannot accept; the message says which and why."""


def _check(cond, msg):
    if not cond:
        raise PrimError(msg() if callable(msg) else msg)


def _tensor_args(args):
    return [a for a in args if type(a) is TensorProxy]


def _common_device(tensors, opname):
    dev = tensors[0]._tt_device
    for t in tensors[1:]:
        _check(t._tt_device == dev, lambda: f"{opname}: expected all tensors on {dev}, got one on {t._tt_device}")
    return dev


def _number_value(x):
    return x.value if isinstance(x, NumberProxy) else x


# ---------------------------------------------------------------------------
# Elementwise
# ---------------------------------------------------------------------------
UNARY_OPS = (
    "abs neg exp exp2 expm1 log log1p log2 log10 sqrt rsqrt sin cos tan asin acos atan sinh cosh tanh "
    "asinh acosh atanh erf erfc erfinv floor ceil round trunc sign reciprocal bitwise_not lgamma digamma sigmoid"
).split()
UNARY_BOOL_OPS = "isfinite isnan isinf signbit".split()
BINARY_OPS = (
    "add sub mul div floor_divide pow maximum minimum atan2 fmod remainder bitwise_and bitwise_or bitwise_xor "
    "copysign hypot nextafter bitwise_left_shift bitwise_right_shift"
).split()
BINARY_BOOL_OPS = "eq ne lt le gt ge".split()

def _elementwise_meta(opname, args, *, bool_output=False):
    tensors = _tensor_args(args)
    if not tensors:
        # A scalar computation on runtime numbers: recorded, output is a NumberProxy.
        _check(any(isinstance(a, NumberProxy) for a in args), f"{opname}: expected a tensor or NumberProxy input")
        fn = _all[opname].python_op
        _check(fn is not None, f"{opname} is not supported on Python numbers")
        value = fn(*[_number_value(a) for a in args])
        if any(is_checked(a) for a in args) and type(value) in (int, float):
            # Arithmetic on symbolic sizes / checked hyper-parameters stays checked (their decisions are guarded).
            out = SizeProxy(value=value, python_type=int) if type(value) is int else CheckedFloat(value=value, python_type=float)
            out.origin = ("op", opname) + tuple(args)
            return out
        return NumberProxy(value=value, python_type=type(value))
    shape = tensors[0]._tt_shape
    dtype = tensors[0]._tt_dtype
    for t in tensors[1:]:
        _check(t._tt_shape == shape, lambda: f"{opname}: prims need equal shapes, got {shape} and {t._tt_shape}")
        _check(t._tt_dtype is dtype, lambda: f"{opname}: prims need equal dtypes, got {dtype} and {t._tt_dtype}")
    for a in args:
        _check(
            type(a) is TensorProxy or isinstance(a, Number) or isinstance(a, NumberProxy),
            lambda: f"{opname}: unsupported input {a!r}",
        )
    device = _common_device(tensors, opname)
    out_dtype = dtypes.bool8 if bool_output else dtype
    return TensorProxy(shape=shape, dtype=out_dtype, device=device)


# Tag "fusible": Inductor fusion (executors/inductor_fusion.py) may take the prim's torch call into a kernel.
_FUSIBLE_ELEMENTWISE = ("elementwise", "fusible")


def _make_unary(name, bool_output=False):
    def meta(a):
        return _elementwise_meta(name, (a,), bool_output=bool_output)

    meta.__name__ = name
    meta.__doc__ = f"Elementwise {name}."
    return _prim(meta, name=name, tags=_FUSIBLE_ELEMENTWISE)


def _make_binary(name, bool_output=False):
    def meta(a, b):
        return _elementwise_meta(name, (a, b), bool_output=bool_output)

    meta.__name__ = name
    meta.__doc__ = f"Elementwise {name}; inputs have equal shapes and dtypes (or are numbers)."
    return _prim(meta, name=name, tags=_FUSIBLE_ELEMENTWISE)


for _n in UNARY_OPS:
    globals()[_n] = _make_unary(_n)
for _n in UNARY_BOOL_OPS:
    globals()[_n] = _make_unary(_n, bool_output=True)
for _n in BINARY_OPS:
    globals()[_n] = _make_binary(_n)
for _n in BINARY_BOOL_OPS:
    globals()[_n] = _make_binary(_n, bool_output=True)
# Elementwise, but not taken into Inductor kernels (not checked with Inductor here).
for _p in (digamma, signbit, copysign, nextafter, bitwise_left_shift, bitwise_right_shift):  # noqa: F821
    _p.tags = _p.tags - {"fusible"}


def _on_numbers(sym, python_op, infix=None, *, commutative=False, mirrored=None):
    """What an elementwise prim is on Python numbers (runtime scalars: an lr, a symbolic size): the Python
    function computing it, its infix spelling (printed programs, prologue checks), whether its operands
    commute and which comparison swaps them (``a < b`` is ``b > a``)."""
    sym.python_op, sym.infix, sym.mirrored = python_op, infix, mirrored
    if commutative:
        sym.tags = sym.tags | {"commutative"}


_on_numbers(add, operator.add, "+", commutative=True)
_on_numbers(sub, operator.sub, "-")
_on_numbers(mul, operator.mul, "*", commutative=True)
_on_numbers(div, operator.truediv, "/")
_on_numbers(floor_divide, operator.floordiv, "//")
_on_numbers(remainder, operator.mod, "%")
_on_numbers(pow, operator.pow, "**")
_on_numbers(maximum, max, commutative=True)
_on_numbers(minimum, min, commutative=True)
_on_numbers(eq, operator.eq, "==", commutative=True)
_on_numbers(ne, operator.ne, "!=", commutative=True)
_on_numbers(lt, operator.lt, "<", mirrored=gt)
_on_numbers(le, operator.le, "<=", mirrored=ge)
_on_numbers(gt, operator.gt, ">", mirrored=lt)
_on_numbers(ge, operator.ge, ">=", mirrored=le)
_on_numbers(neg, operator.neg)
_on_numbers(abs, builtins.abs)
_on_numbers(sqrt, math.sqrt)
_on_numbers(exp, math.exp)
_on_numbers(log, math.log)
_on_numbers(floor, math.floor)
_on_numbers(ceil, math.ceil)
for _p in (bitwise_and, bitwise_or, bitwise_xor, hypot):  # commutative on tensors (no Python-number form)
    _p.tags = _p.tags | {"commutative"}

# Python's infix spelling of the scalar prims, by prim name (prologue size checks read it).
SCALAR_INFIX = {n: s.infix for n, s in _all.items() if s.infix is not None}


@_prim(tags=_FUSIBLE_ELEMENTWISE)
def where(pred, a, b):
    """Select ``a`` where ``pred`` else ``b``; equal shapes, ``a`` and ``b`` one dtype."""
    tensors = _tensor_args((pred, a, b))
    _check(tensors, "where: expected at least one tensor")
    shape = tensors[0]._tt_shape
    for t in tensors:
        _check(t._tt_shape == shape, lambda: f"where: prims need equal shapes, got {shape} and {t._tt_shape}")
    if type(pred) is TensorProxy:
        _check(pred._tt_dtype is dtypes.bool8, "where: predicate must be bool")
    vals = _tensor_args((a, b))
    if len(vals) == 2:
        _check(a._tt_dtype is b._tt_dtype, lambda: f"where: dtypes differ: {a._tt_dtype} and {b._tt_dtype}")
    _check(vals, "where: a or b must be a tensor at prim level")
    return TensorProxy(shape=shape, dtype=vals[0]._tt_dtype, device=_common_device(tensors, "where"))


# ---------------------------------------------------------------------------
# Type conversion
# ---------------------------------------------------------------------------
@_prim(tags=("fusible",))
def convert_element_type(a, dtype):
    """Cast to ``dtype`` (a compiler dtype)."""
    _check(isinstance(dtype, dtypes.DType), "convert_element_type: dtype must be a compiler dtype")
    return TensorProxy(shape=a._tt_shape, dtype=dtype, device=a._tt_device)


@_prim
def clone(a):
    """A fresh copy of ``a`` (never aliases it)."""
    return TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device)


@_prim
def stop_gradient(a):
    """The value of ``a``, through which no gradient flows (``Tensor.detach``)."""
    return TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device)


# ---------------------------------------------------------------------------
# Reductions: ``dims`` is a sorted tuple of non-negative ints, reduced dims are removed.
# ---------------------------------------------------------------------------
def _reduced_shape(a, dims, opname):
    nd = len(a._tt_shape)
    for d in dims:
        _check(isinstance(d, int) and 0 <= d < nd, lambda: f"{opname}: invalid dim {d} for rank {nd}")
    return tuple(s for i, s in enumerate(a._tt_shape) if i not in dims)


def _make_reduction(name, output_dtype=None, tags=("reduction", "fusible")):
    def meta(a, dims):
        shape = _reduced_shape(a, dims, name)
        return TensorProxy(shape=shape, dtype=output_dtype or a._tt_dtype, device=a._tt_device)

    meta.__name__ = name
    meta.__doc__ = f"Reduce ``a`` with {name} over ``dims``; reduced dims are removed."
    return _prim(meta, name=name, tags=tags)


sum = _make_reduction("sum")
prod = _make_reduction("prod", tags=("reduction",))
amax = _make_reduction("amax")
amin = _make_reduction("amin")


@_prim(tags=("reduction",))
def var(a, dims, correction):
    """Variance over ``dims`` with Bessel-style ``correction``."""
    shape = _reduced_shape(a, dims, "var")
    return TensorProxy(shape=shape, dtype=dtypes.to_real(a._tt_dtype), device=a._tt_device)


@_prim(tags=("reduction",))
def argmax(a, dim):
    """Index of the maximum along ``dim`` (removed)."""
    return TensorProxy(shape=_reduced_shape(a, (dim,), "argmax"), dtype=dtypes.int64, device=a._tt_device)


@_prim(tags=("reduction",))
def argmin(a, dim):
    """Index of the minimum along ``dim`` (removed)."""
    return TensorProxy(shape=_reduced_shape(a, (dim,), "argmin"), dtype=dtypes.int64, device=a._tt_device)


@_prim
def cumsum(a, dim):
    """Inclusive prefix sum along ``dim``."""
    return TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device)


@_prim
def topk(a, k, dim, largest, sorted):
    """The ``k`` largest (or smallest) values along ``dim`` and their int64 indices."""
    shape = list(a._tt_shape)
    _check(0 <= k <= shape[dim], lambda: f"topk: k={k} out of range for size {shape[dim]}")
    shape[dim] = k
    return (
        TensorProxy(shape=shape, dtype=a._tt_dtype, device=a._tt_device),
        TensorProxy(shape=shape, dtype=dtypes.int64, device=a._tt_device),
    )


@_prim
def sort(a, dim, descending, stable):
    """Sorted values along ``dim`` and their int64 indices."""
    return (
        TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device),
        TensorProxy(shape=a._tt_shape, dtype=dtypes.int64, device=a._tt_device),
    )


# ---------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------
@_prim(tags=("fusible",))  # when the torch executor runs it as ttex.broadcast_in_dim (a view otherwise)
def broadcast_in_dim(a, shape, broadcast_dimensions):
    """Broadcast ``a`` to ``shape``; dim i of ``a`` maps to ``broadcast_dimensions[i]``."""
    shape = tuple(shape)
    _check(len(broadcast_dimensions) == len(a._tt_shape), "broadcast_in_dim: one target dim per input dim")
    for i, d in enumerate(broadcast_dimensions):
        s = a._tt_shape[i]
        _check(0 <= d < len(shape) and (s == 1 or s == shape[d]), lambda: f"broadcast_in_dim: cannot map size {s} onto {shape} at dim {d}")
    _check(list(broadcast_dimensions) == sorted(broadcast_dimensions), "broadcast_in_dim: dims must increase")
    return TensorProxy(shape=shape, dtype=a._tt_dtype, device=a._tt_device)


@_prim
def reshape(a, shape):
    """Reshape to ``shape`` (no -1; clang resolves it)."""
    shape = tuple(shape)
    n = 1
    for s in shape:
        _check(isinstance(s, int) and s >= 0, lambda: f"reshape: invalid size {s}")
        n *= s
    _check(n == a.numel_(), lambda: f"reshape: shape {shape} is invalid for input of size {a.numel_()}")
    return TensorProxy(shape=shape, dtype=a._tt_dtype, device=a._tt_device)


@_prim
def transpose(a, permutation):
    """Permute dimensions."""
    nd = len(a._tt_shape)
    _check(sorted(permutation) == list(range(nd)), lambda: f"transpose: {permutation} is not a permutation of {nd} dims")
    return TensorProxy(shape=tuple(a._tt_shape[p] for p in permutation), dtype=a._tt_dtype, device=a._tt_device)


@_prim
def slice(a, start_indices, end_indices, strides=None):
    """Take ``a[start:end:stride]`` in every dim; all indices are in range."""
    nd = len(a._tt_shape)
    strides = strides if strides is not None else (1,) * nd
    _check(len(start_indices) == nd and len(end_indices) == nd and len(strides) == nd, "slice: one index per dim")
    shape = []
    for s, lo, hi, st in zip(a._tt_shape, start_indices, end_indices, strides):
        _check(0 <= lo <= hi <= s and st >= 1, lambda: f"slice: invalid range {lo}:{hi}:{st} for size {s}")
        shape.append((hi - lo + st - 1) // st)
    return TensorProxy(shape=shape, dtype=a._tt_dtype, device=a._tt_device)


@_prim
def squeeze(a, dims):
    """Remove the size-1 dims ``dims``."""
    for d in dims:
        _check(a._tt_shape[d] == 1, lambda: f"squeeze: dim {d} has size {a._tt_shape[d]}, not 1")
    return TensorProxy(shape=[s for i, s in enumerate(a._tt_shape) if i not in dims], dtype=a._tt_dtype, device=a._tt_device)


@_prim
def cat(tensors, dim):
    """Concatenate along ``dim``; tensors share dtype and other sizes."""
    _check(len(tensors) > 0, "cat: expected at least one tensor")
    t0 = tensors[0]
    shape = list(t0._tt_shape)
    for t in tensors[1:]:
        _check(len(t._tt_shape) == len(shape), "cat: tensors must have equal rank")
        _check(t._tt_dtype is t0._tt_dtype, "cat: tensors must have equal dtypes at prim level")
        for i, (x, y) in enumerate(zip(shape, t._tt_shape)):
            _check(i == dim or x == y, lambda: f"cat: sizes differ at dim {i}: {x} vs {y}")
        shape[dim] += t._tt_shape[dim]
    return TensorProxy(shape=shape, dtype=t0._tt_dtype, device=_common_device(list(tensors), "cat"))


@_prim
def pad(a, padding_value, padding_config):
    """Pad with ``(lo, hi, interior)`` per dim (negative lo/hi crop)."""
    _check(len(padding_config) == len(a._tt_shape), "pad: one (lo, hi, interior) per dim")
    shape = []
    for s, (lo, hi, interior) in zip(a._tt_shape, padding_config):
        _check(interior >= 0, "pad: interior padding must be >= 0")
        shape.append(lo + hi + s + max(s - 1, 0) * interior)
    return TensorProxy(shape=shape, dtype=a._tt_dtype, device=a._tt_device)


@_prim
def flip(a, dims):
    """Reverse the order of elements along ``dims``."""
    return TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device)


@_prim
def take(a, index, dim):
    """``index_select``: pick entries of ``a`` along ``dim`` by a 1-D integer ``index``."""
    _check(index._tt_dtype.is_int and len(index._tt_shape) <= 1, "take: index must be a 1-D integer tensor")
    shape = list(a._tt_shape)
    shape[dim] = index._tt_shape[0] if index._tt_shape else 1
    if not index._tt_shape:
        del shape[dim]
    return TensorProxy(shape=shape, dtype=a._tt_dtype, device=a._tt_device)


@_prim
def gather(a, index, dim):
    """``torch.gather`` semantics: output has ``index``'s shape."""
    _check(index._tt_dtype.is_int and len(index._tt_shape) == len(a._tt_shape), "gather: index must be integer with a's rank")
    return TensorProxy(shape=index._tt_shape, dtype=a._tt_dtype, device=a._tt_device)


@_prim
def scatter_add(a, index, src, dim):
    """Out-of-place ``a.scatter_add(dim, index, src)``."""
    _check(index._tt_dtype.is_int, "scatter_add: index must be an integer tensor")
    return TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device)


@_prim
def index_put(a, indices, values, accumulate):
    """Out-of-place ``a.index_put(indices, values, accumulate)``."""
    return TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device)


# ---------------------------------------------------------------------------
# Linear algebra and convolution
# ---------------------------------------------------------------------------
def _matmul_shape(sa, sb):
    _check(len(sa) >= 1 and len(sb) >= 1, "matmul: both arguments need at least one dim")
    if len(sa) == 1 and len(sb) == 1:
        _check(sa[0] == sb[0], f"matmul: size mismatch {sa} @ {sb}")
        return ()
    a = (1,) + tuple(sa) if len(sa) == 1 else tuple(sa)
    b = tuple(sb) + (1,) if len(sb) == 1 else tuple(sb)
    _check(a[-1] == b[-2], lambda: f"matmul: shapes {tuple(sa)} and {tuple(sb)} cannot be multiplied ({a[-1]} != {b[-2]})")
    batch_a, batch_b = a[:-2], b[:-2]
    n = max(len(batch_a), len(batch_b))
    batch_a = (1,) * (n - len(batch_a)) + batch_a
    batch_b = (1,) * (n - len(batch_b)) + batch_b
    batch = []
    for x, y in zip(batch_a, batch_b):
        _check(x == y or x == 1 or y == 1, f"matmul: batch dims {batch_a} and {batch_b} do not broadcast")
        batch.append(max(x, y) if min(x, y) != 0 else 0)
    out = tuple(batch) + (a[-2], b[-1])
    if len(sa) == 1:
        out = out[:-2] + out[-1:]
    if len(sb) == 1:
        out = out[:-1]
    return out


@_prim
def matmul(a, b):
    """``torch.matmul`` semantics (batched, 1-D promotion); equal dtypes."""
    _check(a._tt_dtype is b._tt_dtype, lambda: f"matmul: dtypes differ: {a._tt_dtype} and {b._tt_dtype}")
    return TensorProxy(shape=_matmul_shape(a._tt_shape, b._tt_shape), dtype=a._tt_dtype, device=_common_device([a, b], "matmul"))


@_prim
def convolution(a, weight, bias, stride, padding, dilation, groups):
    """N-d convolution (torch.nn.functional.conv{1,2,3}d semantics, no transposed)."""
    nd = len(a._tt_shape) - 2
    _check(len(weight._tt_shape) == nd + 2, "convolution: weight rank must match input rank")
    n, c = a._tt_shape[0], a._tt_shape[1]
    _check(c == weight._tt_shape[1] * groups, lambda: f"convolution: input has {c} channels, weight expects {weight._tt_shape[1] * groups}")
    spatial = []
    for i in range(nd):
        size = a._tt_shape[2 + i] + 2 * padding[i] - dilation[i] * (weight._tt_shape[2 + i] - 1) - 1
        spatial.append(size // stride[i] + 1)
    return TensorProxy(shape=(n, weight._tt_shape[0], *spatial), dtype=a._tt_dtype, device=a._tt_device)


# ---------------------------------------------------------------------------
# Factories
# ---------------------------------------------------------------------------
def _factory_shape(shape):
    shape = tuple(shape)
    for s in shape:
        _check(isinstance(s, (int, NumberProxy)) and _number_value(s) >= 0, lambda: f"invalid size {s} in {shape}")
    return tuple(_size(s) for s in shape)


def _size(s):
    """A size argument: symbolic sizes (dynamic=True) stay symbolic, other runtime numbers are specialised."""
    return s if type(s) is SizeProxy else _number_value(s)


@_prim
def full(shape, fill_value, *, device, dtype):
    """A tensor of ``shape`` filled with ``fill_value``."""
    return TensorProxy(shape=_factory_shape(shape), dtype=dtype, device=device)


@_prim
def empty(shape, *, device, dtype):
    """Uninitialised tensor; differs from ``full`` only at execution."""
    return TensorProxy(shape=_factory_shape(shape), dtype=dtype, device=device)


@_prim
def iota(length, *, start, step, device, dtype):
    """``start, start + step, ...`` (``length`` values)."""
    return TensorProxy(shape=(_size(length),), dtype=dtype, device=device)


@_prim(tags=("random",))
def uniform(shape, minval, maxval, *, device, dtype):
    """Uniform random values in [minval, maxval)."""
    return TensorProxy(shape=_factory_shape(shape), dtype=dtype, device=device)


@_prim(tags=("random",))
def randn(shape, *, device, dtype):
    """Standard normal random values."""
    return TensorProxy(shape=_factory_shape(shape), dtype=dtype, device=device)


@_prim(tags=("random",))
def bernoulli(a, p):
    """1 with probability ``p`` else 0, in ``a``'s shape and dtype."""
    return TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device)


# ---------------------------------------------------------------------------
# Memory and metadata
# ---------------------------------------------------------------------------
@_prim(tags=("side_effect",))
def copy_(src, dst):
    """Write ``src`` into the buffer ``dst``; returns ``dst`` (the only mutating prim)."""
    _check(src._tt_shape == dst._tt_shape, lambda: f"copy_: shapes differ: {src._tt_shape} vs {dst._tt_shape}")
    return TensorProxy(shape=dst._tt_shape, dtype=dst._tt_dtype, device=dst._tt_device)


@_prim
def shape(a):
    """The sizes of ``a`` as runtime numbers (symbolic-shape mode)."""
    return tuple(NumberProxy(value=s, python_type=int) for s in a._tt_shape)


@_prim
def item(a):
    """The Python number in a one-element tensor (``Tensor.item()``): a runtime number of the program.

    Its example value is unknown while tracing (NaN / 0), so Python code may do
    arithmetic with it (recorded as scalar prims) but not branch on it.
    """
    _check(a.numel_() == 1, lambda: f"a Tensor with {a.numel_()} elements cannot be converted to Scalar")
    dt = a._tt_dtype
    if dt.is_float:
        return NumberProxy(value=float("nan"), python_type=float)
    if dt.is_bool:
        return NumberProxy(value=False, python_type=bool)
    return NumberProxy(value=0, python_type=int)


@_prim(tags=("side_effect",))
def check_finite(a, message):
    """Raise ``RuntimeError(message)`` when ``a`` holds a NaN or an infinity (a check on values, at run time)."""
    _check(type(a) is TensorProxy and isinstance(message, str), "check_finite: expected a tensor and a message")
    return None


# ---------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------
@_prim(tags=("side_effect",))
def all_reduce_mean(tensors):
    """The mean of each tensor over the ranks of the default process group (DDP's gradient average).

    A side effect for DCE: every rank must run the same collectives, used or not.
    """
    _check(isinstance(tensors, (list, tuple)) and all(type(t) is TensorProxy and t._tt_dtype.is_float for t in tensors),
           "all_reduce_mean: expected a list of floating-point tensors")
    return [TensorProxy(shape=t._tt_shape, dtype=t._tt_dtype, device=t._tt_device) for t in tensors]


def all_prims() -> dict:
    return dict(_all)


# ---------------------------------------------------------------------------
# Special functions with an order argument
# ---------------------------------------------------------------------------
@_prim(tags=("elementwise",))
def polygamma(n, a):
    """The ``n``-th derivative of digamma (``torch.polygamma(n, a)``); ``n`` is a non-negative Python int.

    Gradient rules use it (digamma's derivative is ``polygamma(1, a)``).
    """
    _check(isinstance(n, int) and not isinstance(n, bool) and n >= 0, lambda: f"polygamma: n must be a non-negative int, got {n!r}")
    _check(type(a) is TensorProxy and a._tt_dtype.is_float, "polygamma: expected a floating-point tensor")
    return TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device)


# Printed traces call prims as ``prims.<name>``; arithmetic on runtime numbers records scalar prims.
codegen.register_namespace("prims", sys.modules[__name__])
proxies._prims = sys.modules[__name__]
