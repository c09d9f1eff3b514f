"""Views made by ops the compiler runs opaquely (diagonal, unfold, as_strided, ...) alias their base as in eager:
updates through them reach the base, reads after the base changed see the change (acquisition/opaque_views.py)."""
from __future__ import annotations

import pytest
import torch

import thunder_train as tt
from thunder_train.compiler.errors import TracingError

CASES = {
    "diagonal_zero_": lambda x: x.diagonal().zero_(),
    "diagonal_offset_of_t": lambda x: x.t().diagonal(1).fill_(5),
    "unfold_mul_": lambda x: x.unfold(0, 2, 2).mul_(3),
    "as_strided_zero_": lambda x: x.as_strided((2,), (4,)).zero_(),
    "read_after_base_update": lambda x: (lambda d: (x.add_(1), d * 1)[1])(x.diagonal()),
    "intermediate_base": lambda x: (lambda y: (y.diagonal().zero_(), y)[1])(x * 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_like_eager(name):
    fn = CASES[name]
    xe, xc = torch.arange(16.0).reshape(4, 4), torch.arange(16.0).reshape(4, 4)
    e, a = fn(xe), tt.compile(fn)(xc)
    torch.testing.assert_close(a, e)
    torch.testing.assert_close(xc, xe)


def test_as_strided_of_a_non_row_major_tensor_updated_in_place_is_refused():
    x = torch.arange(16.0).reshape(4, 4)
    with pytest.raises(TracingError, match="not row-major"):
        tt.compile(lambda x: x.t().as_strided((2,), (4,)).zero_())(x)
    assert torch.equal(x, torch.arange(16.0).reshape(4, 4))
