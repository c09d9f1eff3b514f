"""Ops whose result depends on tensor values through a Python value (torchlang/decided.py): the value is a
decision on per-call inputs, recomputed by the prologue on every call; a decision on a random value is loud."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import thunder_train as tt
from thunder_train.compiler.errors import DataDependentError


@pytest.mark.parametrize("fn,make", [
    (lambda x, t: torch.narrow(x, 0, t, 2), lambda i: torch.tensor(i)),
    (lambda x, t: torch.tensor_split(x, t), lambda i: torch.tensor([i, 4])),
    (lambda x, t: torch.equal(x[:3], t.float()), lambda i: torch.tensor([0, 1, i])),
    (lambda x, t: torch.allclose(x[:3], t.float()), lambda i: torch.tensor([0, 1, i])),
    (lambda x, t: F.one_hot(t), lambda i: torch.tensor([0, i])),
    (lambda x, t: torch.linspace(t, 3.0, 4), lambda i: torch.tensor(float(i))),
], ids=["narrow", "tensor_split", "equal", "allclose", "one_hot", "linspace"])
def test_value_decided_per_call(fn, make):
    x = torch.arange(6.0)
    cf = tt.compile(fn)
    for i in (1, 2, 1, 3):
        t = make(i)
        a, e = cf(x, t), fn(x, t)
        if isinstance(e, tuple):
            assert len(a) == len(e) and all(torch.equal(p, q) for p, q in zip(a, e))
        elif isinstance(e, torch.Tensor):
            assert a.dtype == e.dtype and torch.equal(a, e)
        else:
            assert a == e


def test_decision_on_a_random_value_is_loud():
    with pytest.raises(DataDependentError):  # a random value can be neither recomputed nor checked
        tt.compile(lambda x: torch.narrow(x, 0, (torch.rand(()) * 3).long(), 2))(torch.arange(6.0))


def test_gaussian_nll_loss_checks_var_at_run_time():
    x, y = torch.randn(4), torch.randn(4)
    cf = tt.compile(lambda x, y, v: F.gaussian_nll_loss(x, y, v * 1))
    torch.testing.assert_close(cf(x, y, torch.ones(4)), F.gaussian_nll_loss(x, y, torch.ones(4)))
    with pytest.raises(Exception, match="negative"):
        cf(x, y, -torch.ones(4))


def test_value_shaped_ops_follow_each_calls_values():
    from torch.utils._pytree import tree_flatten

    def f(x, m):
        return (torch.nonzero(x), torch.nonzero(x, as_tuple=True), torch.argwhere(x), torch.masked_select(x, m),
                torch.bincount(m.long().reshape(-1), minlength=3), torch.combinations(x[0], 2))

    cf = tt.compile(f)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randint(0, 2, (3, 4), generator=g).float()
        m = torch.rand(3, 4, generator=g) > 0.5
        for a, e in zip(tree_flatten(cf(x, m))[0], tree_flatten(f(x, m))[0], strict=True):
            assert a.dtype == e.dtype and torch.equal(a, e)


def test_masked_select_of_a_random_mask_follows_eager():
    # The count is a data-dependent size the program reads when masked_select runs (no decision on the random
    # mask, which no prologue could recompute): each call selects what eager selects with the same draws.
    def f(x):
        return torch.masked_select(x, torch.rand(3, 2) > 0.5)

    cf = tt.compile(f)
    x = torch.randn(3, 2)
    for seed in range(4):
        torch.manual_seed(seed)
        e = f(x)
        torch.manual_seed(seed)
        a = cf(x)
        assert torch.equal(a, e)
    assert tt.compile_stats(cf).entries == 1
