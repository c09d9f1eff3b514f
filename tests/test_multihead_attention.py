"""``nn.MultiheadAttention`` (``F.multi_head_attention_forward``) is traced through torch's own body
(``torchlang/attention.py``): its projections and attention become torch-language lines instead of an opaque op
differentiated by torch's autograd at run time.  Every form is checked against eager: outputs, attention weights,
gradients, random state."""
import copy

import pytest
import torch
import torch.nn as nn

import thunder_train as tt

import _zoo

E, H, L, S, N = 16, 4, 5, 6, 3


def _loss_and_backward(m, *xs, **kw):
    out, w = m(*xs, **kw)
    loss = out.square().sum() + (0 if w is None else w.square().sum())
    loss.backward()
    return out, w


def _check(module, make_inputs):
    """Two forward/backward calls of ``module`` compiled and in eager; returns the compiled function."""
    model = copy.deepcopy(module)
    cf = tt.compile(_loss_and_backward)
    for seed in (0, 1):
        xs, kw = make_inputs(torch.Generator().manual_seed(seed))
        torch.manual_seed(seed)
        want = _loss_and_backward(module, *xs, **kw)
        want_rng = torch.get_rng_state()
        torch.manual_seed(seed)
        got = cf(model, *xs, **kw)
        assert torch.equal(torch.get_rng_state(), want_rng), "the random state differs from eager's"
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if b is not None:
                torch.testing.assert_close(a, b)
        for (n, p), q in zip(module.named_parameters(), model.parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"grad of {n}: {m}")
    return cf


def _rand(g, *shape):
    return torch.randn(*shape, generator=g)


def test_causal_self_attention_is_traced_not_opaque():
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    mask = nn.Transformer.generate_square_subsequent_mask(L)

    def inputs(g):
        x = _rand(g, N, L, E)
        return (x, x, x), dict(attn_mask=mask, is_causal=True, need_weights=False)

    cf = _check(mha, inputs)
    assert tt.compile_stats(cf).opaque_ops == []
    assert "scaled_dot_product_attention" in str(tt.last_traces(cf)[0])


@pytest.mark.parametrize("average", [True, False])
def test_attention_weights_and_float_mask(average):
    mha = nn.MultiheadAttention(E, H)

    def inputs(g):
        q, kv = _rand(g, L, N, E), _rand(g, S, N, E)
        return (q, kv, kv), dict(attn_mask=_rand(g, L, S), need_weights=True, average_attn_weights=average)

    assert tt.compile_stats(_check(mha, inputs)).opaque_ops == []


@pytest.mark.parametrize("need_weights", [False, True])
def test_key_padding_mask(need_weights):
    mha = nn.MultiheadAttention(E, H, batch_first=True)

    def inputs(g):
        x = _rand(g, N, S, E)
        pad = torch.zeros(N, S, dtype=torch.bool)
        pad[0, -2:] = True
        return (x, x, x), dict(key_padding_mask=pad, need_weights=need_weights)

    assert tt.compile_stats(_check(mha, inputs)).opaque_ops == []


def test_separate_projections_bias_kv_and_zero_attention():
    mha = nn.MultiheadAttention(E, H, kdim=8, vdim=12, add_bias_kv=True, add_zero_attn=True)

    def inputs(g):
        return (_rand(g, L, N, E), _rand(g, S, N, 8), _rand(g, S, N, 12)), dict(need_weights=False)

    assert tt.compile_stats(_check(mha, inputs)).opaque_ops == []


def test_unbatched_input():
    mha = nn.MultiheadAttention(E, H)

    def inputs(g):
        x = _rand(g, L, E)
        return (x, x, x), {}

    assert tt.compile_stats(_check(mha, inputs)).opaque_ops == []


@pytest.mark.parametrize("need_weights", [False, True])
def test_dropout_draws_as_eager(need_weights):
    mha = nn.MultiheadAttention(E, H, dropout=0.25, batch_first=True)

    def inputs(g):
        x = _rand(g, N, L, E)
        return (x, x, x), dict(need_weights=need_weights)

    _check(mha, inputs)


def test_transformer_encoder_step_runs_no_op_through_torch_autograd():
    """The zoo's nn.TransformerEncoder step: before, each layer's attention was one opaque line whose gradient came
    from torch's autograd graph (a ``_op_autograd_vjp`` line in the backward)."""
    model = _zoo.build("transformer_encoder")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = tt.compile(_zoo.train_step, thin=True, fusion=None)
    for batch in _zoo.batches("transformer_encoder", 3):
        step(model, opt, batch)
    assert tt.compile_stats(step).opaque_ops == []
    assert "_op_autograd" not in str(tt.last_traces(step)[-1])
