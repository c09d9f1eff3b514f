"""Reentrant activation checkpointing inside compiled functions gives eager's values, gradients, parameter updates
and generator state (issue 25 item 9; compiler/acquisition/checkpoint.py), with dropout inside the checkpointed function, in
whole steps (full and thin) and through ``tt.compile(model)``.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import thunder_train as tt
from thunder_train.compiler.errors import TracingError


class Block(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.a, self.b, self.p = nn.Linear(8, 8), nn.Linear(8, 8), p

    def forward(self, x):
        return self.b(F.dropout(torch.tanh(self.a(x)), self.p, self.training)) + x


class Net(nn.Module):
    def __init__(self, p=0.3, **kw):
        super().__init__()
        self.inp, self.out = nn.Linear(4, 8), nn.Linear(8, 2)
        self.blocks = nn.ModuleList([Block(p), Block(p)])
        self.kw = kw

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = checkpoint(b, h, **self.kw)
        return self.out(h)


class SeqNet(nn.Module):
    """checkpoint_sequential over the raw input: the first segment's input needs no gradient, so eager gives its
    parameters none (a known property of the reentrant form)."""

    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x):
        return checkpoint_sequential(self.seq, 3, x, use_reentrant=True)


def _step(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _grads_step(model, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.detach()


def _train(model, step, n=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)) for _ in range(n)]
    torch.manual_seed(1)
    return torch.stack([step(model, opt, x, y) for x, y in data]), torch.get_rng_state()


def _compare(eager, compiled, want, got):
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[1], want[1]), "the generator is left in another state than eager leaves it"
    for (n, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


HOW = ["full", "thin", "module"]


def _compiled_train(model, how):
    if how == "module":
        return _train(tt.compile(model), _step)
    return _train(model, tt.compile(_step, thin=how == "thin"))


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("kw", [dict(use_reentrant=True), dict(use_reentrant=True, preserve_rng_state=True)],
                         ids=["default", "preserve"])
def test_reentrant_checkpoint_with_dropout(kw, how):
    torch.manual_seed(0)
    eager = Net(**kw)
    model = copy.deepcopy(eager)
    _compare(eager, model, _train(eager, _step), _compiled_train(model, how))


@pytest.mark.parametrize("how", HOW)
def test_no_preserved_rng_state_without_random_ops(how):
    torch.manual_seed(0)
    eager = Net(p=0.0, use_reentrant=True, preserve_rng_state=False)
    model = copy.deepcopy(eager)
    _compare(eager, model, _train(eager, _step), _compiled_train(model, how))


def test_no_preserved_rng_state_around_random_ops_is_refused_clearly():
    torch.manual_seed(0)
    model = Net(use_reentrant=True, preserve_rng_state=False)
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    state = torch.get_rng_state()
    with pytest.raises(TracingError, match="preserve_rng_state=True"):
        tt.compile(_step)(model, opt, x, y)
    assert torch.equal(torch.get_rng_state(), state)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


@pytest.mark.parametrize("how", ["full", "module"])
def test_checkpoint_sequential_gradients_including_the_missing_ones(how):
    torch.manual_seed(0)
    eager = SeqNet()
    model = copy.deepcopy(eager)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad"):
        want = _grads_step(eager, x, y)
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad"):
        got = tt.compile(_grads_step)(model, x, y) if how == "full" else _grads_step(tt.compile(model), x, y)
    torch.testing.assert_close(got, want)
    for (n, a), b in zip(eager.named_parameters(), model.parameters()):
        assert (a.grad is None) == (b.grad is None), n
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)
    assert eager.seq[0].weight.grad is None  # the case is what it claims


def test_gpt2_gradient_checkpointing_reentrant():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=16,
                                  resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    torch.manual_seed(0)
    eager = transformers.GPT2LMHeadModel(cfg)
    eager.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    eager.train()
    model = copy.deepcopy(eager)

    def step(m, opt, ids):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def run(m, stepper):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(3)
        batches = [torch.randint(0, 50, (2, 8), generator=g) for _ in range(2)]
        torch.manual_seed(4)
        return torch.stack([stepper(m, opt, ids) for ids in batches]), torch.get_rng_state()

    want = run(eager, step)
    got = run(model, tt.compile(step))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], want[1])
    for (n, a), b in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
