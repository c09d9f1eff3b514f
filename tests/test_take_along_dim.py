"""``take_along_dim`` with indices outside ``[0, size)``: along a dim eager's CPU kernel takes each index modulo
the size (``-1`` is the last entry), in the forward and in the gradient; with ``dim=None`` (a gather of the
flattened input) an index out of range raises.  The compiled function gives eager's result or eager's error."""
from __future__ import annotations

import pytest
import torch

import thunder_train as tt


@pytest.mark.parametrize("decompose", [False, True], ids=["whole", "decomposed"])
@pytest.mark.parametrize("dim", [1, -1])
@pytest.mark.parametrize("idx", [[[0, -1], [1, 2]], [[-9, 5], [3, -4]]], ids=["minus_one", "beyond"])
def test_take_along_dim_wraps_like_eager_with_its_gradient(idx, dim, decompose):
    def f(x, i):
        return torch.take_along_dim(x, i, dim)

    x = torch.randn(2, 4, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    i = torch.tensor(idx)
    got, want = tt.compile(f, decompose=decompose)(x, i), f(x2, i)
    torch.testing.assert_close(got, want)
    got.pow(2).sum().backward()
    want.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_take_along_dim_without_dim_raises_like_eager():
    def f(x, i):
        return torch.take_along_dim(x, i)

    x, i = torch.randn(2, 4), torch.tensor([[-1]])
    with pytest.raises(RuntimeError, match="out of bounds"):
        f(x, i)
    with pytest.raises(RuntimeError, match="out of bounds"):
        tt.compile(f)(x, i)
