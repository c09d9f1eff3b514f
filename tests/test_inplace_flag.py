"""``inplace=True`` of the ``torch.nn.functional`` activations and dropout: eager writes the result into the input.

The trace recorded the out-of-place op only, so a call whose result the code dropped (``F.relu(b, inplace=True)`` on
its own line, ``nn.ReLU(inplace=True)`` whose input is read again) left ``b`` unchanged: losses and gradients differed
from eager's, silently.  Now the result is the input's new value, functionalized like ``b.relu_()``.
"""
import pytest
import torch
import torch.nn.functional as F

import thunder_train as tt

ACTIVATIONS = {
    "relu": lambda b: F.relu(b, inplace=True),
    "relu positional": lambda b: F.relu(b, True),
    "nn.ReLU": torch.nn.ReLU(inplace=True),
    "silu": lambda b: F.silu(b, inplace=True),
    "hardtanh positional": lambda b: F.hardtanh(b, -0.5, 0.5, True),
    "leaky_relu": lambda b: F.leaky_relu(b, 0.2, inplace=True),
    "elu": lambda b: F.elu(b, inplace=True),
    "hardswish": lambda b: F.hardswish(b, inplace=True),
    "celu": lambda b: F.celu(b, inplace=True),
    "dropout, eval": lambda b: F.dropout(b, 0.5, False, True),
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_inplace_activation_writes_its_input(name):
    act = ACTIVATIONS[name]

    def f(x, w):
        b = torch.matmul(x, w)
        r = act(b)  # b is now the activation's result
        return b.sum() * 2 + (r * r).sum(), b

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    w = torch.randn(16, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    mine = w.detach().clone().requires_grad_()
    cf = tt.compile(f)
    for _ in range(2):
        (got, gb), (want, wb) = cf(x, mine), f(x, w)
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(gb, wb)
        torch.testing.assert_close(mine.grad, w.grad, rtol=1e-5, atol=1e-5)


def test_inplace_activation_result_dropped_in_a_thin_step():
    def f(x, w):
        b = torch.matmul(x, w)
        F.relu(b, inplace=True)
        return (b * 3).sum()

    x, w = torch.randn(8, 16), torch.randn(16, 16)
    assert torch.equal(tt.compile(f, thin=True)(x, w), f(x, w))


def test_inplace_activation_of_a_leaf_that_requires_grad_raises_as_eager():
    w = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        F.relu(w, inplace=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        tt.compile(lambda w: F.relu(w, inplace=True).sum())(w)


@pytest.mark.parametrize("kw", [{}, {"thin": True}, {"fusion": None}], ids=["full", "thin", "torch"])
def test_random_ops_torch_computes_write_their_input(kw):
    """rrelu and alpha dropout in training are computed by torch (no torch-language rule for their draws); with
    ``inplace=True`` their values still become the input's, with eager's draws and generator state."""
    def f(x):
        b = x * 2
        F.rrelu(b, training=True, inplace=True)
        F.alpha_dropout(b, 0.5, training=True, inplace=True)
        return b.sum(), b

    x = torch.randn(64)
    torch.manual_seed(0)
    expected, rng = f(x), torch.get_rng_state()
    torch.manual_seed(0)
    got = tt.compile(f, **kw)(x)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[0], expected[0])
    assert torch.equal(torch.get_rng_state(), rng)
