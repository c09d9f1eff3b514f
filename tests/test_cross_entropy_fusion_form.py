"""Cross-entropy's fusion forms (torchlang/cross_entropy_fusion_form.py): what a fused CUDA program compiles for a
language model's loss and its gradient (a log-sum-exp and a gather; ``(softmax - onehot) * g``).

The functions are compared with eager here directly; the whole path (regions formed around the loss, Inductor's
kernels, values of a training step) runs on the CPU by adding ``"cpu"`` to the forms' devices, through Inductor's
C++ kernels (on CUDA: tests/test_cuda.py, Triton's).  By default a CPU program keeps eager's kernels (bitwise)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from _inductor import cxx_available
from thunder_train.compiler.torchlang import cross_entropy_fusion_form as form


def _logits_and_targets(dtype, rows=37, classes=301, ignored=(3, 10)):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(rows, classes, generator=g) * 5).to(dtype)
    t = torch.randint(0, classes, (rows,), generator=g)
    t[list(ignored)] = -100
    return x, t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignored", [(3, 10), (), tuple(range(37))], ids=["some-ignored", "none-ignored", "all-ignored"])
def test_forms_compute_eagers_loss_and_gradient(dtype, reduction, ignored):
    x, t = _logits_and_targets(dtype, ignored=ignored)
    xr = x.clone().requires_grad_()
    want = F.cross_entropy(xr, t, reduction=reduction)
    g = torch.tensor(0.75, dtype=dtype)
    want.backward(g)
    got = form.cross_entropy_by_logsumexp(x, t, reduction=reduction)
    grad, = form.cross_entropy_grad_by_softmax(g, (), x, t, reduction=reduction)
    torch.testing.assert_close(got, want.detach(), equal_nan=True)  # all ignored, mean: nan as eager's 0/0
    torch.testing.assert_close(grad, xr.grad, equal_nan=True)
    if ignored:
        assert torch.equal(grad[list(ignored)], torch.zeros_like(grad[list(ignored)]))


def _step(model, opt, x, y, smoothing=0.0):
    loss = F.cross_entropy(model(x).float(), y, label_smoothing=smoothing)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _train(fn, smoothing=0.0, steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 301))
    twin = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin)]
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x, y = torch.randn(40, 24, generator=g), torch.randint(0, 301, (40,), generator=g)
        y[i] = -100
        torch.testing.assert_close(fn(twin, opts[1], x, y, smoothing), _step(model, opts[0], x, y, smoothing).detach())
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not cxx_available(), reason="Inductor's CPU backend needs a C++ compiler (none found)")
def test_fused_program_computes_the_loss_by_the_forms(monkeypatch):
    """With the forms applying on the CPU (as on CUDA), a whole step's loss and gradient are one fused region, no
    log-probabilities are kept, and the step trains as eager does."""
    monkeypatch.setattr(form, "DEVICES", {"cpu", "cuda"})
    cf = tt.compile(_step, thin=True, fusion="inductor")
    _train(cf)
    notes = "\n".join(tt.compile_stats(cf).fusion_notes)
    assert "cross_entropy, cross_entropy_vjp" in notes, notes
    src = str(tt.last_traces(cf)[-1])
    assert "cross_entropy_with_stats" not in src and "cross_entropy_into_logits" not in src, src


@pytest.mark.skipif(not cxx_available(), reason="Inductor's CPU backend needs a C++ compiler (none found)")
def test_label_smoothing_keeps_eagers_kernels(monkeypatch):
    """What the forms do not compute (here label smoothing) stays eager's kernels, in a fused program too."""
    monkeypatch.setattr(form, "DEVICES", {"cpu", "cuda"})
    cf = tt.compile(_step, thin=True, fusion="inductor")
    _train(cf, smoothing=0.1, steps=2)
    assert not any("cross_entropy" in n for n in tt.compile_stats(cf).fusion_notes)


def test_cpu_programs_keep_eagers_kernels_by_default():
    """On the CPU the forms do not apply: the fused program runs eager's kernels by blocks of rows (bitwise)."""
    assert form.DEVICES == {"cuda"}
    cf = tt.compile(_step, thin=True, fusion="inductor")
    _train(cf, steps=1)
    assert "ttex.cross_entropy_into_logits" in str(tt.last_traces(cf)[-1])
