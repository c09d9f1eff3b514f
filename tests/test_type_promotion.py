"""Type promotion and broadcasting: compiled results have eager's dtypes, shapes and values."""
from __future__ import annotations

import pytest
import torch

import thunder_train as tt

f32, f64, bf16, i64, b8 = torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool


def ints(*shape):
    return torch.arange(1, 1 + torch.Size(shape).numel(), dtype=i64).reshape(shape) - 2


def bools(*shape):
    return torch.arange(torch.Size(shape).numel()).reshape(shape) % 3 == 0


def floats(*shape, dtype=f32):
    return torch.linspace(-2, 3, torch.Size(shape).numel(), dtype=dtype).reshape(shape)


# name → (fn, inputs, expected dtype, expected shape)
CASES = {
    "int_tensor_plus_float_scalar": (lambda a: a + 1.5, (ints(2, 3),), f32, (2, 3)),
    "float_scalar_times_int_tensor": (lambda a: 2.5 * a, (ints(2, 3),), f32, (2, 3)),
    "int_tensor_plus_int_scalar": (lambda a: a + 3, (ints(2, 3),), i64, (2, 3)),
    "int_tensor_plus_bool_scalar": (lambda a: a + True, (ints(2, 3),), i64, (2, 3)),
    "bool_plus_int_tensor": (lambda a, b: a + b, (bools(2, 3), ints(2, 3)), i64, (2, 3)),
    "bool_plus_int_scalar": (lambda a: a + 1, (bools(2, 3),), i64, (2, 3)),
    "bool_plus_bool": (lambda a, b: a + b, (bools(2, 3), bools(2, 3)), b8, (2, 3)),
    "bool_times_float_scalar": (lambda a: a * 0.5, (bools(2, 3),), f32, (2, 3)),
    "float32_plus_float64": (lambda a, b: a + b, (floats(2, 3), floats(2, 3, dtype=f64)), f64, (2, 3)),
    "bfloat16_plus_float32": (lambda a, b: a * b, (floats(2, 3, dtype=bf16), floats(2, 3)), f32, (2, 3)),
    "bfloat16_plus_float_scalar": (lambda a: a + 0.1, (floats(2, 3, dtype=bf16),), bf16, (2, 3)),
    "zero_dim_float64_plus_float32": (lambda a, b: a + b, (torch.tensor(0.25, dtype=f64), floats(2, 3)), f32, (2, 3)),
    "float32_plus_zero_dim_float64": (lambda a, b: a - b, (floats(2, 3), torch.tensor(0.25, dtype=f64)), f32, (2, 3)),
    "zero_dim_float32_plus_int_tensor": (lambda a, b: a + b, (torch.tensor(0.5), ints(2, 3)), f32, (2, 3)),
    "zero_dim_int_plus_bfloat16": (lambda a, b: a + b, (torch.tensor(3), floats(2, 3, dtype=bf16)), bf16, (2, 3)),
    "zero_dim_tensors": (lambda a, b: a * b, (torch.tensor(2), torch.tensor(0.5, dtype=f64)), f64, ()),
    "int_div_int_is_true_division": (lambda a, b: a / b, (ints(2, 3), torch.full((2, 3), 4)), f32, (2, 3)),
    "int_div_int_scalar": (lambda a: a / 4, (ints(2, 3),), f32, (2, 3)),
    "int_floordiv_int": (lambda a, b: a // b, (ints(2, 3), torch.full((2, 3), -4)), i64, (2, 3)),
    "int_pow_float_scalar": (lambda a: a.abs() ** 0.5, (ints(2, 3),), f32, (2, 3)),
    "int_scalar_pow_int_tensor": (lambda a: 2 ** a.abs(), (ints(2, 3),), i64, (2, 3)),
    "float_scalar_pow_int_tensor": (lambda a: 2.0 ** a, (ints(2, 3),), f32, (2, 3)),
    "sqrt_of_int": (lambda a: torch.sqrt(a.abs()), (ints(2, 3),), f32, (2, 3)),
    "sum_of_bool": (lambda a: a.sum(), (bools(2, 3),), i64, ()),
    "cumsum_of_int": (lambda a: a.cumsum(0), (bools(2, 3),), i64, (2, 3)),
    "lt_float32_float64": (lambda a, b: a < b, (floats(2, 3), floats(2, 3, dtype=f64).flip(1)), b8, (2, 3)),
    "eq_int_float_scalar": (lambda a: a == 1.0, (ints(2, 3),), b8, (2, 3)),
    "ge_bool_int": (lambda a, b: a >= b, (bools(2, 3), ints(2, 3)), b8, (2, 3)),
    "ne_bfloat16_scalar": (lambda a: torch.ne(a, 0.5), (floats(2, 3, dtype=bf16),), b8, (2, 3)),
    "where_int_float": (lambda c, a, b: torch.where(c, a, b), (bools(2, 3), ints(2, 3), floats(2, 3)), f32, (2, 3)),
    "where_float64_scalar": (lambda c, a: torch.where(c, a, 1), (bools(2, 3), floats(2, 3, dtype=f64)), f64, (2, 3)),
    "cat_int_float": (lambda a, b: torch.cat([a, b]), (ints(2, 3), floats(1, 3)), f32, (3, 3)),
    "broadcast_3x1_plus_1x4": (lambda a, b: a + b, (floats(3, 1), floats(1, 4)), f32, (3, 4)),
    "broadcast_rank_extension": (lambda a, b: a * b, (floats(4), floats(2, 3, 4)), f32, (2, 3, 4)),
    "broadcast_zero_dim": (lambda a, b: a - b, (torch.tensor(1.5), floats(2, 3)), f32, (2, 3)),
    "broadcast_and_promote": (lambda a, b: a + b, (ints(3, 1), floats(1, 4, dtype=f64)), f64, (3, 4)),
    "broadcast_compare": (lambda a, b: a < b, (ints(3, 1), floats(4)), b8, (3, 4)),
    "reshape_size0_minus1": (lambda x: x.reshape(x.size(0), -1), (floats(2, 3, 4),), f32, (2, 12)),
    "view_size0_minus1": (lambda x: x.view(x.size(0), -1) * 2, (ints(3, 2, 2),), i64, (3, 4)),
    "reshape_shape_tuple": (lambda x: x.reshape(x.shape[0], x.shape[1] * x.shape[2]), (bools(2, 3, 4),), b8, (2, 12)),
}


@pytest.mark.parametrize("decompose", [False, True], ids=["whole", "decomposed"])
@pytest.mark.parametrize("name", list(CASES))
def test_promotion(name, decompose):
    fn, inputs, dtype, shape = CASES[name]
    expected = fn(*inputs)
    assert expected.dtype == dtype and tuple(expected.shape) == shape, "the case's stated eager result is wrong"
    cf = tt.compile(fn, decompose=decompose)
    actual = cf(*inputs)
    assert actual.dtype == dtype
    assert tuple(actual.shape) == shape
    torch.testing.assert_close(actual, expected, rtol=1e-6 if dtype is not bf16 else 1e-2, atol=1e-6)
    assert tt.compile_stats(cf).opaque_ops == []


@pytest.mark.parametrize("decompose", [False, True], ids=["whole", "decomposed"])
def test_mean_of_int_raises(decompose):
    with pytest.raises(Exception, match="mean"):
        torch.mean(ints(2, 3))
    with pytest.raises(ValueError, match="mean"):
        tt.compile(lambda a: a.mean(), decompose=decompose)(ints(2, 3))


@pytest.mark.parametrize("decompose", [False, True], ids=["whole", "decomposed"])
def test_shapes_that_do_not_broadcast_raise(decompose):
    with pytest.raises(ValueError, match="broadcast"):
        tt.compile(lambda a, b: a + b, decompose=decompose)(floats(2, 3), floats(3, 2))


@pytest.mark.parametrize("decompose", [False, True], ids=["whole", "decomposed"])
def test_reshape_invalid_raises(decompose):
    with pytest.raises(ValueError, match="invalid for input of size 24"):
        tt.compile(lambda x: x.reshape(x.size(0), 5, -1), decompose=decompose)(floats(2, 3, 4))


@pytest.mark.parametrize("decompose", [False, True], ids=["whole", "decomposed"])
def test_matmul_does_not_promote(decompose):
    """Eager matmul rejects mixed dtypes; the compiled op must not silently promote."""
    a, b = floats(2, 3), floats(3, 4, dtype=f64)
    with pytest.raises(RuntimeError, match="same dtype"):
        a @ b
    with pytest.raises(RuntimeError, match="same dtype"):
        tt.compile(lambda x, y: x @ y, decompose=decompose)(a, b)
