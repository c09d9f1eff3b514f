"""Every op in the op table, compiled both ways, compared with eager torch.

``tt.compile(f)`` lets the torch executor claim torch-language symbols whole;
``tt.compile(f, decompose=True)`` runs each op through its prim
decomposition.  Both must match eager in values, dtypes and shapes, must
leave inputs mutated exactly as eager does (batch_norm running stats), and
must not run any op opaquely.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

import thunder_train as tt
from _models import leaves  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from op_table import OPS  # noqa: E402

# (rtol, atol) per dtype; decompositions may reassociate, so float32 is a little loose.
DEFAULT_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.bfloat16: (1.6e-2, 1e-2),
}
# bfloat16 rounds after every step; a decomposition may round in different places.
BF16_TOL = (2e-2, 2e-2)

CASES = [pytest.param(o, dt, id=f"{o.name}-{str(dt).removeprefix('torch.')}") for o in OPS for dt in o.dtypes]


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


_leaves = leaves


def _tol(op, dtype):
    if dtype in op.tol:
        return op.tol[dtype]
    if "rtol" in op.tol and dtype is not torch.bfloat16:
        return op.tol["rtol"], op.tol["atol"]
    if dtype is torch.bfloat16:
        return BF16_TOL
    return DEFAULT_TOL.get(dtype, (0, 0))


def _compare(op, dtype, actual, expected, what):
    a, e = _leaves(actual), _leaves(expected)
    assert len(a) == len(e), f"{what}: {len(a)} outputs, eager has {len(e)}"
    if isinstance(expected, tuple):  # named tuples (torch.return_types) keep their type
        assert type(actual) is type(expected), f"{what}: output type {type(actual)} vs {type(expected)}"
    for i, (x, y) in enumerate(zip(a, e)):
        if not isinstance(y, torch.Tensor):
            assert x == y, f"{what}[{i}]: {x!r} != {y!r}"
            continue
        assert isinstance(x, torch.Tensor), f"{what}[{i}]: expected a tensor, got {type(x)}"
        assert x.dtype == y.dtype, f"{what}[{i}]: dtype {x.dtype}, eager {y.dtype}"
        assert x.shape == y.shape, f"{what}[{i}]: shape {tuple(x.shape)}, eager {tuple(y.shape)}"
        assert x.device == y.device, f"{what}[{i}]: device {x.device}, eager {y.device}"
        if op.random:
            continue
        rtol, atol = _tol(op, y.dtype)
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}[{i}]: {m}")


@pytest.mark.parametrize("decompose", [False, True], ids=["whole", "decomposed"])
@pytest.mark.parametrize("op,dtype", CASES)
def test_op(op, dtype, decompose):
    torch.manual_seed(0)
    samples = op.samples(dtype)
    cf = tt.compile(op.fn, decompose=decompose)
    for n, s in enumerate(samples):
        eager_args, eager_kwargs = _clone(s.args), _clone(s.kwargs)
        expected = op.fn(*eager_args, **eager_kwargs)
        args, kwargs = _clone(s.args), _clone(s.kwargs)
        actual = cf(*args, **kwargs)
        _compare(op, dtype, actual, expected, f"sample {n} output")
        # Inputs must be mutated exactly as eager mutates them (e.g. running stats).
        _compare(op, dtype, args, eager_args, f"sample {n} inputs after the call")
    assert tt.compile_stats(cf).opaque_ops == [], f"ran opaquely: {tt.compile_stats(cf).opaque_ops}"


def test_table_size():
    assert len(OPS) >= 150
    assert len({o.name for o in OPS}) == len(OPS), "op names must be unique"


def test_dropout_statistics():
    """The compiled dropout keeps about 1 - p of the values and scales them by 1 / (1 - p)."""
    x = torch.ones(4000)
    for decompose in (False, True):
        out = tt.compile(lambda t: torch.nn.functional.dropout(t, 0.25), decompose=decompose)(x)
        kept = out != 0
        assert 0.70 < kept.float().mean().item() < 0.80
        torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / 0.75))


# Cases that cannot be compiled raise a clear error rather than computing something else.
UNSUPPORTED = {
    "boolean_mask_index": (lambda x: x[x > 0], NotImplementedError, "boolean-mask indexing"),
    # as eager: in place, the mask may not grow the input; the value must be 0-d
    "masked_fill__grows_input": (lambda x: (x * 1).masked_fill_(torch.ones(5, 1, 1, 1, dtype=torch.bool), 0.0), RuntimeError, "broadcast shape"),
    "masked_fill_vector_value": (lambda x: x.masked_fill(x > 0, torch.ones(4)), RuntimeError, "0-dimensional value"),
    "where_one_argument": (lambda x: torch.where(x > 0), NotImplementedError, "three-argument form"),
    "one_hot_without_num_classes": (lambda x: torch.nn.functional.one_hot(x.long().abs()), NotImplementedError, "num_classes"),
    # (branching on .item() of an input is specialised now: tests/test_decisions.py)
    "einsum_trace": (lambda x: torch.einsum("ii->i", x[0, :, :3]), NotImplementedError, "repeated indices"),
    "round_decimals_int": (lambda x: torch.round(x.long(), decimals=1), NotImplementedError, "floating point"),
    "addcdiv_int": (lambda x: torch.addcdiv(x.long(), x.long(), x.long() + 10), RuntimeError, "addcdiv"),
}


@pytest.mark.parametrize("decompose", [False, True], ids=["whole", "decomposed"])
@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_raises_clearly(name, decompose):
    fn, exc, match = UNSUPPORTED[name]
    with pytest.raises(exc, match=match):
        tt.compile(fn, decompose=decompose)(torch.randn(2, 3, 4))


def test_returning_named_tuple():
    x = torch.randn(3, 4)
    for decompose in (False, True):
        out = tt.compile(lambda t: torch.max(t, 1), decompose=decompose)(x)
        assert type(out) is torch.return_types.max
        torch.testing.assert_close(out.values, x.max(1).values)
        torch.testing.assert_close(out.indices, x.max(1).indices)
