"""Python attributes set on input tensors and read by the function (compiler/acquisition/tensor_attributes.py):
before, the proxy standing for the tensor had none, so ``getattr(self.lin.weight, "scaled", False)`` in a forward
traced the default branch whatever the parameter held, silently otherwise than eager from the first call."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import thunder_train as tt
from _steps import squared_output_step as _step


class _Flagged(nn.Module):
    """Reads Python attributes of its parameter and of its input, as some model code does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        y = self.lin(x)
        if getattr(self.lin.weight, "scaled", False):
            y = y * self.lin.weight.factor
        if getattr(x, "mask", None) is not None:
            y = y * x.mask
        return y


def _twins(how):
    torch.manual_seed(0)
    eager = _Flagged()
    model = copy.deepcopy(eager)
    eopt, copt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model))
    if how == "module":
        cmod = tt.compile(model)
        return eager, eopt, model, copt, (lambda m, o, x: _step(cmod, o, x))
    return eager, eopt, model, copt, tt.compile(_step, thin=how == "thin")


def _same(eager, model):
    return all(torch.equal(p, q) for p, q in zip(eager.parameters(), model.parameters()))


@pytest.mark.parametrize("how", ["thin", "full", "module"])
def test_a_parameters_attribute_read_by_the_forward_is_an_input(how):
    eager, eopt, model, copt, cf = _twins(how)
    for m in (eager, model):
        m.lin.weight.scaled, m.lin.weight.factor = True, 3.0  # set before the first call: eager's branch
    x = torch.randn(4, 3)
    for _ in range(3):
        assert torch.equal(cf(model, copt, x), _step(eager, eopt, x))
    for m in (eager, model):
        m.lin.weight.factor = 0.5  # a new value: traced again
    assert torch.equal(cf(model, copt, x), _step(eager, eopt, x))
    for m in (eager, model):
        m.lin.weight.scaled = False
    for _ in range(2):
        assert torch.equal(cf(model, copt, x), _step(eager, eopt, x))
    assert _same(eager, model)


@pytest.mark.parametrize("how", ["thin", "full"])
def test_an_input_tensors_attribute_read_by_the_forward_is_an_input(how):
    eager, eopt, model, copt, cf = _twins(how)
    for i in range(4):
        x = torch.randn(4, 3)
        x.mask = torch.tensor([1.0, 0.0, 1.0]) * (i + 1)  # a tensor attribute: read as an input on every call
        assert torch.equal(cf(model, copt, x), _step(eager, eopt, x))
    assert _same(eager, model)


def test_an_attribute_the_function_does_not_read_guards_nothing():
    eager, eopt, model, copt, cf = _twins("thin")
    x = torch.randn(4, 3)
    for i in range(4):
        model.lin.bias.note = f"step {i}"  # bookkeeping on a tensor no forward reads: no new trace
        assert torch.equal(cf(model, copt, x), _step(eager, eopt, x))
    assert tt.compile_stats(cf).cache_misses == 1
