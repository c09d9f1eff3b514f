"""View lines that give back the tensor their chain of views started from are dropped (executors/identity_views.py),
and Falcon's multi-query attention runs the flash kernels (executors/saved_statistics.py): values stay eager's."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F

import _zoo
import thunder_train as tt
from thunder_train.compiler import pipeline


def source(cf) -> str:
    return tt.last_traces(cf)[-1].python_source()


def test_transpose_of_a_transpose_and_a_reshape_back_are_dropped_and_values_are_bitwise_the_same(monkeypatch):
    def f(x, w):
        wt = w.permute(1, 0)
        back = wt.permute(1, 0)  # w itself
        h = torch.matmul(x, back)
        flat = h.reshape(12, 4).reshape(3, 4, 4)  # h's own layout
        same = h.reshape(3, 4, 4)  # h's own shape
        return (flat * 2 + same).sum(), h.transpose(0, 1)

    x, w = torch.randn(3, 4, 5), torch.randn(5, 4)
    cf = tt.compile(f, thin=True, fusion=None)
    with monkeypatch.context() as m:
        m.setattr(pipeline, "drop_identity_views", lambda trc: trc)
        reference = tt.compile(f, thin=True, fusion=None)
        want = reference(x, w)
    for _ in range(2):
        got = cf(x, w)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert all(torch.equal(a, b) for a, b in zip(got, f(x, w)))
    src, ref = source(cf), source(reference)
    n = lambda s: s.count("permute(") + s.count("reshape(")  # noqa: E731
    assert n(src) < n(ref), src
    assert "reshape(h" not in src.replace("torch.", "")


def test_a_returned_view_stays_a_new_tensor():
    # The result is returned: the user gets a new tensor object, as eager gives, not the input.
    def f(x):
        return x.permute(1, 0).permute(1, 0) * 1, x.reshape(x.shape)

    x = torch.randn(3, 4)
    cf = tt.compile(f, thin=True, fusion=None)
    for _ in range(2):
        a, b = cf(x)
        assert torch.equal(a, x) and torch.equal(b, x) and b is not x


@pytest.mark.parametrize("masked", [False, True])
def test_one_key_value_head_broadcast_over_the_query_heads_runs_the_flash_kernels(masked):
    # Multi-query attention written without enable_gqa (Falcon's): flash forward and backward, gradients (the key's
    # and value's summed over the query heads) within the tolerance of eager's math kernel.
    torch.manual_seed(0)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()[None, None].expand(2, 1, 8, 8) if masked else None

    def step(q, k, v):
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked)
        loss = (o * o).sum()
        loss.backward()
        return loss

    leaves = [torch.randn(2, 4, 8, 8, requires_grad=True), torch.randn(2, 1, 8, 8, requires_grad=True),
              torch.randn(2, 1, 8, 8, requires_grad=True)]
    mine = [t.detach().clone().requires_grad_() for t in leaves]
    cf = tt.compile(step, thin=True, fusion=None)
    for _ in range(2):
        for t in (*leaves, *mine):
            t.grad = None
        want, got = step(*leaves), cf(*mine)
        torch.testing.assert_close(got, want)
        for a, b in zip(mine, leaves):
            torch.testing.assert_close(a.grad, b.grad)
    src = source(cf)
    assert "one_kv_head=True" in src and "sdpa_flash_cpu_backward(" in src and "amax(" not in src


def falcon_attention_heads(cf) -> list:
    """(query heads, key/value heads) of each attention call Falcon's traced step made.  transformers 5.24 passes its
    one key/value head as it is (eager runs the math kernel; the program the flash pair for one key/value head,
    ``one_kv_head=True``), 5.25 repeats it over the query heads with an explicit scale (eager runs flash itself)."""
    return [(b.args[0]._tt_shape[1], b.args[1]._tt_shape[1]) for b in tt.last_traces(cf)[0].bound_symbols
            if b.sym.name == "scaled_dot_product_attention"]


def test_falcon_step_runs_flash_and_trains_as_eager():
    eager = _zoo.build("falcon")
    model = copy.deepcopy(eager)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, model)]
    cf = tt.compile(_zoo.train_step, thin=True, fusion=None)
    for b in _zoo.batches("falcon", 3):
        torch.testing.assert_close(cf(model, opts[1], b), _zoo.train_step(eager, opts[0], b), rtol=1e-4, atol=1e-5)
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    src = source(cf)
    heads = falcon_attention_heads(cf)
    one_kv = sum(kv == 1 < q for q, kv in heads)
    why = (heads, [line for line in src.splitlines() if "sdpa" in line])
    # Both attentions run the flash pair, the one key/value head's as one group of all query heads.
    assert len(heads) == 2 and src.count("one_kv_head=True") == one_kv, why
    assert len(re.findall(r"ttex\.sdpa_flash_cpu(?:_masked|_bool_masked)?\(", src)) == 2, why
    assert src.count("sdpa_flash_cpu_backward(") == 2, why


def test_a_reshape_of_a_reshape_read_by_nothing_else_is_one_reshape(monkeypatch):
    """``reshape(reshape(g, a), b)`` with the middle value read by the second line alone: one reshape of ``g``; a middle
    value read elsewhere, or a chain whose single reshape would copy (a transposed start), keeps its lines.  Values,
    layouts and the views' sharing are eager's."""
    def f(x, w):
        h = torch.matmul(x, w)  # (3, 4, 6)
        a = h.reshape(3, 24).reshape(12, 6)  # one reshape of h
        b = h.reshape(72)
        c = b.reshape(6, 12) * 2 + b.reshape(72, 1).sum()  # b is read twice: kept
        t = h.transpose(1, 2)  # (3, 6, 4), not contiguous
        d = t.reshape(18, 4).reshape(72)  # the first reshape copies: kept as it is
        return (a * 3).sum() + c.sum() + d.sum(), a.sin(), d.cos()

    x, w = torch.randn(3, 4, 5), torch.randn(5, 6)
    opts = dict(thin=True, fusion=None, keep_buffers=False)  # (kept buffers make views of their values once)
    cf = tt.compile(f, **opts)
    with monkeypatch.context() as m:
        m.setattr(pipeline, "drop_identity_views", lambda trc: trc)
        reference = tt.compile(f, **opts)
        want = reference(x, w)
    for _ in range(2):
        got = cf(x, w)
        for g, r, e in zip(got, want, f(x, w)):
            assert torch.equal(g, r) and torch.equal(g, e) and g.stride() == e.stride()
    src = source(cf)
    assert src.count("reshape(") == source(reference).count("reshape(") - 1, src
    h = re.search(r"(\w+) = torch\.matmul\(", src).group(1)
    assert f"torch.reshape({h}, (12, 6))" in src, src
