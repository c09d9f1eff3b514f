"""A custom optimizer's own attributes are guarded where its step reads them (acquisition/instance_reads.py, the
same watch as a module's): its public and private scalars, the objects and containers it holds.  Before, a step
reading ``self.scale`` or a Lookahead-style counter (``self._steps += 1``, averaging every ``k`` steps) ran the
program traced for the first value on every later call, silently."""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import thunder_train as tt

from _steps import squared_output_step


class Scaled(torch.optim.Optimizer):
    """SGD whose step reads attributes of its own: a public and a private scalar, a held object, a list of them."""

    def __init__(self, params):
        super().__init__(params, dict(lr=0.1))
        self.scale, self._private = 1.0, 1.0
        self.cfg = types.SimpleNamespace(clip=10.0)
        self.factors = [types.SimpleNamespace(f=1.0)]

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                p.add_(p.grad.clamp(-self.cfg.clip, self.cfg.clip),
                       alpha=-g["lr"] * self.scale * self._private * self.factors[0].f)


class Lookahead(torch.optim.Optimizer):
    """SGD with slow weights pulled towards the fast ones every ``k`` steps, counted in a Python attribute."""

    def __init__(self, params, k=2, alpha=0.5):
        super().__init__(params, dict(lr=0.1))
        self.k, self.alpha, self._steps = k, alpha, 0
        self.slow = [p.detach().clone() for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self):
        ps = [p for g in self.param_groups for p in g["params"]]
        for p in ps:
            p.add_(p.grad, alpha=-0.1)
        self._steps += 1
        if self._steps % self.k == 0:
            for p, s in zip(ps, self.slow):
                s.add_(p - s, alpha=self.alpha)
                p.copy_(s)


def _pair(make_opt):
    torch.manual_seed(0)
    m, ref = nn.Linear(4, 4), nn.Linear(4, 4)
    ref.load_state_dict(m.state_dict())
    return (m, make_opt(m.parameters())), (ref, make_opt(ref.parameters()))


CHANGES = {
    "a public scalar": lambda o: setattr(o, "scale", 2.0),
    "a private scalar": lambda o: setattr(o, "_private", 0.5),
    "a held object's field": lambda o: setattr(o.cfg, "clip", 0.01),
    "an object in a held list": lambda o: setattr(o.factors[0], "f", 3.0),
    "a held object replaced": lambda o: setattr(o, "cfg", types.SimpleNamespace(clip=0.1)),
}


@pytest.mark.parametrize("thin", [True, False])
@pytest.mark.parametrize("what", list(CHANGES))
def test_a_custom_optimizers_attribute_changed_between_steps(thin, what):
    (m, opt), (ref, ref_opt) = _pair(Scaled)
    cf = tt.compile(squared_output_step, thin=thin, fusion=None)
    x = torch.randn(3, 4)
    for i in range(6):
        if i == 3:
            CHANGES[what](opt)
            CHANGES[what](ref_opt)
        torch.testing.assert_close(cf(m, opt, x), squared_output_step(ref, ref_opt, x), rtol=0, atol=0)
        torch.testing.assert_close(m.weight, ref.weight, rtol=0, atol=0, msg=f"step {i}")
    assert any("args[1]." in r for r in tt.compile_stats(cf).retrace_reasons), tt.compile_stats(cf).retrace_reasons


@pytest.mark.parametrize("thin", [True, False])
def test_a_lookahead_counter_decides_as_in_eager(thin):
    (m, opt), (ref, ref_opt) = _pair(Lookahead)
    cf = tt.compile(squared_output_step, thin=thin, fusion=None)
    for i in range(6):
        x = torch.randn(3, 4)
        torch.testing.assert_close(cf(m, opt, x), squared_output_step(ref, ref_opt, x), rtol=0, atol=0)
        assert opt._steps == ref_opt._steps == i + 1
        torch.testing.assert_close(m.weight, ref.weight, rtol=0, atol=0, msg=f"step {i}")
        for s, t in zip(opt.slow, ref_opt.slow):
            torch.testing.assert_close(s, t, rtol=0, atol=0)


@pytest.mark.parametrize("fused", [False, True])
def test_a_builtin_optimizer_with_a_scheduler_retraces_nothing_more(fused):
    """torch's own bookkeeping on the optimizer (an LR scheduler's ``_opt_called``, fused Adam's device check
    flag) is not a guard: no retrace after the first step's state."""
    (m, opt), (ref, ref_opt) = _pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=fused))
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt, ref_opt)]
    cf = tt.compile(squared_output_step, thin=True, fusion=None)
    for i in range(6):
        x = torch.randn(3, 4)
        torch.testing.assert_close(cf(m, opt, x), squared_output_step(ref, ref_opt, x))
        for s in scheds:
            s.step()
    torch.testing.assert_close(m.weight, ref.weight)
    stats = tt.compile_stats(cf)
    assert stats.cache_misses <= 2, stats.retrace_reasons
