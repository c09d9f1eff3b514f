"""``t.grad_fn`` and ``t.is_leaf`` inside a compiled function answer as eager (issue 25, autograd9 item 2).

Code that branches on ``t.grad_fn is None`` takes eager's path: a computed value that requires grad has a grad_fn
(a stand-in: reading from it is a clear error), a detached value, one computed under ``no_grad`` and a parameter
have none, a non-leaf input has its own.  The full prologue guards an input's ``is_leaf`` when the function read it.
"""
import pytest
import torch
import torch.nn as nn

import thunder_train as tt

MODES = [dict(), dict(thin=True)]


def probe(m, record):
    def f(x, xi):
        h = m(x)
        with torch.no_grad():
            n = h * 2
        values = {"x": x, "xi": xi, "w": m.weight, "h": h, "n": n, "d": h.detach(), "row": h[0], "g": xi * 2}
        for k, t in values.items():
            record[k] = (t.requires_grad, t.is_leaf, t.grad_fn is None)
        # a branch on grad_fn, as library code writes it
        scale = 2.0 if h.grad_fn is not None else 3.0
        return (h * scale).sum() + (xi.grad_fn is None) * xi.sum()
    return f


@pytest.mark.parametrize("opts", MODES)
def test_grad_fn_and_is_leaf_inside_match_eager(opts):
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    xi = torch.randn(3, requires_grad=True) * 1  # a non-leaf input
    eager, traced = {}, {}
    expected = probe(m, eager)(x, xi)
    cf = tt.compile(probe(m, traced), **opts)
    for _ in range(2):
        got = cf(x, xi)
    assert traced == eager
    torch.testing.assert_close(got, expected)


def test_reading_the_stand_in_node_is_a_clear_error():
    m = nn.Linear(4, 3)

    def f(x):
        h = m(x)
        return h.sum() if h.grad_fn.name() else h

    with pytest.raises(tt.TracingError, match="records no PyTorch autograd node"):
        tt.compile(f)(torch.randn(2, 4))


def test_an_input_read_as_leaf_then_passed_as_non_leaf_retraces():
    """The trace specialised on ``xi.is_leaf``: a call with a non-leaf tensor there takes eager's other branch."""
    def f(xi):
        return xi * (2.0 if xi.is_leaf else 5.0)

    cf = tt.compile(f)
    leaf = torch.randn(3, requires_grad=True)
    torch.testing.assert_close(cf(leaf), f(leaf))
    non_leaf = leaf * 1
    torch.testing.assert_close(cf(non_leaf), f(non_leaf))
    torch.testing.assert_close(cf(leaf), f(leaf))
