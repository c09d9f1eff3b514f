"""User ``torch.autograd.Function`` and ``torch.library.custom_op`` layers in training steps (session 19), compared
with eager after every step (tests/_scenario_harness.py).

Found silently wrong before: a ``backward`` that builds its result with a factory (``out = torch.zeros(n, 3);
out[:, :2] = -g``, the usual way to scatter a gradient back) made the factory a constant while tracing and lost
the gradient entirely; a gradient reversal layer (domain-adversarial training) whose forward returns its
input (``x.view_as(x)``, the usual form, or ``x`` itself) recorded nothing, so the branch trained with the plain
gradient instead of ``-lambda * g``; and ``grad_reverse = GradReverse.apply``, bound before compiling (the usual
module-level alias), bypassed the traced ``apply`` and cut the branch's gradient entirely.  Also tried and
matching eager: a straight-through estimator in ``setup_context`` style, ``ctx.mark_non_differentiable``,
``ctx.set_materialize_grads(False)`` and a ``custom_op`` with ``register_autograd``.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from _scenario_harness import MODES, assert_matches_eager


class ReverseView(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lam):
        ctx.lam = lam
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.lam * g, None


class ReverseSame(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return -0.3 * g


class ReverseMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return -0.3 * g


grad_reverse = ReverseMul.apply  # bound at import, before anything is compiled


class RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.round()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g


class SortKeepIndex(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        v, i = x.sort(-1)
        ctx.mark_non_differentiable(i)
        ctx.save_for_backward(i)
        return v, i

    @staticmethod
    def backward(ctx, gv, gi):
        (i,) = ctx.saved_tensors
        return torch.zeros_like(gv).scatter(-1, i, gv)


class TwoHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, g1, g2):
        r = None if g1 is None else g1 * 2
        if g2 is not None:
            r = g2 * 3 if r is None else r + g2 * 3
        return r


@torch.library.custom_op("tt_scenarios::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, s: float) -> torch.Tensor:
    return torch.tanh(x) * s


@scaled_tanh.register_fake
def _(x, s):
    return torch.empty_like(x)


def _st_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.s = inputs[1]


def _st_backward(ctx, g):
    (x,) = ctx.saved_tensors
    return g * ctx.s * (1 - torch.tanh(x) ** 2), None


scaled_tanh.register_autograd(_st_backward, setup_context=_st_setup)


class DANN(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Linear(4, 8)
        self.c = nn.Linear(8, 3)
        self.d = nn.Linear(8, 2)


REVERSALS = {
    "view_as": lambda h: ReverseView.apply(h, 0.3),
    "returns_input": ReverseSame.apply,
    "bound_alias": lambda h: grad_reverse(h),
    "bound_alias_view_as": ReverseView.apply,
}


def _dann(name):
    rev = REVERSALS[name]

    def setup(wrap):
        m = DANN()
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        cf, cd = wrap(m.c), wrap(m.d)

        def step(x, y, dom):
            h = torch.relu(m.f(x))
            r = rev(h, 0.3) if name == "bound_alias_view_as" else rev(h)
            loss = F.cross_entropy(cf(h), y) + F.cross_entropy(cd(r), dom)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        calls = [(torch.randn(8, 4), torch.randint(0, 3, (8,)), torch.randint(0, 2, (8,))) for _ in range(3)]
        return dict(step=step, calls=calls, modules=[m], opts=[opt])

    return setup


@pytest.mark.parametrize("mode", ["full", "thin", "nofuse"])
@pytest.mark.parametrize("name", REVERSALS)
def test_gradient_reversal_layer_trains_as_eager(name, mode):
    assert_matches_eager(_dann(name), mode)


def test_gradient_reversal_under_compiled_model_matches_eager():
    assert_matches_eager(_dann("view_as"), "model")


@pytest.mark.parametrize("fn", [lambda h: ReverseView.apply(h, 0.3), grad_reverse], ids=["view_as", "bound"])
def test_reversed_gradient_reaches_the_input(fn):
    """The smallest form: eager's ``w.grad`` is ``x - 0.3 x``; before, 2x (view_as) or x (the bound alias)."""

    def step(w, x):
        h = w * x
        y = fn(h)
        (y.sum() + h.sum()).backward()
        return w.grad

    grads = []
    for f in (step, tt.compile(step)):
        w = torch.ones(3, requires_grad=True)
        grads.append(f(w, torch.arange(3.0)).clone())
    torch.testing.assert_close(grads[1], grads[0])
    torch.testing.assert_close(grads[0], torch.arange(3.0) * 0.7)


def _mlp():
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))


def _steps(body):
    def setup(wrap):
        m = _mlp()
        cm = wrap(m)
        opt = torch.optim.Adam(m.parameters(), lr=0.01)

        def step(x, y):
            loss, extra = body(cm, m, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss, extra

        calls = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(3)]
        return dict(step=step, calls=calls, modules=[m], opts=[opt])

    return setup


def _ste(cm, m, x, y):
    h = RoundSTE.apply(m[0](x) * 2) / 2
    return F.cross_entropy(m[2](torch.tanh(h)), y), h


def _sorted(cm, m, x, y):
    v, i = SortKeepIndex.apply(cm(x))
    return (v * torch.arange(3.0)).sum(), i


def _two_heads(cm, m, x, y):
    a, _ = TwoHeads.apply(cm(x))
    return F.cross_entropy(a, y), a


def _custom_op(cm, m, x, y):
    h = scaled_tanh(m[0](x), 1.5)
    return F.cross_entropy(m[2](h), y), h


OTHERS = {"ste_setup_context": _ste, "mark_non_differentiable": _sorted, "no_materialize": _two_heads,
          "custom_op_register_autograd": _custom_op}


@pytest.mark.parametrize("mode", ["full", "thin", "model"])
@pytest.mark.parametrize("name", OTHERS)
def test_custom_function_forms_match_eager(name, mode):
    assert_matches_eager(_steps(OTHERS[name]), mode)


def test_bound_apply_is_torch_own_again_after_tracing():
    """The base class's ``apply`` is replaced only while tracing."""
    from torch.autograd.function import _SingleLevelFunction

    tt.compile(lambda x: grad_reverse(x).sum())(torch.ones(2, requires_grad=True))
    assert "apply" not in _SingleLevelFunction.__dict__
    x = torch.ones(2, requires_grad=True)
    grad_reverse(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2,), -0.3))


class Crop(torch.autograd.Function):
    """A crop whose backward pads the gradient back with a factory and a slice assignment."""

    @staticmethod
    def forward(ctx, x):
        ctx.n = x.shape[1]
        return x[:, :2] + torch.zeros(x.shape[0], 2)  # a factory in the forward too

    @staticmethod
    def backward(ctx, g):
        out = torch.zeros(g.shape[0], ctx.n)
        out[:, :2] = -g
        out[:, 2:] = torch.full((g.shape[0], ctx.n - 2), 0.5)
        return out


def _crop(cm, m, x, y):
    h = Crop.apply(m[0](x))
    return F.cross_entropy(torch.cat([h, h[:, :1]], 1), y), h


@pytest.mark.parametrize("mode", ["full", "thin", "nofuse", "model"])
def test_backward_built_with_factories_matches_eager(mode):
    assert_matches_eager(_steps(_crop), mode)


def test_backward_built_with_factories_smallest_form():
    def step(w, x):
        h = w * x
        (Crop.apply(h).pow(2).sum() + h.sum() * 0.1).backward()
        return w.grad

    grads = []
    for f in (step, tt.compile(step)):
        w = torch.ones(4, 3, requires_grad=True)
        grads.append(f(w, torch.arange(12.0).view(4, 3) / 10).clone())
    torch.testing.assert_close(grads[1], grads[0])


class RecomputeInBackward(torch.autograd.Function):
    """Recomputes its forward under enable_grad in backward and differentiates it (a memory-saving pattern)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            xx = x.detach().requires_grad_()
            (gx,) = torch.autograd.grad(torch.sigmoid(xx), xx, g)
        return gx


def test_autograd_inside_a_custom_backward_is_refused_clearly_and_changes_nothing():
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = [p.detach().clone() for p in m.parameters()]

    def step(x, y):
        loss = F.cross_entropy(m[2](RecomputeInBackward.apply(m[0](x))), y)
        loss.backward()
        opt.step()
        return loss

    with pytest.raises(Exception, match="autograd.grad or backward\\(\\) inside a custom torch.autograd.Function"):
        tt.compile(step)(torch.randn(8, 4), torch.randint(0, 3, (8,)))
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before))
    assert all(p.grad is None for p in m.parameters())


def test_autograd_inside_a_custom_backward_under_a_compiled_model_is_refused_clearly():
    """Before: an internal ``AttributeError`` while the compiled module's backward was built."""
    m = nn.Sequential(nn.Linear(4, 4), _Recompute())
    with pytest.raises(Exception, match="autograd.grad or backward\\(\\) inside a custom torch.autograd.Function"):
        tt.compile(m)(torch.randn(2, 4)).sum().backward()
    m(torch.randn(2, 4)).sum().backward()  # eager still works
    assert m[0].weight.grad is not None


class _Recompute(nn.Module):
    def forward(self, x):
        return RecomputeInBackward.apply(x)
