"""A compiled call that raises leaves parameters, optimizer state, buffers and ``.grad`` as they were (issue 14)."""
import pytest
import torch
import torch.nn.functional as F

import thunder_train as tt
from _thin_twin import Twin, snapshot, assert_same_inputs, small_model

MODES = [pytest.param(dict(thin=True), id="thin"), pytest.param(dict(thin=False), id="full")]


def ce_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def clipped_step(model, opt, x, y):
    loss = F.mse_loss(model(x), y) * y.sum()  # y.sum() = inf makes every gradient non-finite
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    opt.step()
    opt.zero_grad()
    return loss


def _bound(step, make_batch, mode):
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    cf = tt.compile(step, **mode)
    for _ in range(3):
        cf(model, opt, *make_batch())
    assert cf.is_thin_bound == mode["thin"]
    return model, opt, cf


@pytest.mark.parametrize("mode", MODES)
def test_error_inside_the_program_changes_nothing(mode):
    g = torch.Generator().manual_seed(0)
    model, opt, cf = _bound(ce_step, lambda: (torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)), mode)
    before = snapshot(model, opt)
    bad = torch.tensor([0, 1, 2, 7, 0, 1, 2, 0])  # class 7 of 3: cross_entropy raises after BatchNorm ran
    with pytest.raises((IndexError, RuntimeError)):
        ce_step(small_model(), torch.optim.AdamW(small_model().parameters()), torch.randn(8, 4), bad)  # eager raises too
    with pytest.raises((IndexError, RuntimeError)):
        cf(model, opt, torch.randn(8, 4, generator=g), bad)
    assert_same_inputs(before, snapshot(model, opt), "error inside the program")


@pytest.mark.parametrize("mode", MODES)
def test_clip_grad_norm_nonfinite_changes_nothing(mode):
    g = torch.Generator().manual_seed(0)
    model, opt, cf = _bound(clipped_step, lambda: (torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)), mode)
    before = snapshot(model, opt)
    y = torch.randn(8, 3)
    y[0, 0] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite"):
        cf(model, opt, torch.randn(8, 4, generator=g), y)
    assert_same_inputs(before, snapshot(model, opt), "clip_grad_norm_(error_if_nonfinite=True)")


def test_a_batch_the_binding_refuses_runs_as_eager():
    # Issue 26: a per-call input the bound program does not accept takes the full path (no ThinModeError).
    t = Twin(thin=True)
    t.steps(3)
    assert t.step(t.batch(5)) == (None, None)  # compared with eager: result, parameters, .grad, optimizer state
    t.steps(2)
    assert tt.compile_stats(t.compiled).thin_fallbacks == 1
