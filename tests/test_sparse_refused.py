"""Sparse tensors (COO, CSR, CSC) inside a compiled function are opaque values (compiler/acquisition/sparse.py):
the ops that take or make one run as torch runs them, compared here with eager over calls with new values, a
changed layout and thin mode (their gradients: tests/test_sparse_gradients.py).  What they cannot do is refused with
what to do, every user object as it was: in-place updates of one, reading what it stores (values(), _nnz()), blocked
layouts, and sparse gradients of strided ops (Embedding/EmbeddingBag(sparse=True), gather(sparse_grad=True))."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import thunder_train as tt
from thunder_train.compiler.errors import TracingError, UnsupportedOpError

D = torch.arange(15.0).reshape(5, 3)


def _dense(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 5, generator=g) * (torch.rand(5, 5, generator=g) > 0.5)


CASES = {
    "coo_input_sparse_mm": (lambda s, d: torch.sparse.mm(s, d), lambda k: _dense(k).to_sparse()),
    "csr_input_mm_reduce": (lambda s, d: torch.sparse.mm(s, d, "sum"), lambda k: _dense(k).to_sparse_csr()),
    "csc_input_to_dense": (lambda s, d: s.to_dense() @ d, lambda k: _dense(k).to_sparse_csc()),
    "coo_input_to_dense": (lambda s, d: s.to_dense() + 1, lambda k: _dense(k).to_sparse()),
    "sparse_arithmetic": (lambda s, d: (s + s * 2).to_dense() * s.shape[0], lambda k: _dense(k).to_sparse()),
    "to_sparse_then_mm": (lambda x, d: torch.sparse.mm(x.to_sparse(), d), _dense),
    "to_sparse_then_sum": (lambda x, d: torch.sparse.sum(x.to_sparse()), _dense),
    "to_sparse_csr_to_dense": (lambda x, d: x.to_sparse_csr().to_dense() * 2, _dense),
    "sparse_factory": (lambda x, d: torch.zeros(2, 2, layout=torch.sparse_coo).to_dense() + x[:2, :2], _dense),
    "sparse_coo_tensor": (lambda x, d: torch.sparse_coo_tensor(torch.tensor([[0], [1]]), torch.ones(1), (5, 5)) @ d, _dense),
    "returns_sparse": (lambda x, d: (x * 2).to_sparse_csr(), _dense),
}


def _same(got, want):
    assert got.layout == want.layout
    if got.layout != torch.strided:
        got, want = got.to_dense(), want.to_dense()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
@pytest.mark.parametrize("name", list(CASES))
def test_sparse_values_run_as_eager(name, thin):
    fn, make = CASES[name]
    cf = tt.compile(fn, thin=thin)
    for k in range(3):
        x, d = make(k), D.clone()
        _same(cf(x, d), fn(x, d))
        assert torch.equal(d, D)
    st = tt.compile_stats(cf)
    assert st.cache_misses == 1 and st.opaque_ops  # the sparse lines run as opaque lines


def test_a_sparse_input_is_guarded_by_layout_and_shape():
    """Another layout, shape or a dense tensor in its place: a retrace, eager's values (no binding: the prologue
    checks a sparse input on every call, also with thin=True)."""
    fn = lambda s, d: s.to_dense() @ d * 2  # noqa: E731
    cf = tt.compile(fn, thin=True)
    for s in (_dense(0).to_sparse_csr(), _dense(1).to_sparse_csr(), _dense(2).to_sparse(), _dense(3),
              _dense(4).to_sparse_csr(), torch.randn(4, 5).to_sparse_csr()):
        d = torch.randn(s.shape[1], 3)
        torch.testing.assert_close(cf(s, d), fn(s, d))
    st = tt.compile_stats(cf)
    assert st.cache_misses == 4 and st.thin_calls == 0
    assert any("sparse tensor" in why for why in st.thin_bind_failures), st.thin_bind_failures


def test_a_dense_input_updated_before_a_sparse_op_is_read_current():
    x = torch.ones(5, 3)

    def step(s, x):
        x.add_(1)
        return torch.sparse.mm(s, x)

    s = _dense().to_sparse()
    out = tt.compile(step)(s, x)
    torch.testing.assert_close(out, torch.sparse.mm(s, torch.full((5, 3), 2.0)))
    assert torch.equal(x, torch.full((5, 3), 2.0))


REFUSED = {
    "in_place": (lambda s, w: s.mul_(2).to_dense(), TracingError, "in place"),
    "stored_values": (lambda s, w: s.values() * 2, TracingError, "reads what it stores"),
    "stored_count": (lambda s, w: w * s._nnz(), TracingError, "reads what it stores"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_a_sparse_value_cannot_do_is_refused_clearly(name):
    fn, error, match = REFUSED[name]
    s, w = _dense().to_sparse(), torch.randn(5, 5, requires_grad=True)
    s_before, w_before = s.to_dense(), w.detach().clone()
    with pytest.raises(error, match=match + ".*opaque value"):
        tt.compile(fn)(s, w)
    assert torch.equal(s.to_dense(), s_before) and torch.equal(w, w_before) and w.grad is None


GRADIENTS = {  # were refused before gradients through sparse values ran; now eager's
    "gradient_into_dense": lambda s, w: torch.sparse.mm(s, w).sum(),
    "gradient_of_to_sparse": lambda s, w: torch.sparse.sum(w.to_sparse()),
}


@pytest.mark.parametrize("name", list(GRADIENTS))
def test_gradients_that_were_refused_are_eagers(name):
    fn = GRADIENTS[name]
    s, w = _dense().to_sparse(), torch.randn(5, 5, requires_grad=True)
    e_w = w.detach().clone().requires_grad_()
    out, e_out = tt.compile(fn)(s, w), fn(s, e_w)
    _same(out, e_out)
    out.backward()
    e_out.backward()
    _same(w.grad, e_w.grad)


def test_a_sparse_input_that_requires_grad_gets_eagers_sparse_gradient():
    s, d = _dense().to_sparse().requires_grad_(), torch.randn(5, 3)
    e_s = s.detach().clone().requires_grad_()
    out = tt.compile(lambda s, d: torch.sparse.mm(s, d))(s, d)
    e_out = torch.sparse.mm(e_s, d)
    _same(out, e_out)
    out.sum().backward()
    e_out.sum().backward()
    _same(s.grad, e_s.grad)
    assert s.grad.layout == torch.sparse_coo
    with torch.no_grad():
        torch.testing.assert_close(tt.compile(lambda s, d: torch.sparse.mm(s, d))(s, d), torch.sparse.mm(s, d))


def test_blocked_layouts_and_strict_are_refused():
    with pytest.raises(TracingError, match="sparse_bsr.*not blocked layouts"):
        tt.compile(lambda s: s.to_dense())(_dense()[:4, :4].to_sparse_bsr((2, 2)))
    with pytest.raises(UnsupportedOpError, match="strict=True"):
        tt.compile(lambda s: s.to_dense(), strict=True)(_dense().to_sparse())


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
