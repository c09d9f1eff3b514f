"""Optimizers that keep their parameters in an attribute besides ``param_groups``.

torch's LBFGS sets ``self._params = self.param_groups[0]["params"]`` and reads ``p.grad`` through it.  While tracing,
``param_groups`` holds the traced parameters (walker.py); ``_params`` still held the real ones, so the step read the
gradients the parameters had *before* the call (a silently wrong update once LBFGS had state).  Now an attribute
that is a group's ``params`` list itself sees the traced list too, and one holding the parameters otherwise is
refused.  Each case runs eagerly and compiled (thin, full, ``fusion=None``); what is refused leaves the model,
optimizer and random state as they were.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import thunder_train as tt

MODES = {"thin": dict(thin=True), "full": dict(), "nofuse": dict(fusion=None)}


class _AliasSGD(torch.optim.Optimizer):
    """A hand-written optimizer in LBFGS's style: it walks ``self._params``, the group's own list."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))
        self._params = self.param_groups[0]["params"]

    @torch.no_grad()
    def step(self):
        lr = self.param_groups[0]["lr"]
        for p in self._params:
            buf = self.state[p].setdefault("buf", torch.zeros_like(p))
            buf.mul_(0.9).add_(p.grad)
            p.add_(buf, alpha=-lr)


class _CopySGD(_AliasSGD):
    def __init__(self, params, lr):
        super().__init__(params, lr)
        self._params = list(self.param_groups[0]["params"])  # a copy: not what param_groups holds while tracing


def _run(make_opt, kw, steps=3):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = make_opt(m.parameters())
    xs = [torch.randn(6, 4) for _ in range(steps + 1)]

    def step(x):
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step(xs[0])  # state exists before the compiled calls
    f = step if kw is None else tt.compile(step, **kw)
    return [f(x) for x in xs[1:]], m, opt


@pytest.mark.parametrize("mode", MODES)
def test_optimizer_walking_its_group_list_through_an_attribute(mode):
    ref, m, opt = _run(lambda p: _AliasSGD(p, 0.1), None)
    got, cm, copt = _run(lambda p: _AliasSGD(p, 0.1), MODES[mode])
    torch.testing.assert_close(torch.stack(got), torch.stack(ref))
    for p, q in zip(m.parameters(), cm.parameters()):
        torch.testing.assert_close(q, p)
        torch.testing.assert_close(copt.state[q]["buf"], opt.state[p]["buf"])
    assert copt._params is copt.param_groups[0]["params"]


def _snapshot(m, opt):
    out = [t.detach().clone() for t in m.parameters()]
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                out.append(v.clone())
            elif isinstance(v, list):
                out.extend(x.clone() for x in v if torch.is_tensor(x))
    return out


def _refused(make_opt, mode, match, closure=False):
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    opt = make_opt(m.parameters())
    x0, x = torch.randn(6, 4), torch.randn(6, 4)

    def step(x):
        if closure:
            def closure_fn():
                opt.zero_grad()
                loss = m(x).square().mean()
                loss.backward()
                return loss
            return opt.step(closure_fn)
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step(x0)
    before, rng = _snapshot(m, opt), torch.get_rng_state()
    with pytest.raises(Exception, match=match):
        tt.compile(step, **MODES[mode])(x)
    after = _snapshot(m, opt)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("mode", ["thin", "full"])
def test_optimizer_holding_a_copy_of_its_parameters_is_refused(mode):
    _refused(lambda p: _CopySGD(p, 0.1), mode, "holds the optimizer's parameters apart from param_groups")


@pytest.mark.parametrize("mode", ["thin", "full"])
def test_lbfgs_with_state_is_refused_not_run_on_stale_gradients(mode):
    """It ran before, updating with the previous call's gradients; now its data-dependent steps are refused."""
    _refused(lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=4, history_size=3), mode, "needs the value of a tensor",
             closure=True)
