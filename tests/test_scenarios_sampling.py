"""Training steps that draw random numbers the way users write them, compiled whole and compared with eager after
every step (tests/_scenario_harness.py: returned values, parameters, ``.grad``, optimizer state, buffers,
``torch.get_rng_state()``) in every mode: full, thin, ``fusion=None``, thin with ``fusion=None``, ``tt.compile(model)``.

* PPO with ``torch.multinomial``, normalised advantages and the old log-probabilities carried between steps;
  mixup with ``torch.distributions.Beta`` and ``torch.randperm`` (Beta's sampler ``torch._sample_dirichlet`` has no
  meta kernel: it was refused as unsupported; ``torchlang/opaque_rules.py`` gives it an output rule); a Dirichlet and a
  Gamma policy (``rsample``); Poisson counts; stochastic depth (``torch.rand(...) < p``); ``F.gumbel_softmax(hard=True)``;
  in-place draws (``bernoulli_``, ``exponential_``, ``random_``, ``uniform_``/``normal_``) into a buffer the step keeps.
* Python's ``random`` and numpy's global generator drawn inside the step (cutmix with ``random.betavariate``, a
  random flip with ``random.random()``): the program kept the number drawn while tracing as a constant, so every
  later step used it (silently wrong from step 1).  Now a clear error naming the generator, with the generators,
  model and optimizer as they were (``acquisition/global_state.py``).
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from _scenario_harness import MODES, assert_matches_eager

D = torch.distributions


def _mlp(i=4, o=3):
    return nn.Sequential(nn.Linear(i, 16), nn.Tanh(), nn.Linear(16, o))


def _train(loss_fn, opt_cls=torch.optim.Adam, o=3, steps=4, batch=6):
    def setup(wrap):
        m = _mlp(4, o)
        cm = wrap(m)
        opt = opt_cls(m.parameters(), lr=0.01)

        def step(x):
            loss, *rest = loss_fn(cm, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss, *rest

        return dict(step=step, calls=[(torch.randn(batch, 4),) for _ in range(steps)], modules=[m], opts=[opt])

    return setup


def _ppo_setup(wrap):
    m = _mlp()
    cm = wrap(m)
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    mem = {"old_lp": None}

    def step(x):
        logits = cm(x)
        probs = logits.softmax(-1)
        a = torch.multinomial(probs.detach(), 1).squeeze(1)
        lp = logits.log_softmax(-1).gather(1, a[:, None]).squeeze(1)
        old = mem["old_lp"] if mem["old_lp"] is not None else lp.detach()
        adv = torch.randn(x.shape[0])
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        ratio = (lp - old).exp()
        entropy = -(probs * logits.log_softmax(-1)).sum(-1).mean()
        loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean() - 0.01 * entropy
        opt.zero_grad()
        loss.backward()
        opt.step()
        mem["old_lp"] = lp.detach()
        return loss, a

    return dict(step=step, calls=[(torch.randn(6, 4),) for _ in range(4)], modules=[m], opts=[opt], extra=lambda: mem)


def _mixup_setup(wrap):
    m = _mlp()
    cm = wrap(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    beta = D.Beta(torch.tensor(0.4), torch.tensor(0.4))

    def step(x, y):
        lam = beta.sample()
        idx = torch.randperm(x.shape[0])
        out = cm(lam * x + (1 - lam) * x[idx])
        loss = lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss, lam

    calls = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(4)]
    return dict(step=step, calls=calls, modules=[m], opts=[opt])


def _dirichlet(cm, x):
    d = D.Dirichlet(F.softplus(cm(x)) + 0.5, validate_args=False)
    s = d.rsample()
    return -d.log_prob(s.detach()).mean() + s[:, 0].mean(), s


def _beta_policy(cm, x):
    ab = F.softplus(cm(x)) + 1.0
    d = D.Beta(ab[:, 0], ab[:, 1], validate_args=False)
    a = d.sample()
    return -(d.log_prob(a) * (a - 0.5)).mean(), a


def _gamma(cm, x):
    out = F.softplus(cm(x)) + 0.1
    g = D.Gamma(out[:, 0], out[:, 1])
    s = g.rsample()
    return (s - 1).pow(2).mean() - g.entropy().mean(), s


def _poisson(cm, x):
    rate = F.softplus(cm(x))
    k = torch.poisson(rate.detach())
    return F.poisson_nll_loss(rate, k, log_input=False), k


def _gumbel(cm, x):
    z = F.gumbel_softmax(cm(x), tau=0.5, hard=True)
    return (z * torch.arange(5.0)).sum(-1).mean(), z


_NOISE = torch.empty(6, 4)


def _inplace_draws(cm, x):
    mask = torch.empty(6, 4).bernoulli_(0.8)
    _NOISE.exponential_(2.0)
    target = torch.empty(6, dtype=torch.long).random_(0, 3)
    jitter = torch.empty(6, 3).uniform_(-0.1, 0.1).normal_(0, 0.01)
    return F.cross_entropy(cm(x * mask + _NOISE * 0.01) + jitter, target), target, _NOISE.clone()


class _StochasticDepth(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x, p=0.7):
        for b in self.blocks:
            keep = (torch.rand(x.shape[0], 1) < p).to(x.dtype)
            x = x + b(x) * keep / p
        return x


def _stochastic_depth_setup(wrap):
    m = _StochasticDepth()
    cm = wrap(m)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)

    def step(x):
        loss = cm(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return dict(step=step, calls=[(torch.randn(5, 8),) for _ in range(4)], modules=[m], opts=[opt])


SCENARIOS = {
    "ppo_multinomial": _ppo_setup,
    "mixup_beta": _mixup_setup,
    "dirichlet_rsample": _train(_dirichlet),
    "beta_policy": _train(_beta_policy, o=2),
    "gamma_rsample": _train(_gamma, o=2),
    "poisson": _train(_poisson),
    "gumbel_hard": _train(_gumbel, o=5),
    "inplace_draws": _train(_inplace_draws, batch=6),
    "stochastic_depth": _stochastic_depth_setup,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", SCENARIOS)
def test_random_training_step_matches_eager(name, mode):
    assert_matches_eager(SCENARIOS[name], mode)


def _cutmix(x, y, m, opt):
    lam = random.betavariate(1.0, 1.0)
    cut = int(4 * (1 - lam))
    idx = torch.randperm(x.shape[0])
    x = x.clone()
    x[:, :cut] = x[idx, :cut]
    out = m(x)
    return lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[idx])


def _flip(x, y, m, opt):
    if random.random() < 0.5:
        x = x.flip(-1)
    return F.cross_entropy(m(x), y)


def _numpy_beta(x, y, m, opt):
    lam = float(np.random.beta(0.4, 0.4))
    return F.cross_entropy(m(lam * x + (1 - lam) * x.flip(0)), y)


@pytest.mark.parametrize("mode", ["full", "thin"])
@pytest.mark.parametrize("draw", [_cutmix, _flip, _numpy_beta])
def test_python_or_numpy_random_inside_the_step_is_refused_with_everything_kept(draw, mode):
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    m = _mlp()
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))

    def step(x, y):
        loss = draw(x, y, m, opt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    before = [p.detach().clone() for p in m.parameters()]
    states = random.getstate(), np.random.get_state(legacy=False), torch.get_rng_state()
    which = "numpy.random" if draw is _numpy_beta else "Python's random module"
    with pytest.raises(tt.TracingError, match="pass them in as tensors") as info:
        tt.compile(step, **MODES[mode])(x, y)
    assert which in str(info.value)
    assert random.getstate() == states[0] and torch.equal(torch.get_rng_state(), states[2])
    assert np.random.get_state(legacy=False)["state"]["pos"] == states[1]["state"]["pos"]
    assert all(torch.equal(p, b) and p.grad is None for p, b in zip(m.parameters(), before)) and not opt.state
    step(x, y)  # eager still works on the same objects
    assert opt.state


class _LayerDrop(nn.Module):
    """An encoder skipping layers with Python's random module (older Hugging Face LayerDrop)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            if self.training and random.uniform(0, 1) < 0.3:
                continue
            x = layer(x)
        return x


def test_python_random_in_a_compiled_modules_forward_is_refused():
    random.seed(0)
    state = random.getstate()
    with pytest.raises(tt.TracingError, match="Python's random module"):
        tt.compile(_LayerDrop())(torch.randn(2, 4))
    assert random.getstate() == state


def test_python_random_outside_the_step_passed_in_as_a_tensor_matches_eager():
    def setup(wrap):
        m = _mlp()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        cm = wrap(m)

        def step(x, y, lam):
            out = cm(lam * x + (1 - lam) * x.flip(0))
            loss = lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y.flip(0))
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        rng = random.Random(0)
        calls = [(torch.randn(8, 4), torch.randint(0, 3, (8,)), torch.tensor(rng.betavariate(1, 1))) for _ in range(4)]
        return dict(step=step, calls=calls, modules=[m], opts=[opt])

    for mode in ("full", "thin"):
        assert_matches_eager(setup, mode)


def test_python_random_is_refused_while_another_thread_runs():
    """A logger's or data loader's thread is running (torch's generator check stands down then): still refused."""
    import threading

    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, daemon=True)
    worker.start()
    try:
        with pytest.raises(tt.TracingError, match="Python's random module"):
            tt.compile(lambda x: x * random.random())(torch.ones(2))
    finally:
        stop.set()
        worker.join()
