"""What a compiled step would silently get wrong is a clear error instead: Python a program would not repeat."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from _models import train_step
from _steps import assert_same_state, mlp, mlp_batches, twin


def test_model_from_a_closure_trains():
    # (An optimizer from a closure trains too, and one the walker cannot reach is an error: test_closures.py.)
    eager, compiled = twin(mlp, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    model, opt = compiled
    step = tt.compile(lambda opt, x, y: train_step(model, opt, x, y), thin=True)
    for x, y in mlp_batches(5):
        torch.testing.assert_close(step(opt, x, y), train_step(*eager, x, y).detach())
    assert_same_state(eager, compiled)


def test_lr_scheduler_stepping_inside_the_step_is_a_clear_error():
    # It would run once, while tracing, and the compiled program would keep the first lr.
    (_, _), (m, opt) = twin(mlp, lambda ps: torch.optim.SGD(ps, lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step_fn(model, opt, sched, x, y):
        loss = train_step(model, opt, x, y)
        sched.step()
        return loss

    with pytest.raises(Exception, match=r"args\[1\].param_groups\[0\]\['lr'\] was changed inside the compiled function"):
        tt.compile(step_fn)(m, opt, sched, *mlp_batches(1)[0])
    assert opt.param_groups[0]["lr"] == 0.1


def test_backward_hooks_are_a_clear_error_where_they_would_not_run():
    x, y = mlp_batches(1)[0]
    # Gradient hooks on parameters: not run by a backward inside the function ...
    (_, _), (m, opt) = twin(mlp, lambda ps: torch.optim.SGD(ps, lr=0.1))
    m[0].weight.register_hook(lambda g: g * 0.5)
    with pytest.raises(Exception, match=r"gradient hooks .* on args\[0\].0.weight would not run"):
        tt.compile(train_step)(m, opt, x, y)
    # ... but run by PyTorch's engine around tt.compile(model): same .grad as eager.
    eager, compiled = twin(mlp, lambda ps: torch.optim.SGD(ps, lr=0.1))
    for model in (eager[0], compiled[0]):
        model[0].weight.register_hook(lambda g: g * 0.5)
    F.cross_entropy(eager[0](x), y).backward()
    F.cross_entropy(tt.compile(compiled[0])(x), y).backward()
    torch.testing.assert_close(compiled[0][0].weight.grad, eager[0][0].weight.grad)
    # Module backward hooks: not run by our backward on either path.
    (_, _), (m, opt) = twin(mlp, lambda ps: torch.optim.SGD(ps, lr=0.1))
    m[2].register_full_backward_pre_hook(lambda mod, go: (go[0] * 2,))
    with pytest.raises(Exception, match=r"module backward hooks .* on args\[0\].2 would not run"):
        tt.compile(train_step)(m, opt, x, y)
    with pytest.raises(Exception, match=r"module backward hooks .* would not run"):
        tt.compile(m)(x)
    with torch.no_grad():  # no gradients, nothing to refuse
        torch.testing.assert_close(tt.compile(m)(x), m(x))


def test_tensor_hooks_inside_are_a_clear_error():
    x, y = mlp_batches(1)[0]

    def hooked(model, x, y):
        h = model(x)
        h.register_hook(lambda g: g * 2)
        F.cross_entropy(h, y).backward()

    with pytest.raises(Exception, match="Tensor.register_hook inside a compiled function"):
        tt.compile(hooked)(mlp(), x, y)


def test_grad_scaler_inside_a_step_is_a_clear_error():
    m = nn.Linear(4, 2)
    opt = torch.optim.AdamW(m.parameters())
    scaler = torch.amp.GradScaler("cpu")

    def step_fn(m, opt, x):
        scaler.scale(m(x).sum()).backward()
        scaler.step(opt)
        scaler.update()

    with pytest.raises(Exception, match="GradScaler inside a compiled step is not supported yet.*bf16 autocast"):
        tt.compile(step_fn)(m, opt, torch.randn(3, 4))
