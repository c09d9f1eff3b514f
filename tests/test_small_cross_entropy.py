"""Cross-entropy of small logits compiled whole in fused programs (executors/small_cross_entropy.py): the loss, the
log-probabilities, the count of targets and the gradient against eager's kernels; a target out of range raises
eager's error; large logits keep eager's kernels."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import thunder_train as tt
from thunder_train.compiler.executors import saved_statistics, small_cross_entropy

cxx = pytest.mark.skipif(not __import__("_inductor").cxx_available(), reason="Inductor's CPU fusion needs a C++ compiler")


def _targets(rows, classes, ignored=(), seed=0):
    t = torch.randint(0, classes, (rows,), generator=torch.Generator().manual_seed(seed))
    t[list(ignored)] = -100
    return t


@pytest.mark.parametrize("reduction", [1, 2])
@pytest.mark.parametrize("ignored", [(), (0, 5), tuple(range(7))])
def test_the_forms_compute_eagers_kernels_values(reduction, ignored):
    x = torch.randn(7, 11, dtype=torch.float64)
    t = _targets(7, 11, ignored)
    loss, logp, total = small_cross_entropy.cross_entropy_small(x, t, -100, reduction)
    want_loss, want_logp, want_total = saved_statistics.cross_entropy_into_logits(x.clone(), t, -100, reduction)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-12)
    torch.testing.assert_close(total, want_total)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-12, equal_nan=True)  # all ignored: NaN, as eager
    assert small_cross_entropy.classes_matched(loss, logp, total)
    g = torch.tensor(0.7, dtype=torch.float64)
    (grad,) = small_cross_entropy.cross_entropy_backward_small(g, logp, t, total, -100, reduction)
    (want,) = saved_statistics.cross_entropy_backward_into_logp(g, want_logp.clone(), t, want_total, -100, reduction)
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("bad", [11, 40, -1, -7])
def test_a_target_that_is_no_class_makes_the_count_nan(bad):
    x, t = torch.randn(5, 11), _targets(5, 11, (1,))
    t[3] = bad
    assert not small_cross_entropy.classes_matched(*small_cross_entropy.cross_entropy_small(x, t, -100, 1))


def _classifier_step(model, opt, x, y, reduction="mean"):
    loss = F.cross_entropy(model(x), y, reduction=reduction)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _setup(dtype=torch.float32, classes=10):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, classes)).to(dtype)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _lines(cf) -> str:
    return "\n".join(line for line in tt.last_traces(cf)[-1].python_source().splitlines() if "cross_entropy" in line)


@cxx
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_fused_classifier_step_trains_as_eager(reduction):
    base, _ = _setup(torch.float64)
    (m1, m2) = copy.deepcopy(base), copy.deepcopy(base)
    o1, o2 = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (m1, m2))
    cf = tt.compile(_classifier_step, thin=True, fusion="inductor")
    for i in range(4):
        x, y = torch.randn(12, 16, dtype=torch.float64), _targets(12, 10, (2, 9) if i % 2 else (), seed=i)
        got, want = cf(m2, o2, x, y, reduction), _classifier_step(m1, o1, x, y, reduction)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for a, b in zip(m2.parameters(), m1.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert "compiled whole" in _lines(cf) and _lines(cf).count("inductor_line") >= 2, _lines(cf)


@cxx
@pytest.mark.parametrize("bad", [10, 25, -3])
def test_a_target_out_of_range_raises_eagers_error_and_the_step_goes_on(bad):
    model, opt = _setup()
    cf = tt.compile(_classifier_step, thin=True, fusion="inductor")
    x = torch.randn(12, 16)
    for i in range(3):
        cf(model, opt, x, _targets(12, 10, seed=i))
    assert "compiled whole" in _lines(cf)
    y = _targets(12, 10, (4,))
    y[7] = bad
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
        cf(model, opt, x, y)
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
        _classifier_step(copy.deepcopy(model), opt, x, y)  # eager's error
    # nothing was updated (the error is raised in the forward), and valid targets train again
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert torch.isfinite(cf(model, opt, x, _targets(12, 10, seed=5)))


@cxx
def test_large_logits_keep_eagers_kernels(monkeypatch):
    monkeypatch.setattr(small_cross_entropy, "SMALL_LOGITS", 12 * 10 - 1)
    model, opt = _setup()
    cf = tt.compile(_classifier_step, thin=True, fusion="inductor")
    for i in range(2):
        cf(model, opt, torch.randn(12, 16), _targets(12, 10, seed=i))
    assert "compiled whole" not in _lines(cf) and "ttex.cross_entropy_into_logits(" in _lines(cf), _lines(cf)
