"""Data-dependent sizes (``nonzero``, boolean masks, ``torch.where(cond)``, ``masked_select``, ``unique``,
``bincount``, ``repeat_interleave`` with tensor repeats, ``argwhere``) and a mixture-of-experts layer, in whole
training steps (forward, backward, AdamW) against eager, full and thin.

The counts change on every step (the data and the routing do), and one program serves them all: each op's count
is a size the program reads when the op runs (docs/dynamic_shapes.md), so a step compiles twice at most (the
first AdamW step has no state yet) and no call is abandoned on a count.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt

MODES = [dict(), dict(thin=True)]
MODE_IDS = ["full", "thin"]


class Net(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.l1, self.l2, self.body = nn.Linear(6, 8), nn.Linear(8, 4), body

    def forward(self, x):
        return self.body(self.l1(x), self.l2)


def nonzero(h, l2):
    idx = torch.nonzero(h[:, 0] > 0).squeeze(1)
    return l2(h.index_select(0, idx)).sum() + l2(h).sum() * 0.1


def mask_get(h, l2):
    return l2(h[h[:, 0] > 0]).sum() + h.sum() * 0.1


def mask_set_scalar(h, l2):
    h = h.clone()
    h[h > 0.5] = 0.0
    return l2(h).sum()


def mask_set_tensor(h, l2):
    h = h.clone()
    m = h > 0.5
    h[m] = h[m] * 2
    return l2(h).sum()


def where_cond(h, l2):
    r, c = torch.where(h > 0)
    return (h[r, c] ** 2).sum() + l2(h).sum()


def masked_select(h, l2):
    return torch.masked_select(h, h > 0).pow(2).sum() + l2(h).sum()


def unique(h, l2):
    k = (h[:, 0] > 0).long() + (h[:, 1] > 0).long()
    u, inv, cnt = torch.unique(k, sorted=True, return_inverse=True, return_counts=True)
    return (l2(h).sum(1) * cnt[inv].float()).sum() + u.sum()


def bincount(h, l2):
    k = h.argmax(1)
    c = torch.bincount(k)  # its length is the largest index + 1: data-dependent
    return (l2(h).sum(1) * c[k].float()).sum() + c.shape[0] * 0


def repeat_interleave(h, l2):
    r = (h[:, 0] > 0).long() + 1
    return l2(torch.repeat_interleave(h, r, dim=0)).sum()


def argwhere(h, l2):
    i = torch.argwhere(h > 0)
    return h[i[:, 0], i[:, 1]].sum() + l2(h).sum()


BODIES = [nonzero, mask_get, mask_set_scalar, mask_set_tensor, where_cond, masked_select, unique, bincount,
          repeat_interleave, argwhere]


class SparseMoE(nn.Module):
    """Mixtral-style: softmax router, top-k, each expert run on the tokens routed to it (``torch.where`` on the
    routing mask, ``index_select``, ``index_add_``)."""

    def __init__(self, d=8, experts=4, k=2):
        super().__init__()
        self.gate, self.k = nn.Linear(d, experts, bias=False), k
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 16), nn.SiLU(), nn.Linear(16, d)) for _ in range(experts))

    def forward(self, x):
        w = self.gate(x).softmax(-1)
        w, sel = torch.topk(w, self.k, -1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        mask = F.one_hot(sel, len(self.experts)).permute(2, 1, 0)
        for e, expert in enumerate(self.experts):
            kk, tok = torch.where(mask[e])
            out.index_add_(0, tok, expert(x.index_select(0, tok)) * w[tok, kk, None])
        return out


class MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.moe, self.out = nn.Linear(6, 8), SparseMoE(), nn.Linear(8, 4)

    def forward(self, x):
        return self.out(self.moe(self.inp(x))).sum(1)


def step(model, opt, x):
    out = model(x)
    loss = out.sum() if out.ndim == 0 else out.pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _train(make, mode, steps=6, rows=10):
    torch.manual_seed(0)
    m1 = make()
    m2 = copy.deepcopy(m1)
    o1, o2 = (torch.optim.AdamW(m.parameters(), 1e-2) for m in (m1, m2))
    cf = tt.compile(step, **mode)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(rows, 6, generator=g)
        torch.testing.assert_close(cf(m2, o2, x), step(m1, o1, x))
    for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(q, p, msg=lambda m: f"{n}: {m}")
    for p, q in zip(m1.parameters(), m2.parameters()):
        for key, v in o1.state[p].items():
            torch.testing.assert_close(o2.state[q][key], v)
    return tt.compile_stats(cf)


def _one_program_for_every_count(stats, mode):
    # Two entries: the first AdamW step (no optimizer state yet) and every later one, whatever the counts.
    assert stats.entries == 2, stats.retrace_reasons
    assert stats.decision_mismatches == 0
    assert not stats.opaque_ops, stats.opaque_ops
    if mode.get("thin"):
        assert stats.thin_calls >= 3


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("body", BODIES, ids=[b.__name__ for b in BODIES])
def test_data_dependent_op_in_a_training_step(body, mode):
    _one_program_for_every_count(_train(lambda: Net(body), mode), mode)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_sparse_moe_training_step_follows_eager_with_routing_that_changes(mode):
    # the tokens per expert differ from step to step (checked below), and one program runs them all
    torch.manual_seed(0)
    moe, g, counts = MoENet(), torch.Generator().manual_seed(1), set()
    for _ in range(6):
        x = moe.inp(torch.randn(10, 6, generator=g))
        sel = torch.topk(moe.moe.gate(x).softmax(-1), 2, -1).indices
        counts.add(tuple(torch.bincount(sel.reshape(-1), minlength=4).tolist()))
    assert len(counts) > 3
    _one_program_for_every_count(_train(MoENet, mode), mode)


def test_the_program_reads_the_count_where_the_op_runs():
    def f(x):
        return x[x > 0] * 2

    cf = tt.compile(f)
    for n in range(6):
        x = torch.randn(12)
        x[:n] = -1.0
        x[n:] = x[n:].abs() + 0.1
        torch.testing.assert_close(cf(x), f(x))
    src = tt.last_traces(cf)[-1].python_source()
    assert 'f32[u0]"' in src  # the selection's size is a symbol of the program, not the traced call's count
    assert tt.compile_stats(cf).entries == 1


def test_a_decision_on_a_count_is_checked_by_the_program():
    def f(x):
        idx = torch.nonzero(x > 0)
        if idx.shape[0] > 3:  # a Python decision on a count: checked where the program has it
            return x.sum()
        return x.prod()

    cf = tt.compile(f)
    for x in (torch.tensor([1.0, 2, 3, 4, 5]), torch.tensor([1.0, -2, 3, -4, 5]), torch.tensor([1.0, 2, 3, 4, -5])):
        torch.testing.assert_close(cf(x), f(x))
    assert tt.compile_stats(cf).entries == 2


def test_a_mask_of_the_wrong_shape_raises_eagers_error():
    def f(x, m):
        return x[m]

    with pytest.raises(IndexError, match="shape of the mask"):
        f(torch.randn(4, 3), torch.ones(3, dtype=torch.bool))
    with pytest.raises(IndexError, match="shape of the mask"):
        tt.compile(f)(torch.randn(4, 3), torch.ones(3, dtype=torch.bool))


FORWARD = {
    "boolean_mask_index": lambda x: x[x > 0],
    "mask_of_leading_dims": lambda x: x[x[:, :, 0] > 0],
    "mask_after_a_slice": lambda x: x[:, x[0, :, 0] > 0],
    "where_one_argument": lambda x: torch.where(x > 0),
    "nonzero_as_tuple": lambda x: torch.nonzero(x > 0, as_tuple=True),
    "argwhere": lambda x: torch.argwhere(x > 0),
    "masked_select_broadcast": lambda x: torch.masked_select(x, x[0] > 0),
    "unique_counts": lambda x: torch.unique((x > 0).long() + (x > 1).long(), return_counts=True),
    "unique_method": lambda x: (x > 0).long().unique(return_inverse=True),
    "unique_consecutive": lambda x: torch.unique_consecutive((x > 0).long(), return_inverse=True, return_counts=True),
    "unique_dim": lambda x: torch.unique((x > 0).long(), dim=1, return_inverse=True, return_counts=True),
    "unique_consecutive_dim": lambda x: torch.unique_consecutive((x[0] > 0).long(), dim=-1, return_counts=True),
    "bincount_weights": lambda x: torch.bincount((x[0, 0] > 0).long() * 3, weights=x[0, 0]),
    "repeat_interleave_index": lambda x: torch.repeat_interleave((x[0, 0] > 0).long() + 1),
    "mask_set_vector": lambda x: x.clone().index_put_((x > 0,), torch.tensor(5.0)),
}


@pytest.mark.parametrize("decompose", [False, True], ids=["whole", "decomposed"])
@pytest.mark.parametrize("name", list(FORWARD))
def test_forward_equals_eager_for_every_count(name, decompose):
    from torch.utils._pytree import tree_flatten

    fn = FORWARD[name]
    cf = tt.compile(fn, decompose=decompose)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(2, 3, 4, generator=g)
        got, want = tree_flatten(cf(x))[0], tree_flatten(fn(x))[0]
        assert len(got) == len(want)
        for a, e in zip(got, want):
            assert a.dtype == e.dtype and a.shape == e.shape and a.stride() == e.stride(), (a.stride(), e.stride())
            torch.testing.assert_close(a, e)
    assert tt.compile_stats(cf).entries == 1


# Mixtral's per-expert loop (transformers) is a model of the zoo: tests/_zoo.py, tests/test_model_zoo.py.


class GroupedExperts(nn.Module):
    """transformers' grouped-experts path: tokens sorted by expert, one ``grouped_mm`` over all experts with the
    offsets of each expert's rows (a static shape; the offsets are values)."""

    def __init__(self, d=8, experts=4):
        super().__init__()
        self.gate = nn.Linear(d, experts, bias=False)
        self.w = nn.Parameter(torch.randn(experts, d, d) * 0.3)

    def forward(self, x):
        expert = self.gate(x).argmax(-1)
        order = torch.sort(expert).indices
        offs = torch.cumsum(torch.bincount(expert, minlength=self.w.shape[0]), 0).to(torch.int32)
        y = F.grouped_mm(x[order], self.w, offs=offs)
        return torch.zeros_like(x).index_add(0, order, y).sum(1)


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without F.grouped_mm")
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_grouped_mm_experts_train_like_eager(mode):
    stats = _train(lambda: nn.Sequential(nn.Linear(6, 8), GroupedExperts()), mode, rows=16)
    assert stats.entries == 2 and stats.decision_mismatches == 0
    assert any("grouped_mm" in o for o in stats.opaque_ops)


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without F.grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_mixtral_default_grouped_experts_train_like_eager(dtype):
    """Mixtral with transformers' default experts (``grouped_mm`` over tokens sorted by expert, ``histc``
    counts), in float32 and in bfloat16 weights: losses, parameters and optimizer state equal eager's, thin."""
    transformers = pytest.importorskip("transformers")
    from _steps import assert_same_state
    from _zoo import FFN, HEADS, HIDDEN, VOCAB

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=1,
                                     num_attention_heads=HEADS, num_key_value_heads=1, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    want_m = transformers.MixtralForCausalLM(cfg).to(dtype)
    assert want_m.config._experts_implementation != "eager"  # the grouped path, not the zoo's per-expert loop
    got_m = copy.deepcopy(want_m)
    want_o, got_o = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (want_m, got_m))

    def step(m, o, ids):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        o.step()
        o.zero_grad()
        return loss

    compiled = tt.compile(step, thin=True)
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        ids = torch.randint(0, VOCAB, (2, 12), generator=g)
        torch.testing.assert_close(compiled(got_m, got_o, ids), step(want_m, want_o, ids).detach(), msg=f"loss {i}")
    assert_same_state((want_m, want_o), (got_m, got_o))
    assert any("grouped_mm" in o for o in tt.compile_stats(compiled).opaque_ops)


def _mask_set(x):
    h = x * 1
    h[h > 0] = h[h > 0] * 3  # two masks: two counts the program finds equal (checked) before the update
    return h.pow(2).sum()


BACKWARD = {
    "mask_get": lambda x: (x[x > 0] ** 2).sum(),
    "masked_select": lambda x: torch.masked_select(x, x > 0).exp().sum(),
    "where_cond": lambda x: x[torch.where(x > 0)].sin().sum(),
    "repeat_interleave": lambda x: torch.repeat_interleave(x, (x[:, 0] > 0).long() + 1, dim=0).pow(2).sum(),
    "index_select_nonzero": lambda x: x.index_select(0, torch.nonzero(x[:, 0] > 0)[:, 0]).tanh().sum(),
    "mask_set": _mask_set,
}


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
@pytest.mark.parametrize("name", list(BACKWARD))
def test_compiled_function_gradients_through_data_dependent_sizes(name, dynamic):
    # tt.compile(fn): the forward and its backward are separate programs; the counts cross between them
    fn = BACKWARD[name]
    cf = tt.compile(fn, dynamic=dynamic)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(5, 3, generator=g, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        got, want = cf(x), fn(x2)
        torch.testing.assert_close(got, want)
        got.backward()
        want.backward()
        torch.testing.assert_close(x.grad, x2.grad)
    assert tt.compile_stats(cf).entries == 1


def test_a_loop_over_positions_after_an_inplace_op_run_on_a_copy():
    """DeepSeek-V3's router: ``mask.scatter_(1, idx, 1)`` (run by torch on a copy of ``mask``) feeds the per-expert
    loop ``for e in hit.nonzero()``; the copy changes no input, so the loop's decisions are checked by the program
    and every routing gives eager's result."""
    def f(x):
        m = torch.zeros(4, 3)
        m.scatter_(1, x.topk(1, dim=-1)[1], 1)
        total = x.sum() * 0
        for e in (m.sum(0) > 0).nonzero():
            total = total + (x[:, e[0]] * m[:, e[0]]).sum()
        return total

    cf = tt.compile(f)
    for seed in range(4):  # different experts hit on different calls
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(cf(x), f(x))


def test_two_selections_by_one_mask_share_their_size():
    """``hidden[mask]`` and ``labels[mask]`` (ModernBERT's sparse masked-LM head) have equal sizes in eager; the loss
    combining them differentiates."""
    def f(h, labels):
        keep = labels != -100
        return F.cross_entropy(h[keep], labels[keep])

    h = torch.randn(6, 5, requires_grad=True)
    labels = torch.tensor([1, -100, 3, -100, 0, 4])
    a, b = h.detach().clone().requires_grad_(), h.detach().clone().requires_grad_()
    tt.compile(f)(a, labels).backward()
    f(b, labels).backward()
    torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("thin", [False, True])
def test_masked_scatter_one_program_for_every_count(thin):
    """``masked_scatter`` takes source elements by a cumulative count of the mask: static shapes, so every count
    (none, some, all; a 0-d and a broadcast mask) runs one program with eager's values and gradients."""
    def f(x, mask, src):
        return x.masked_scatter(mask, src * 2).sin().sum() + torch.masked_scatter(x, mask, src).pow(2).sum()

    cf = tt.compile(f, thin=thin)
    gen = torch.Generator().manual_seed(0)
    x, src = torch.randn(3, 4, generator=gen), torch.randn(20, generator=gen)
    masks = [torch.rand(3, 4, generator=gen) < p for p in (0.0, 0.3, 0.7, 1.0)]
    for mask in masks:
        a = [t.clone().requires_grad_() for t in (x, src)]
        b = [t.clone().requires_grad_() for t in (x, src)]
        cf(a[0], mask, a[1]).backward()
        f(b[0], mask, b[1]).backward()
        for p, q in zip(a, b):
            torch.testing.assert_close(p.grad, q.grad)
    assert tt.compile_stats(cf).cache_misses == 1
    for mask in (torch.tensor(True), torch.tensor([True, False, True, False])):
        torch.testing.assert_close(cf(x, mask, src), f(x, mask, src))
    with pytest.raises(RuntimeError, match="at least as many elements as ones in mask"):
        cf(x, torch.ones(3, 4, dtype=torch.bool), torch.randn(5))


def test_unique_dim_forward_runs_and_backward_raises_eagers_error():
    x = torch.randn(4, 3, requires_grad=True)
    out = tt.compile(lambda x: torch.unique(x, dim=0))(x)
    assert out.requires_grad
    with pytest.raises(NotImplementedError, match="the derivative for 'unique_dim' is not implemented"):
        out.sum().backward()


def _masked_sum_step(x, w, p):
    h = torch.nn.functional.dropout(x @ w, p)
    loss = h[h[:, 0] > 0].sum()
    loss.backward()
    return loss


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_count_of_one_is_not_a_decision_of_the_backward(mode):
    # The sum's gradient is broadcast back to the selection's shape; choosing how to run that broadcast compared the
    # count with 1 (a decision checked on every call: retraced when a count of 1 came, refused after a dropout).
    cf = tt.compile(_masked_sum_step, **mode)
    w = torch.randn(5, 3, requires_grad=True)
    g = torch.Generator().manual_seed(2)
    for rows, p in [(3, 0.0), (1, 0.0), (0, 0.0), (2, 0.0), (1, 0.0)]:
        x = torch.randn(4, 5, generator=g)
        x = x * torch.sign((x @ w)[:, :1]).detach()
        x[rows:] = -x[rows:]
        assert int(((x @ w)[:, 0] > 0).sum()) == rows
        w.grad = None
        want, want_grad = _masked_sum_step(x, w, p), w.grad.clone()
        w.grad = None
        torch.testing.assert_close(cf(x, w, p), want)
        torch.testing.assert_close(w.grad, want_grad)
    stats = tt.compile_stats(cf)
    assert stats.entries == 1 and stats.decision_mismatches == 0, stats.retrace_reasons


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_mask_of_dropped_out_values_selects_as_eager(mode):
    cf = tt.compile(_masked_sum_step, **mode)
    w1 = torch.randn(5, 3, requires_grad=True)
    w2 = w1.detach().clone().requires_grad_()
    for seed in range(3):
        x = torch.randn(4, 5)
        torch.manual_seed(seed)
        want = _masked_sum_step(x, w1, 0.3)
        eager_state = torch.get_rng_state()
        torch.manual_seed(seed)
        torch.testing.assert_close(cf(x, w2, 0.3), want)
        torch.testing.assert_close(w2.grad, w1.grad)
        assert torch.equal(torch.get_rng_state(), eager_state)


class _CountScaled(nn.Module):
    """Per-class counts (``bincount(k, minlength=3)``, data-dependent length) scaling a (rows, 3) activation: the
    count's length is decided equal to 3 where it broadcasts."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        h = self.lin(x)
        k = h.argmax(1)
        counts = torch.bincount(k, minlength=3)
        weighted = torch.bincount(k, weights=h[:, 0].detach(), minlength=3)
        return (h * counts.float()).sum() + weighted.sum() + torch.bincount(k).sum()


@pytest.mark.parametrize("mode", ["full", "thin", "module"])
def test_bincount_broadcast_against_a_static_size_trains_as_eager_without_error_logs(mode):
    """Before, the trace kept the count's stand-in length (the input's length, 8) where it broadcast against 3: torch's
    fake-tensor layout probe logged "failed while attempting to run meta for aten.mul.Tensor" ERROR lines on every
    trace, and ``tt.compile(model)`` failed ("reshape: shape (8, 3) is invalid for input of size u4")."""
    import logging

    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Collect(level=logging.ERROR)
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    fake_log.addHandler(handler)
    try:
        torch.manual_seed(0)
        base = _CountScaled()
        xs = [torch.randn(8, 4) for _ in range(3)]
        want_m, got_m = copy.deepcopy(base), copy.deepcopy(base)
        want_opt, got_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (want_m, got_m))
        if mode == "module":
            cm = tt.compile(got_m)
            cstep = lambda m, opt, x: step(cm, opt, x)  # noqa: E731
        else:
            cstep = tt.compile(step, thin=mode == "thin")
        for x in xs:
            want = step(want_m, want_opt, x)
            got = cstep(got_m, got_opt, x)
            assert torch.equal(got, want)
            for p, q in zip(want_m.parameters(), got_m.parameters()):
                assert torch.equal(q, p)
    finally:
        fake_log.removeHandler(handler)
    assert not records, records[:2]
