"""In-place metadata methods (t_, squeeze_, resize_, as_strided_, ...) inside a compiled function, against eager:
the returned object, its shape, strides and values, and the input after the call (compiler/acquisition/metadata_inplace.py)."""
from __future__ import annotations

import pytest
import torch

import thunder_train as tt
from thunder_train.compiler.errors import TracingError

STEPS = {
    "t_input": lambda x: x.t_(),
    "transpose_then_use": lambda x: x.transpose_(0, 1) * 2,
    "squeeze_unsqueeze": lambda x: x.unsqueeze_(0).squeeze_(0).unsqueeze_(-1),
    "swapdims_": lambda x: x.swapdims_(0, 1).sum(0),
    "intermediate_t_then_add_": lambda x: (x + 1).t_().add_(1),
    "intermediate_shape_read": lambda x: torch.zeros((x * 2).t_().shape),
    "resize_shrink_intermediate": lambda x: (x * 3).resize_(2, 2),
    "resize_input": lambda x: x.resize_(5),
    "resize_as_": lambda x: x.resize_as_(torch.ones(3, 2)),
    "as_strided_input": lambda x: x.as_strided_((2, 2), (1, 3)),
}


@pytest.mark.parametrize("name", list(STEPS))
def test_like_eager(name):
    fn = STEPS[name]
    cf = tt.compile(fn)
    for _ in range(2):
        xe, xc = torch.arange(6.0).reshape(2, 3), torch.arange(6.0).reshape(2, 3)
        e, a = fn(xe), cf(xc)
        assert (e is xe) == (a is xc)
        assert a.shape == e.shape and a.stride() == e.stride() and a.dtype == e.dtype
        torch.testing.assert_close(a, e)
        assert xc.shape == xe.shape and xc.stride() == xe.stride()
        torch.testing.assert_close(xc, xe)


@pytest.mark.parametrize("fn,match", [
    (lambda x: x.t_().add_(1), "changed in place"),
    (lambda x: x.add_(1).t_(), "also updated in place"),
    (lambda x: (x.view(3, 2), x.t_())[1], "view"),
    (lambda x: x.resize_(10), "fewer elements"),
])
def test_what_cannot_be_expressed_is_refused(fn, match):
    x = torch.arange(6.0).reshape(2, 3)
    with pytest.raises(TracingError, match=match):
        tt.compile(fn)(x)
    assert x.shape == (2, 3) and torch.equal(x, torch.arange(6.0).reshape(2, 3))


def test_input_requiring_grad_is_refused():
    with pytest.raises(TracingError, match="requires grad"):
        tt.compile(lambda x: x.t_())(torch.ones(2, 3, requires_grad=True))


# addbmm_ writes through its out= kernel with out=self: a self that only broadcasts to the result is resized to
# it, with values that follow no broadcasting rule for a (5, 1) self (metadata_inplace.RESIZES_SELF).
@pytest.mark.parametrize("shape,where", [(s, w) for s in ((1,), (10,), (5, 1), (5, 10)) for w in ("input", "intermediate")]
                         + [((5, 1), "input_then_t_")])  # (t_ after a write that keeps the shape is refused above)
def test_addbmm_resizes_self_like_eager(shape, where):
    g = torch.Generator().manual_seed(0)
    b1, b2 = torch.randn(5, 5, 5, generator=g), torch.randn(5, 5, 10, generator=g)
    fn = {"input": lambda x: x.addbmm_(b1, b2),
          "intermediate": lambda x: (x * 2).addbmm_(b1, b2, beta=0.5),
          "input_then_t_": lambda x: x.addbmm_(b1, b2).t_()}[where]
    cf = tt.compile(fn)
    x = torch.randn(shape, generator=g)
    for _ in range(2):
        xe, xc = x.clone(), x.clone()
        e, a = fn(xe), cf(xc)
        assert (e is xe) == (a is xc)
        assert a.shape == e.shape and a.stride() == e.stride()
        torch.testing.assert_close(a, e)
        assert xc.shape == xe.shape and xc.stride() == xe.stride()
        torch.testing.assert_close(xc, xe)


def test_addbmm_resizing_gradients_like_eager():
    def step(x, b1, b2):
        y = x * 2
        y.addbmm_(b1, b2)
        return (y * torch.arange(50.0).reshape(5, 10)).sum()

    g = torch.Generator().manual_seed(0)
    x, b1, b2 = (torch.randn(s, generator=g, requires_grad=True) for s in ((5, 1), (5, 5, 5), (5, 5, 10)))
    expected = torch.autograd.grad(step(x, b1, b2), (x, b1, b2))
    actual = torch.autograd.grad(tt.compile(step)(x, b1, b2), (x, b1, b2))
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)
