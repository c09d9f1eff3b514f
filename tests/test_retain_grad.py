"""``retain_grad()`` and ``is_leaf`` inside a compiled function, against eager.

``h.retain_grad()`` on a computed value did nothing while tracing: ``h.grad`` stayed None after a backward
(inside the step, or outside on the returned ``h``) where eager's holds the gradient.  It is refused with what to
do; on a leaf it is eager's no-op, without grad eager's error.  ``is_leaf`` answered True for every value.
"""
from __future__ import annotations

import pytest
import torch

import thunder_train as tt
from thunder_train.compiler.errors import TracingError


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _inside(m, x):
    h = m(x)
    h.retain_grad()
    (h.sum() * 2).backward()
    return h.grad


def _returned(m, x):
    h = m(x)
    h.retain_grad()
    return h


@pytest.mark.parametrize("step", [_inside, _returned])
def test_retain_grad_on_a_computed_value_is_refused_leaving_objects_untouched(step):
    m = _model()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(TracingError, match="retain_grad"):
        tt.compile(step)(m, torch.ones(2, 3))
    for p, b in zip(m.parameters(), before):
        torch.testing.assert_close(p, b)
        assert p.grad is None


def _on_leaves(m, x):
    m.weight.retain_grad()  # a leaf: eager's no-op
    loss = m(x).sum()
    loss.backward()
    return loss


@pytest.mark.parametrize("thin", [False, True])
def test_retain_grad_on_a_leaf_is_a_no_op_as_in_eager(thin):
    m, mc = _model(), _model()
    step = tt.compile(_on_leaves, thin=thin)
    for _ in range(3):
        torch.testing.assert_close(step(mc, torch.ones(2, 3)), _on_leaves(m, torch.ones(2, 3)))
    for p, pc in zip(m.parameters(), mc.parameters()):
        torch.testing.assert_close(pc.grad, p.grad)


def test_retain_grad_without_grad_raises_eagers_error():
    def step(m, x):
        (x * 2).retain_grad()
        return x

    with pytest.raises(RuntimeError, match="requires_grad=False") as eager:
        step(_model(), torch.ones(2))
    with pytest.raises(RuntimeError, match="requires_grad=False") as compiled:
        tt.compile(step)(_model(), torch.ones(2))
    assert str(compiled.value) == str(eager.value)


def _leafness(m, x):
    h = m(x)
    w = torch.zeros(2, requires_grad=True)
    with torch.no_grad():
        m.weight.mul_(1.0)
    return torch.tensor([h.is_leaf, (x * 2).is_leaf, w.is_leaf, m.weight.is_leaf, h.detach().is_leaf,
                         (m.weight * 1).is_leaf, (w + 1).is_leaf])


@pytest.mark.parametrize("grad", [True, False])
def test_is_leaf_matches_eager(grad):
    with torch.set_grad_enabled(grad):
        expected = _leafness(_model(), torch.ones(2, 3))
        got = tt.compile(_leafness)(_model(), torch.ones(2, 3))
    assert got.tolist() == expected.tolist()
