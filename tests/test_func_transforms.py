"""torch.func transforms inside a compiled function are refused while tracing, with what to do.

``torch.func.grad(loss_fn)(params, x)`` or ``torch.vmap`` inside a step traced a program holding the transform's
wrapped tracer tensors, which failed when the program ran with "thunder_train internal error: ... reached torch
dispatch with a proxy".  ``functional_call`` alone (no transform) works as in eager.
"""
from __future__ import annotations

import pytest
import torch

import thunder_train as tt
from thunder_train.compiler.errors import TracingError


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def _loss(m, params, x):
    return torch.func.functional_call(m, params, (x,)).pow(2).sum()


def _func_grad(m, params, x):
    return torch.func.grad(lambda p: _loss(m, p, x))(params)


def _vmapped(m, params, x):
    return torch.vmap(lambda row: row @ params["weight"].t())(x)


@pytest.mark.parametrize("step", [_func_grad, _vmapped])
def test_func_transform_inside_is_refused_leaving_inputs_untouched(step):
    m = _model()
    params = {k: v.detach().clone() for k, v in m.named_parameters()}
    before = {k: v.clone() for k, v in params.items()}
    with pytest.raises(TracingError, match="torch.func transform"):
        tt.compile(step)(m, params, torch.ones(3, 4))
    for k in params:
        torch.testing.assert_close(params[k], before[k])


@pytest.mark.parametrize("thin", [False, True])
def test_functional_call_with_autograd_grad_matches_eager(thin):
    def step(m, params, x):
        loss = _loss(m, params, x)
        grads = torch.autograd.grad(loss, list(params.values()))
        return {k: v - 0.1 * g for (k, v), g in zip(params.items(), grads)}

    m = _model()
    compiled = tt.compile(step, thin=thin)
    p = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
    pc = {k: v.detach().clone().requires_grad_() for k, v in m.named_parameters()}
    for i in range(3):
        x = torch.full((3, 4), float(i + 1))
        p = {k: v.detach().requires_grad_() for k, v in step(m, p, x).items()}
        pc = {k: v.detach().requires_grad_() for k, v in compiled(m, pc, x).items()}
    for k in p:
        torch.testing.assert_close(pc[k], p[k])
