"""Tensors made inside a compiled function and set to require grad (adversarial examples, gradient penalties) and
the ``requires_grad`` of computed values, as eager has them (issue 25's neighbours: every flag a trace reads is
eager's)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import thunder_train as tt
from thunder_train.compiler.errors import TracingError


def model_and_opt():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def fgsm_step(m, opt, x, y):
    """Adversarial training with the fast gradient sign method: the input's gradient from a first backward."""
    x_adv = x.clone().requires_grad_()
    F.cross_entropy(m(x_adv), y).backward()
    x2 = (x + 0.1 * x_adv.grad.sign()).detach()
    opt.zero_grad()
    loss = F.cross_entropy(m(x2), y)
    loss.backward()
    opt.step()
    return loss


def pgd_step(m, opt, x, y):
    """Projected gradient descent on a perturbation made with ``requires_grad=True`` and projected with
    ``delta.data = ...``, its ``.grad`` zeroed in place between the inner steps."""
    delta = torch.zeros_like(x, requires_grad=True)
    for _ in range(3):
        F.cross_entropy(m(x + delta), y).backward()
        delta.data = (delta + 0.05 * delta.grad.detach().sign()).clamp(-0.1, 0.1)
        delta.grad.zero_()
    opt.zero_grad()
    loss = F.cross_entropy(m(x + delta.detach()), y)
    loss.backward()
    opt.step()
    return loss


def gradient_penalty_step(m, opt, x, y):
    """A WGAN-GP style penalty: the gradient at an interpolate made inside the step, with create_graph."""
    x_hat = (0.3 * x + 0.7 * x.flip(0)).detach().requires_grad_(True)
    out = m(x_hat).sum()
    (g,) = torch.autograd.grad(out, x_hat, create_graph=True)
    loss = F.cross_entropy(m(x), y) + ((g.norm(2, dim=1) - 1) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
@pytest.mark.parametrize("step", [fgsm_step, pgd_step, gradient_penalty_step], ids=lambda f: f.__name__)
def test_adversarial_steps_train_as_eager(step, thin):
    eager, eager_opt = model_and_opt()
    compiled, opt = model_and_opt()
    cf = tt.compile(step, thin=thin)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(5, 4, generator=g), torch.randint(0, 2, (5,), generator=g)
        torch.testing.assert_close(cf(compiled, opt, x, y), step(eager, eager_opt, x, y).detach(), atol=1e-6, rtol=1e-6)
    for a, b in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_requires_grad_of_computed_values_is_eagers():
    """``y.requires_grad`` of a value computed inside the function: True through a parameter or a new leaf, False
    under ``no_grad`` and after ``detach``; library code branches on it (checkpoint, fast paths)."""
    lin = nn.Linear(3, 3)

    def fn(x):
        y = lin(x)
        t = torch.zeros(3).requires_grad_()
        with torch.no_grad():
            n = lin(x)
        flags = [y.requires_grad, (x * 2).requires_grad, (t * x).requires_grad, n.requires_grad,
                 y.detach().requires_grad, y.sum().requires_grad, y.argmax().requires_grad]
        return y.detach() + sum(flags)

    x = torch.randn(3)
    torch.testing.assert_close(tt.compile(fn)(x), fn(x).detach())


def test_requires_grad_false_on_a_computed_value_is_eagers_error():
    lin = nn.Linear(3, 3)

    def fn(x):
        y = lin(x)
        y.requires_grad_(False)
        return y

    with pytest.raises(RuntimeError, match="only change requires_grad flags of leaf variables") as want:
        fn(torch.randn(3))
    with pytest.raises(RuntimeError, match=str(want.value).split(".")[0]):
        tt.compile(fn)(torch.randn(3))


@pytest.mark.parametrize("fn", [
    lambda x: torch.zeros(3).requires_grad_() * x,
    lambda x: x.detach().clone().requires_grad_(),
    lambda x: ((x * 2).detach().requires_grad_() * 3).sum(),
], ids=["product", "the_leaf_itself", "sum"])
def test_returning_a_value_that_requires_grad_through_a_new_leaf_is_refused(fn):
    assert fn(torch.randn(3)).requires_grad  # eager
    with pytest.raises(TracingError, match="requires grad through a tensor made inside it"):
        tt.compile(fn)(torch.randn(3))


def test_a_new_leaf_returned_under_no_grad_computes_as_eager():
    fn = lambda x: torch.zeros(3).requires_grad_() * x  # noqa: E731
    x = torch.randn(3)
    with torch.no_grad():
        want, got = fn(x), tt.compile(fn)(x)
    torch.testing.assert_close(got, want)
    assert got.requires_grad == want.requires_grad is False


def test_data_assignment_on_an_input_inside_the_function_matches_eager():
    """(tests/test_data_assignment.py has training steps.)"""
    def fn(x, w):
        w.data = x * 2
        return w + 1

    x, w = torch.randn(3), torch.randn(3)
    we = w.clone()
    torch.testing.assert_close(tt.compile(fn)(x, w), fn(x, we))
    torch.testing.assert_close(w, we)


def test_writing_either_side_of_a_data_assignment_in_place_is_refused():
    """Eager's ``t.data = v`` shares memory; an in-place write afterwards shows in both, which the trace does not
    follow: refused, with what to do."""
    def fn(x):
        t = torch.zeros(3)
        v = x * 2
        t.data = v
        v.add_(1)
        return t + 0

    with pytest.raises(TracingError, match="share memory"):
        tt.compile(fn)(torch.randn(3))

    def fresh(x):
        t = torch.zeros(3)
        t.data = (x * 2).clone()
        return t * 3

    x = torch.randn(3)
    torch.testing.assert_close(tt.compile(fresh)(x), fresh(x))
