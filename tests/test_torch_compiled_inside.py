"""``torch.compile``'d modules and functions reached while tracing (compiler/acquisition/torch_compiled.py): a model
wrapped by ``torch.compile`` or a ``@torch.compile`` loss function called by the step failed deep inside Inductor
("BackendCompilerFailed") with pages of graph-break logs; they are traced as their Python code, as eager runs them."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import thunder_train as tt


@pytest.mark.parametrize("thin", [False, True])
def test_a_torch_compiled_model_and_loss_inside_a_compiled_step_train_as_eager(thin):
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(3, 4), nn.GELU(), nn.Linear(4, 1))
    model = copy.deepcopy(eager)
    wrapped = torch.compile(model)
    eopt, copt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model))

    @torch.compile
    def compiled_loss(y):
        return y.square().mean()

    def step(m, o, x, loss_fn):
        loss = loss_fn(m(x))
        loss.backward()
        o.step()
        o.zero_grad()
        return loss

    cf = tt.compile(step, thin=thin)
    for _ in range(3):
        x = torch.randn(5, 3)
        assert torch.equal(cf(wrapped, copt, x, compiled_loss), step(eager, eopt, x, lambda y: y.square().mean()))
    for p, q in zip(eager.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert torch._dynamo.config.disable is False  # put back after each trace


def test_tt_compile_of_a_torch_compiled_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    compiled = tt.compile(torch.compile(model))
    x = torch.randn(2, 3)
    for _ in range(2):
        assert torch.equal(compiled(x), model(x))
