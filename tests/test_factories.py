"""Factories inside a compiled function: every argument honoured (eager's result) or refused with an error.

Values, dtypes, shapes, strides (memory_format), layout, requires_grad, ``out=`` identity and ``torch.Size``
are compared with eager; factories go torch language -> clang -> prims.
"""
from __future__ import annotations

import pytest
import torch

import thunder_train as tt
from thunder_train.compiler.errors import TracingError

X = torch.arange(120.0).reshape(2, 3, 4, 5).permute(0, 2, 3, 1)  # channels-last strides

CASES = {
    "empty": lambda x: torch.empty(2, 3).fill_(1),
    "zeros_dtype": lambda x: torch.zeros(2, 3, dtype=torch.float64),
    "zeros_tuple_device": lambda x: torch.zeros((2, 3), device="cpu"),
    "ones_bool": lambda x: torch.ones(3, dtype=torch.bool),
    "ones_int": lambda x: torch.ones(3, dtype=torch.int32) + 1,
    "full_int": lambda x: torch.full((2,), 3),
    "full_bool": lambda x: torch.full((2,), True),
    "full_float_dtype": lambda x: torch.full((2, 2), 1.5, dtype=torch.float64),
    "zeros_like": lambda x: torch.zeros_like(x),
    "ones_like_dtype": lambda x: torch.ones_like(x, dtype=torch.int64),
    "full_like": lambda x: torch.full_like(x, 7.0),
    "empty_like_preserve": lambda x: torch.empty_like(x, memory_format=torch.preserve_format).fill_(2),
    "zeros_like_channels_last": lambda x: torch.zeros_like(x.contiguous(), memory_format=torch.channels_last),
    "empty_channels_last": lambda x: torch.empty(2, 3, 4, 5, memory_format=torch.channels_last).fill_(0),
    "new_zeros": lambda x: x.new_zeros(2, 3),
    "new_ones_dtype": lambda x: x.new_ones((2,), dtype=torch.int64),
    "new_full": lambda x: x.new_full((2,), 4.0),
    "new_tensor": lambda x: x.new_tensor([1, 2, 3]),
    "arange_int": lambda x: torch.arange(5),
    "arange_float": lambda x: torch.arange(0, 1, 0.25),
    "arange_dtype": lambda x: torch.arange(5, dtype=torch.float64),
    "linspace": lambda x: torch.linspace(0, 1, 5),
    "linspace_one": lambda x: torch.linspace(2, 3, 1),
    "tensor_nested": lambda x: torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
    "tensor_int": lambda x: torch.tensor(3),
    "as_tensor": lambda x: torch.as_tensor([1, 2], dtype=torch.float32),
    "scalar_tensor": lambda x: torch.scalar_tensor(2.5),
    "eye": lambda x: torch.eye(3),
    "zeros_out": lambda x: torch.zeros(3, out=torch.empty(3)),
    "shape_is_size": lambda x: (x.shape, x.size(), x.new_zeros(x.shape).shape, x[0].shape),
}


def _same(a, e, what="output"):
    assert type(a) is type(e), what
    if isinstance(e, (tuple, list)):
        for i, (x, y) in enumerate(zip(a, e, strict=True)):
            _same(x, y, f"{what}[{i}]")
        return
    if isinstance(e, torch.Tensor):
        for attr in ("dtype", "shape", "device", "layout", "requires_grad"):
            assert getattr(a, attr) == getattr(e, attr), f"{what}.{attr}"
        assert a.stride() == e.stride(), f"{what} strides {a.stride()}, eager {e.stride()}"
        torch.testing.assert_close(a, e)
    else:
        assert a == e, what


@pytest.mark.parametrize("name", list(CASES))
def test_factory_matches_eager(name):
    fn = CASES[name]
    cf = tt.compile(fn)
    for _ in range(2):
        _same(cf(X), fn(X))


def test_out_is_the_destination_object():
    def step(x, buf):
        r = torch.zeros(3, out=buf)
        return r is buf, r

    buf_e, buf_c = torch.full((3,), 5.0), torch.full((3,), 5.0)
    same_e, r_e = step(X, buf_e)
    cf = tt.compile(lambda x, b: torch.zeros(3, out=b))
    r_c = cf(X, buf_c)
    assert same_e and r_c is buf_c
    torch.testing.assert_close(buf_c, buf_e)


def test_default_dtype_changed_inside_is_what_the_factory_uses():
    def step(x):
        torch.set_default_dtype(torch.float64)
        try:
            return torch.ones(2), torch.full((2,), 1.5), torch.linspace(0, 1, 3)
        finally:
            torch.set_default_dtype(torch.float32)

    cf = tt.compile(step)
    for _ in range(2):
        _same(cf(X), step(X))


@pytest.mark.parametrize("make", [
    lambda: torch.zeros(3, requires_grad=True),
    lambda: torch.ones(2, 2, requires_grad=True),
    lambda: torch.full((2,), 1.0, requires_grad=True),
    lambda: torch.tensor([1.0, 2.0], requires_grad=True),
    lambda: torch.randn(3, requires_grad=True),
    lambda: X.new_zeros(3, requires_grad=True),
    lambda: torch.zeros_like(X, requires_grad=True),
], ids=["zeros", "ones", "full", "tensor", "randn", "new_zeros", "zeros_like"])
def test_a_new_leaf_returned_through_is_refused_clearly(make):
    """Eager's ``make() + 1`` requires grad through a leaf only the function sees: the compiled program cannot
    return that, and says so."""
    with pytest.raises(TracingError, match="requires grad through a tensor made inside it.*requires_grad=True"):
        tt.compile(lambda x: make() + 1)(torch.ones(3))


@pytest.mark.parametrize("make", [
    lambda: torch.zeros(3, requires_grad=True),
    lambda: torch.full((3,), 2.0, requires_grad=True),
    lambda: torch.randn(3, requires_grad=True),
    lambda: X.new_ones(3, requires_grad=True),
    lambda: torch.zeros_like(X, requires_grad=True),
], ids=["zeros", "full", "randn", "new_ones", "zeros_like"])
def test_a_new_leaf_gets_its_grad_from_a_backward_inside(make):
    """``delta = torch.zeros_like(x, requires_grad=True)`` then a backward inside the function (adversarial
    perturbations): the new leaf's ``.grad`` is eager's, and so are the random draws."""
    def fn(x):
        t = make()
        ((t * x).sin().sum() + (t * t).sum()).backward()
        return t.grad * 1, t.detach() + 0

    torch.manual_seed(0)
    want = fn(X)
    torch.manual_seed(0)
    got = tt.compile(fn)(X)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
        assert not a.requires_grad


def test_opaque_factories_keep_requires_grad():
    fn = lambda x: (torch.eye(2, requires_grad=True), torch.logspace(0, 1, 3, requires_grad=True))  # noqa: E731
    _same(tt.compile(fn)(X), fn(X))


def test_factories_go_through_clang():
    cf = tt.compile(lambda x: torch.zeros(2) + torch.empty(2).fill_(1) + torch.linspace(0, 1, 2))
    cf(X)
    trace = tt.last_traces(cf)[0]
    from thunder_train.compiler.torchlang import factories

    for sym in (factories.zeros, factories.empty, factories.linspace):
        bsym = next(b for b in trace.bound_symbols if b.sym is sym)
        assert bsym.subsymbols and all(s.sym.module == "prims" for s in bsym.subsymbols)
