"""A user's ``torch.autograd.Function`` inside a compiled function: its ``backward()`` is the gradient rule."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from _models import train_step


class RoundSTE(torch.autograd.Function):
    """A straight-through estimator: the gradient is not the derivative of the forward (which is zero)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class ScaledProductClamp(torch.autograd.Function):
    """Several inputs (one a number), two outputs (one marked non-differentiable), saved tensors, a ctx attribute
    holding an internal value of the forward, needs_input_grad."""

    @staticmethod
    def forward(ctx, a, b, scale):
        ctx.save_for_backward(a, b)
        ctx.scale = scale
        pre = a * b * scale
        ctx.pre = pre
        positive = (pre > 0).to(torch.int64)
        ctx.mark_non_differentiable(positive)
        return pre.clamp(-1, 1), positive

    @staticmethod
    def backward(ctx, g, g_positive):
        a, b = ctx.saved_tensors
        g = g * (ctx.pre.abs() < 1)
        ga = g * b * ctx.scale if ctx.needs_input_grad[0] else None
        gb = g * a * ctx.scale if ctx.needs_input_grad[1] else None
        return ga, gb, None


class HalfCosine(torch.autograd.Function):
    """The setup_context style; its backward is deliberately not the true derivative."""

    @staticmethod
    def forward(x, k):
        return x.sin() * k

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.k = inputs[1]

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos() * ctx.k * 0.5, None


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x):
        h, positive = ScaledProductClamp.apply(self.a(x), self.b(x), 0.7)
        h = HalfCosine.apply(RoundSTE.apply(h * 3) / 3 + h, 2.0)
        return self.c(h + positive)


def batches(n):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 6, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)]


def twins():
    torch.manual_seed(0)
    m = Net()
    m2 = copy.deepcopy(m)
    return (m, torch.optim.AdamW(m.parameters(), lr=1e-2)), (m2, torch.optim.AdamW(m2.parameters(), lr=1e-2))


@pytest.mark.parametrize("options", [{"thin": True}, {"decompose": True}], ids=["thin", "decomposed"])
def test_custom_functions_in_a_whole_step_use_their_backward(options):
    (m1, o1), (m2, o2) = twins()
    step = tt.compile(train_step, **options)
    for x, y in batches(5):
        torch.testing.assert_close(step(m2, o2, x, y), train_step(m1, o1, x, y).detach())
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(b, a)


def test_custom_functions_on_the_autograd_path_use_their_backward():
    (m1, o1), (m2, o2) = twins()
    cm = tt.compile(m2, thin=True)
    for x, y in batches(4):
        F.cross_entropy(m1(x), y).backward()
        F.cross_entropy(cm(x), y).backward()
        for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
            torch.testing.assert_close(b.grad, a.grad, msg=lambda s: f"{n}: {s}")
        o1.step(), o2.step(), o1.zero_grad(), o2.zero_grad()
    assert tt.last_backward_traces(cm)


def test_custom_function_without_gradients_runs_its_forward():
    m = Net()
    x = batches(1)[0][0]
    with torch.no_grad():
        torch.testing.assert_close(tt.compile(m)(x), m(x))


def test_in_place_custom_function_is_a_clear_error():
    class AddOneInPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.mark_dirty(x)
            return x.add_(1)

        @staticmethod
        def backward(ctx, g):
            return g

    lin = nn.Linear(3, 3)
    with pytest.raises(Exception, match="modifies its inputs in place"):
        tt.compile(lambda m, x: AddOneInPlace.apply(m(x)).sum().backward())(lin, torch.randn(2, 3))


def test_once_differentiable_backward():
    from torch.autograd.function import once_differentiable

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        @once_differentiable
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 3 * x * g  # not the true derivative: the rule must be this backward

    torch.manual_seed(0)
    m1 = nn.Linear(6, 4)
    m2 = copy.deepcopy(m1)
    x, y = batches(1)[0]
    F.cross_entropy(Square.apply(m1(x)), y).backward()
    tt.compile(lambda m, x, y: F.cross_entropy(Square.apply(m(x)), y).backward())(m2, x, y)
    torch.testing.assert_close(m2.weight.grad, m1.weight.grad)
