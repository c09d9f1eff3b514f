"""A slice line's key keeps only the dimensions it slices (executors/torch_executor.py ``_short_key``): fewer
Python objects for ``Tensor.__getitem__`` to read on every call, the same view.  Slice lines come from gradients
(a concatenation's gradient is a slice of the incoming one per input)."""
import torch

import thunder_train as tt


def _step(a, b, c, d):
    last = torch.cat([a, b], dim=-1)   # gradients: g[..., 0:3:1] and g[..., 3:8:1]
    middle = torch.cat([c, d], dim=1)  # gradients: g[0:2:1, 0:1:1] and g[0:2:1, 1:4:1]
    loss = (last * last.flip(0)).sum() + (middle.cos() * middle).sum()
    loss.backward()
    return loss


def _inputs(n=6):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g, requires_grad=True) for s in ((2, 4, n, 3), (2, 4, n, 5), (2, 1, n, 8), (2, 3, n, 8))]


def _check(cf, n=6):
    xs, ys = _inputs(n), _inputs(n)
    assert torch.equal(cf(*xs), _step(*ys))
    for x, y in zip(xs, ys):
        assert torch.equal(x.grad, y.grad) and x.grad.stride() == y.grad.stride()
    return str(tt.last_traces(cf)[-1])


def test_gradient_slices_are_eagers_with_short_keys():
    src = _check(tt.compile(_step, fusion=None))
    assert "(..., slice(0, 3, 1))" in src and "(..., slice(3, 8, 1))" in src, src
    assert "(slice(0, 2, 1), slice(1, 4, 1))" in src, src
    assert "slice(0, 6, 1)" not in src  # no whole dimension spelled out


def test_symbolic_sizes_keep_every_slice():
    # A size that varies between calls may not be the traced one: the key names every dimension's bounds.
    cf = tt.compile(_step, fusion=None, dynamic=True)
    for n in (6, 10, 12):
        src = _check(cf, n)
    assert "(..., slice(" not in src, src
