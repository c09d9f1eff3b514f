"""thin_call's checks (runtime/thin_checks.py): where torch's C++ guards refuse a bound object, the binding is
generated once with every check in Python (no second generation after an error), and it still catches changes."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import thunder_train as tt
from thunder_train.compiler import bulk


def _step(model, opt, x, y):
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_refused_objects_give_python_checks_that_still_catch_changes(monkeypatch):
    if "meta" not in bulk.supported():
        pytest.skip("this torch has no usable C++ metadata guards (thin mode checks in Python anyway)")
    asked = []

    def refuse(tensors):
        asked.append(len(tensors))
        raise TypeError("not a tensor this guard takes")

    monkeypatch.setattr(bulk, "tensor_meta_check", refuse)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step = tt.compile(_step, thin=True, fusion=None)
    for _ in range(4):
        x, y = torch.randn(5, 4), torch.randn(5, 2)
        torch.testing.assert_close(step(model, opt, x, y), _step(ref, ref_opt, x, y))
    assert step.is_thin_bound and len(asked) == 1, asked  # asked once, before generating
    source = str(tt.last_prologue_traces(step)[-1])
    assert "_meta_check(" not in source and "_list(map(_stride" in source and "_list(map(_rg" in source
    # A frozen parameter changes what the program computes: the Python check re-validates.
    model[0].weight.requires_grad_(False)
    ref[0].weight.requires_grad_(False)
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    torch.testing.assert_close(step(model, opt, x, y), _step(ref, ref_opt, x, y))
    assert any("requires_grad" in r for r in tt.compile_stats(step).thin_invalidations), tt.compile_stats(step).thin_invalidations
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    # A batch of another shape: the per-call check refuses it and the call runs the full path as eager would
    # (issue 26: thin mode across sizes), updating the parameters as eager does.
    for _ in range(2):
        x, y = torch.randn(5, 4), torch.randn(5, 2)
        torch.testing.assert_close(step(model, opt, x, y), _step(ref, ref_opt, x, y))
    assert step.is_thin_bound
    fallbacks = tt.compile_stats(step).thin_fallbacks
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    torch.testing.assert_close(step(model, opt, x, y), _step(ref, ref_opt, x, y))
    assert tt.compile_stats(step).thin_fallbacks == fallbacks + 1
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
