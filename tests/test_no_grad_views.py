"""In-place updates through a view made under ``torch.no_grad()`` reach its base, as in eager.

Results of a ``no_grad`` region are detached (``prims.stop_gradient``); a detached view stays a view of its base,
so ``x[0].mul_(2)`` or ``x.diagonal().add_(1)`` inside ``with torch.no_grad():`` updates ``x`` (these updates were
lost before: the detached result was no view).  A view made there and read after its base changed is re-derived,
detached.  (Not covered here: a ``no_grad`` update of a tensor that requires grad, then used with grad enabled:
eager keeps its old autograd graph, the trace's value is detached.)
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
