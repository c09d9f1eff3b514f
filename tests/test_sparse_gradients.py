"""Gradients through sparse values (COO, CSR, CSC), compared with eager in full and thin mode.

A line that reads or makes a sparse value runs with torch's autograd (transforms/opaque_grad.py); the gradient of a
sparse value is made and read by opaque lines only (transforms/sparse_grads.py).  Compared here: values and the
layout of every gradient (a sparse leaf's ``.grad`` is sparse where eager's is, strided where eager's is), through
``tt.compile(fn)`` whose outputs require grad, and through ``loss.backward()`` / ``torch.autograd.grad`` inside the
compiled function.  What is still refused (accumulating into an existing sparse ``.grad``, an optimizer updating a
sparse parameter in place) leaves every user object as it was."""
from __future__ import annotations

import pytest
import torch

import thunder_train as tt
from thunder_train.compiler.errors import TracingError

pytestmark = pytest.mark.filterwarnings("ignore:Sparse (CSR|CSC) tensor support is in beta state")


def _dense(seed, shape=(5, 5)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * (torch.rand(*shape, generator=g) > 0.4)


def _rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 + seed)).requires_grad_()


def _same(got, want, what, coalesced_flag=False):
    assert (got is None) == (want is None), f"{what}: {got} vs eager {want}"
    if want is None:
        return
    assert got.layout == want.layout, f"{what}: layout {got.layout}, eager {want.layout}"
    if coalesced_flag and want.layout == torch.sparse_coo:  # (AccumulateGrad's shallow copy drops it: ours must too)
        assert got.is_coalesced() == want.is_coalesced(), f"{what}: is_coalesced {got.is_coalesced()}, eager's not"
    if want.layout != torch.strided:
        got, want = got.to_dense(), want.to_dense()
    torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}")


def _leaves(args):
    return [a.detach().clone().requires_grad_(a.requires_grad) for a in args]


# name -> (fn, inputs for seed k, loss of the output); the loss runs outside the compiled function, so a sparse
# output gets the cotangent eager's engine gives it (strided from to_dense, sparse from torch.sparse.sum).
CASES = {
    "sparse_mm_coo_leaf": (lambda s, w: torch.sparse.mm(s, w),
                           lambda k: [_dense(k).to_sparse().requires_grad_(), _rand(k, 5, 3)], lambda o: (o * o).sum()),
    "sparse_mm_csr_leaf": (lambda s, w: torch.sparse.mm(s, w),
                           lambda k: [_dense(k).to_sparse_csr().requires_grad_(), _rand(k, 5, 3)], lambda o: (o * o).sum()),
    "sparse_mm_dense_operand_only": (lambda s, w: torch.sparse.mm(s, w) * 2,
                                     lambda k: [_dense(k).to_sparse(), _rand(k, 5, 3)], lambda o: (o * o).sum()),
    "sparse_mm_reduce_mean": (lambda s, w: torch.sparse.mm(s, w, "mean"),
                              lambda k: [_dense(k).to_sparse_csr().requires_grad_(), _rand(k, 5, 3)], lambda o: (o * o).sum()),
    "sparse_mm_reduce_amax": (lambda s, w: torch.sparse.mm(s, w, "amax"),
                              lambda k: [_dense(k).to_sparse_csr().requires_grad_(), _rand(k, 5, 3)], lambda o: (o * o).sum()),
    "sampled_addmm": (lambda s, a, b: torch.sparse.sampled_addmm(s, a, b, alpha=0.6, beta=0.2),
                      lambda k: [_dense(k).to_sparse_csr().requires_grad_(), _rand(k, 5, 4), _rand(k + 1, 4, 5)],
                      lambda o: (o.to_dense() * torch.arange(25.0).reshape(5, 5)).sum()),
    "to_sparse_to_dense": (lambda x, w: x.to_sparse().to_dense() * 3 @ w,
                           lambda k: [_rand(k, 5, 5), _rand(k + 1, 5, 3)], lambda o: (o * o).sum()),
    "to_sparse_mm": (lambda x, w: torch.sparse.mm(x.to_sparse(), w),
                     lambda k: [_rand(k, 5, 5), _rand(k + 1, 5, 3)], lambda o: o.sum()),
    "sparse_leaf_used_twice": (lambda s, w: torch.sparse.mm(s, w) * torch.sparse.mm(s * 2, w),
                               lambda k: [_dense(k).to_sparse().requires_grad_(), _rand(k, 5, 3)], lambda o: o.sum()),
    "two_sparse_leaves_added": (lambda s, t: (s + t * 2).to_dense(),
                                lambda k: [_dense(k).to_sparse().requires_grad_(), _dense(k + 1).to_sparse().requires_grad_()],
                                lambda o: (o * o).sum()),
    "sparse_output_sparse_cotangent": (lambda x: x.to_sparse() * 2, lambda k: [_rand(k, 4, 4)],
                                       lambda o: torch.sparse.sum(o * o)),
    "sparse_leaf_sparse_output": (lambda s: s * 3, lambda k: [_dense(k).to_sparse().requires_grad_()],
                                  lambda o: torch.sparse.sum(o)),
}


@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
@pytest.mark.parametrize("name", list(CASES))
def test_gradients_through_sparse_values_are_eagers(name, thin):
    fn, make, loss = CASES[name]
    cf = tt.compile(fn, thin=thin)
    for k in range(3):
        args = make(k)
        e_args = _leaves(args)
        out, e_out = cf(*args), fn(*e_args)
        _same(out, e_out, "output")
        assert out.requires_grad == e_out.requires_grad
        loss(out).backward()
        loss(e_out).backward()
        for i, (a, e) in enumerate(zip(args, e_args)):
            _same(a.grad, e.grad, f"call {k}: grad of input {i}")
    assert tt.compile_stats(cf).cache_misses == 1


def _step(s, w):
    """A whole step with the backward inside: the sparse leaf's .grad is set by the compiled program."""
    loss = torch.sparse.mm(s, w).pow(2).sum() + (s.to_dense() * 0.5).sum()
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_backward_inside_sets_a_sparse_grad_as_eager(layout, thin):
    to_sparse = (lambda d: d.to_sparse()) if layout == "coo" else (lambda d: d.to_sparse_csr())
    fn = _step if layout == "coo" else (lambda s, w: _step_csr(s, w))
    cf = tt.compile(fn, thin=thin)
    w, e_w = _rand(0, 5, 3), None
    e_w = w.detach().clone().requires_grad_()
    for k in range(3):
        s = to_sparse(_dense(k)).requires_grad_()
        e_s = s.detach().clone().requires_grad_()
        _same(cf(s, w), fn(e_s, e_w), "loss")
        _same(s.grad, e_s.grad, "sparse .grad", coalesced_flag=True)
        _same(w.grad, e_w.grad, "dense .grad (accumulated over calls)")


def _step_csr(s, w):
    loss = torch.sparse.mm(s, w).pow(2).sum()  # (to_dense of a CSR tensor has no backward in eager)
    loss.backward()
    return loss.detach()


def test_a_sparse_grad_set_to_none_read_and_returned_inside():
    def step(s, w):
        s.grad = None
        torch.sparse.mm(s, w).sum().backward()
        return s.grad

    cf = tt.compile(step, thin=True)
    s, w = _dense(0).to_sparse().requires_grad_(), _rand(0, 5, 3)
    e_s, e_w = s.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    for _ in range(3):
        g, e_g = cf(s, w), step(e_s, e_w)
        assert g is s.grad
        _same(g, e_g, "returned .grad", coalesced_flag=True)
        _same(w.grad, e_w.grad, "dense .grad")


@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
def test_autograd_grad_with_a_sparse_input(thin):
    def f(s, w):
        return torch.autograd.grad(torch.sparse.mm(s, w).pow(2).sum(), [s, w])

    cf = tt.compile(f, thin=thin)
    for k in range(2):
        s, w = _dense(k).to_sparse().requires_grad_(), _rand(k, 5, 3)
        for got, want in zip(cf(s, w), f(*_leaves([s, w]))):
            _same(got, want, "autograd.grad")
        assert s.grad is None and w.grad is None


def test_accumulating_into_an_existing_sparse_grad_is_refused_and_changes_nothing():
    s, w = _dense(0).to_sparse().requires_grad_(), _rand(0, 5, 3)
    cf = tt.compile(_step)
    cf(s, w)
    s_grad, w_grad = s.grad, w.grad.clone()
    with pytest.raises(TracingError, match="existing .grad of the sparse tensor.*Nothing was changed"):
        cf(s, w)
    assert s.grad is s_grad and torch.equal(w.grad, w_grad)


def test_an_optimizer_updating_a_sparse_parameter_is_refused_and_changes_nothing():
    s, w = _dense(0).to_sparse().requires_grad_(), _rand(0, 5, 3)
    opt = torch.optim.SGD([s], lr=0.1)
    before = s.detach().clone()

    def step(s, w):
        _step(s, w)
        opt.step()
        opt.zero_grad()

    with pytest.raises(TracingError, match="in place"):
        tt.compile(step)(s, w)
    assert torch.equal(s.detach().to_dense(), before.to_dense()) and s.grad is None and w.grad is None


def test_a_sparse_gradient_of_a_strided_tensor_is_refused_while_tracing():
    """``s * w``: eager's ``w.grad`` is sparse COO; w's proxy and .grad are strided here, so refused, nothing run."""
    s, w = _dense(0).to_sparse(), _rand(0, 5, 5)
    w_before = w.detach().clone()

    def step(s, w):
        (s * w).to_dense().sum().backward()

    with pytest.raises(TracingError, match="sparse gradient.*Nothing was changed"):
        tt.compile(step)(s, w)
    assert w.grad is None and torch.equal(w, w_before)
    e_w = w.detach().clone().requires_grad_()
    step(s, e_w)
    assert e_w.grad.layout == torch.sparse_coo  # (what eager gives, which the refusal names)


@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
def test_a_graph_convolution_training_step_with_a_sparse_adjacency_follows_eager(thin):
    """The common use: a fixed sparse adjacency, dense parameters trained by Adam, the whole step compiled."""
    def make():
        torch.manual_seed(0)
        return torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)

    adj = (_dense(0, (6, 6)).abs() + torch.eye(6)).to_sparse_csr()
    x, y = torch.randn(6, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 1, 0, 1, 0])
    models = [make(), make()]
    opts = [torch.optim.Adam([p for m in ms for p in m.parameters()], lr=0.05) for ms in models]

    def step_with(ms, opt):
        def step(adj, x, y):
            h = torch.relu(torch.sparse.mm(adj, ms[0](x)))
            loss = torch.nn.functional.cross_entropy(torch.sparse.mm(adj, ms[1](h)), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step

    cf, eager = tt.compile(step_with(models[0], opts[0]), thin=thin), step_with(models[1], opts[1])
    for _ in range(4):
        _same(cf(adj, x, y), eager(adj, x, y), "loss")
    for (a, b) in zip([p for m in models[0] for p in m.parameters()], [p for m in models[1] for p in m.parameters()]):
        _same(a.detach(), b.detach(), "parameter after 4 steps")


def test_a_backward_from_a_sparse_output_inside_is_refused():
    x = _rand(0, 4, 4)
    with pytest.raises(TracingError, match="from a sparse output.*torch.sparse.sum"):
        tt.compile(lambda x: torch.autograd.grad(x.to_sparse() * 2, [x], torch.ones(4, 4).to_sparse()))(x)
    assert x.grad is None
