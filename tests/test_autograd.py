"""Gradients of compiled functions, compared with eager PyTorch."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from _models import Block  # noqa: E402


def _rand(*shape, dtype=torch.float32, positive=False, unit=False):
    t = torch.randn(*shape, dtype=dtype)
    if positive:
        t = t.abs() + 0.5
    if unit:
        t = torch.rand(*shape, dtype=dtype) * 1.8 - 0.9
    return t.requires_grad_()


def check_grads(fn, *args, atol=None, rtol=None):
    """Forward values and input gradients (for a random cotangent) of compiled ``fn`` match eager."""
    torch.manual_seed(1234)
    expected = fn(*args)
    outs = [expected] if isinstance(expected, torch.Tensor) else list(expected)
    cotangents = [torch.randn_like(o) for o in outs]
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    eager_grads = torch.autograd.grad(outs, leaves, cotangents, allow_unused=True)

    cf = tt.compile(fn)
    actual = cf(*args)
    actual_outs = [actual] if isinstance(actual, torch.Tensor) else list(actual)
    for a, e in zip(actual_outs, outs):
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol)
    assert tt.last_backward_traces(cf), "the compiled function did not take the autograd path"
    grads = torch.autograd.grad(actual_outs, leaves, cotangents, allow_unused=True)
    for g, e, leaf in zip(grads, eager_grads, leaves):
        if e is None:
            assert g is None or torch.count_nonzero(g) == 0
            continue
        assert g is not None, f"no gradient for an input of shape {tuple(leaf.shape)}"
        torch.testing.assert_close(g, e, atol=atol, rtol=rtol)
    return cf


# ---------------------------------------------------------------------------
# One case per op with a gradient rule (prims reached through torch ops, and direct rules)
# ---------------------------------------------------------------------------
def _cases(dtype):
    r = lambda *s, **k: _rand(*s, dtype=dtype, **k)  # noqa: E731
    return {
        # elementwise prims
        "neg_abs": (lambda x: (-x).abs(), (r(3, 4),)),
        "exp_log": (lambda x: torch.exp(x) + torch.log(x), (r(3, 4, positive=True),)),
        "exp2_expm1_log1p": (lambda x: torch.exp2(x) + torch.expm1(x) + torch.log1p(x), (r(3, 4, positive=True),)),
        "log2_log10": (lambda x: torch.log2(x) * torch.log10(x), (r(5, positive=True),)),
        "sqrt_rsqrt_reciprocal": (lambda x: x.sqrt() + x.rsqrt() + x.reciprocal(), (r(5, positive=True),)),
        "trig": (lambda x: x.sin() * x.cos() + x.tan(), (r(6, unit=True),)),
        "inverse_trig": (lambda x: x.asin() + x.acos() + x.atan(), (r(6, unit=True),)),
        "hyperbolic": (lambda x: x.sinh() + x.cosh() + x.tanh() + x.asinh() + x.atanh(), (r(6, unit=True),)),
        "acosh": (lambda x: torch.acosh(x + 1.5), (r(6, positive=True),)),
        "erf_erfc_erfinv": (lambda x: torch.erf(x) + torch.erfc(x) + torch.erfinv(x), (r(6, unit=True),)),
        "sigmoid_lgamma": (lambda x: torch.sigmoid(x) * torch.lgamma(x), (r(6, positive=True),)),
        "add_sub_broadcast": (lambda x, y: x + y - 2 * y, (r(3, 4), r(4))),
        "mul_div": (lambda x, y: x * y / (y + 3.0), (r(3, 4), r(3, 1, positive=True))),
        "scalar_ops": (lambda x: 2.0 / (x + 3.0) - x * 0.5, (r(3, 4, positive=True),)),
        "pow": (lambda x, y: x ** y + x ** 2.5 + 2.0 ** y, (r(4, positive=True), r(4))),
        "maximum_minimum": (lambda x, y: torch.maximum(x, y) + torch.minimum(x, y) * 2, (r(3, 4), r(3, 4))),
        "clamp": (lambda x: torch.clamp(x, -0.5, 0.5), (r(20),)),
        "atan2_hypot": (lambda x, y: torch.atan2(x, y) + torch.hypot(x, y), (r(5), r(5))),
        "fmod_remainder": (lambda x, y: torch.fmod(x, y) + torch.remainder(x, y), (r(5) * 3, r(5, positive=True))),
        "where": (lambda x, y: torch.where(x > 0, x, y), (r(3, 4), r(3, 4))),
        "type_conversion": (lambda x: (x.to(torch.float64) * 2).to(x.dtype), (r(3, 4),)),
        # reductions and scans
        "sum_mean": (lambda x: x.sum(1) + x.mean(1, keepdim=True).squeeze(1), (r(3, 4),)),
        "var": (lambda x: torch.var(x, dim=1) + x.var(), (r(3, 4),)),
        "amax_amin": (lambda x: x.amax(1) + x.amin(0).sum(), (r(3, 4),)),
        "max_ties": (lambda x: x.amax(), (torch.tensor([1.0, 3.0, 3.0, 2.0], dtype=dtype, requires_grad=True),)),
        "cumsum": (lambda x: torch.cumsum(x, 1), (r(3, 4),)),
        "topk_sort": (lambda x: torch.topk(x, 2, dim=1).values.sum() + torch.sort(x, dim=0).values, (r(3, 4),)),
        # shapes and indexing
        "reshape_permute": (lambda x: x.reshape(4, 6).t().reshape(2, 12).permute(1, 0), (r(2, 3, 4),)),
        "expand_squeeze": (lambda x: x.unsqueeze(0).expand(3, 4, 5).sum(0) + x.squeeze(), (r(4, 1) * torch.ones(4, 5, dtype=dtype),)),
        "slice_step": (lambda x: x[1:, ::2] * 3, (r(4, 5),)),
        "cat_stack": (lambda x, y: torch.cat([x, y, x], 1) * torch.stack([x, x], 0).sum(0)[:, :1], (r(3, 2), r(3, 3))),
        "pad": (lambda x: F.pad(x, (1, 2, 0, 1)), (r(3, 4),)),
        "flip": (lambda x: torch.flip(x, (0,)), (r(3, 4),)),
        "index_select": (lambda x: x.index_select(0, torch.tensor([2, 0, 3, 3, 1])), (r(4, 3),)),
        "gather": (lambda x: torch.gather(x, 1, torch.tensor([[0, 0], [1, 0], [2, 1]])), (r(3, 3),)),
        # matmul in all its shapes
        "matmul_vec_vec": (lambda a, b: a @ b, (r(4), r(4))),
        "matmul_vec_mat": (lambda a, b: a @ b, (r(4), r(4, 3))),
        "matmul_mat_vec": (lambda a, b: a @ b, (r(3, 4), r(4))),
        "matmul_batched_broadcast": (lambda a, b: a @ b, (r(2, 3, 4), r(4, 5))),
        "bmm_broadcast": (lambda a, b: torch.matmul(a, b), (r(2, 1, 3, 4), r(5, 4, 2))),
        # direct rules for composites
        "linear": (lambda x, w, b: F.linear(x, w, b), (r(2, 3, 4), r(5, 4), r(5))),
        "linear_nobias": (lambda x, w: F.linear(x, w), (r(3, 4), r(5, 4))),
        "relu": (lambda x: F.relu(x), (r(4, 5),)),
        "gelu": (lambda x: F.gelu(x), (r(4, 5),)),
        "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), (r(4, 5),)),
        "silu": (lambda x: F.silu(x), (r(4, 5),)),
        "softmax": (lambda x: torch.softmax(x, -1), (r(3, 5),)),
        "log_softmax": (lambda x: F.log_softmax(x, 1), (r(3, 5, 2),)),
        "layer_norm": (lambda x, w, b: F.layer_norm(x, (6,), w, b), (r(2, 3, 6), r(6), r(6))),
        "layer_norm_plain": (lambda x: F.layer_norm(x, (3, 6)), (r(2, 3, 6),)),
        "rms_norm": (lambda x, w: F.rms_norm(x, (6,), w, eps=1e-6), (r(2, 3, 6), r(6))),
        "cross_entropy": (lambda x: F.cross_entropy(x, torch.tensor([1, 0, 4])), (r(3, 5),)),
        "cross_entropy_weighted_ignore": (
            lambda x, w: F.cross_entropy(x, torch.tensor([1, -100, 4, 2]), weight=w, ignore_index=-100),
            (r(4, 5), torch.rand(5, dtype=dtype) + 0.1),
        ),
        "cross_entropy_sum_3d": (lambda x: F.cross_entropy(x, torch.tensor([[1, 0], [2, 2]]), reduction="sum"), (r(2, 3, 2),)),
        "cross_entropy_none": (lambda x: F.cross_entropy(x, torch.tensor([1, 0, 4]), reduction="none"), (r(3, 5),)),
        "cross_entropy_label_smoothing": (lambda x: F.cross_entropy(x, torch.tensor([1, 0, 4]), label_smoothing=0.1), (r(3, 5),)),
        "embedding": (lambda w: F.embedding(torch.tensor([[1, 2, 1], [0, 3, 1]]), w), (r(4, 3),)),
        "embedding_padding_idx": (lambda w: F.embedding(torch.tensor([[1, 2, 1], [0, 3, 1]]), w, padding_idx=1), (r(4, 3),)),
        "embedding_scale_grad_by_freq": (lambda w: F.embedding(torch.tensor([[1, 2, 1], [0, 3, 1]]), w, padding_idx=2, scale_grad_by_freq=True), (r(4, 3),)),
        "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), (r(2, 2, 4, 8), r(2, 2, 5, 8), r(2, 2, 5, 8))),
        "sdpa_causal": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), (r(1, 2, 4, 8), r(1, 2, 4, 8), r(1, 2, 4, 8))),
        "sdpa_float_mask": (
            lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
            (r(1, 2, 4, 8), r(1, 2, 5, 8), r(1, 2, 5, 8), r(4, 5)),
        ),
        "sdpa_bool_mask": (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=torch.tensor([True, False, True, True, True]).expand(4, 5)),
            (r(1, 2, 4, 8), r(1, 2, 5, 8), r(1, 2, 5, 8)),
        ),
        "conv2d": (lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1), (r(2, 4, 7, 7), r(6, 4, 3, 3), r(6))),
        "conv2d_groups": (lambda x, w: F.conv2d(x, w, groups=2, dilation=2), (r(1, 4, 8, 8), r(4, 2, 3, 3))),
        "conv1d": (lambda x, w: F.conv1d(x, w, padding=1), (r(2, 3, 9), r(4, 3, 3))),
        # composites differentiated through their decomposition
        "mse_loss": (lambda x, y: F.mse_loss(x, y), (r(3, 4), r(3, 4))),
        "bce_with_logits": (lambda x, t: F.binary_cross_entropy_with_logits(x, t), (r(3, 4), torch.rand(3, 4, dtype=dtype))),
        "leaky_relu_elu": (lambda x: F.leaky_relu(x, 0.1) + F.elu(x), (r(4, 5),)),
        "softplus_mish": (lambda x: F.softplus(x) + F.mish(x), (r(4, 5),)),
        "avg_max_pool": (lambda x: F.avg_pool2d(x, 2) + F.max_pool2d(x, 2), (r(1, 2, 4, 4),)),
        "einsum": (lambda a, b: torch.einsum("bij,bjk->bik", a, b), (r(2, 3, 4), r(2, 4, 5))),
    }


CASES = _cases(torch.float32)


@pytest.mark.parametrize("name", sorted(CASES))
def test_grad_matches_eager_float32(name):
    fn, args = _cases(torch.float32)[name]
    check_grads(fn, *args, atol=1e-4, rtol=1e-4)


FLOAT64 = ["exp_log", "pow", "mul_div", "var", "matmul_batched_broadcast", "linear", "layer_norm", "rms_norm",
           "cross_entropy_weighted_ignore", "log_softmax", "sdpa_causal", "conv2d", "embedding_padding_idx",
           "embedding_scale_grad_by_freq", "gelu"]


@pytest.mark.parametrize("name", FLOAT64)
def test_grad_matches_eager_float64(name):
    fn, args = _cases(torch.float64)[name]
    check_grads(fn, *args, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("kwargs", [{}, {"padding_idx": -1}, {"padding_idx": 2, "scale_grad_by_freq": True}])
def test_embedding_gradient_is_eagers_kernel_bitwise(kwargs):
    """The torch executor runs eager's own embedding backward (no forward recomputation): the same bits."""
    torch.manual_seed(0)
    emb = nn.Embedding(7, 5, **kwargs)
    x = torch.tensor([[1, 2, 1, 6], [0, 2, 2, 3]])
    g = torch.randn(2, 4, 5)
    cf = tt.compile(emb)
    got = torch.autograd.grad(cf(x), emb.weight, g)[0]
    assert torch.equal(got, torch.autograd.grad(emb(x), emb.weight, g)[0])
    assert "ttex.embedding_vjp(" in str(tt.last_backward_traces(cf)[-1])


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("dim, dtype", [(-1, None), (1, None), (-1, torch.float32), (-1, torch.float64)])
def test_softmax_gradient_is_eagers_kernel_bitwise(op, dim, dtype):
    """Eager's backward kernel on the forward's output (no forward recomputation) where that is what eager's autograd
    runs; with a ``dtype`` other than the input's, eager differentiates the conversion too (the forward is run again
    under autograd then)."""
    torch.manual_seed(0)
    x, g = torch.randn(3, 5, 7, requires_grad=True), torch.randn(3, 5, 7, dtype=dtype or torch.float32)
    f = lambda x: getattr(torch, op)(x * 2.0, dim, dtype=dtype)  # noqa: E731
    cf = tt.compile(f)
    got = torch.autograd.grad(cf(x), x, g)[0]
    assert torch.equal(got, torch.autograd.grad(f(x), x, g)[0])
    direct = f"ttex.{op}_vjp" in str(tt.last_backward_traces(cf)[-1])  # (or its out form)
    assert direct == (dtype in (None, torch.float32))


def test_sparse_embedding_gradient_is_refused_with_what_to_do():
    """A sparse gradient cannot be given; a dense one in its place would be silently different (its type)."""
    emb = nn.Embedding(5, 3, sparse=True)
    x = torch.tensor([1, 2, 1])
    cf = tt.compile(emb)
    with torch.no_grad():
        assert torch.equal(cf(x), emb(x))  # the forward is fine
    with pytest.raises(NotImplementedError, match="sparse=True.*use sparse=False"):
        cf(x).sum().backward()


# ---------------------------------------------------------------------------
# Integration with torch.autograd
# ---------------------------------------------------------------------------
def test_module_backward_accumulates_into_grad():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    ref = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())
    cm = tt.compile(model)
    x = torch.randn(5, 4)
    for _ in range(2):  # the second call accumulates into .grad, like eager
        cm(x).square().mean().backward()
        ref(x).square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    src = str(tt.last_backward_traces(cm)[-1])
    assert "def backward(saved" in src and "Final backward" in src


def test_inputs_without_grad_and_non_differentiable_outputs():
    def f(x, w):
        y = x @ w
        return {"y": y, "idx": y.argmax(1), "scale": 2}

    x, w = torch.randn(3, 4), torch.randn(4, 5, requires_grad=True)
    cf = tt.compile(f)
    out = cf(x, w)
    assert out["scale"] == 2 and not out["idx"].requires_grad and out["y"].requires_grad
    out["y"].sum().backward()
    torch.testing.assert_close(w.grad, x.t() @ torch.ones(3, 5))
    assert x.grad is None


def test_no_grad_call_and_no_grad_region():
    def f(x):
        with torch.no_grad():
            s = x.sum()
        return x * s

    cf = tt.compile(f)
    x = torch.randn(4, requires_grad=True)
    with torch.no_grad():
        assert not cf(x).requires_grad
    assert tt.last_backward_traces(cf) == []
    cf(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, x.sum().item()))


def test_tensor_hooks_and_retain_graph():
    cf = tt.compile(lambda x: (x.sin() * x).sum())
    x = torch.randn(5, requires_grad=True)
    seen = []
    x.register_hook(lambda g: seen.append(g.clone()))
    loss = cf(x)
    loss.backward(retain_graph=True)
    loss.backward()
    expected = x.cos() * x + x.sin()
    torch.testing.assert_close(x.grad, 2 * expected.detach())
    assert len(seen) == 2


def test_second_backward_without_retain_graph_errors():
    cf = tt.compile(lambda x: (x.exp() * x).sum())
    x = torch.randn(5, requires_grad=True)
    loss = cf(x)
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_saved_input_modified_in_place_errors():
    cf = tt.compile(lambda x, w: (x * w).sum())
    x, w = torch.randn(3, requires_grad=True), torch.randn(3)
    loss = cf(x, w)
    w.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_opaque_op_gradient_comes_from_torch_autograd():
    # torch.special.i0e is unknown to the compiler and runs opaquely; its gradient is eager's (transforms/opaque_grad.py).
    cf = tt.compile(lambda x: (torch.special.i0e(x) * torch.arange(4.0)).sum())
    x = torch.randn(4, requires_grad=True)
    out = cf(x)
    expected = (torch.special.i0e(x) * torch.arange(4.0)).sum()
    torch.testing.assert_close(out, expected)
    (g,) = torch.autograd.grad(out, x)
    torch.testing.assert_close(g, torch.autograd.grad(expected, x)[0])
    assert any("i0e" in n and "gradient by torch autograd" in n for n in tt.compile_stats(cf).opaque_ops)


def test_dropout_backward_uses_the_forward_mask():
    torch.manual_seed(0)
    cf = tt.compile(lambda x: F.dropout(x, 0.5, training=True))
    x = (torch.rand(200) + 1).requires_grad_()
    y = cf(x)
    y.backward(torch.ones_like(y))
    kept = y != 0
    assert 0 < kept.sum() < 200
    torch.testing.assert_close(x.grad, kept.to(x.dtype) * 2.0)
    assert any("saved" in str(t) for t in tt.last_backward_traces(cf))


def _count_saved_eager(fn, *args):
    packed = {}

    def pack(t):
        packed[(t.data_ptr(), tuple(t.shape), t.dtype)] = True
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return len(packed)


# ---------------------------------------------------------------------------
# A small transformer block over several training steps
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_transformer_block_training_steps_match_eager(dtype):
    torch.manual_seed(0)
    model = Block().to(dtype)
    ref = Block().to(dtype)
    ref.load_state_dict(model.state_dict())
    cm = tt.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-10)
    for step in range(3):
        x = torch.randn(2, 5, 16, dtype=dtype, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        target = torch.randn(2, 5, 16, dtype=dtype)
        out, out_ref = cm(x), ref(x_ref)
        torch.testing.assert_close(out, out_ref, **tol)
        F.mse_loss(out, target).backward()
        F.mse_loss(out_ref, target).backward()
        torch.testing.assert_close(x.grad, x_ref.grad, **tol)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m: f"step {step}, {name}: {m}")
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    assert tt.compile_stats(cm).cache_misses == 1


def test_transformer_block_saves_no_more_than_eager():
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 5, 16, requires_grad=True)
    cm = tt.compile(model)
    cm(x)
    forward_src = str(tt.last_traces(cm)[-1])
    ours = len(cm._tt_compiled._last.computation.saved_names)
    eager = _count_saved_eager(model, x)
    assert ours <= eager, (ours, eager, forward_src)


# ---------------------------------------------------------------------------
# Rules added for the remaining ops: prod, index_put (values), copysign, nextafter,
# digamma, SDPA with dropout or grouped-query attention, cross-entropy with label smoothing
# ---------------------------------------------------------------------------
def _zeros_at(t, *positions):
    t = t.detach().clone()
    for p in positions:
        t[p] = 0.0
    return t.requires_grad_()


def _setitem(x, v, key):
    y = x * 1.0
    y[key] = v
    return y


def _more_cases(dtype):
    r = lambda *s, **k: _rand(*s, dtype=dtype, **k)  # noqa: E731
    target = torch.tensor([1, 0, 4, 2])
    probs = torch.softmax(torch.randn(4, 5, dtype=dtype), 1)
    return {
        "prod_all": (lambda x: torch.prod(x), (r(3, 4),)),
        "prod_dim": (lambda x: x.prod(1), (r(3, 4),)),
        "prod_keepdim_one_zero": (lambda x: x.prod(0, keepdim=True), (_zeros_at(r(3, 4), (1, 2)),)),
        "prod_two_zeros": (lambda x: x.prod(1), (_zeros_at(r(3, 4), (0, 1), (0, 3), (2, 0)),)),
        "setitem_values": (lambda x, v: _setitem(x, v, torch.tensor([2, 0])), (r(4, 3), r(2, 3))),
        "setitem_broadcast_values": (lambda x, v: _setitem(x, v, (slice(None), torch.tensor([1, -1]))), (r(3, 4), r(2))),
        "setitem_rows": (lambda x, v: _setitem(x, v, slice(1, 3)), (r(4, 3), r(3))),
        # several tensor indices (HF attention-mask helpers index padding_mask[batch_idx, kv_idx])
        "getitem_two_tensors_repeated": (lambda x: x[torch.tensor([[0], [2]]), torch.tensor([1, 1, -1])] * 2, (r(3, 4, 2),)),
        "getitem_tensors_separated": (lambda x: x[torch.tensor([1, 0, 1]), :, torch.tensor([0, 2, 0])], (r(2, 3, 4),)),
        "setitem_two_tensors": (lambda x, v: _setitem(x, v, (torch.tensor([0, 2]), slice(None), torch.tensor([1, -1]))), (r(3, 2, 4), r(2, 2))),
        "copysign": (lambda x, y: torch.copysign(x, y), (_zeros_at(r(6), 2), r(6))),
        "copysign_scalar": (lambda x: torch.copysign(x, -1.5), (r(6),)),
        "nextafter": (lambda x, y: torch.nextafter(x, y) * 3, (r(5), r(5))),
        "digamma": (lambda x: torch.digamma(x), (torch.tensor([0.3, 1.7, 4.0, -0.5, -2.3], dtype=dtype, requires_grad=True),)),
        "sdpa_gqa": (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            (r(2, 4, 5, 8), r(2, 2, 6, 8), r(2, 2, 6, 8)),
        ),
        "sdpa_gqa_causal_scale": (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True),
            (r(1, 6, 4, 8), r(1, 2, 4, 8), r(1, 2, 4, 8)),
        ),
        "sdpa_gqa_float_mask": (
            lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True),
            (r(2, 4, 3, 8), r(2, 1, 5, 8), r(2, 1, 5, 8), r(3, 5)),
        ),
        "ce_smoothing_mean": (lambda x: F.cross_entropy(x, target, label_smoothing=0.2), (r(4, 5),)),
        "ce_smoothing_sum": (lambda x: F.cross_entropy(x, target, label_smoothing=0.2, reduction="sum"), (r(4, 5),)),
        "ce_smoothing_none": (lambda x: F.cross_entropy(x, target, label_smoothing=0.2, reduction="none"), (r(4, 5),)),
        # (eager cannot differentiate class-index cross-entropy w.r.t. weight: see test_cross_entropy_weight_gradient)
        "ce_smoothing_weight_ignore": (
            lambda x, w: F.cross_entropy(x, torch.tensor([1, -100, 4, 2]), weight=w, label_smoothing=0.3),
            (r(4, 5), torch.rand(5, dtype=dtype) + 0.1),
        ),
        "ce_smoothing_weight_none": (
            lambda x, w: F.cross_entropy(x, torch.tensor([1, 3, -1, 2]), weight=w, ignore_index=-1, label_smoothing=0.1, reduction="none"),
            (r(4, 5), torch.rand(5, dtype=dtype) + 0.1),
        ),
        "ce_smoothing_spatial": (
            lambda x: F.cross_entropy(x, torch.tensor([[1, 0, 2], [2, 2, 0]]), label_smoothing=0.1),
            (r(2, 3, 3),),
        ),
        "ce_smoothing_unbatched": (lambda x: F.cross_entropy(x, torch.tensor(3), label_smoothing=0.25), (r(5),)),
        "ce_probs_smoothing": (
            lambda x, t, w: F.cross_entropy(x, t, weight=w, label_smoothing=0.1),
            (r(4, 5), probs.clone().requires_grad_(), (torch.rand(5, dtype=dtype) + 0.1).requires_grad_()),
        ),
        "ce_probs_sum": (lambda x, t: F.cross_entropy(x, t, reduction="sum"), (r(4, 5), probs.clone().requires_grad_())),
    }


MORE_CASES = _more_cases(torch.float32)


@pytest.mark.parametrize("name", sorted(MORE_CASES))
def test_new_rule_matches_eager_float32(name):
    fn, args = _more_cases(torch.float32)[name]
    check_grads(fn, *args, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["prod_dim", "prod_keepdim_one_zero", "prod_two_zeros", "setitem_broadcast_values", "copysign",
                                  "digamma", "sdpa_gqa", "ce_smoothing_weight_ignore", "ce_smoothing_spatial", "ce_probs_smoothing"])
def test_new_rule_matches_eager_float64(name):
    fn, args = _more_cases(torch.float64)[name]
    check_grads(fn, *args, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("fn, op", [
    (lambda x: F.cross_entropy(x, torch.tensor([1, 0, 4]), label_smoothing=0.1), "cross_entropy"),
    (lambda x: F.scaled_dot_product_attention(x, x[:, :1], x[:, :1], enable_gqa=True), "scaled_dot_product_attention"),
])
def test_direct_rules_keep_the_forward_one_torch_call(fn, op):
    """A direct rule lets the forward run the torch function whole and save only its inputs."""
    x = _rand(3, 5) if op == "cross_entropy" else _rand(1, 2, 3, 4)
    cf = check_grads(fn, x, atol=1e-5, rtol=1e-5)
    fwd = str(tt.last_traces(cf)[-1])
    assert f"torch.nn.functional.{op}(" in fwd
    assert "softmax" not in fwd and "amax" not in fwd


@pytest.mark.parametrize("gqa", [False, True])
def test_sdpa_dropout_backward_reuses_the_forward_mask(gqa):
    """With v = I the output is the dropped-out attention matrix itself, which reveals the mask the forward drew."""
    torch.manual_seed(0)
    p, L = 0.4, 6
    q = _rand(2, 4, L, 8)
    kv_heads = 2 if gqa else 4
    k = _rand(2, kv_heads, L, 8)
    v = torch.eye(L).expand(2, kv_heads, L, L).clone().requires_grad_()
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=p, enable_gqa=gqa)  # noqa: E731
    cf = tt.compile(fn)
    out = cf(q, k, v)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    keep = out.detach() != 0
    assert 0 < keep.sum() < keep.numel()

    def reference(q, k, v):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        attn = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1)
        return (attn * keep / (1 - p)) @ v

    expected = reference(q, k, v)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for a, e in zip(grads, torch.autograd.grad(expected, (q, k, v), g)):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_index_put_rule_directly():
    """prims.index_put: gradients of the destination (written positions get none) and of the values."""
    from thunder_train.compiler import prims
    from thunder_train.compiler import grad_rules

    assert grad_rules.has_rule(prims.index_put) and grad_rules.has_rule(prims.polygamma)
    x, v = _rand(4, 3, dtype=torch.float64), _rand(2, 3, dtype=torch.float64)
    idx = torch.tensor([3, 1])
    fn = lambda x, v: _setitem(x, v, idx).sin()  # noqa: E731
    check_grads(fn, x, v, atol=1e-12, rtol=1e-12)


def _cross_entropy_reference(x, target, weight, eps, ignore_index, reduction):
    """Eager's class-index cross-entropy (aten's cross_entropy_loss_label_smoothing) written with differentiable ops."""
    c_dim = 0 if x.ndim == 1 else 1
    C = x.shape[c_dim]
    logp = x.log_softmax(c_dim)
    valid = target != ignore_index
    safe = torch.where(valid, target, 0)
    w_t = weight[safe] * valid
    nll = -logp.gather(c_dim, safe.unsqueeze(c_dim)).squeeze(c_dim) * w_t
    shape = [1] * x.ndim
    shape[c_dim] = C
    smooth = -(logp * weight.view(shape)).sum(c_dim) * valid
    if reduction == "none":
        return (1 - eps) * nll + eps / C * smooth
    if reduction == "sum":
        return (1 - eps) * nll.sum() + eps / C * smooth.sum()
    return ((1 - eps) * nll.sum() + eps / C * smooth.sum()) / w_t.sum()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("eps", [0.0, 0.2])
@pytest.mark.parametrize("spatial", [False, True])
def test_cross_entropy_weight_gradient(reduction, eps, spatial):
    """Eager refuses a weight that requires grad (nll_loss); ours differentiates it, checked on eager's formula."""
    torch.manual_seed(0)
    x = _rand(4, 5, 3, dtype=torch.float64) if spatial else _rand(4, 5, dtype=torch.float64)
    target = torch.tensor([[1, -100, 4], [0, 2, 2], [3, 3, -100], [4, 0, 1]]) if spatial else torch.tensor([1, -100, 4, 2])
    w = (torch.rand(5, dtype=torch.float64) + 0.1).requires_grad_()
    expected = _cross_entropy_reference(x, target, w, eps, -100, reduction)
    torch.testing.assert_close(expected, F.cross_entropy(x, target, weight=w.detach(), label_smoothing=eps, reduction=reduction))
    cf = tt.compile(lambda x, w: F.cross_entropy(x, target, weight=w, label_smoothing=eps, reduction=reduction))
    actual = cf(x, w)
    torch.testing.assert_close(actual, expected.detach(), atol=1e-12, rtol=1e-12)
    cot = torch.randn_like(expected)
    for a, e in zip(torch.autograd.grad(actual, (x, w), cot), torch.autograd.grad(expected, (x, w), cot)):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-10)


def test_two_layer_norms_with_different_inputs_needing_grad():
    """The first norm's input (the batch) does not require grad, the second's does: their backwards differ."""
    torch.manual_seed(0)
    ln1, ln2 = nn.LayerNorm(6), nn.LayerNorm(6)
    x = torch.randn(3, 6)
    fn = lambda x: ln2(ln1(x) * 2.0).sum()  # noqa: E731
    fn(x).backward()
    expected = [p.grad.clone() for p in (*ln1.parameters(), *ln2.parameters())]
    for p in (*ln1.parameters(), *ln2.parameters()):
        p.grad = None
    tt.compile(fn)(x).backward()
    for p, e in zip((*ln1.parameters(), *ln2.parameters()), expected):
        torch.testing.assert_close(p.grad, e)


_SHARED_ARGUMENTS = {
    # one tensor passed as two differentiated arguments of an op whose backward is torch's fused kernel
    "sdpa_x_x_x": (lambda x: F.scaled_dot_product_attention(x, x, x), ((2, 3, 5, 4),)),
    "sdpa_q_x_x": (lambda q, x: F.scaled_dot_product_attention(q, x, x), ((2, 3, 5, 4), (2, 3, 5, 4))),
    "sdpa_x_k_x_causal": (lambda x, k: F.scaled_dot_product_attention(x, k, x, is_causal=True), ((2, 5, 4), (2, 5, 4))),
    "layer_norm_w_w": (lambda x, w: F.layer_norm(x, (4,), w, w), ((3, 4), (4,))),
    "layer_norm_x_x_x": (lambda w: F.layer_norm(w, (4,), w, w), ((4,),)),
}


@pytest.mark.parametrize("name", sorted(_SHARED_ARGUMENTS))
def test_one_tensor_as_two_differentiated_arguments(name):
    """Each argument gets its own gradient (eager sums them); torch's fused backward would only give the sum."""
    torch.manual_seed(0)
    fn, shapes = _SHARED_ARGUMENTS[name]
    check_grads(fn, *(_rand(*s) for s in shapes), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "gelu", "layer_norm", "cross_entropy", "sdpa_causal"])
def test_decomposed_backward_matches_eager(name):
    """decompose=True runs the rules' prims: every value they read must reach the backward."""
    fn, args = _cases(torch.float64)[name]
    torch.manual_seed(0)
    expected = fn(*args)
    cot = torch.randn_like(expected)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    actual = tt.compile(fn, decompose=True)(*args)
    torch.testing.assert_close(actual, expected)
    for a, e in zip(torch.autograd.grad(actual, leaves, cot), torch.autograd.grad(expected, leaves, cot)):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("decompose", [False, True], ids=["whole", "decomposed"])
def test_split_gradients_are_one_cat(decompose):
    """split/chunk/tensor_split: the pieces' gradients are concatenated (missing pieces are zeros), as eager does."""
    fns = [
        lambda x: x.split(2, dim=1)[0].sum() + x.split(2, dim=1)[2].pow(2).sum(),
        lambda x: sum((a * (i + 1)).sum() for i, a in enumerate(x.split([1, 3, 2], dim=-1))),
        lambda x: sum((a ** 2).sum() for a in x.chunk(3, 1)),
        lambda x: sum((a * 2).sum() for a in torch.tensor_split(x, 2, dim=1)),
    ]
    for fn in fns:
        x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
        expected = torch.autograd.grad(fn(x), x)[0]
        cf = tt.compile(fn, decompose=decompose)
        torch.testing.assert_close(torch.autograd.grad(cf(x), x)[0], expected)
        bwd = tt.last_backward_traces(cf)[-1].python_source()
        assert "cat(" in bwd and "pad(" not in bwd


def test_gradient_of_unsqueeze_is_a_reshape_not_a_sum():
    """A new size-1 dim (unsqueeze, keepdim reductions' results) gets its gradient by a reshape, as eager's squeeze
    view does: a sum over the one element was a kernel call per use and turned a -0.0 gradient into 0.0."""

    def f(x):
        return x.unsqueeze(1).exp()

    x = torch.randn(4, 3, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    g = -torch.zeros(4, 1, 3)
    cf = tt.compile(f)
    cf(x).backward(g)
    f(x_eager).backward(g)
    torch.testing.assert_close(x.grad, x_eager.grad, rtol=0, atol=0)
    assert torch.equal(torch.signbit(x.grad), torch.signbit(x_eager.grad))
    assert "torch.sum" not in str(tt.last_backward_traces(cf)[-1])
