"""In-place updates through a view made under ``torch.no_grad()`` reach its base, as in eager.

Results of a ``no_grad`` region are detached (``prims.stop_gradient``); a detached view stays a view of its base,
so ``x[0].mul_(2)`` or ``x.diagonal().add_(1)`` inside ``with torch.no_grad():`` updates ``x`` (these updates were
lost before: the detached result was no view).  A view made there and read after its base changed is re-derived,
detached.  A write autograd does not see (under ``no_grad``, or through ``.data``/``.detach()``) into a computed value
that requires grad keeps that value's graph, as eager does: a later backward still reaches what the old value was
computed from (``prims.unseen_write``, ``acquisition/inplace.py``).
"""
from __future__ import annotations

import pytest
import torch

import thunder_train as tt


def _index(x):
    with torch.no_grad():
        x[0].mul_(2)


def _opaque_views(x):
    with torch.no_grad():
        x.diagonal().mul_(3)  # diagonal and unfold run through torch (opaque views)
        x.unfold(0, 2, 2).add_(1)


def _reshaped(x):
    with torch.no_grad():
        x.view(16).mul_(3)


def _intermediate(x):
    with torch.no_grad():
        y = x * 1
        y[1:, 0].sub_(5)
        return y


@pytest.mark.parametrize("f", [_index, _opaque_views, _reshaped, _intermediate], ids=lambda f: f.__name__.strip("_"))
def test_update_through_a_view_made_under_no_grad(f):
    x = torch.randn(4, 4)
    a, b = x.clone(), x.clone()
    got, want = tt.compile(f)(a), f(b)
    torch.testing.assert_close(a, b)
    if want is not None:
        torch.testing.assert_close(got, want)


def _scaled_under_no_grad(w, x):
    y = w * 2
    with torch.no_grad():
        y.mul_(2)
    return (y * x).sum() + (w * x).sum()


def _scaled_through_data(w, x):
    y = w * 2
    y.data.mul_(2)
    return (y * x).sum() + (w * x).sum()


def _element_through_detach(w, x):
    y = w * 3 + 1  # (tanh saves its output: eager would refuse the backward after the write)
    y.detach()[0] = 5.0
    return (y * x).sum() + (w * x).sum()


def _element_under_no_grad(w, x):
    y = w.sin() * 2
    with torch.no_grad():
        y[1:].clamp_(max=1.0)
    return (y * x).sum()


def _element_with_grad(w, x):  # seen by autograd: the overwritten element's gradient is zero, in eager too
    y = w * 2
    y[0] = 5.0
    return (y * x).sum() + (w * x).sum()


UNSEEN = [_scaled_under_no_grad, _scaled_through_data, _element_through_detach, _element_under_no_grad, _element_with_grad]


@pytest.mark.parametrize("backward_inside", [True, False], ids=["backward_inside", "backward_outside"])
@pytest.mark.parametrize("fn", UNSEEN, ids=lambda f: f.__name__.strip("_"))
def test_a_write_autograd_does_not_see_keeps_the_graph(fn, backward_inside):
    """Values and gradients equal eager's, with the backward inside the compiled function and outside it."""
    def inside(w, x):
        loss = fn(w, x)
        loss.backward()
        return loss.detach()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, generator=g)
    w_eager = torch.randn(4, generator=g).requires_grad_()
    w_compiled = w_eager.detach().clone().requires_grad_()
    if backward_inside:
        want, got = inside(w_eager, x), tt.compile(inside)(w_compiled, x)
    else:
        want, got = fn(w_eager, x), tt.compile(fn)(w_compiled, x)
        want.backward()
        got.backward()
    torch.testing.assert_close(got.detach(), want.detach())
    torch.testing.assert_close(w_compiled.grad, w_eager.grad)
