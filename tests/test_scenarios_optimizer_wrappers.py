"""Optimizers users write themselves, compiled whole and compared with eager after every step in every mode
(tests/_scenario_harness.py).

* SAM (sharpness-aware minimisation): an ``Optimizer`` subclass holding its base optimizer as an attribute and
  sharing its ``param_groups``; two forward/backward passes per step, the perturbation kept in SAM's own state.
  Stepping the base optimizer was refused ("the optimizer is not an input of the function") unless the user passed
  it in; an optimizer held by a walked optimizer is now walked too (``acquisition/walker.py``).  With an LR
  scheduler on SAM between steps.
* Lion (a user ``Optimizer`` with ``@torch.no_grad`` step and lazily created state), Lookahead (a plain object
  wrapping Adam with slow weights and a Python counter), a global optimizer rebound between steps (switching from
  Adam to SGD, or to a new optimizer over the head with the body frozen), Adam's second moments read for logging.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _scenario_harness import MODES, assert_matches_eager
from _steps import cross_entropy_step


def _mlp():
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches(n=4):
    return [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(n)]


class SAM(torch.optim.Optimizer):
    def __init__(self, params, base_cls, rho=0.05, **kw):
        super().__init__(params, dict(rho=rho, **kw))
        self.base_optimizer = base_cls(self.param_groups, **kw)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self):
        grads = [p.grad.norm(2) for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.norm(torch.stack(grads), 2)
        for g in self.param_groups:
            scale = g["rho"] / (norm + 1e-12)
            for p in g["params"]:
                if p.grad is not None:
                    e = p.grad * scale
                    p.add_(e)
                    self.state[p]["e_w"] = e

    @torch.no_grad()
    def second_step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.sub_(self.state[p]["e_w"])
        self.base_optimizer.step()


class SAMClosure(SAM):
    """The other common form: the old weights kept and put back with ``p.data =``, and ``step(closure)``."""

    @torch.no_grad()
    def first_step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    self.state[p]["old_p"] = p.data.clone()
        super().first_step()
        self.zero_grad()

    @torch.no_grad()
    def second_step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()

    @torch.no_grad()
    def step(self, closure):
        self.first_step()
        torch.enable_grad()(closure)()
        self.second_step()


def _sam_closure(wrap):
    m = _mlp()
    cm = wrap(m)
    opt = SAMClosure(m.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)

    def step(x, y):
        def closure():
            loss = F.cross_entropy(cm(x), y)
            loss.backward()
            return loss

        loss = closure()
        opt.step(closure)
        opt.zero_grad()
        return loss

    return dict(step=step, calls=_batches(), modules=[m], opts=[opt, opt.base_optimizer])


def _sam(base_cls, **kw):
    def setup(wrap):
        m = _mlp()
        cm = wrap(m)
        opt = SAM(m.parameters(), base_cls, **kw)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)

        def step(x, y):
            F.cross_entropy(cm(x), y).backward()
            opt.first_step()
            opt.zero_grad()
            loss = F.cross_entropy(cm(x), y)
            loss.backward()
            opt.second_step()
            opt.zero_grad()
            return loss

        return dict(step=step, calls=_batches(), modules=[m], opts=[opt, opt.base_optimizer],
                    between=lambda i: sched.step())

    return setup


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p)
                p.mul_(1 - g["lr"] * g["weight_decay"])
                b1, b2 = g["betas"]
                p.add_((st["exp_avg"] * b1 + p.grad * (1 - b1)).sign(), alpha=-g["lr"])
                st["exp_avg"].mul_(b2).add_(p.grad, alpha=1 - b2)


def _plain(make_opt, n=4):
    def setup(wrap):
        m = _mlp()
        cm = wrap(m)
        opt = make_opt(m)

        step = cross_entropy_step(cm, opt)
        inner = getattr(opt, "inner", opt)
        return dict(step=step, calls=_batches(n), modules=[m], opts=[inner], extra=lambda: vars(opt).get("slow"))

    return setup


class Lookahead:
    def __init__(self, inner, k=2, alpha=0.5):
        self.inner, self.k, self.alpha, self.n = inner, k, alpha, 0
        self.slow = [p.detach().clone() for g in inner.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self):
        self.inner.step()
        self.n += 1
        if self.n % self.k == 0:
            for s, p in zip(self.slow, (p for g in self.inner.param_groups for p in g["params"])):
                s.add_(p - s, alpha=self.alpha)
                p.copy_(s)

    def zero_grad(self):
        self.inner.zero_grad()


OPT = None


def _rebound(freeze):
    def setup(wrap):
        global OPT
        m = _mlp()
        cm = wrap(m)
        OPT = torch.optim.Adam(m.parameters(), lr=0.01)

        def step(x, y):
            loss = F.cross_entropy(cm(x), y)
            loss.backward()
            OPT.step()
            OPT.zero_grad()
            return loss

        def between(i):
            global OPT
            if i == 1:
                OPT = torch.optim.SGD(m[2].parameters() if freeze else m.parameters(), lr=0.05, momentum=0.9)
                for p in m[0].parameters() if freeze else ():
                    p.requires_grad_(False)

        return dict(step=step, calls=_batches(), modules=[m], between=between,
                    extra=lambda: [dict(st) for st in OPT.state.values()])

    return setup


def _second_moments(wrap):
    m = _mlp()
    cm = wrap(m)
    opt = torch.optim.Adam(m.parameters(), lr=0.01)

    def step(x, y):
        loss = F.cross_entropy(cm(x), y)
        loss.backward()
        opt.step()
        v = torch.stack([opt.state[p]["exp_avg_sq"].sqrt().mean() for p in m.parameters()])
        opt.zero_grad()
        return loss, v

    return dict(step=step, calls=_batches(), modules=[m], opts=[opt])


SCENARIOS = {
    "sam_sgd": _sam(torch.optim.SGD, lr=0.1, momentum=0.9),
    "sam_adamw": _sam(torch.optim.AdamW, lr=0.01),
    "sam_closure_data_restore": _sam_closure,
    "lion": _plain(lambda m: Lion(m.parameters(), lr=1e-2, weight_decay=0.1)),
    "lookahead": _plain(lambda m: Lookahead(torch.optim.Adam(m.parameters(), lr=0.01)), n=5),
    "global_optimizer_switched": _rebound(freeze=False),
    "global_optimizer_head_only": _rebound(freeze=True),
    "adam_moments_logged": _second_moments,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", SCENARIOS)
def test_user_optimizer_matches_eager(name, mode):
    assert_matches_eager(SCENARIOS[name], mode)
