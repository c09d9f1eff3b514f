"""Multi-output ops that hand back some of their own inputs: ``torch.broadcast_tensors(x, b)`` returns ``x`` itself
where it already has the broadcast shape (eager: ``y is x``), ``torch.atleast_2d(a, b)`` a 2-d input itself.

The line computes only the other results (symbols.py ``_without_inputs``), so each value keeps the one line that
computes it: kept buffers (``out=``), early optimizer updates and the backward see a program in order.  Realistic
case: torch.distributions broadcasts a policy's logits with ``broadcast_all`` (REINFORCE, PPO), in a whole step with
Adam.  Each runs eagerly and compiled (thin, full, ``fusion=None``, and ``tt.compile(model)``): the same values,
gradients, parameters, optimizer state, identities and random state.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import thunder_train as tt

MODES = {"thin": dict(thin=True), "full": dict(), "nofuse": dict(fusion=None)}


def _broadcast(a, b):
    x = a * 2  # an intermediate: kept buffers give its line an out= buffer
    y, z = torch.broadcast_tensors(x, b)
    p, q = torch.atleast_2d(x, b)
    return y is x, p is x, (y * z).sum() + (p + q).sum()


def _broadcast_sums(a, b):
    x = a * 2
    y, z = torch.broadcast_tensors(x, b)
    p, q = torch.atleast_2d(x, b)
    return y is x, p is x, y.sum() + z.sum() + x.expand(4, 3).sum() + q.sum()


@pytest.mark.parametrize("fn", [_broadcast, _broadcast_sums])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_broadcast_tensors_returning_an_intermediate(mode, grad, fn):
    a, b = torch.randn(4, 3, requires_grad=grad), torch.randn(3, requires_grad=grad)
    ca, cb = a.detach().clone().requires_grad_(grad), b.detach().clone().requires_grad_(grad)
    ref = fn(a, b)
    got = tt.compile(fn, **MODES[mode])(ca, cb)
    assert got[:2] == ref[:2] == (True, True)
    torch.testing.assert_close(got[-1], ref[-1])
    if grad:
        ref[-1].backward()
        got[-1].backward()
        torch.testing.assert_close(ca.grad, a.grad)
        torch.testing.assert_close(cb.grad, b.grad)


class _Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, bias):
        h, bb = torch.broadcast_tensors(self.lin(x), bias)
        return (h * bb.sigmoid()).sum()


def test_module_broadcasting_its_activation():
    torch.manual_seed(0)
    m = _Gate()
    cm = copy.deepcopy(m)
    x, bias = torch.randn(5, 3), torch.randn(3)
    m(x, bias).backward()
    tt.compile(cm)(x, bias).backward()
    for p, q in zip(m.parameters(), cm.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


def _reinforce(kw, steps=3):
    D = torch.distributions
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    xs = [torch.randn(6, 4) for _ in range(steps)]

    def step(x):
        d = D.Categorical(logits=m(x), validate_args=False)
        a = d.sample()
        r = (a == 1).float()
        loss = -(d.log_prob(a) * (r - r.mean())).mean() - 0.01 * d.entropy().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss, a

    f = step if kw is None else tt.compile(step, **kw)
    out = [f(x) for x in xs]
    return out, m, opt, torch.get_rng_state()


@pytest.mark.parametrize("mode", MODES)
def test_reinforce_step_with_torch_distributions(mode):
    ref, m, opt, rng = _reinforce(None)
    got, cm, copt, crng = _reinforce(MODES[mode])
    for (l, a), (cl, ca) in zip(ref, got):
        torch.testing.assert_close(cl, l)
        assert torch.equal(ca, a)
    for p, q in zip(m.parameters(), cm.parameters()):
        torch.testing.assert_close(q, p)
        s, cs = opt.state[p], copt.state[q]
        for k in s:
            torch.testing.assert_close(cs[k], s[k])
    assert torch.equal(crng, rng)
