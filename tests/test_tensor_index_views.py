"""``w[e]`` with ``e`` a 0-d integer tensor is a view of ``w`` in eager (the tensor indexes as an int does), so an
in-place write through it reaches ``w``; any other tensor key (1-d, boolean) is advanced indexing and copies.

The compiled function records such a result as a view whose position is a value known at run time: writes go back
by positions (``acquisition/functional.py``, ``View.by_positions``).  Before, the write was silently lost.
"""
from __future__ import annotations

import pytest
import torch

import thunder_train as tt


def _add_through_row(w, e):
    w[e].add_(1)
    return w.sum()


def _nested(w, e):
    w[e, None][:, 1:].mul_(3)
    w[:, e].sub_(0.5)
    return w * 1


def _copies(w, e):
    w[e.reshape(1)].add_(1)  # a 1-d tensor key: advanced indexing, a copy
    w[e, e.reshape(1)].add_(1)  # a 0-d key next to a 1-d one: advanced indexing too
    return w.sum()


def _view_read_after_base_write(w, e):
    v = w[e]
    w.mul_(2)
    v.add_(1)
    return v * 1


@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
@pytest.mark.parametrize("fn", [_add_through_row, _nested, _copies, _view_read_after_base_write], ids=lambda f: f.__name__)
def test_write_through_a_zero_dim_tensor_index_is_eagers(fn, thin):
    cf = tt.compile(fn, thin=thin)
    want_w = torch.arange(12.).reshape(4, 3)
    got_w = want_w.clone()
    for i in (1, 2, 0, 1):  # the position changes from call to call: one program reads it at run time
        e = torch.tensor(i)
        torch.testing.assert_close(cf(got_w, e), fn(want_w, e))
        assert torch.equal(got_w, want_w), (i, got_w, want_w)
    assert tt.compile_stats(cf).entries == 1


@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
def test_gradient_through_a_write_at_a_zero_dim_tensor_index(thin):
    def step(w, e):
        y = w * 1
        y[e].mul_(2)
        return (y ** 2).sum()

    def run(f, w, e):
        loss = f(w, e)
        loss.backward()
        return loss

    cf = tt.compile(step, thin=thin)
    want_w = torch.randn(4, 3, generator=torch.Generator().manual_seed(0), requires_grad=True)
    got_w = want_w.detach().clone().requires_grad_()
    for i in (0, 2, 3):
        e = torch.tensor(i)
        torch.testing.assert_close(run(cf, got_w, e), run(step, want_w, e))
        torch.testing.assert_close(got_w.grad, want_w.grad)
