"""The op table: torch-level ops with sample inputs, compared against eager by test_ops.py.

Each ``OpInfo`` names one op (or one distinct way of calling it), a callable
wrapper ``fn(*args, **kwargs)``, a sample generator ``samples(dtype)`` that
returns ``Sample``s, the dtypes the op supports in eager torch, and optional
tolerance overrides.  ``random=True`` ops compare only shape, dtype and device.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch.testing import make_tensor

f32, f64, bf16, i64, b8 = torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool
FLOATS = (f32, f64, bf16)
NUMERIC = FLOATS + (i64,)
ALL = NUMERIC + (b8,)
INTS = (i64, b8)


@dataclasses.dataclass
class Sample:
    args: tuple
    kwargs: dict


def S(*args, **kwargs) -> Sample:
    return Sample(args, kwargs)


@dataclasses.dataclass
class OpInfo:
    name: str
    fn: Callable
    samples: Callable  # dtype -> list[Sample]
    dtypes: tuple = FLOATS
    tol: dict = dataclasses.field(default_factory=dict)  # dtype -> (rtol, atol)
    random: bool = False  # compare shape/dtype/device only


OPS: list[OpInfo] = []


def op(name, fn, samples, dtypes=FLOATS, tol=None, random=False):
    OPS.append(OpInfo(name, fn, samples, dtypes, tol or {}, random))


# ---------------------------------------------------------------------------
# Input helpers
# ---------------------------------------------------------------------------
def T(*shape, dtype=f32, low=None, high=None, nonzero=False):
    """A random tensor; bounds are ignored for bool and rounded inwards for ints."""
    if dtype is b8:
        return make_tensor(shape, dtype=dtype, device="cpu")
    if not dtype.is_floating_point and low is not None and high is not None:
        low, high = math.ceil(low), max(math.floor(high), math.ceil(low) + 1)
    return make_tensor(shape, dtype=dtype, device="cpu", low=low, high=high, exclude_zero=nonzero)


def idx(*shape, high):
    return torch.randint(0, high, shape, dtype=torch.int64)


def unary_samples(low=None, high=None, nonzero=False):
    def gen(dt):
        return [S(T(2, 3, dtype=dt, low=low, high=high, nonzero=nonzero)), S(T(dtype=dt, low=low, high=high, nonzero=nonzero))]

    return gen


def binary_samples(low=None, high=None, nonzero_rhs=False, scalar=None):
    """Same shape, broadcasting (3,1)x(1,4), and a Python scalar on the right."""

    def gen(dt):
        out = [
            S(T(2, 3, dtype=dt, low=low, high=high), T(2, 3, dtype=dt, low=low, high=high, nonzero=nonzero_rhs)),
            S(T(3, 1, dtype=dt, low=low, high=high), T(1, 4, dtype=dt, low=low, high=high, nonzero=nonzero_rhs)),
        ]
        if scalar is not None:
            out.append(S(T(2, 3, dtype=dt, low=low, high=high), scalar))
        return out

    return gen


# ---------------------------------------------------------------------------
# Unary elementwise
# ---------------------------------------------------------------------------
_POS = dict(low=0.1, high=5.0)
_UNIT = dict(low=-0.9, high=0.9)
_UNARY = [
    ("abs", NUMERIC, {}),
    ("neg", NUMERIC, {}),
    ("exp", ALL, {}),
    ("exp2", ALL, {}),
    ("expm1", ALL, {}),
    ("log", NUMERIC, _POS),
    ("log1p", NUMERIC, _POS),
    ("log2", NUMERIC, _POS),
    ("log10", NUMERIC, _POS),
    ("sqrt", NUMERIC, _POS),
    ("rsqrt", NUMERIC, _POS),
    ("sin", ALL, {}),
    ("cos", ALL, {}),
    ("tan", ALL, {"low": -1.0, "high": 1.0}),
    ("asin", ALL, _UNIT),
    ("acos", ALL, _UNIT),
    ("atan", ALL, {}),
    ("sinh", ALL, {}),
    ("cosh", ALL, {}),
    ("tanh", ALL, {}),
    ("asinh", ALL, {}),
    ("acosh", NUMERIC, {"low": 1.1, "high": 5.0}),
    ("atanh", ALL, _UNIT),
    ("erf", ALL, {}),
    ("erfc", ALL, {}),
    ("erfinv", ALL, _UNIT),
    ("lgamma", NUMERIC, _POS),
    ("digamma", NUMERIC, _POS),
    ("sigmoid", ALL, {}),
    ("reciprocal", NUMERIC, _POS),
    ("floor", NUMERIC, {}),
    ("ceil", NUMERIC, {}),
    ("trunc", NUMERIC, {}),
    ("round", NUMERIC, {}),
    ("sign", ALL, {}),
    ("sgn", ALL, {}),
    ("square", ALL, {}),
    ("isfinite", ALL, {}),
    ("isnan", ALL, {}),
    ("isinf", ALL, {}),
    ("signbit", NUMERIC, {}),
    ("logical_not", ALL, {}),
]
for _name, _dts, _kw in _UNARY:
    op(_name, getattr(torch, _name), unary_samples(**_kw), _dts)

op("bitwise_not", torch.bitwise_not, unary_samples(), INTS)
op("round_decimals", lambda x: torch.round(x, decimals=2), unary_samples(), FLOATS)
op("Tensor.exp_method", lambda x: x.exp(), unary_samples(), ALL)


def _nan_inf(dt):
    x = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), -2.5], dtype=dt)
    return [S(x), S(x, nan=1.0, posinf=100.0, neginf=-100.0)]


op("nan_to_num", torch.nan_to_num, _nan_inf, FLOATS)
op("isnan_special", torch.isnan, lambda dt: _nan_inf(dt)[:1], FLOATS)
op("isinf_special", torch.isinf, lambda dt: _nan_inf(dt)[:1], FLOATS)

# ---------------------------------------------------------------------------
# Binary elementwise
# ---------------------------------------------------------------------------
op("add", torch.add, binary_samples(scalar=2), ALL)
op("add_alpha", lambda a, b: torch.add(a, b, alpha=2), binary_samples(), NUMERIC)
op("sub", torch.sub, binary_samples(scalar=3), NUMERIC)
op("sub_alpha", lambda a, b: torch.sub(a, b, alpha=2), binary_samples(), NUMERIC)
op("mul", torch.mul, binary_samples(scalar=3), ALL)
op("div", torch.div, binary_samples(nonzero_rhs=True, scalar=3), ALL)
op("div_trunc", lambda a, b: torch.div(a, b, rounding_mode="trunc"), binary_samples(nonzero_rhs=True, scalar=3), NUMERIC)
op("div_floor", lambda a, b: torch.div(a, b, rounding_mode="floor"), binary_samples(nonzero_rhs=True, scalar=3), NUMERIC)
op("floor_divide", torch.floor_divide, binary_samples(nonzero_rhs=True, scalar=3), NUMERIC)
op("remainder", torch.remainder, binary_samples(nonzero_rhs=True, scalar=3), NUMERIC)
op("fmod", torch.fmod, binary_samples(nonzero_rhs=True, scalar=3), NUMERIC)
op("maximum", torch.maximum, binary_samples(), ALL)
op("minimum", torch.minimum, binary_samples(), ALL)
op("fmax", torch.fmax, binary_samples(), NUMERIC)
op("fmin", torch.fmin, binary_samples(), NUMERIC)
op("atan2", torch.atan2, binary_samples(), NUMERIC)
op("copysign", torch.copysign, binary_samples(scalar=-1.0), NUMERIC)
op("hypot", torch.hypot, binary_samples(), FLOATS)
op("nextafter", torch.nextafter, binary_samples(), (f32, f64))
op("pow", torch.pow, binary_samples(low=0.5, high=3.0, scalar=3), NUMERIC)
op("pow_square", lambda a: torch.pow(a, 2), unary_samples(), NUMERIC)
op("pow_float_exponent", lambda a: torch.pow(a, 0.5), unary_samples(**_POS), NUMERIC)
op("bitwise_and", torch.bitwise_and, binary_samples(scalar=True), INTS)
op("bitwise_or", torch.bitwise_or, binary_samples(scalar=True), INTS)
op("bitwise_xor", torch.bitwise_xor, binary_samples(scalar=True), INTS)
op("bitwise_left_shift", torch.bitwise_left_shift, binary_samples(low=0, high=5, scalar=2), (i64,))
op("bitwise_right_shift", torch.bitwise_right_shift, binary_samples(low=0, high=5, scalar=1), (i64,))
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    op(_name, getattr(torch, _name), binary_samples(low=-2, high=2, scalar=0), ALL)
for _name in ("logical_and", "logical_or", "logical_xor"):
    op(_name, getattr(torch, _name), binary_samples(), ALL)
op("xlogy", torch.xlogy, binary_samples(low=0.0, high=3.0), FLOATS)

# ---------------------------------------------------------------------------
# Ternary and friends: where, clamp, lerp, addcmul, addcdiv
# ---------------------------------------------------------------------------


def _where(dt):
    return [
        S(T(2, 3, dtype=b8), T(2, 3, dtype=dt), T(2, 3, dtype=dt)),
        S(T(3, 1, dtype=b8), T(1, 4, dtype=dt), T(3, 4, dtype=dt)),
    ]


op("where", torch.where, _where, ALL)
op("where_scalar", lambda c, a: torch.where(c, a, 0), lambda dt: [S(T(2, 3, dtype=b8), T(2, 3, dtype=dt))], ALL)
op("where_scalars", lambda c: torch.where(c, 1.0, 0.0), lambda dt: [S(T(2, 3, dtype=b8))], (b8,))
op("clamp", lambda x: torch.clamp(x, -1, 1), unary_samples(), NUMERIC)
op("clamp_min_only", lambda x: torch.clamp(x, min=0), unary_samples(), NUMERIC)
op("clamp_float_bounds_int", lambda x: torch.clamp(x, -1.5, 2.5), unary_samples(), NUMERIC)
op("clamp_tensor", torch.clamp, lambda dt: [S(T(2, 3, dtype=dt), T(2, 3, dtype=dt), T(2, 3, dtype=dt))], NUMERIC)
op("clamp_min", lambda x: torch.clamp_min(x, 0.5), unary_samples(), FLOATS)
op("clamp_max", lambda x: torch.clamp_max(x, 0.5), unary_samples(), FLOATS)
op("lerp", torch.lerp, lambda dt: [S(T(2, 3, dtype=dt), T(2, 3, dtype=dt), 0.3), S(T(2, 3, dtype=dt), T(2, 3, dtype=dt), T(2, 3, dtype=dt))], FLOATS)
op("addcmul", lambda a, b, c: torch.addcmul(a, b, c, value=0.5), lambda dt: [S(T(2, 3, dtype=dt), T(2, 3, dtype=dt), T(1, 3, dtype=dt))], FLOATS)
op("addcmul_int", torch.addcmul, lambda dt: [S(T(2, 3, dtype=dt), T(2, 3, dtype=dt), T(2, 3, dtype=dt))], (i64,))
op("addcdiv", lambda a, b, c: torch.addcdiv(a, b, c, value=2), lambda dt: [S(T(2, 3, dtype=dt), T(2, 3, dtype=dt), T(2, 3, dtype=dt, low=0.5, high=2))], FLOATS)

# ---------------------------------------------------------------------------
# Reductions and scans
# ---------------------------------------------------------------------------


def red_samples(dt):
    return [S(T(3, 4, dtype=dt)), S(T(2, 3, 4, dtype=dt))]


op("sum", torch.sum, red_samples, ALL)
op("sum_dim", lambda x: torch.sum(x, 1), red_samples, ALL)
op("sum_dims_keepdim", lambda x: x.sum((0, -1), keepdim=True), red_samples, ALL)
op("sum_dtype", lambda x: x.sum(dtype=torch.float64), red_samples, ALL)
op("mean", torch.mean, red_samples, FLOATS)
op("mean_dim_keepdim", lambda x: x.mean(-1, keepdim=True), red_samples, FLOATS)
op("mean_int_dtype", lambda x: x.mean(dtype=torch.float32), red_samples, (i64,))
op("prod", torch.prod, lambda dt: [S(T(3, 4, dtype=dt, low=0.5, high=1.5))], ALL)
op("prod_dim", lambda x: torch.prod(x, 1, keepdim=True), lambda dt: [S(T(3, 4, dtype=dt, low=0.5, high=1.5))], ALL)
op("amax", lambda x: torch.amax(x, 1), red_samples, ALL)
op("amin", lambda x: torch.amin(x, (0, 1)), red_samples, ALL)
op("max", torch.max, red_samples, ALL)
op("max_dim", lambda x: torch.max(x, 1), red_samples, NUMERIC)
op("max_dim_keepdim", lambda x: tuple(x.max(dim=-1, keepdim=True)), red_samples, NUMERIC)
op("max_dim_values_indices", lambda x: (x.max(1).values, x.max(1).indices), red_samples, NUMERIC)
op("min_dim", lambda x: tuple(torch.min(x, 0)), red_samples, NUMERIC)
op("max_binary", torch.max, binary_samples(), NUMERIC)
op("argmax", torch.argmax, red_samples, NUMERIC)
op("argmax_dim", lambda x: torch.argmax(x, 1, keepdim=True), red_samples, NUMERIC)
op("argmin_dim", lambda x: torch.argmin(x, -1), red_samples, NUMERIC)
op("var", torch.var, red_samples, FLOATS)
op("var_dim_correction", lambda x: torch.var(x, 1, correction=0, keepdim=True), red_samples, FLOATS)
op("std", lambda x: torch.std(x, -1), red_samples, FLOATS)
op("std_unbiased_false", lambda x: x.std(unbiased=False), red_samples, FLOATS)
op("var_mean", lambda x: torch.var_mean(x, 1), red_samples, FLOATS)
op("std_mean", lambda x: torch.std_mean(x, (0, 1)), red_samples, FLOATS)
op("logsumexp", lambda x: torch.logsumexp(x, 1), red_samples, FLOATS)
op("logsumexp_int", lambda x: torch.logsumexp(x, 1, keepdim=True), red_samples, (i64,))
op("cumsum", lambda x: torch.cumsum(x, 1), red_samples, ALL)
op("cumsum_dtype", lambda x: torch.cumsum(x, 0, dtype=torch.float64), red_samples, NUMERIC)
op("topk", lambda x: torch.topk(x, 2), red_samples, NUMERIC)
op("topk_values", lambda x: x.topk(3).values * 2, red_samples, NUMERIC)
op("topk_smallest_dim0", lambda x: tuple(torch.topk(x, 2, dim=0, largest=False)), red_samples, NUMERIC)
op("sort", lambda x: torch.sort(x, stable=True), red_samples, NUMERIC)
op("sort_indices", lambda x: x.sort(dim=-1, stable=True).indices, red_samples, NUMERIC)
op("sort_descending", lambda x: tuple(torch.sort(x, dim=0, descending=True, stable=True)), red_samples, NUMERIC)
op("all", torch.all, red_samples, ALL)
op("all_dim", lambda x: torch.all(x, 1), red_samples, ALL)
op("any", torch.any, red_samples, ALL)
op("any_dim_keepdim", lambda x: x.any(-1, keepdim=True), red_samples, ALL)
op("count_nonzero", lambda x: torch.count_nonzero(x, 1), red_samples, ALL)
op("norm", torch.norm, red_samples, FLOATS)
op("norm_p1_dim", lambda x: torch.linalg.vector_norm(x, 1, dim=1), red_samples, FLOATS)
op("norm_inf_keepdim", lambda x: x.norm(float("inf"), dim=-1, keepdim=True), red_samples, FLOATS)
op("norm_p3", lambda x: torch.linalg.vector_norm(x, 3, dim=0), red_samples, FLOATS)

# ---------------------------------------------------------------------------
# Shape ops
# ---------------------------------------------------------------------------


def x234(dt):
    return [S(T(2, 3, 4, dtype=dt))]


op("reshape", lambda x: x.reshape(4, 6), x234, ALL)
op("reshape_minus1", lambda x: torch.reshape(x, (-1, 4)), x234, ALL)
op("reshape_size0_minus1", lambda x: x.reshape(x.size(0), -1), x234, ALL)
op("view", lambda x: x.view(6, 4), x234, ALL)
op("view_as", lambda x, y: x.view_as(y), lambda dt: [S(T(2, 3, 4, dtype=dt), T(6, 4, dtype=dt))], ALL)
op("reshape_as", lambda x, y: x.reshape_as(y), lambda dt: [S(T(2, 3, 4, dtype=dt), T(24, dtype=dt))], ALL)
op("flatten", torch.flatten, x234, ALL)
op("flatten_range", lambda x: x.flatten(1), x234, ALL)
op("unflatten", lambda x: x.unflatten(-1, (2, -1)), x234, ALL)
op("squeeze", torch.squeeze, lambda dt: [S(T(2, 1, 3, 1, dtype=dt))], ALL)
op("squeeze_dim", lambda x: x.squeeze(1), lambda dt: [S(T(2, 1, 3, 1, dtype=dt))], ALL)
op("unsqueeze", lambda x: torch.unsqueeze(x, -1), x234, ALL)
op("permute", lambda x: x.permute(2, 0, 1), x234, ALL)
op("permute_tuple", lambda x: torch.permute(x, (1, 2, 0)), x234, ALL)
op("transpose", lambda x: x.transpose(0, -1), x234, ALL)
op("t", lambda x: x.t(), lambda dt: [S(T(3, 4, dtype=dt))], ALL)
op("T_property", lambda x: x.T, lambda dt: [S(T(3, 4, dtype=dt))], ALL)
op("mT_property", lambda x: x.mT, x234, ALL)
op("movedim", lambda x: torch.movedim(x, 0, -1), x234, ALL)
op("movedim_multi", lambda x: x.movedim((0, 1), (2, 0)), x234, ALL)
op("expand", lambda x: x.expand(2, 3, 4), lambda dt: [S(T(3, 1, dtype=dt))], ALL)
op("expand_minus1", lambda x: x.expand(5, -1, 4), lambda dt: [S(T(3, 1, dtype=dt))], ALL)
op("expand_as", lambda x, y: x.expand_as(y), lambda dt: [S(T(1, 4, dtype=dt), T(3, 4, dtype=dt))], ALL)
op("broadcast_to", lambda x: torch.broadcast_to(x, (2, 3, 4)), lambda dt: [S(T(4, dtype=dt))], ALL)
op("broadcast_tensors", torch.broadcast_tensors, lambda dt: [S(T(3, 1, dtype=dt), T(1, 4, dtype=dt))], ALL)
op("cat", lambda a, b: torch.cat([a, b], 1), lambda dt: [S(T(2, 3, dtype=dt), T(2, 2, dtype=dt))], ALL)
op("cat_mixed_dtype", lambda a, b: torch.cat([a, b]), lambda dt: [S(T(2, 3, dtype=dt), T(1, 3, dtype=f64))], ALL)
op("stack", lambda a, b: torch.stack((a, b), -1), lambda dt: [S(T(2, 3, dtype=dt), T(2, 3, dtype=dt))], ALL)
op("hstack", lambda a, b: torch.hstack([a, b]), lambda dt: [S(T(2, 3, dtype=dt), T(2, 3, dtype=dt))], ALL)
op("vstack", lambda a, b: torch.vstack([a, b]), lambda dt: [S(T(3, dtype=dt), T(3, dtype=dt))], ALL)
op("split", lambda x: torch.split(x, 2, -1), x234, ALL)
op("split_sizes", lambda x: x.split([1, 3], dim=2), x234, ALL)
op("chunk", lambda x: x.chunk(3, 2), x234, ALL)
op("tensor_split", lambda x: torch.tensor_split(x, 3, dim=1), x234, ALL)
op("unbind", lambda x: x.unbind(1), x234, ALL)
op("narrow", lambda x: x.narrow(2, 1, 2), x234, ALL)
op("narrow_negative", lambda x: torch.narrow(x, -1, -3, 2), x234, ALL)
op("select", lambda x: x.select(1, -1), x234, ALL)
op("flip", lambda x: torch.flip(x, (0, 2)), x234, ALL)
op("roll", lambda x: torch.roll(x, (1, -1), (1, 2)), x234, ALL)
op("roll_flat", lambda x: x.roll(5), x234, ALL)
op("repeat", lambda x: x.repeat(2, 1, 3), lambda dt: [S(T(2, 3, dtype=dt))], ALL)
op("tile", lambda x: torch.tile(x, (2,)), lambda dt: [S(T(2, 3, dtype=dt))], ALL)
op("tril", lambda x: torch.tril(x), lambda dt: [S(T(4, 5, dtype=dt))], ALL)
op("triu_diag", lambda x: x.triu(1), lambda dt: [S(T(2, 4, 5, dtype=dt))], ALL)
op("masked_fill", lambda x, m: x.masked_fill(m, 0), lambda dt: [S(T(3, 4, dtype=dt), T(3, 4, dtype=b8)), S(T(3, 4, dtype=dt), T(1, 4, dtype=b8))], ALL)
op("masked_fill_float", lambda x, m: x.masked_fill(m, -float("inf")), lambda dt: [S(T(3, 4, dtype=dt), T(4, dtype=b8))], FLOATS)
# out of place, input and mask broadcast together (Falcon's ALiBi bias (b, h, 1, k) filled with a (b, 1, q, k) mask)
op("masked_fill_broadcast_input", lambda x, m: torch.masked_fill(x, m, -1.5), lambda dt: [S(T(2, 3, 1, 4, dtype=dt), T(2, 1, 5, 4, dtype=b8)), S(T(4, dtype=dt), T(3, 4, dtype=b8))], NUMERIC)
op("masked_fill_tensor_value", lambda x, m, v: x.masked_fill(m, v), lambda dt: [S(T(2, 1, 4, dtype=dt), T(3, 4, dtype=b8), T(dtype=dt))], ALL)
op("index_select", lambda x, i: torch.index_select(x, 1, i), lambda dt: [S(T(3, 4, dtype=dt), idx(5, high=4))], ALL)
op("gather", lambda x, i: torch.gather(x, 1, i), lambda dt: [S(T(3, 4, dtype=dt), idx(3, 2, high=4))], ALL)
op("scatter_add", lambda x, i, s: x.scatter_add(0, i, s), lambda dt: [S(T(3, 4, dtype=dt), idx(2, 4, high=3), T(2, 4, dtype=dt))], NUMERIC)
# scatter from a tensor (indices distinct per row: which of two writes to one position wins is the kernel's), from a
# number, and in place with a number (a router's mask of chosen groups: DeepSeek-V3's ``scatter_(1, group_idx, 1)``)
op("scatter", lambda x, i, s: x.scatter(1, i, s), lambda dt: [S(T(3, 4, dtype=dt), torch.tensor([[0, 2], [3, 1], [1, 0]]), T(3, 2, dtype=dt))], ALL)
op("scatter_value", lambda x, i: torch.scatter(x, 0, i, 2.5 if x.is_floating_point() else 2), lambda dt: [S(T(3, 4, dtype=dt), idx(2, 4, high=3))], NUMERIC)
op("scatter_inplace_mask", lambda x, i: torch.zeros_like(x).scatter_(1, i, 1) * x, lambda dt: [S(T(4, 5, dtype=dt), idx(4, 2, high=5))], NUMERIC)
op("index_add", lambda x, i, s: torch.index_add(x, 0, i, s), lambda dt: [S(T(3, 4, dtype=dt), torch.tensor([0, 2]), T(2, 4, dtype=dt))], NUMERIC)
op("take_along_dim", lambda x, i: torch.take_along_dim(x, i, 1), lambda dt: [S(T(3, 4, dtype=dt), idx(3, 2, high=4))], ALL)
op("take_along_dim_flat", lambda x, i: torch.take_along_dim(x, i), lambda dt: [S(T(3, 4, dtype=dt), idx(5, high=12))], ALL)
op("clone", torch.clone, x234, ALL)
op("contiguous", lambda x: x.transpose(0, 1).contiguous(), x234, ALL)
op("detach", lambda x: x.detach(), x234, ALL)

# ---------------------------------------------------------------------------
# Indexing t[...]
# ---------------------------------------------------------------------------
_GETITEM = {
    "int": lambda x: x[1],
    "negative_int": lambda x: x[-1, -2],
    "slice_step": lambda x: x[:, ::2, 1:],
    "slice_negative": lambda x: x[-1:, :-1],
    "none": lambda x: x[None, :, None],
    "ellipsis": lambda x: x[..., 1],
    "ellipsis_none": lambda x: x[..., None, 0:2],
    "int_tensor": lambda x: x[torch.tensor([0, -1, 1])],
    "int_tensor_dim1": lambda x: x[:, torch.tensor([[2, 0], [1, 1]])],
    # several tensor indices: they broadcast; adjacent ones keep their place, separated ones go first
    "two_tensors_adjacent": lambda x: x[:, torch.tensor([0, 2, -1]), torch.tensor([1, 3, 0])],
    "two_tensors_broadcast": lambda x: x[torch.tensor([[0], [1]]), torch.tensor([[0, 2, 1]])],
    "two_tensors_separated": lambda x: x[torch.tensor([1, 0]), :, torch.tensor([3, -4])],
    "three_tensors": lambda x: x[torch.tensor([1]), torch.tensor([[2], [0]]), torch.tensor([3, 1])],
    "int_then_tensors": lambda x: x[1, torch.tensor([0, 2]), torch.tensor([1, 3])],
    "none_ellipsis_tensors": lambda x: x[None, torch.tensor([0, 1]), ..., torch.tensor([1, 2])],
    "tensors_after_slice": lambda x: x[..., torch.tensor([0, 1]), torch.tensor([[3], [2]])],
    "two_lists": lambda x: x[[0, 1], [2, 0]],
}
for _name, _fn in _GETITEM.items():
    op(f"getitem_{_name}", _fn, x234, ALL)

# ---------------------------------------------------------------------------
# Python operators, including the reversed scalar forms
# ---------------------------------------------------------------------------
_OPERATORS = {
    "add": (lambda a, b: a + b, ALL),
    "sub": (lambda a, b: a - b, NUMERIC),
    "mul": (lambda a, b: a * b, ALL),
    "truediv": (lambda a, b: a / b, ALL),
    "floordiv": (lambda a, b: a // b, NUMERIC),
    "mod": (lambda a, b: a % b, NUMERIC),
    "and": (lambda a, b: a & b, INTS),
    "or": (lambda a, b: a | b, INTS),
    "xor": (lambda a, b: a ^ b, INTS),
    "lt": (lambda a, b: a < b, ALL),
    "eq": (lambda a, b: a == b, ALL),
    "ge": (lambda a, b: a >= b, ALL),
}
for _name, (_fn, _dts) in _OPERATORS.items():
    op(f"operator_{_name}", _fn, binary_samples(low=0.5, high=3.0, nonzero_rhs=True, scalar=2), _dts)

op("operator_pow", lambda a, b: a**b, binary_samples(low=0.5, high=2.0, scalar=3), NUMERIC)
op("operator_matmul", lambda a, b: a @ b, lambda dt: [S(T(2, 3, dtype=dt), T(3, 4, dtype=dt))], NUMERIC)
op("operator_neg", lambda a: -a, unary_samples(), NUMERIC)
op("operator_invert", lambda a: ~a, unary_samples(), INTS)
op("operator_abs", lambda a: abs(a), unary_samples(), NUMERIC)
_RSCALAR = {
    "radd": (lambda a: 1 + a, ALL),
    "rsub": (lambda a: 1 - a, NUMERIC),
    "rsub_float": (lambda a: 1.5 - a, NUMERIC),
    "rmul": (lambda a: 2.5 * a, ALL),
    "rtruediv": (lambda a: 1 / a, ALL),
    "rfloordiv": (lambda a: 7 // a, NUMERIC),
    "rmod": (lambda a: 7 % a, NUMERIC),
    "rpow": (lambda a: 2**a, NUMERIC),
    "rpow_float": (lambda a: 2.5**a, NUMERIC),
    "rand": (lambda a: True & a, INTS),
    "rgt": (lambda a: 1 > a, ALL),
}
for _name, (_fn, _dts) in _RSCALAR.items():
    op(f"operator_{_name}", _fn, unary_samples(low=0.5, high=3.0, nonzero=True), _dts)

# ---------------------------------------------------------------------------
# Factories (the tensor argument only supplies dtype/device/shape)
# ---------------------------------------------------------------------------


def like(dt):
    return [S(T(2, 3, dtype=dt))]


op("zeros", lambda x: torch.zeros(2, 3, dtype=x.dtype), like, ALL)
op("ones", lambda x: torch.ones((2, 3), dtype=x.dtype) + x, like, ALL)
op("zeros_default", lambda x: torch.zeros(x.shape) * 2, like, (f32,))
op("full", lambda x: torch.full((2, 3), 1.5) * x, like, FLOATS)
op("full_int", lambda x: torch.full((2, 3), 7, dtype=x.dtype), like, NUMERIC)
op("arange", lambda x: torch.arange(5), like, (f32,))
op("arange_start_step", lambda x: torch.arange(1, 10, 3, dtype=x.dtype), like, NUMERIC)
op("arange_float", lambda x: torch.arange(0.0, 1.0, 0.25, dtype=x.dtype), like, FLOATS)
op("linspace", lambda x: torch.linspace(-1, 2, 7, dtype=x.dtype), like, FLOATS)
op("zeros_like", torch.zeros_like, like, ALL)
op("ones_like", torch.ones_like, like, ALL)
op("full_like", lambda x: torch.full_like(x, 3), like, NUMERIC)
op("zeros_like_dtype", lambda x: torch.zeros_like(x, dtype=torch.float64), like, ALL)
op("new_zeros", lambda x: x.new_zeros(4, 2), like, ALL)
op("new_ones", lambda x: x.new_ones((4,)), like, ALL)
op("new_full", lambda x: x.new_full((2, 2), 5), like, NUMERIC)
op("tensor", lambda x: torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=x.dtype), like, NUMERIC)
op("tensor_scalar", lambda x: x * torch.tensor(2), like, NUMERIC)
op("tensor_int_list", lambda x: torch.tensor([1, 2, 3]), like, (f32,))
op("empty", lambda x: torch.empty(2, 3, dtype=x.dtype), like, ALL, random=True)
op("empty_like", torch.empty_like, like, ALL, random=True)
op("new_empty", lambda x: x.new_empty(3, 1), like, ALL, random=True)
op("randn", lambda x: torch.randn(3, 4, dtype=x.dtype), like, FLOATS, random=True)
op("rand", lambda x: torch.rand(3, 4, dtype=x.dtype), like, FLOATS, random=True)
op("randn_like", torch.randn_like, like, FLOATS, random=True)
op("rand_like", torch.rand_like, like, FLOATS, random=True)
op("dropout", lambda x: F.dropout(x, 0.3), like, FLOATS, random=True)

# ---------------------------------------------------------------------------
# Casts
# ---------------------------------------------------------------------------
op("cast_float", lambda x: x.float(), like, ALL)
op("cast_double", lambda x: x.double(), like, ALL)
op("cast_bfloat16", lambda x: x.bfloat16(), like, ALL)
op("cast_long", lambda x: x.long(), like, ALL)
op("cast_bool", lambda x: x.bool(), like, ALL)
op("cast_int", lambda x: x.int(), like, ALL)
op("to_dtype", lambda x: x.to(torch.float64), like, ALL)
op("to_dtype_kw", lambda x: x.to(dtype=torch.int64), like, ALL)
op("to_tensor", lambda x, y: x.to(y), lambda dt: [S(T(2, 3, dtype=dt), T(1, dtype=f32))], ALL)
op("type_as", lambda x, y: x.type_as(y), lambda dt: [S(T(2, 3, dtype=dt), T(1, dtype=f64))], ALL)


# ---------------------------------------------------------------------------
# Linear algebra
# ---------------------------------------------------------------------------
op("matmul", torch.matmul, lambda dt: [S(T(2, 3, dtype=dt), T(3, 4, dtype=dt)), S(T(3, dtype=dt), T(2, 3, 4, dtype=dt)), S(T(2, 2, 3, dtype=dt), T(3, dtype=dt))], NUMERIC)
op("matmul_batched_broadcast", torch.matmul, lambda dt: [S(T(2, 1, 3, 4, dtype=dt), T(5, 4, 2, dtype=dt))], NUMERIC)
op("mm", torch.mm, lambda dt: [S(T(2, 3, dtype=dt), T(3, 4, dtype=dt))], NUMERIC)
op("bmm", torch.bmm, lambda dt: [S(T(2, 2, 3, dtype=dt), T(2, 3, 4, dtype=dt))], NUMERIC)
op("addmm", lambda a, b, c: torch.addmm(a, b, c, beta=0.5, alpha=2), lambda dt: [S(T(2, 4, dtype=dt), T(2, 3, dtype=dt), T(3, 4, dtype=dt)), S(T(4, dtype=dt), T(2, 3, dtype=dt), T(3, 4, dtype=dt))], FLOATS)
op("outer", torch.outer, lambda dt: [S(T(3, dtype=dt), T(4, dtype=dt))], NUMERIC)
op("dot", torch.dot, lambda dt: [S(T(5, dtype=dt), T(5, dtype=dt))], NUMERIC)
op("einsum_matmul", lambda a, b: torch.einsum("ij,jk->ik", a, b), lambda dt: [S(T(2, 3, dtype=dt), T(3, 4, dtype=dt))], FLOATS)
op("einsum_batched", lambda a, b: torch.einsum("bhqd,bhkd->bhqk", a, b), lambda dt: [S(T(2, 2, 3, 4, dtype=dt), T(2, 2, 5, 4, dtype=dt))], FLOATS)
op("einsum_transpose_sum", lambda a: torch.einsum("ijk->ki", a), x234, FLOATS)
op("einsum_outer_list", lambda a, b: torch.einsum("i,j->ij", [a, b]), lambda dt: [S(T(3, dtype=dt), T(4, dtype=dt))], FLOATS)

# ---------------------------------------------------------------------------
# nn.functional: activations
# ---------------------------------------------------------------------------
_ACTS = {
    "relu": F.relu,
    "relu6": F.relu6,
    "hardtanh": F.hardtanh,
    "leaky_relu": lambda x: F.leaky_relu(x, 0.2),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "mish": F.mish,
    "softplus": lambda x: F.softplus(x, beta=2.0, threshold=5.0),
    "elu": F.elu,
    "logsigmoid": F.logsigmoid,
    "hardsigmoid": F.hardsigmoid,
    "hardswish": F.hardswish,
    "softsign": F.softsign,
    "glu": F.glu,
    "tanh_functional": F.tanh,
    "sigmoid_functional": F.sigmoid,
}
for _name, _fn in _ACTS.items():
    op(_name, _fn, lambda dt: [S(T(2, 4, dtype=dt, low=-4, high=4))], FLOATS)
op("relu_int", F.relu, lambda dt: [S(T(2, 4, dtype=dt))], (i64,))
op("softmax", lambda x: F.softmax(x, -1), red_samples, FLOATS)
op("softmax_dim0_dtype", lambda x: torch.softmax(x, 0, dtype=torch.float64), red_samples, FLOATS)
op("log_softmax", lambda x: F.log_softmax(x, 1), red_samples, FLOATS)
op("log_softmax_method", lambda x: x.log_softmax(-1), red_samples, FLOATS)

# ---------------------------------------------------------------------------
# nn.functional: linear, embedding, dropout
# ---------------------------------------------------------------------------
op("linear", F.linear, lambda dt: [S(T(2, 3, dtype=dt), T(4, 3, dtype=dt), T(4, dtype=dt)), S(T(2, 5, 3, dtype=dt), T(4, 3, dtype=dt))], FLOATS)
op("embedding", F.embedding, lambda dt: [S(idx(2, 3, high=5), T(5, 4, dtype=dt))], ALL)
op("embedding_padding_idx", lambda i, w: F.embedding(i, w, padding_idx=0), lambda dt: [S(idx(4, high=5), T(5, 4, dtype=dt))], FLOATS)
# the flags that change only the gradient (6 indices below 5: some repeat)
op("embedding_scale_grad_by_freq", lambda i, w: F.embedding(i, w, scale_grad_by_freq=True), lambda dt: [S(idx(2, 3, high=5), T(5, 4, dtype=dt))], FLOATS)
op("embedding_padding_scale_grad", lambda i, w: F.embedding(i, w, padding_idx=-2, scale_grad_by_freq=True), lambda dt: [S(idx(2, 3, high=5), T(5, 4, dtype=dt))], FLOATS)
op("dropout_p0", lambda x: F.dropout(x, 0.0), like, FLOATS)
op("dropout_eval", lambda x: F.dropout(x, 0.5, training=False), like, FLOATS)

# ---------------------------------------------------------------------------
# nn.functional: losses
# ---------------------------------------------------------------------------


def _logits_target(dt, ignore=False):
    t = idx(4, high=5)
    if ignore:
        t[1] = -100
    return T(4, 5, dtype=dt), t


_LOSS = {"rtol": 1e-4, "atol": 1e-5}
op("cross_entropy", F.cross_entropy, lambda dt: [S(*_logits_target(dt)), S(T(5, dtype=dt), torch.tensor(2))], FLOATS, _LOSS)
op("cross_entropy_ignore_index", F.cross_entropy, lambda dt: [S(*_logits_target(dt, ignore=True))], FLOATS, _LOSS)
op("cross_entropy_ignore_index_custom", lambda x, t: F.cross_entropy(x, t, ignore_index=3), lambda dt: [S(T(4, 5, dtype=dt), torch.tensor([3, 1, 3, 0]))], FLOATS, _LOSS)
for _red in ("none", "sum", "mean"):
    op(f"cross_entropy_{_red}", lambda x, t, _red=_red: F.cross_entropy(x, t, reduction=_red), lambda dt: [S(*_logits_target(dt, ignore=True))], FLOATS, _LOSS)
    op(f"cross_entropy_smoothing_{_red}", lambda x, t, _red=_red: F.cross_entropy(x, t, reduction=_red, label_smoothing=0.1), lambda dt: [S(*_logits_target(dt, ignore=True))], FLOATS, _LOSS)
op("cross_entropy_weight", lambda x, t, w: F.cross_entropy(x, t, weight=w), lambda dt: [S(*_logits_target(dt, ignore=True), T(5, dtype=dt, low=0.1, high=2))], FLOATS, _LOSS)
op("cross_entropy_weight_smoothing", lambda x, t, w: F.cross_entropy(x, t, weight=w, label_smoothing=0.2), lambda dt: [S(*_logits_target(dt, ignore=True), T(5, dtype=dt, low=0.1, high=2))], FLOATS, _LOSS)
op("cross_entropy_probs", F.cross_entropy, lambda dt: [S(T(4, 5, dtype=dt), torch.softmax(T(4, 5, dtype=f32), -1).to(dt))], FLOATS, _LOSS)
op("cross_entropy_probs_smoothing_sum", lambda x, p: F.cross_entropy(x, p, reduction="sum", label_smoothing=0.1), lambda dt: [S(T(4, 5, dtype=dt), torch.softmax(T(4, 5, dtype=f32), -1).to(dt))], FLOATS, _LOSS)
op("cross_entropy_spatial", F.cross_entropy, lambda dt: [S(T(2, 3, 4, dtype=dt), idx(2, 4, high=3))], FLOATS, _LOSS)
op("nll_loss", F.nll_loss, lambda dt: [S(torch.log_softmax(T(4, 5, dtype=dt), -1), idx(4, high=5))], FLOATS, _LOSS)
op("nll_loss_weight_none", lambda x, t, w: F.nll_loss(x, t, weight=w, reduction="none"), lambda dt: [S(T(4, 5, dtype=dt), idx(4, high=5), T(5, dtype=dt))], FLOATS, _LOSS)
op("mse_loss", F.mse_loss, lambda dt: [S(T(2, 3, dtype=dt), T(2, 3, dtype=dt))], FLOATS, _LOSS)
op("mse_loss_sum", lambda a, b: F.mse_loss(a, b, reduction="sum"), lambda dt: [S(T(2, 3, dtype=dt), T(2, 3, dtype=dt))], FLOATS, _LOSS)
op("l1_loss", F.l1_loss, lambda dt: [S(T(2, 3, dtype=dt), T(2, 3, dtype=dt))], FLOATS, _LOSS)
op("smooth_l1_loss", lambda a, b: F.smooth_l1_loss(a, b, beta=0.5), lambda dt: [S(T(2, 3, dtype=dt), T(2, 3, dtype=dt))], FLOATS, _LOSS)
op("bce_with_logits", F.binary_cross_entropy_with_logits, lambda dt: [S(T(2, 3, dtype=dt), T(2, 3, dtype=dt, low=0, high=1))], FLOATS, _LOSS)
op("bce_with_logits_pos_weight", lambda a, b, w: F.binary_cross_entropy_with_logits(a, b, pos_weight=w, reduction="none"), lambda dt: [S(T(2, 3, dtype=dt), T(2, 3, dtype=dt, low=0, high=1), T(3, dtype=dt, low=0.5, high=2))], FLOATS, _LOSS)

# ---------------------------------------------------------------------------
# nn.functional: normalisation
# ---------------------------------------------------------------------------
_NORM = {"rtol": 1e-4, "atol": 1e-4}
op("layer_norm", lambda x, w, b: F.layer_norm(x, (4,), w, b), lambda dt: [S(T(2, 3, 4, dtype=dt), T(4, dtype=dt), T(4, dtype=dt))], FLOATS, _NORM)
op("layer_norm_no_affine", lambda x: F.layer_norm(x, (3, 4)), x234, FLOATS, _NORM)
op("rms_norm", lambda x, w: F.rms_norm(x, (4,), w, eps=1e-6), lambda dt: [S(T(2, 3, 4, dtype=dt), T(4, dtype=dt))], FLOATS, _NORM)
op("rms_norm_default_eps", lambda x: F.rms_norm(x, (4,)), x234, FLOATS, _NORM)


def _bn(dt):
    return [S(T(4, 3, 5, dtype=dt), T(3, dtype=dt), T(3, dtype=dt, low=0.5, high=2), T(3, dtype=dt), T(3, dtype=dt))]


op("batch_norm_eval", lambda x, m, v, w, b: F.batch_norm(x, m, v, w, b, training=False), _bn, FLOATS, _NORM)
op("batch_norm_train", lambda x, m, v, w, b: F.batch_norm(x, m, v, w, b, training=True, momentum=0.2), _bn, FLOATS, _NORM)
op("batch_norm_train_2d", lambda x, m, v: F.batch_norm(x, m, v, training=True), lambda dt: [S(T(2, 3, 4, 4, dtype=dt), T(3, dtype=dt), T(3, dtype=dt, low=0.5, high=2))], FLOATS, _NORM)
op("normalize", F.normalize, red_samples, FLOATS, _NORM)
op("normalize_p1_dim", lambda x: F.normalize(x, p=1.0, dim=-1), red_samples, FLOATS, _NORM)
op("cosine_similarity", F.cosine_similarity, lambda dt: [S(T(3, 4, dtype=dt), T(3, 4, dtype=dt))], FLOATS, _NORM)

# ---------------------------------------------------------------------------
# nn.functional: attention, convolution, pooling, padding, one_hot
# ---------------------------------------------------------------------------


def _qkv(dt, L=3, S_=4):
    return T(2, 2, L, 8, dtype=dt), T(2, 2, S_, 8, dtype=dt), T(2, 2, S_, 8, dtype=dt)


op("sdpa", F.scaled_dot_product_attention, lambda dt: [S(*_qkv(dt))], FLOATS, _NORM)
op("sdpa_causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), lambda dt: [S(*_qkv(dt, 4, 4))], FLOATS, _NORM)
op("sdpa_bool_mask", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), lambda dt: [S(*_qkv(dt), torch.tensor([[True, False, True, True], [True, True, False, True], [False, True, True, True]]))], FLOATS, _NORM)
op("sdpa_float_mask", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), lambda dt: [S(*_qkv(dt), T(3, 4, dtype=dt))], FLOATS, _NORM)
op("sdpa_scale", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.3), lambda dt: [S(*_qkv(dt))], FLOATS, _NORM)
op("conv1d", F.conv1d, lambda dt: [S(T(2, 4, 9, dtype=dt), T(6, 4, 3, dtype=dt), T(6, dtype=dt))], FLOATS, _NORM)
op("conv1d_stride_padding_groups", lambda x, w: F.conv1d(x, w, stride=2, padding=1, groups=2), lambda dt: [S(T(2, 4, 9, dtype=dt), T(6, 2, 3, dtype=dt))], FLOATS, _NORM)
op("conv2d", F.conv2d, lambda dt: [S(T(2, 3, 6, 6, dtype=dt), T(4, 3, 3, 3, dtype=dt), T(4, dtype=dt))], FLOATS, _NORM)
op("conv2d_stride_padding", lambda x, w: F.conv2d(x, w, stride=(2, 1), padding=(1, 2), dilation=(1, 2)), lambda dt: [S(T(1, 3, 7, 7, dtype=dt), T(2, 3, 3, 3, dtype=dt))], FLOATS, _NORM)
op("conv2d_groups_same", lambda x, w: F.conv2d(x, w, padding="same", groups=4), lambda dt: [S(T(2, 4, 5, 5, dtype=dt), T(8, 1, 3, 3, dtype=dt))], FLOATS, _NORM)
op("max_pool2d", lambda x: F.max_pool2d(x, 2), lambda dt: [S(T(2, 3, 6, 6, dtype=dt))], FLOATS)
op("max_pool2d_stride_padding", lambda x: F.max_pool2d(x, 3, stride=2, padding=1), lambda dt: [S(T(1, 2, 7, 7, dtype=dt))], FLOATS)
op("avg_pool2d", lambda x: F.avg_pool2d(x, 2), lambda dt: [S(T(2, 3, 6, 6, dtype=dt))], FLOATS, _NORM)
op("avg_pool2d_padding_exclude", lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False), lambda dt: [S(T(1, 2, 7, 7, dtype=dt))], FLOATS, _NORM)
op("adaptive_avg_pool2d", lambda x: F.adaptive_avg_pool2d(x, (2, 3)), lambda dt: [S(T(2, 3, 4, 6, dtype=dt))], FLOATS, _NORM)
op("pad", lambda x: F.pad(x, (1, 2)), x234, ALL)
op("pad_value_2d", lambda x: F.pad(x, (1, 0, 0, 2), value=-1.0), x234, FLOATS)
op("pad_negative", lambda x: F.pad(x, (-1, 1, 1, -1)), x234, NUMERIC)
op("one_hot", lambda t: F.one_hot(t, 5), lambda dt: [S(idx(2, 3, high=5))], (i64,))


# ---------------------------------------------------------------------------
# Special values: NaN, +-inf, -0.0, exact halves (round half to even)
# ---------------------------------------------------------------------------
_SPECIAL = [0.0, -0.0, 0.5, 1.5, 2.5, -0.5, -2.5, float("nan"), float("inf"), -float("inf"), 1e-30, -3.7, 4.2]


def special(dt):
    return [S(torch.tensor(_SPECIAL, dtype=dt))]


def special_pair(dt):
    a = torch.tensor(_SPECIAL, dtype=dt)
    return [S(a, a.flip(0)), S(a, torch.full_like(a, float("nan")))]


_SPECIAL_UNARY = {
    "abs": torch.abs, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "sign": torch.sign, "signbit": torch.signbit,
    "floor": torch.floor, "ceil": torch.ceil, "round": torch.round, "trunc": torch.trunc, "sigmoid": torch.sigmoid,
    "tanh": torch.tanh, "reciprocal": torch.reciprocal, "square": torch.square, "isfinite": torch.isfinite,
    "relu": F.relu, "relu6": F.relu6, "hardtanh": F.hardtanh, "leaky_relu": F.leaky_relu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "softplus": F.softplus, "elu": F.elu,
    "logsigmoid": F.logsigmoid, "mish": F.mish, "hardswish": F.hardswish, "clamp": lambda x: torch.clamp(x, -1.0, 1.0),
    "clamp_min": lambda x: torch.clamp(x, min=0.0), "clamp_max": lambda x: torch.clamp(x, max=0.0),
    "nan_to_num": torch.nan_to_num, "pow_square": lambda x: x**2, "rpow": lambda x: 2**x, "logical_not": torch.logical_not,
}
for _name, _fn in _SPECIAL_UNARY.items():
    op(f"special_{_name}", _fn, special, FLOATS)


def special_finite_or_nan(dt):
    return [S(torch.tensor([v for v in _SPECIAL if not math.isinf(v)], dtype=dt))]


# Eager CPU gives gelu(+inf) = nan (an artifact of its vectorised kernel), so
# exact gelu is checked on NaN and finite specials only.
op("special_gelu_exact", F.gelu, special_finite_or_nan, FLOATS)

_SPECIAL_BINARY = {
    "maximum": torch.maximum, "minimum": torch.minimum, "fmax": torch.fmax, "fmin": torch.fmin,
    "max_binary": torch.max, "min_binary": torch.min, "div": torch.div, "floor_divide": torch.floor_divide,
    "remainder": torch.remainder, "fmod": torch.fmod, "atan2": torch.atan2, "copysign": torch.copysign,
    "pow": torch.pow, "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "xlogy": torch.xlogy, "hypot": torch.hypot,
    "clamp_tensor": lambda x, lo: torch.clamp(x, min=lo), "lerp": lambda a, b: torch.lerp(a, b, 0.5),
}
for _name, _fn in _SPECIAL_BINARY.items():
    op(f"special_{_name}", _fn, special_pair, FLOATS)


def special_rows(dt):
    ninf = -float("inf")
    return [S(torch.tensor([[1.0, ninf, 2.0], [ninf, ninf, ninf], [float("nan"), 0.0, 1.0]], dtype=dt))]


op("special_softmax", lambda x: torch.softmax(x, -1), special_rows, FLOATS)
op("special_log_softmax", lambda x: torch.log_softmax(x, -1), special_rows, FLOATS)
op("special_logsumexp", lambda x: torch.logsumexp(x, -1), special_rows, FLOATS)
op("special_amax", lambda x: torch.amax(x, -1), special_rows, FLOATS)
op("special_max_dim", lambda x: torch.max(x, -1), special_rows, FLOATS)
op("special_argmax", lambda x: torch.argmax(x, -1), special_rows, FLOATS)
op("special_sum", lambda x: torch.sum(x, -1), special_rows, FLOATS)
op("special_sort", lambda x: tuple(torch.sort(x, dim=-1, stable=True)), special_rows, FLOATS)
op("special_max_pool2d", lambda x: F.max_pool2d(x[None], 2, 1), special_rows, FLOATS)

# Kinks and bounds of piecewise ops (where a subgradient convention decides the gradient), with NaN and infinities.
_KINKS = [-6.0, -3.0, -1.0, -0.0, 0.0, 1.0, 3.0, 6.0, 20.0, 0.5, -0.5, float("nan"), float("inf"), -float("inf")]


def kinks(dt):
    return [S(torch.tensor(_KINKS, dtype=dt))]


def kink_pair(dt):
    a = torch.tensor(_KINKS, dtype=dt)
    return [S(a, torch.tensor([0.0] * 4 + [1.0] * 4 + [0.5, -0.5, 0.5, 1.0, 0.0, float("nan")], dtype=dt))]


_KINK_UNARY = {
    "hardtanh": F.hardtanh, "relu6": F.relu6, "hardsigmoid": F.hardsigmoid, "hardswish": F.hardswish, "relu": F.relu,
    "leaky_relu": lambda x: F.leaky_relu(x, 0.2), "elu": lambda x: F.elu(x, 0.7), "softplus": lambda x: F.softplus(x, 2.0, 6.0),
    "clamp": lambda x: torch.clamp(x, -1.0, 1.0), "clamp_min": lambda x: x.clamp(min=3.0), "clamp_max": lambda x: x.clamp(max=-3.0),
    "hardtanh_range": lambda x: F.hardtanh(x, -3.0, 6.0), "abs": torch.abs, "max_all": torch.max, "min_all": torch.min,
    "amin": lambda x: torch.amin(x, 0), "max_dim": lambda x: torch.max(x, 0), "min_dim": lambda x: torch.min(x, 0),
}
for _name, _fn in _KINK_UNARY.items():
    op(f"kink_{_name}", _fn, kinks, FLOATS)

_KINK_BINARY = {
    "maximum": torch.maximum, "minimum": torch.minimum, "fmax": torch.fmax, "fmin": torch.fmin,
    "clamp_tensor_min": lambda x, lo: torch.clamp(x, min=lo), "clamp_tensor_max": lambda x, hi: torch.clamp(x, max=hi),
    "clamp_tensors": lambda x, lo: torch.clamp(x, lo, lo + 1.0), "clamp_crossed": lambda x, lo: torch.clamp(x, lo + 1.0, lo),
    "l1_loss": lambda x, y: F.l1_loss(x, y, reduction="none"), "smooth_l1": lambda x, y: F.smooth_l1_loss(x, y, reduction="none", beta=0.5),
    "huber": lambda x, y: F.huber_loss(x, y, reduction="none", delta=0.5), "xlogy": torch.xlogy,
}
for _name, _fn in _KINK_BINARY.items():
    op(f"kink_{_name}", _fn, kink_pair, FLOATS)


def pool_ties(dt):
    ninf, nan = -float("inf"), float("nan")
    x = torch.tensor([[1.0, 1.0, 2.0, 2.0], [1.0, ninf, 2.0, nan], [ninf, ninf, nan, nan], [3.0, 3.0, 3.0, 0.0]], dtype=dt)
    return [S(x[None]), S(torch.full((1, 3, 3), ninf, dtype=dt))]


op("kink_max_pool2d_ties", lambda x: F.max_pool2d(x, 2, 1), pool_ties, FLOATS)
op("kink_max_pool2d_padded", lambda x: F.max_pool2d(x, 3, 2, padding=1), pool_ties, FLOATS)
op("kink_max_pool2d_stride", lambda x: F.max_pool2d(x, 2), pool_ties, FLOATS)



def bce_extremes(dt):
    x = torch.tensor([0.0, 1.0, 1e-20, 0.5, 0.3, 1.0], dtype=dt)
    return [S(x, torch.tensor([0.3, 0.6, 1.0, 0.2, 0.7, 1.0], dtype=dt))]


# Probabilities at 0 and 1: eager's backward kernel divides by max(x (1 - x), 1e-12), the clamped logs' gradient is NaN.
op("kink_binary_cross_entropy", lambda x, t: F.binary_cross_entropy(x, t), bce_extremes, FLOATS)
op("kink_binary_cross_entropy_sum", lambda x, t: F.binary_cross_entropy(x, t, reduction="sum"), bce_extremes, FLOATS)
op("kink_bce_with_logits", lambda x, t: F.binary_cross_entropy_with_logits(x, t * 0.0 + 0.3), special_pair, FLOATS)
op("kink_bce_with_logits_pos_weight", lambda x, t: F.binary_cross_entropy_with_logits(
    x, t.nan_to_num().sigmoid(), pos_weight=torch.linspace(0.5, 2.0, x.shape[-1], dtype=x.dtype)), special_pair, FLOATS)


def zeros_and_infs(dt):
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[0.0, 0.0, 2.0, inf], [0.0, 1.0, -inf, 2.0], [3.0, 0.0, nan, 1.0], [1.0, 2.0, 3.0, 4.0], [-inf, 2.0, inf, 0.5],
                      [nan, -inf, 2.0, 1.0]], dtype=dt)
    return [S(x), S(x[3:]), S(torch.zeros(2, 3, dtype=dt))]


# Products beside zeros and infinities (eager's exclusive products), norms of zeros, NaN and infinities.
op("kink_prod_dim", lambda x: torch.prod(x, -1), zeros_and_infs, FLOATS)
op("kink_prod_cols", lambda x: torch.prod(x, 0), zeros_and_infs, FLOATS)
op("kink_prod_all", lambda x: torch.prod(x), zeros_and_infs, FLOATS)
for _name, _ord in (("2", 2), ("1", 1), ("3", 3), ("half", 0.5), ("inf", float("inf")), ("neg_inf", -float("inf"))):
    op(f"kink_vector_norm_{_name}", lambda x, _o=_ord: torch.linalg.vector_norm(x, _o, dim=-1), zeros_and_infs, FLOATS)
op("kink_normalize", lambda x: F.normalize(x, dim=-1), zeros_and_infs, FLOATS)

# ---------------------------------------------------------------------------
# Ops added to the torch language while building this table
# ---------------------------------------------------------------------------
op("norm_p0", lambda x: torch.linalg.vector_norm(x, 0, dim=1), lambda dt: [S(T(3, 4, dtype=dt) * (T(3, 4, dtype=b8)).to(dt))], FLOATS)
op("aminmax", lambda x: torch.aminmax(x), red_samples, NUMERIC)
op("aminmax_dim", lambda x: tuple(x.aminmax(dim=1, keepdim=True)), red_samples, NUMERIC)
op("isclose", torch.isclose, special_pair, FLOATS)
op("isclose_equal_nan", lambda a, b: torch.isclose(a, b, rtol=0.1, atol=0.5, equal_nan=True), special_pair, FLOATS)
op("isclose_int", torch.isclose, binary_samples(low=-2, high=2), (i64, b8))
op("rsub_function", lambda x, y: torch.rsub(x, y, alpha=2), binary_samples(scalar=1.5), NUMERIC)
op("operator_rlshift", lambda a: 1 << a, unary_samples(low=0, high=5), (i64,))
op("operator_rrshift", lambda a: 64 >> a, unary_samples(low=0, high=5), (i64,))
op("scalar_tensor", lambda x: torch.scalar_tensor(2.5, dtype=x.dtype) * x, like, NUMERIC)
op("new_tensor", lambda x: x.new_tensor([[1, 2, 3]]) + x, like, NUMERIC)
op("baddbmm", lambda a, b, c: torch.baddbmm(a, b, c, beta=0.5, alpha=2), lambda dt: [S(T(2, 2, 4, dtype=dt), T(2, 2, 3, dtype=dt), T(2, 3, 4, dtype=dt))], FLOATS, _NORM)
op("diff", torch.diff, x234, ALL)
op("diff_n2_prepend", lambda x, p: torch.diff(x, n=2, dim=1, prepend=p), lambda dt: [S(T(2, 3, 4, dtype=dt), T(2, 1, 4, dtype=dt))], NUMERIC)
op("getitem_int_list", lambda x: x[[0, 1, 0]], x234, ALL)
op("getitem_slice_then_list", lambda x: x[:, [2, 0]], x234, ALL)
op("binary_cross_entropy", F.binary_cross_entropy, lambda dt: [S(T(2, 3, dtype=dt, low=0.05, high=0.95), T(2, 3, dtype=dt, low=0, high=1))], FLOATS, _LOSS)
op("binary_cross_entropy_saturated", lambda p, t, w: F.binary_cross_entropy(p, t, weight=w, reduction="none"), lambda dt: [S(torch.tensor([0.0, 1.0, 0.5], dtype=dt), torch.tensor([1.0, 0.0, 0.5], dtype=dt), T(3, dtype=dt))], FLOATS, _LOSS)
op("huber_loss", lambda a, b: F.huber_loss(a, b, delta=0.5), lambda dt: [S(T(2, 3, dtype=dt), T(2, 3, dtype=dt))], FLOATS, _LOSS)
op("kl_div_batchmean", lambda a, b: F.kl_div(a, b, reduction="batchmean"), lambda dt: [S(torch.log_softmax(T(3, 4, dtype=dt), -1), torch.softmax(T(3, 4, dtype=dt), -1) * T(3, 4, dtype=b8))], FLOATS, _LOSS)
op("kl_div_log_target", lambda a, b: F.kl_div(a, b, reduction="sum", log_target=True), lambda dt: [S(torch.log_softmax(T(3, 4, dtype=dt), -1), torch.log_softmax(T(3, 4, dtype=dt), -1))], FLOATS, _LOSS)
op("group_norm", lambda x, w, b: F.group_norm(x, 2, w, b), lambda dt: [S(T(2, 4, 3, 3, dtype=dt), T(4, dtype=dt), T(4, dtype=dt))], FLOATS, _NORM)
