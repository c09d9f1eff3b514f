"""Lines computing constants (executors/constants.py) run once, at a program's first call.

What is kept must be the values every call computed (bitwise: the same calls), and a kept tensor must never reach
the user or be written: returned constants, constants written in place and views of them handed out stay lines.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import _zoo
import thunder_train as tt
from thunder_train.compiler.executors import constants


def source(cf) -> str:
    return tt.last_traces(cf)[-1].python_source()


def folded(cf) -> int:
    """How many lines the program's folded block computes (0: none)."""
    for line in source(cf).splitlines():
        if "lines computing constants" in line:
            return int(line.split("#")[1].split()[0])
    return 0


def masked_scores(q, k):
    """Attention scores with a causal mask and ALiBi-like biases built from sizes only."""
    T = q.shape[-2]
    i = torch.arange(T)
    mask = i[None, :] <= i[:, None]
    bias = torch.pow(torch.full((), 0.5), torch.arange(1, 3))[:, None, None] * i.float()
    s = q @ k.transpose(-1, -2) + bias
    return torch.where(mask, s, torch.finfo(s.dtype).min).softmax(-1)


def test_mask_and_biases_are_computed_once_bitwise_eagers():
    g = torch.Generator().manual_seed(0)
    cf = tt.compile(masked_scores, fusion=None)
    for _ in range(3):
        q, k = torch.randn(2, 5, 4, generator=g), torch.randn(2, 5, 4, generator=g)
        assert torch.equal(cf(q, k), masked_scores(q, k))
    assert folded(cf) >= 8, source(cf)


def test_thin_training_step_with_folded_masks_equals_eager():
    """Mistral (sliding-window mask from sizes) and BLOOM (ALiBi and causal mask): the folded values are those of
    each eager step, bitwise (the program without folding is, and so is the program with it)."""
    for name in ("mistral", "bloom"):
        model = _zoo.build(name)
        runs = {}
        for fold in (True, False):
            m = copy.deepcopy(model)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
            limit = constants.FOLD_MAX_BYTES
            constants.FOLD_MAX_BYTES = limit if fold else -1
            try:
                cf = tt.compile(_zoo.train_step, thin=True, fusion=None)
                losses = [cf(m, opt, b) for b in _zoo.batches(name, 4)]
            finally:
                constants.FOLD_MAX_BYTES = limit
            runs[fold] = (m, losses, folded(cf))
        (m1, l1, n1), (m2, l2, n2) = runs[True], runs[False]
        assert n1 >= 10 and n2 == 0, (name, n1, n2)
        assert all(torch.equal(a, b) for a, b in zip(l1, l2)), name
        assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters())), name


def test_returned_constants_are_new_tensors_every_call():
    def fn(x):
        mask = torch.ones(3, 3).tril()
        return x * mask, mask, mask[0], torch.arange(3).float()

    cf = tt.compile(fn, fusion=None)
    x = torch.randn(3, 3)
    a = cf(x)
    a[1].add_(100)
    a[2].add_(100)
    a[3].add_(100)
    b = cf(x)
    for got, want in zip(b, fn(x)):
        assert torch.equal(got, want)
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(a[1:], b[1:]))


def test_constants_updated_in_place_are_recomputed():
    """A constant that the function then updates in place (a buffer it accumulates into) starts from its
    constant value on every call."""
    def fn(x):
        acc = torch.zeros(4)
        acc += x
        acc.mul_(2)
        z = torch.full((4,), 3.0)
        torch.add(z, 1, out=z)
        return acc + z

    cf = tt.compile(fn, fusion=None)
    x = torch.arange(4.0)
    for _ in range(3):
        assert torch.equal(cf(x), fn(x))


def test_random_and_generator_reads_are_not_constants():
    def fn(x):
        return x + torch.rand(3) + torch.randn(3).abs()

    cf = tt.compile(fn, fusion=None)
    torch.manual_seed(0)
    a = cf(torch.zeros(3))
    b = cf(torch.zeros(3))
    torch.manual_seed(0)
    assert torch.equal(a, fn(torch.zeros(3))) and torch.equal(b, fn(torch.zeros(3)))
    assert folded(cf) == 0


def test_symbolic_sizes_are_not_constants():
    def fn(x):
        return x + torch.arange(x.shape[0]).float()

    cf = tt.compile(fn, fusion=None, dynamic=True)
    for n in (3, 5, 7):
        x = torch.randn(n)
        assert torch.equal(cf(x), fn(x))


def test_folded_constants_in_a_module_forward_and_backward():
    """tt.compile(model): the forward's folded values (a causal mask) and the gradients equal eager's."""
    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            T = x.shape[1]
            mask = torch.ones(T, T, dtype=torch.bool).tril()
            return F.scaled_dot_product_attention(self.proj(x), x, x, attn_mask=mask).sum()

    torch.manual_seed(0)
    m = Attn()
    m2 = copy.deepcopy(m)
    cm = tt.compile(m, fusion=None)
    x = torch.randn(2, 6, 8)
    for _ in range(2):
        m.zero_grad()
        m2.zero_grad()
        cm(x).backward()
        m2(x).backward()
    for p, q in zip(m.parameters(), m2.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("limit", [0, 10**9])
def test_byte_limit(limit, monkeypatch):
    monkeypatch.setattr(constants, "FOLD_MAX_BYTES", limit)
    cf = tt.compile(masked_scores, fusion=None)
    q = torch.randn(2, 5, 4)
    assert torch.equal(cf(q, q), masked_scores(q, q))
    assert (folded(cf) > 0) == (limit > 0)
