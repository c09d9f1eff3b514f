"""Errors eager PyTorch raises inside a step, which the functional trace had not: each compiled case ran and
returned a result (a write into a view of a parameter, ``out=`` on tensors that require grad, a write into an
expanded tensor, a second backward from the same loss), or a gradient that missed a write (an in-place write into
an activation handed in).  Each now raises as eager raises, or is refused saying what to do; where eager runs, the
values are eager's."""
import pytest
import torch

import thunder_train as tt
from thunder_train.compiler.errors import TracingError


def _view_of_a_parameter(w):
    w[0].add_(1)
    return w.sum()


def _view_of_a_parameter_by_view(w):
    w.view(-1).mul_(2)
    return w.sum()


def _out_with_an_argument_requiring_grad(w):
    out = torch.empty(3, 4)
    torch.mul(w, 2, out=out)
    return out.sum()


def _out_into_a_tensor_requiring_grad(w):
    out = w * 1
    torch.add(torch.ones(3, 4), 1, out=out)
    return out.sum()


def _write_into_an_expanded_tensor(w):
    x = torch.zeros(4).expand(3, 4)
    x.add_(w)
    return x.sum()


def _backward_twice(w):
    loss = (w * w).sum()
    loss.backward()
    loss.backward()
    return loss


RAISING = [_view_of_a_parameter, _view_of_a_parameter_by_view, _out_with_an_argument_requiring_grad,
           _out_into_a_tensor_requiring_grad, _write_into_an_expanded_tensor, _backward_twice]


@pytest.mark.parametrize("thin", [False, True])
@pytest.mark.parametrize("fn", RAISING, ids=lambda f: f.__name__)
def test_compiled_raises_where_eager_raises(fn, thin):
    w = torch.randn(3, 4, requires_grad=True)
    before = w.detach().clone()
    with pytest.raises(RuntimeError) as eager:
        fn(w)
    w = before.clone().requires_grad_()
    with pytest.raises(RuntimeError) as compiled:
        tt.compile(fn, thin=thin)(w)
    first = lambda e: str(e.value).split(".")[0].split(" (")[0]  # noqa: E731 (eager's words, before ours)
    assert first(compiled) == first(eager), (str(compiled.value), str(eager.value))
    assert torch.equal(w.detach(), before) and w.grad is None  # nothing written


def _under_no_grad(w):
    with torch.no_grad():
        w[0].add_(1)
        out = torch.empty(3, 4)
        torch.mul(w, 2, out=out)
    return (w * out).sum()


def _fill_an_expanded_tensor(w):
    x = torch.zeros(4).expand(3, 4)
    x.fill_(1.0)
    return (x * w).sum()


def _backward_twice_retaining_the_graph(w):
    loss = (w * w).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    return loss


def _out_on_tensors_needing_no_grad(w):
    out = torch.empty(3, 4)
    torch.mul(w.detach(), 2, out=out)
    return (out * w).sum()


ALLOWED = [_under_no_grad, _fill_an_expanded_tensor, _backward_twice_retaining_the_graph, _out_on_tensors_needing_no_grad]


@pytest.mark.parametrize("thin", [False, True])
@pytest.mark.parametrize("fn", ALLOWED, ids=lambda f: f.__name__)
def test_compiled_gives_eagers_values_where_eager_runs(fn, thin):
    def run(f):
        torch.manual_seed(0)
        w = torch.randn(3, 4, requires_grad=True)
        loss = f(w)
        if w.grad is None:
            loss.backward()
        return loss.detach(), w.detach().clone(), w.grad.clone()

    want = run(fn)
    cf = tt.compile(fn, thin=thin)
    for _ in range(2):
        for a, b in zip(run(cf), want):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("through_a_view", [False, True])
def test_write_into_an_activation_handed_in_is_refused(through_a_view):
    """``h = w * 2`` passed in and written in place: eager adds the write to ``h``'s history, and a backward through
    the result reaches ``w`` through it (``w.grad`` 6 for ``h.mul_(3)``); the compiled program cannot, and had given
    ``w.grad`` 2, silently (before that, a leaf's error that did not apply).  Refused, nothing changed."""
    def fn(h):
        (h[0] if through_a_view else h).mul_(3)
        return h.sum()

    w = torch.ones(3, requires_grad=True)
    h = w * 2
    with pytest.raises(TracingError, match="not a leaf"):
        tt.compile(fn)(h)
    assert torch.equal(h.detach(), torch.full((3,), 2.0)) and w.grad is None
