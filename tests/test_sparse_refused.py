"""Sparse tensors inside a compiled function are refused with what to do (compiler/acquisition/sparse.py):
proxies carry strided metadata, so a sparse value behind one would be handled right only by luck.  Every
user object is as it was after the refused call; the same function with dense tensors compiles."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import thunder_train as tt
from thunder_train.compiler.errors import TracingError

D = torch.arange(15.0).reshape(5, 3)


def _dense():
    return torch.eye(5) * torch.arange(5.0)


CASES = {
    "coo_input_sparse_mm": (lambda s, d: torch.sparse.mm(s, d), lambda: _dense().to_sparse()),
    "csr_input": (lambda s, d: torch.sparse.mm(s, d, "sum"), lambda: _dense().to_sparse_csr()),
    "coo_input_to_dense": (lambda s, d: s.to_dense() + 1, lambda: _dense().to_sparse()),
    "to_sparse_then_mm": (lambda x, d: torch.sparse.mm(x.to_sparse(), d), _dense),
    "to_sparse_then_sum": (lambda x, d: torch.sparse.sum(x.to_sparse()), _dense),
    "to_sparse_csr_to_dense": (lambda x, d: x.to_sparse_csr().to_dense() * 2, _dense),
    "sparse_factory": (lambda x, d: torch.zeros(2, 2, layout=torch.sparse_coo).to_dense() + x[:2, :2], _dense),
    "sparse_coo_tensor": (lambda x, d: torch.sparse_coo_tensor(torch.tensor([[0], [1]]), torch.ones(1), (5, 5)) @ d, _dense),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sparse_is_refused_clearly(name):
    fn, make = CASES[name]
    x, d = make(), D.clone()
    with pytest.raises(TracingError, match="sparse tensor.*strided.*outside the compiled function"):
        tt.compile(fn)(x, d)
    assert torch.equal(d, D)


def test_sparse_embedding_step_is_refused_and_leaves_the_model_unchanged():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    before = emb.weight.detach().clone()

    def step(i):
        loss = emb(i).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    with pytest.raises(NotImplementedError, match="sparse=True.*use sparse=False"):
        tt.compile(step)(torch.tensor([1, 2, 3]))
    assert torch.equal(emb.weight, before) and emb.weight.grad is None and not opt.state


def test_gather_sparse_grad_is_refused():
    """eager's gradient of gather(sparse_grad=True) is a sparse COO tensor; a dense one would differ in type."""
    x = torch.randn(3, 4, requires_grad=True)
    idx = torch.tensor([[0, 1], [2, 3], [1, 1]])
    with pytest.raises(TracingError, match="sparse_grad=True.*sparse_grad=False"):
        tt.compile(lambda x, i: torch.gather(x, 1, i, sparse_grad=True).sum())(x, idx).backward()


def test_gather_sparse_grad_without_gradient_runs():
    x = torch.randn(3, 4)
    idx = torch.tensor([[0, 1], [2, 3], [1, 1]])
    fn = lambda x, i: torch.gather(x, 1, i, sparse_grad=True) * 2  # noqa: E731
    torch.testing.assert_close(tt.compile(fn)(x, idx), fn(x, idx))


def test_sparse_embedding_bag_step_is_refused_and_leaves_the_model_unchanged():
    """EmbeddingBag(sparse=True) runs opaquely; its gradient (torch's) would be sparse, which no strided proxy, .grad
    rule or optimizer kernel here takes: refused while tracing, with what to do, nothing changed."""
    bag = nn.EmbeddingBag(10, 4, sparse=True, mode="sum")
    opt = torch.optim.SGD(bag.parameters(), lr=0.1)
    before = bag.weight.detach().clone()

    def step(i, offsets):
        loss = bag(i, offsets).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    with pytest.raises(TracingError, match=r"embedding_bag\(sparse=True\).*use sparse=False"):
        tt.compile(step)(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2]))
    assert torch.equal(bag.weight, before) and bag.weight.grad is None and not opt.state


def test_sparse_embedding_bag_without_gradient_runs():
    bag = nn.EmbeddingBag(10, 4, sparse=True, mode="mean")
    i, offsets = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2])

    def look_up(i, offsets):
        with torch.no_grad():
            return bag(i, offsets) * 2

    torch.testing.assert_close(tt.compile(look_up)(i, offsets), look_up(i, offsets))
