"""Only the user's random ops touch the global generators (DESIGN.md 8b; issue 25 item 2).

After N steps of every mode the CPU generator is exactly where eager leaves it, with and without random ops in
the step, also across the default's background switch, and a ``DataLoader(shuffle=True)`` (whose sampler draws
its epoch seed from the global generator) gives eager's batch order. The payback estimate's stand-in values, the
meta runs that learn an opaque op's output, and unread random ops (dropped by DCE before) were the ways the
runtime moved the generator.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from thunder_train.compiler.executors import payback
from _inductor import cxx_available


def _model(dropout):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3 if dropout else 0.0), nn.Linear(16, 3))


def _fusible_model(dropout):
    """``_model`` with tanh-approximated GELU: its forward and backward have fusion forms the background fusion
    takes (the optimizer's updates, interleaved with the backward since transforms/early_updates.py, leave no
    region in ``_model``; tanh's backward is one eager kernel, ``tanh_backward``, no region either)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(approximate="tanh"), nn.Dropout(0.3 if dropout else 0.0),
                         nn.Linear(16, 3))


def _step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _unread_draw_step(model, opt, x, y):
    torch.rand(3)  # nobody reads it; eager's generator moves all the same
    F.dropout(x, 0.5)
    return _step(model, opt, x, y)


def _data(n=5):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def _train(step, model, data, seed=11):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(seed)
    losses = [step(model, opt, x, y) for x, y in data]
    return torch.stack(losses), torch.get_rng_state()


MODES = {
    "default": dict(),
    "unfused": dict(fusion=None),
    "inductor": dict(fusion="inductor"),
    "thin": dict(thin=True, fusion=None),
    "full": dict(thin=False, fusion=None),
}


@pytest.fixture
def default_fusion(monkeypatch):
    monkeypatch.delenv("THUNDER_TRAIN_FUSION", raising=False)  # tests/conftest.py turns the default off


@pytest.mark.parametrize("dropout", [False, True], ids=["no_random_op", "dropout"])
@pytest.mark.parametrize("mode", list(MODES))
def test_steps_leave_the_generator_where_eager_does(mode, dropout, default_fusion):
    if mode in ("inductor",) and not cxx_available():
        pytest.skip("Inductor's CPU backend needs a C++ compiler")
    eager, compiled = _model(dropout), _model(dropout)
    want = _train(_step, eager, _data())
    got = _train(tt.compile(_step, **MODES[mode]), compiled, _data())
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[1], want[1]), f"{mode}: the generator moved differently from eager"


@pytest.mark.parametrize("dropout", [False, True], ids=["no_random_op", "dropout"])
def test_compiled_module_leaves_the_generator_where_eager_does(dropout):
    eager, model = _model(dropout), _model(dropout)
    compiled = tt.compile(model)
    want = _train(_step, eager, _data())
    got = _train(_step, compiled, _data())
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("mode", ["default", "unfused", "thin"])
def test_an_unread_random_op_still_draws(mode, default_fusion):
    want = _train(_unread_draw_step, _model(False), _data(3))
    got = _train(tt.compile(_unread_draw_step, **MODES[mode]), _model(False), _data(3))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[1], want[1])


@pytest.mark.skipif(not cxx_available(), reason="Inductor's CPU backend needs a C++ compiler (none found)")
@pytest.mark.parametrize("dropout", [False, True], ids=["no_random_op", "dropout"])
def test_across_the_background_switch(monkeypatch, default_fusion, dropout):
    """The real pay-back estimate runs (it times the regions on stand-in values) and the build is made to start
    at the third call; the steps go on while it builds and after the fused program took over."""
    real = payback.decide
    monkeypatch.setattr(payback, "decide", lambda traces, call_s: dataclasses.replace(real(traces, call_s), start_at=3))
    cf = tt.compile(_step)
    data = _data(4)
    model = _fusible_model(dropout)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(11)
    got = [cf(model, opt, x, y) for x, y in data]
    assert tt.wait_for_fusion(cf, timeout=300)
    got += [cf(model, opt, x, y) for x, y in data]
    state = torch.get_rng_state()
    assert tt.compile_stats(cf).fusion_switches == 1, tt.compile_stats(cf).fusion_notes
    eager = _fusible_model(dropout)
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    torch.manual_seed(11)
    want = [_step(eager, opt, x, y) for x, y in data + data]
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("mode", ["default", "thin"])
def test_dataloader_shuffle_order_is_eagers(mode, default_fusion):
    """The sampler draws each epoch's permutation seed from the global generator."""
    xs, ys = torch.randn(12, 6), torch.randint(0, 3, (12,))
    dataset = torch.utils.data.TensorDataset(torch.arange(12), xs, ys)

    def epochs(step, model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(5)
        loader = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True)
        order, losses = [], []
        for _ in range(3):
            for idx, x, y in loader:
                order += idx.tolist()
                losses.append(step(model, opt, x, y))
        return order, torch.stack(losses)

    want_order, want = epochs(_step, _model(True))
    got_order, got = epochs(tt.compile(_step, **MODES[mode]), _model(True))
    assert got_order == want_order
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("call", [
    lambda x: torch.randint_like(x, 10, device="cpu"),
    lambda x: torch.randint_like(x, 2, 10, dtype=torch.float64, device=torch.device("cpu")),
    lambda x: torch.randint_like(x, 10),
    lambda x: x * torch.rand_like(x, device="cpu"),
], ids=["randint_like-device", "randint_like-low-dtype-device", "randint_like", "rand_like-device"])
def test_a_random_op_given_a_device_draws_only_when_the_program_runs(call):
    # randint_like runs opaquely; its meta runs (to learn its result) ran on the device it was given, for real: a CPU
    # tensor drawn from the CPU generator while tracing (refused: the generator moved outside the traced program).
    # Meta runs now make their results on the meta device, and a draw is placed by the device an op is given.
    x = torch.randn(6)
    cf = tt.compile(call)
    for _ in range(2):
        torch.manual_seed(5)
        got, after = cf(x), torch.get_rng_state()
        torch.manual_seed(5)
        want = call(x)
        assert torch.equal(got, want) and got.dtype == want.dtype
        assert torch.equal(after, torch.get_rng_state())
