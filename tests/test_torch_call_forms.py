"""Call forms eager's argument parser takes that a Python signature does not, compiled as eager runs them: numpy's
parameter names (``axis``, ``keepdims``, ``x``/``a``/``x1`` for ``input``, ``x2`` for ``other``; refused where eager
refuses them, in Python-level functions such as ``F.softmax``), sizes by keyword (``torch.ones(size=...)``,
``x.reshape(shape=...)``), Python numbers as the tensor of add/sub/mul/div, and the tensors those make from numbers
alone used as sizes (``torch.div(seq_len, w, rounding_mode="trunc") - 1``: transformers' Longformer and LED)."""
import pytest
import torch
import torch.nn.functional as F

import thunder_train as tt

import _zoo

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


KEYWORD_CALLS = {
    "torch.ones size": lambda x: x + torch.ones(size=(2, 3)),
    "torch.zeros size": lambda x: x + torch.zeros(size=[2, 3], dtype=torch.float64),
    "torch.empty size": lambda x: x + torch.empty(size=(2, 3)).fill_(2),
    "new_ones size": lambda x: x * x.new_ones(size=(2, 3)),
    "new_zeros size": lambda x: x + x.new_zeros(size=(2, 3)),
    "Tensor.view size": lambda x: x.view(size=(3, 2)) * 2,
    "Tensor.reshape shape": lambda x: x.reshape(shape=(3, 2)) * 2,
    "torch.reshape shape": lambda x: torch.reshape(x, shape=(6,)) * 2,
    "Tensor.expand size": lambda x: x[:1].expand(size=(4, 3)) * 2,
    "Tensor.repeat repeats": lambda x: x.repeat(repeats=(2, 1)),
    "Tensor.permute dims": lambda x: x.permute(dims=(1, 0)) * 2,
    "torch.permute dims": lambda x: torch.permute(x, dims=(1, 0)) * 2,
    "sum_to_size size": lambda x: x.sum_to_size(size=(1, 3)),
    "torch.add of ints": lambda x: x * torch.add(2, 3),
    "torch.add alpha of ints": lambda x: x * torch.add(2, 3, alpha=2),
    "torch.div of ints trunc": lambda x: x + torch.div(12, 5, rounding_mode="trunc"),
    "torch.true_divide of ints": lambda x: x + torch.true_divide(7, 2),
    "torch.mul bool int": lambda x: x * torch.mul(True, 2),
    "torch.sub float int": lambda x: x * torch.sub(2.5, 1),
    "torch.floor_divide": lambda x: x + torch.floor_divide(7, 2),
    "torch.add tensor number alpha": lambda x: torch.add(x, 3, alpha=2),
    "torch.sub tensor float alpha": lambda x: torch.sub(x, 0.1, alpha=3),
    "Tensor.add number alpha": lambda x: x.add(0.7, alpha=0.3),
}


@pytest.mark.parametrize("name", sorted(KEYWORD_CALLS))
def test_call_forms_eagers_parser_takes(name):
    fn = KEYWORD_CALLS[name]
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    expected, got = fn(x), tt.compile(fn)(x)
    assert got.dtype == expected.dtype and got.stride() == expected.stride()
    assert torch.equal(got, expected)


def _chunked(x, w):
    """Longformer's and LED's chunking: a count made from sizes by torch.div, then used as sizes and as a value."""
    n = torch.div(x.shape[0], w, rounding_mode="trunc") - 1
    chunks = x.as_strided(size=[n + 1, w, x.shape[1]], stride=[w * x.shape[1], x.shape[1], 1])
    scores = chunks.new_zeros((n + 1, w, 2 * w + 1))
    scores[:, :, : x.shape[1]] = chunks * 2
    return scores.sum(0) * n + int(n) + n.item()


@pytest.mark.parametrize("thin", [False, True])
def test_tensors_made_from_sizes_are_eagers_values_in_sizes_and_math(thin):
    cf = tt.compile(_chunked, thin=thin)
    for rows in (8, 8, 12, 8):  # the count follows the size (the program is specialised to it)
        x = torch.randn(rows, 3, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(cf(x, 2), _chunked(x, 2))


def test_writing_a_traced_value_into_a_tensor_made_from_numbers_is_refused():
    def f(x):
        scale = torch.mul(2.0, 1.5)
        scale.add_(x.sum())
        return x * scale

    x = torch.randn(3)
    with pytest.raises(tt.TracingError, match="made from Python numbers"):
        tt.compile(f)(x)


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
    step = _zoo.train_step

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


def test_led_step_trains_as_eager():
    """transformers' LED chunks its attention with ``torch.div(seq_len, w, rounding_mode="trunc") - 1`` as a size
    of ``as_strided``: it failed with a PrimError compiled."""
    transformers = pytest.importorskip("transformers")
    import copy

    torch.manual_seed(0)
    cfg = transformers.LEDConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                 encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                 decoder_ffn_dim=32, attention_window=4, max_encoder_position_embeddings=32,
                                 max_decoder_position_embeddings=32)
    base = transformers.LEDForConditionalGeneration(cfg).train()
    g = torch.Generator().manual_seed(1)
    batch = dict(input_ids=torch.randint(3, 64, (2, 8), generator=g), labels=torch.randint(3, 64, (2, 5), generator=g))
    me, mc = copy.deepcopy(base), copy.deepcopy(base)

    def step(model, batch):
        loss = model(**batch).loss
        loss.backward()
        return loss

    torch.manual_seed(3)
    expected = step(me, batch)
    torch.manual_seed(3)
    torch.testing.assert_close(tt.compile(step, fusion=None)(mc, batch), expected)
    for pe, pc in zip(me.parameters(), mc.parameters()):
        torch.testing.assert_close(pc.grad, pe.grad)


@pytest.mark.parametrize("thin", [False, True])
def test_membership_test_is_a_checked_decision_as_eager(thin):
    """``pad_token_id in input_ids[:, [-1, 0]]`` (transformers' Reformer) was refused as an unsupported op."""
    def step(x, ids):
        return x * 2 if 0 in ids[:, [-1, 0]] else x * 3

    cf = tt.compile(step, thin=thin)
    x = torch.randn(3)
    for ids in ([[1, 2, 3]], [[0, 2, 3]], [[1, 2, 0]], [[1, 0, 3]], [[0, 2, 3]]):
        ids = torch.tensor(ids)
        assert torch.equal(cf(x, ids), step(x, ids))
    with pytest.raises(RuntimeError, match="only supports Tensor or scalar"):
        tt.compile(lambda x: "a" in x)(x)


def test_a_tensor_made_from_numbers_made_to_require_grad_is_refused():
    def f(x):
        w = torch.mul(2.0, 3.0).requires_grad_()
        (x * w).sum().backward()
        return w.grad

    with pytest.raises(tt.TracingError, match="made from Python numbers"):
        tt.compile(f)(torch.randn(3))
