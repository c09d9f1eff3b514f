"""A training step compiled around part of the model: the backbone runs eagerly, its output is passed in, and the
compiled step calls ``loss.backward()`` (session 19).  Eager's backward continues into the backbone's graph; the
program stopped at the input, so the backbone never trained and the input got a ``.grad`` eager leaves None.
Refused now, before anything changes, also when a leaf was traced first (the input's leafness is guarded)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt

MODES = [dict(), dict(thin=True), dict(fusion=None)]


def _parts():
    torch.manual_seed(0)
    backbone, head = nn.Linear(4, 8), nn.Linear(8, 3)
    opt = torch.optim.SGD(list(backbone.parameters()) + list(head.parameters()), lr=0.1)

    def step(feat, y):
        loss = F.cross_entropy(head(torch.relu(feat)), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return backbone, head, step


def _state(*mods):
    return [t.detach().clone() for m in mods for t in m.parameters()] + [p.grad for m in mods for p in m.parameters()]


@pytest.mark.parametrize("mode", MODES, ids=["full", "thin", "nofuse"])
def test_backward_into_a_graph_made_outside_is_refused_and_changes_nothing(mode):
    backbone, head, step = _parts()
    f = tt.compile(step, **mode)
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    before = _state(backbone, head)
    feat = backbone(x)
    with pytest.raises(Exception, match="non-leaf tensor.*eager's backward would go on into the graph"):
        f(feat, y)
    after = _state(backbone, head)
    assert all(a is None and b is None or torch.equal(a, b) for a, b in zip(before, after))
    assert feat.grad is None


@pytest.mark.parametrize("mode", MODES, ids=["full", "thin", "nofuse"])
def test_a_detached_leaf_first_then_a_graph_is_refused_too(mode):
    backbone, head, step = _parts()
    f = tt.compile(step, **mode)
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    leaf = backbone(x).detach().requires_grad_()
    want_head = [p.detach().clone() for p in head.parameters()]
    for _ in range(2):  # a leaf: eager's result (the leaf's .grad set, the head trained)
        f(leaf, y)
    ref_backbone, ref_head, ref_step = _parts()
    ref_leaf = ref_backbone(x).detach().requires_grad_()
    for _ in range(2):
        ref_step(ref_leaf, y)
    for a, b in zip(head.parameters(), ref_head.parameters()):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad)
    assert not all(torch.equal(a, b) for a, b in zip(head.parameters(), want_head))
    with pytest.raises(Exception, match="non-leaf tensor"):
        f(backbone(x), y)
