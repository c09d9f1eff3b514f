"""Matrix products with a column-major operand differentiate as eager's backward of ``mm`` does (it computes such an
operand's gradient transposed: prims/linalg.py ``matmul_vjp``).  A weight used as ``x @ W.T`` (Falcon's linear
layers) gets ``gᵀ x`` row-major as its ``.grad``, no copy and no view (executors/row_major_weight_grads.py);
before, the program made ``(xᵀ g)ᵀ`` and copied it, which rounded otherwise on a 3-d activation.  Compared with
eager after every step: the torch program bitwise, the fused one within its tolerance, the gradients' layouts
eager's."""
import copy

import pytest
import torch
import torch.nn.functional as F

import thunder_train as tt
from _inductor import cxx_available

needs_inductor = pytest.mark.skipif(not cxx_available(), reason="Inductor's CPU backend needs a C++ compiler (none found)")


class TransposedUse(torch.nn.Module):
    """Two weights used as ``x @ W.T`` on one 2-d input (its transpose is then shared by both gradients), and one
    on a 3-d activation (the gradient's own ``permute`` of the flattened activation is folded)."""

    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(24, 16) * 0.2)
        self.w2 = torch.nn.Parameter(torch.randn(24, 16) * 0.2)
        self.w3 = torch.nn.Parameter(torch.randn(8, 24) * 0.2)

    def forward(self, x):
        h = torch.tanh(x @ self.w1.T) * torch.sigmoid(x @ self.w2.T)
        return h.view(2, -1, 24) @ self.w3.T


def _step(model, opt, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


def _train_both(fusion, exact):
    torch.manual_seed(0)
    me = TransposedUse()
    mc = copy.deepcopy(me)
    oe, oc = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (me, mc))
    cf = tt.compile(_step, thin=True, fusion=fusion)
    g = torch.Generator().manual_seed(1)
    close = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    for i in range(3):
        x, y = torch.randn(12, 16, generator=g), torch.randn(2, 6, 8, generator=g)
        assert close(cf(mc, oc, x, y), _step(me, oe, x, y)), i
        for (n, pe), pc in zip(me.named_parameters(), mc.parameters()):
            assert close(pc, pe) and close(pc.grad, pe.grad), (i, n)
            assert pc.grad.stride() == pe.grad.stride() == pe.stride(), (i, n, pc.grad.stride())
            assert (pc.grad._base is None) == (pe.grad._base is None), (i, n)  # eager's is no view
        oe.zero_grad()
        oc.zero_grad()
    return str(tt.last_traces(cf)[-1])


@pytest.mark.parametrize("fusion", [None, pytest.param("inductor", marks=needs_inductor)])
def test_transposed_weights_gradients_are_made_row_major_as_eager_makes_them(fusion):
    src = _train_both(fusion, exact=fusion is None)
    assert "grad_copy(" not in src and "grad_layout(" not in src, src


class ProductsOfActivations(torch.nn.Module):
    """A similarity matrix of two activations (``a @ b.T``, CLIP's logits: the second operand column-major), a
    product whose first operand is an activation transposed (``a.T @ W``, column-major), a vector's product with a
    column-major matrix (eager's ``mm`` on the vector as one row), and a batch of one transposed matrix times a
    matrix (eager's folded rows are then a column-major view)."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.Linear(16, 24)
        self.q = torch.nn.Linear(16, 24)
        self.w = torch.nn.Parameter(torch.randn(12, 8) * 0.2)

    def forward(self, x):
        a, b = torch.tanh(self.p(x)), torch.sigmoid(self.q(x))
        batch_of_one = torch.tanh(a[:, :8]).contiguous().unsqueeze(0).mT  # (1, 8, 12): its folded rows column-major
        return (torch.tanh(a @ b.T).mean() + torch.tanh(a.T @ self.w).mean() + torch.tanh(a[0] @ b.T).mean()
                + torch.tanh(batch_of_one @ self.w).mean())


class MatrixTimesBatch(torch.nn.Module):
    """A matrix times a batch of matrices (token mixing, ``W @ h``): with the matrix requiring grad (a parameter, an
    activation) eager folds the batch into one ``mm``, forward and backward; with a constant matrix it multiplies
    batch by batch."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 12) * 0.3)
        self.v = torch.nn.Parameter(torch.randn(12, 8).t() * 0.3)  # column-major
        self.p = torch.nn.Linear(16, 10)
        self.q = torch.nn.Linear(16, 12)
        self.register_buffer("c", torch.randn(6, 12))

    def forward(self, x):
        h = torch.tanh(self.p(x)).reshape(2, 12, 5)
        a = torch.tanh(self.q(x))[:8]  # an activation requiring grad: eager folds too, forward and backward
        return (torch.tanh(self.w @ h).mean() + torch.tanh(self.c @ h).mean() + torch.tanh(self.v @ h[:1]).mean()
                + torch.tanh(a @ h).mean())


class LinearLayouts(torch.nn.Module):
    """``F.linear`` on a transposed input (2-d, and a transposed batch of one) and with a weight stored column-major:
    eager's ``mm`` backward computes those operands' gradients transposed."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 12) * 0.3)
        self.wc = torch.nn.Parameter(torch.randn(12, 6).t() * 0.3)
        self.b = torch.nn.Parameter(torch.zeros(6))
        self.p = torch.nn.Linear(16, 12)

    def forward(self, x):
        h = torch.tanh(self.p(x))  # (12, 12)
        return (torch.tanh(F.linear(h.T, self.w, self.b)).mean() + torch.tanh(F.linear(h, self.wc)).mean()
                + torch.tanh(F.linear(h.reshape(2, 6, 12), self.wc, self.b)).mean()
                + torch.tanh(F.linear(h.unsqueeze(0).mT, self.w)).mean())


@pytest.mark.parametrize("make", [ProductsOfActivations, MatrixTimesBatch, LinearLayouts])
def test_column_major_operands_of_activations_are_differentiated_bitwise_as_eager(make):
    torch.manual_seed(0)
    me = make()
    mc = copy.deepcopy(me)
    oe, oc = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (me, mc))

    def step(model, opt, x):
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    cf = tt.compile(step, thin=True, fusion=None)
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        x = torch.randn(12, 16, generator=g)
        assert torch.equal(cf(mc, oc, x), step(me, oe, x)), i
        for (n, pe), pc in zip(me.named_parameters(), mc.parameters()):
            assert torch.equal(pc, pe), (i, n, (pc - pe).abs().max())


def test_a_product_the_user_transposes_twice_is_returned_as_eager_returns_it():
    # Only the two transposes a gradient rule leaves are read as the product: the user's own are views, as in eager.
    w = torch.nn.Parameter(torch.randn(6, 12))

    def step(x):
        y = torch.tanh(x @ w.T)
        y.sum().backward()
        return torch.permute(torch.permute(y.detach() @ w.detach(), (1, 0)), (1, 0))

    cf = tt.compile(step, fusion=None)
    x = torch.randn(4, 12)
    got, want = cf(x), step(x)
    assert torch.equal(got, want) and got._base is not None and want._base is not None
