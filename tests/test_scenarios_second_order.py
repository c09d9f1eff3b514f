"""Second-order training steps: MAML (``autograd.grad(create_graph=True)`` with ``functional_call``), a
Hessian-vector product with a gradient-norm penalty, and StyleGAN's R1 penalty on real images.

Compiled whole (full, thin, ``fusion=None``, thin with ``fusion=None``) they give eager's values after every step
(tests/_scenario_harness.py).  Through ``tt.compile(model)`` the compiled module is one autograd node whose backward
is not differentiable.  torch's ``once_differentiable`` marks the gradients only when an incoming gradient requires
grad, so R1's ``autograd.grad(D(real).sum(), real, create_graph=True)`` (incoming gradient: ones) returned a
gradient without a graph: the penalty silently trained nothing (parameters off from step 0), and a Hessian-vector
product raised torch's "appears to not have been used in the graph".  Both now raise at the second backward,
naming the cause and the whole-step remedy (``compiler/autograd_function.py``, ``_differentiable_once``); a
``create_graph=True`` backward that is not differentiated again still matches eager.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

import thunder_train as tt
from _scenario_harness import MODES, assert_matches_eager

WHOLE = [m for m in MODES if m != "model"]


def _mlp():
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))


def _maml(wrap):
    m = _mlp()
    opt = torch.optim.Adam(m.parameters(), lr=0.01)

    def step(xs, ys, xq, yq):
        params = dict(m.named_parameters())
        loss_s = F.cross_entropy(functional_call(m, params, (xs,)), ys)
        grads = torch.autograd.grad(loss_s, list(params.values()), create_graph=True)
        fast = {k: v - 0.1 * g for (k, v), g in zip(params.items(), grads)}
        loss_q = F.cross_entropy(functional_call(m, fast, (xq,)), yq)
        opt.zero_grad()
        loss_q.backward()
        opt.step()
        return loss_s.detach(), loss_q.detach()

    calls = [(torch.randn(6, 4), torch.randint(0, 3, (6,)), torch.randn(6, 4), torch.randint(0, 3, (6,)))
             for _ in range(4)]
    return dict(step=step, calls=calls, modules=[m], opts=[opt])


def _hvp(wrap):
    m = _mlp()
    cm = wrap(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)

    def step(x, y):
        loss = F.cross_entropy(cm(x), y)
        ps = list(m.parameters())
        g = torch.autograd.grad(loss, ps, create_graph=True)
        v = [torch.randn_like(p) for p in ps]
        hv = torch.autograd.grad(sum((a * b).sum() for a, b in zip(g, v)), ps, retain_graph=True)
        total = loss + 0.01 * sum(gg.pow(2).sum() for gg in g)
        opt.zero_grad()
        total.backward()
        opt.step()
        return total, sum(h.sum() for h in hv)

    return dict(step=step, calls=[(torch.randn(6, 4), torch.randint(0, 3, (6,))) for _ in range(4)], modules=[m],
                opts=[opt])


def _r1(wrap):
    d = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    cd = wrap(d)
    opt = torch.optim.Adam(d.parameters(), lr=1e-3, betas=(0.0, 0.99))

    def step(real, fake):
        real = real.detach().requires_grad_(True)
        out_r = cd(real)
        loss = F.softplus(-out_r).mean() + F.softplus(cd(fake)).mean()
        (g,) = torch.autograd.grad(out_r.sum(), real, create_graph=True)
        r1 = g.pow(2).sum(1).mean()
        opt.zero_grad()
        (loss + 5.0 * r1).backward()
        opt.step()
        return loss, r1, real.grad

    return dict(step=step, calls=[(torch.randn(6, 4), torch.randn(6, 4)) for _ in range(4)], modules=[d], opts=[opt])


SCENARIOS = {"maml": _maml, "hvp_penalty": _hvp, "r1_penalty": _r1}


@pytest.mark.parametrize("mode", WHOLE)
@pytest.mark.parametrize("name", SCENARIOS)
def test_second_order_step_compiled_whole_matches_eager(name, mode):
    assert_matches_eager(SCENARIOS[name], mode)


@pytest.mark.parametrize("name", ["hvp_penalty", "r1_penalty"])
def test_second_order_through_a_compiled_module_raises_naming_the_whole_step(name):
    torch.manual_seed(0)
    s = SCENARIOS[name](tt.compile)
    with pytest.raises(RuntimeError, match=r"not differentiable.*tt.compile\(step\)"):
        s["step"](*s["calls"][0])


def test_create_graph_backward_through_a_compiled_module_not_differentiated_again_matches_eager():
    torch.manual_seed(0)
    m = _mlp()
    cm = tt.compile(m)
    x = torch.randn(5, 4, requires_grad=True)
    ref = [torch.autograd.grad(m(x).pow(2).sum(), [x, *m.parameters()], create_graph=True)]
    got = [torch.autograd.grad(cm(x).pow(2).sum(), [x, *m.parameters()], create_graph=True)]
    for a, b in zip(ref[0], got[0]):
        torch.testing.assert_close(b, a)
        assert b.requires_grad  # as eager's: a later backward through it is the error above
