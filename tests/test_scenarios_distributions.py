"""Policy-gradient steps written with torch.distributions, compiled whole (thin, full, ``fusion=None``).

torch.distributions validates by default: ``log_prob(sample)`` runs ``if not valid.all(): raise ValueError`` on the
sample, a Python decision on a value after a random op, which the compiler refuses (acquisition/decisions.py).  The
refusal says so and what to do (``validate_args=False``), and leaves the model, optimizer and random state as they
were.  Without validation the steps (Gaussian ``rsample``, PPO's clipped ratio, Bernoulli sampling) give eager's
losses, samples, parameters, optimizer state and random state.  (REINFORCE with a Categorical:
tests/test_scenarios_returned_inputs.py.)
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt

D = torch.distributions
MODES = {"thin": dict(thin=True), "full": dict(), "nofuse": dict(fusion=None)}


def _gauss(m, x, validate):
    out = m(x)
    d = D.Normal(out[:, :2], F.softplus(out[:, 2:]) + 1e-3, validate_args=validate)
    a = d.rsample()
    return (a.square().sum(-1) + d.log_prob(a).sum(-1)).mean()


def _ppo(m, x, validate):
    logits = m(x)
    d = D.Categorical(logits=logits, validate_args=validate)
    with torch.no_grad():
        old = D.Categorical(logits=logits.detach() + 0.1, validate_args=validate)
        a = old.sample()
        old_lp = old.log_prob(a)
    ratio = (d.log_prob(a) - old_lp).exp()
    adv = torch.randn(x.shape[0])
    return -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()


def _bernoulli(m, x, validate):
    d = D.Bernoulli(logits=m(x), validate_args=validate)
    return -d.log_prob(d.sample()).mean() - d.entropy().mean()


LOSSES = {"gauss_rsample": _gauss, "ppo": _ppo, "bernoulli": _bernoulli}


def _run(loss_fn, kw, validate=False, steps=3):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    xs = [torch.randn(6, 4) for _ in range(steps)]

    def step(x):
        loss = loss_fn(m, x, validate)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    f = step if kw is None else tt.compile(step, **kw)
    return [f(x) for x in xs], m, opt, torch.get_rng_state()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", LOSSES)
def test_policy_step_without_validation_matches_eager(name, mode):
    ref, m, opt, rng = _run(LOSSES[name], None)
    got, cm, copt, crng = _run(LOSSES[name], MODES[mode])
    torch.testing.assert_close(torch.stack(got), torch.stack(ref))
    for p, q in zip(m.parameters(), cm.parameters()):
        torch.testing.assert_close(q, p)
        for k, v in opt.state[p].items():
            torch.testing.assert_close(copt.state[q][k], v)
    assert torch.equal(crng, rng)


@pytest.mark.parametrize("mode", ["thin", "full"])
def test_validating_distribution_is_refused_naming_validate_args(mode):
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    x = torch.randn(6, 4)
    before = [p.detach().clone() for p in m.parameters()]
    rng = torch.get_rng_state()

    def step(x):
        loss = _bernoulli(m, x, True)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    with pytest.raises(Exception, match="validate_args=False") as info:
        tt.compile(step, **MODES[mode])(x)
    assert "torch.distributions" in str(info.value)
    assert all(torch.equal(p, b) and p.grad is None for p, b in zip(m.parameters(), before))
    assert not opt.state and torch.equal(torch.get_rng_state(), rng)
