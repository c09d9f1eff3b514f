"""Seeding, reading and restoring the generators inside a compiled function behave as in eager on every call
(DESIGN.md 8b "Random state is a value of the program"; issue 29 item 3): ``torch.manual_seed``,
``torch.get_rng_state``/``set_rng_state``, ``torch.random.fork_rng`` (and the ``torch.cuda`` forms where CUDA
runs) are lines of the program (prims/generators.py). Each case compares every call's values and the generator
state after it with eager.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt

MODES = {"full": dict(fusion=None), "thin": dict(thin=True, fusion=None), "inductor": dict(fusion="inductor")}


def _reseed(x):
    torch.manual_seed(4)
    return x + torch.randn(3)


def _restore(x):
    s = torch.get_rng_state()
    a = torch.rand(3)
    torch.set_rng_state(s)
    return x + a - torch.rand(3), s  # zero: the same numbers twice


def _fork(x):
    with torch.random.fork_rng():
        y = F.dropout(x, 0.5)
    return y + torch.rand(3)  # the draw after fork_rng sees the state from before it


def _random_module(x):
    torch.random.manual_seed(1)
    s = torch.random.get_rng_state()
    y = x * torch.rand(3)
    torch.random.set_rng_state(s)
    return y + torch.rand(3)


def _seed_from_argument(x, seed):
    torch.manual_seed(seed)
    return x + torch.randn(3)


def _unread_state(x):
    torch.get_rng_state()  # read and dropped: changes nothing
    torch.manual_seed(9)  # its result (the generator) is dropped too, the seeding stays
    return x + torch.rand(3)


CASES = {"manual_seed": _reseed, "get_set": _restore, "fork_rng": _fork, "torch.random": _random_module,
         "unread": _unread_state}


def _calls(fn, n=3, start=100):
    out = []
    for i in range(n):
        torch.manual_seed(start + i)  # a different stream before each call
        r = fn(torch.ones(3))
        out.append((r, torch.get_rng_state()))
    return out


def _same(got, want):
    for (r1, s1), (r2, s2) in zip(got, want):
        for a, b in zip(torch.utils._pytree.tree_leaves(r1), torch.utils._pytree.tree_leaves(r2)):
            assert torch.equal(a, b)
        assert torch.equal(s1, s2), "the generator is left in another state than eager leaves it"


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(CASES))
def test_every_call_draws_what_eager_draws(case, mode):
    fn = CASES[case]
    _same(_calls(tt.compile(fn, **MODES[mode])), _calls(fn))


def test_seed_from_an_argument():
    cf = tt.compile(_seed_from_argument)
    for seed in (1, 2, 1):
        torch.manual_seed(0)
        want = _seed_from_argument(torch.ones(3), seed)
        torch.manual_seed(0)
        assert torch.equal(cf(torch.ones(3), seed), want)


def test_a_state_passed_in_is_set_on_every_call():
    def step(x, state):
        torch.set_rng_state(state)
        return x + torch.rand(3)

    cf = tt.compile(step)
    torch.manual_seed(3)
    saved = torch.get_rng_state()
    first = torch.rand(3)
    for _ in range(3):
        torch.rand(7)
        assert torch.equal(cf(torch.zeros(3), saved), first)


def test_an_invalid_state_raises_eagers_error():
    def step(x):
        torch.set_rng_state(torch.zeros(5056, dtype=torch.uint8).add(1))
        return x

    with pytest.raises(RuntimeError, match="Invalid mt19937 state"):
        step(torch.zeros(3))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="Invalid mt19937 state"):
        tt.compile(step)(torch.zeros(3))
    assert torch.equal(torch.get_rng_state(), before)


class _SeededNoise(nn.Module):
    """A layer that draws its noise from a fixed stream and leaves the caller's stream alone (fork_rng)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        with torch.random.fork_rng():
            torch.manual_seed(17)
            noise = torch.randn_like(x)
        return F.dropout(self.lin(x + noise), 0.3, self.training)


@pytest.mark.parametrize("how", ["step", "module"])
def test_training_with_seeded_layers_matches_eager(how):
    torch.manual_seed(0)
    eager = _SeededNoise()
    model = copy.deepcopy(eager)

    def step(m, opt, x):
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def run(m, stepper):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        torch.manual_seed(5)
        losses = [stepper(m, opt, torch.randn(3, 4)) for _ in range(3)]
        return torch.stack(losses), torch.get_rng_state()

    want = run(eager, step)
    got = run(tt.compile(model), step) if how == "module" else run(model, tt.compile(step))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[1], want[1])
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA generators need CUDA")
def test_cuda_state_functions():
    def step(x):
        s = torch.cuda.get_rng_state()
        a = torch.rand(3, device="cuda")
        torch.cuda.set_rng_state(s)
        torch.cuda.manual_seed(2)
        b = torch.rand(3, device="cuda")
        with torch.random.fork_rng(devices=[0]):
            c = torch.rand(3, device="cuda")
        return x + a + b + c + torch.rand(3, device="cuda")

    cf = tt.compile(step)
    for i in range(3):
        torch.manual_seed(i)
        want = step(torch.ones(3, device="cuda"))
        ws = torch.cuda.get_rng_state()
        torch.manual_seed(i)
        assert torch.equal(cf(torch.ones(3, device="cuda")), want)
        assert torch.equal(torch.cuda.get_rng_state(), ws)
