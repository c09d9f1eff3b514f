"""``inplace=True`` of the ``torch.nn.functional`` activations and dropout: eager writes the result into the input.

The trace recorded the out-of-place op only, so a call whose result the code dropped (``F.relu(b, inplace=True)`` on
its own line, ``nn.ReLU(inplace=True)`` whose input is read again) left ``b`` unchanged: losses and gradients differed
from eager's, silently.  Now the result is the input's new value, functionalized like ``b.relu_()``.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import thunder_train as tt

ACTIVATIONS = {
    "relu": lambda b: F.relu(b, inplace=True),
    "relu positional": lambda b: F.relu(b, True),
    "nn.ReLU": torch.nn.ReLU(inplace=True),
    "silu": lambda b: F.silu(b, inplace=True),
    "hardtanh positional": lambda b: F.hardtanh(b, -0.5, 0.5, True),
    "leaky_relu": lambda b: F.leaky_relu(b, 0.2, inplace=True),
    "elu": lambda b: F.elu(b, inplace=True),
    "hardswish": lambda b: F.hardswish(b, inplace=True),
    "celu": lambda b: F.celu(b, inplace=True),
    "dropout, eval": lambda b: F.dropout(b, 0.5, False, True),
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_inplace_activation_writes_its_input(name):
    act = ACTIVATIONS[name]

    def f(x, w):
        b = torch.matmul(x, w)
        r = act(b)  # b is now the activation's result
        return b.sum() * 2 + (r * r).sum(), b

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    w = torch.randn(16, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    mine = w.detach().clone().requires_grad_()
    cf = tt.compile(f)
    for _ in range(2):
        (got, gb), (want, wb) = cf(x, mine), f(x, w)
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(gb, wb)
        torch.testing.assert_close(mine.grad, w.grad, rtol=1e-5, atol=1e-5)


def test_inplace_activation_result_dropped_in_a_thin_step():
    def f(x, w):
        b = torch.matmul(x, w)
        F.relu(b, inplace=True)
        return (b * 3).sum()

    x, w = torch.randn(8, 16), torch.randn(16, 16)
    assert torch.equal(tt.compile(f, thin=True)(x, w), f(x, w))


def test_inplace_activation_of_a_leaf_that_requires_grad_raises_as_eager():
    w = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        F.relu(w, inplace=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        tt.compile(lambda w: F.relu(w, inplace=True).sum())(w)


@pytest.mark.parametrize("kw", [{}, {"thin": True}, {"fusion": None}], ids=["full", "thin", "torch"])
def test_random_ops_torch_computes_write_their_input(kw):
    """rrelu and alpha dropout in training are computed by torch (no torch-language rule for their draws); with
    ``inplace=True`` their values still become the input's, with eager's draws and generator state."""
    def f(x):
        b = x * 2
        F.rrelu(b, training=True, inplace=True)
        F.alpha_dropout(b, 0.5, training=True, inplace=True)
        return b.sum(), b

    x = torch.randn(64)
    torch.manual_seed(0)
    expected, rng = f(x), torch.get_rng_state()
    torch.manual_seed(0)
    got = tt.compile(f, **kw)(x)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[0], expected[0])
    assert torch.equal(torch.get_rng_state(), rng)


# The in-place forms of eager's elu kernel, differentiated from their result (derivatives.yaml: is_result=True)
ELU_FAMILY = [lambda b: F.elu(b, 1.3, inplace=True), lambda b: F.elu_(b, 0.7), lambda b: torch.celu_(b, 0.8),
              torch.nn.CELU(1.5, inplace=True), torch.selu_, torch.nn.SELU(inplace=True)]


class _EluFamily(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x):
        outs = []
        for i, act in enumerate(ELU_FAMILY):
            y = self.lin(x) * (i + 1)
            act(y)
            outs.append(y * y.cos())
        return torch.stack(outs)


def _elu_family_step(model, x):
    out = model(x)
    out.sum().backward()
    return out.detach()


@pytest.mark.parametrize("mode", ["full", "thin", "model"])
def test_inplace_elu_family_is_bitwise_eagers(mode):
    """elu_, celu_, selu_ and their ``inplace=True`` forms: eager's values and float32 gradients bit for bit (the
    out-of-place forms are); before, the gradient came from the input, as the out-of-place forms', an ulp off."""
    torch.manual_seed(0)
    model = _EluFamily()
    ref = copy.deepcopy(model)
    x = torch.randn(5, 6) * 3
    if mode == "model":
        compiled = tt.compile(model)

        def run(m, x):
            out = (compiled if m is model else m)(x)
            out.sum().backward()
            return out.detach()
    else:
        cf = tt.compile(_elu_family_step, thin=mode == "thin")

        def run(m, x):
            return (cf if m is model else _elu_family_step)(m, x)
    for _ in range(2):
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        got, want = run(model, x), run(ref, x)
        assert torch.equal(got, want)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
