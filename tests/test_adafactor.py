"""``torch.optim.Adafactor`` inside a compiled step, against eager.

Its step computes the step size and the update's clipping in Python from ``.item()`` values (the step count, the
parameter's and the update's norms), choosing with ``max``/``min``, and mixes its second moments with ``lerp_`` by a
weight that is one of those numbers.  Compiled, those are runtime numbers the program computes on every call
(``torchlang/optim.py`` ``_NUMBER_CHOOSING``; ``lerp`` by a runtime number); it had raised a DataDependentError.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import thunder_train as tt


def _model():
    torch.manual_seed(0)
    # a matrix (factored second moments), a vector (a plain one), a 3-d weight (factored over its last two dims)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model.register_parameter("cube", nn.Parameter(torch.randn(2, 3, 4)))
    return model


def _step(model, opt, x, y):
    loss = F.mse_loss(model(x), y) + model.cube.pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("thin", [True, False], ids=["thin", "full"])
@pytest.mark.parametrize("options", [dict(), dict(weight_decay=0.1, maximize=True), dict(foreach=True),
                                     dict(lr=0.5, beta2_decay=-0.5, eps=(None, 1e-2))],
                         ids=["default", "decay-maximize", "foreach", "large-lr"])
def test_adafactor_steps_equal_eagers(thin, options):
    eager = _model()
    compiled = copy.deepcopy(eager)
    opt_e = torch.optim.Adafactor(eager.parameters(), **{"lr": 1e-2, **options})
    opt_c = torch.optim.Adafactor(compiled.parameters(), **{"lr": 1e-2, **options})
    step = tt.compile(_step, thin=thin)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        torch.testing.assert_close(step(compiled, opt_c, x, y), _step(eager, opt_e, x, y))
        for p, q in zip(eager.parameters(), compiled.parameters()):
            torch.testing.assert_close(q, p)
        for p, q in zip(eager.parameters(), compiled.parameters()):
            se, sc = opt_e.state[p], opt_c.state[q]
            assert se.keys() == sc.keys()
            for k in se:
                if se[k] is None:
                    assert sc[k] is None, k
                else:
                    torch.testing.assert_close(sc[k], se[k], msg=lambda m: f"state {k}: {m}")
    # (the first call finds no state; the step count is then a runtime number: no retrace per step)
    assert tt.compile_stats(step).cache_misses == 2


def test_an_lr_schedule_reaches_adafactor_as_a_runtime_number():
    eager = _model()
    compiled = copy.deepcopy(eager)
    opt_e, opt_c = (torch.optim.Adafactor(m.parameters(), lr=0.05) for m in (eager, compiled))
    sched_e, sched_c = (torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt_e, opt_c))
    step = tt.compile(_step, thin=True)
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        torch.testing.assert_close(step(compiled, opt_c, x, y), _step(eager, opt_e, x, y))
        sched_e.step()
        sched_c.step()
        for p, q in zip(eager.parameters(), compiled.parameters()):
            torch.testing.assert_close(q, p)
