"""torch's C++-bound functions and Tensor methods take numpy's names for some parameters (``axis``, ``keepdims``,
``x``/``a``/``x1`` for ``input``, ``x2`` for ``other``); compiled code takes them as eager does, and refuses them
where eager does (Python-level functions such as ``F.softmax``)."""
import pytest
import torch
import torch.nn.functional as F

import thunder_train as tt

CALLS = {
    "torch.cat axis": lambda x: torch.cat([x, x * 2], axis=1),
    "torch.stack axis": lambda x: torch.stack([x, x.exp()], axis=0),
    "torch.sum axis keepdims": lambda x: torch.sum(x, axis=1, keepdims=True),
    "Tensor.mean axis": lambda x: x.mean(axis=0),
    "Tensor.std axis keepdims": lambda x: x.std(axis=0, keepdims=True),
    "Tensor.var axis": lambda x: x.var(axis=1),
    "torch.amax axis": lambda x: torch.amax(x, axis=1),
    "torch.max axis": lambda x: torch.max(x, axis=1).values,
    "torch.logsumexp axis": lambda x: torch.logsumexp(x, axis=1),
    "Tensor.cumsum axis": lambda x: x.cumsum(axis=0),
    "torch.softmax axis": lambda x: torch.softmax(x, axis=1),
    "Tensor.squeeze axis": lambda x: x[None].squeeze(axis=0),
    "Tensor.unsqueeze axis": lambda x: x.unsqueeze(axis=0) * 3,
    "torch.prod axis": lambda x: torch.prod(x, axis=1),
    "torch.add x1 x2": lambda x: torch.add(x1=x, x2=x * 3),
    "torch.mul input other": lambda x: torch.mul(input=x, other=x),
    "torch.abs a": lambda x: torch.abs(a=x - 0.5),
    "torch.tanh x": lambda x: torch.tanh(x=x),
    # trapezoid has a parameter named x: the name is its own, not input's
    "torch.trapezoid x": lambda x: torch.trapezoid(x, x=torch.arange(4.0) * 0.5),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_numpy_parameter_names_give_eagers_values_and_gradients(name):
    fn = CALLS[name]

    def step(x):
        out = fn(x)
        out.sum().backward()
        return out

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = step(xe)
    got = tt.compile(step)(xc)
    assert torch.equal(got, expected.detach())
    # the gradient of the same call written with torch's names (var, logsumexp and tanh's differ from eager's by
    # an ulp in float32 either way: docs/autograd.md)
    torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-6, atol=1e-6)


def test_a_python_level_function_refuses_numpy_names_as_eager():
    x = torch.randn(3, 4)
    with pytest.raises(TypeError, match="axis") as eager:
        F.softmax(x, axis=1)
    with pytest.raises(TypeError, match="axis") as compiled:
        tt.compile(lambda x: F.softmax(x, axis=1))(x)
    assert str(compiled.value) == str(eager.value)


def test_funnel_transformer_step_trains_as_eager():
    """transformers' Funnel writes ``torch.cat([...], axis=axis)``: it failed with a TypeError compiled."""
    transformers = pytest.importorskip("transformers")
    import copy

    torch.manual_seed(0)
    cfg = transformers.FunnelConfig(vocab_size=64, block_sizes=[1, 1], d_model=16, n_head=2, d_head=8, d_inner=32,
                                    num_labels=3)
    base = transformers.FunnelForSequenceClassification(cfg).train()
    g = torch.Generator().manual_seed(1)
    batches = [dict(input_ids=torch.randint(3, 64, (2, 8), generator=g), labels=torch.randint(0, 3, (2,), generator=g))
               for _ in range(1)]

    def step(model, opt, batch):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    me, mc = copy.deepcopy(base), copy.deepcopy(base)
    oe, oc = torch.optim.SGD(me.parameters(), lr=0.1), torch.optim.SGD(mc.parameters(), lr=0.1)
    cf = tt.compile(step, fusion=None)
    for b in batches:
        torch.manual_seed(3)
        le = step(me, oe, b)
        torch.manual_seed(3)
        torch.testing.assert_close(cf(mc, oc, b), le)
    for pe, pc in zip(me.parameters(), mc.parameters()):
        torch.testing.assert_close(pe, pc)
