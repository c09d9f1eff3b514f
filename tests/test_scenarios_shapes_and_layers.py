"""Shapes as a real loop sees them and layers a user builds with (session 19), compared with eager after every
step (tests/_scenario_harness.py).

Found before: ``tt.compile(model)`` whose forward takes ``h[:, 0]`` (a Transformer's first token) crashed with
``NameError`` once automatic dynamic sizes made the sequence length symbolic (the slice's length was dropped as
dead code, though the backward reshapes to it); ``parametrize.cached()`` around a compiled call left a proxy in
torch's process-wide cache ("a proxy escaped"); a lazy module's first call inside the compiled function failed
with torch's message about ``load_state_dict`` (later refused, now run eagerly: its forward initialises it); and ``clip_grad_norm_(error_if_nonfinite=True)`` inside a
``try`` did not say why the step's own ``except`` did not catch it; ``nn.Embedding(max_norm=...)`` in a training
step failed with torch's error about an internal node (refused now, with the remedy; without grad it runs).  Matching eager and kept as guards: the last
batch smaller, dynamic padding, truncated BPTT with a detached hidden state carried in a dict, an LSTM with
``proj_size``, a bidirectional GRU given ``h0``.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from _scenario_harness import assert_matches_eager


def _loop(make, calls, opt=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), extra=None):
    def setup(wrap):
        m = make()
        cm = wrap(m)
        o = opt(m)
        ctx = {}

        def step(*args):
            *inputs, y = args
            out = cm(*inputs, ctx) if extra else cm(*inputs)
            loss = F.cross_entropy(out.reshape(-1, 3), y.reshape(-1))
            loss.backward()
            o.step()
            o.zero_grad()
            return loss

        return dict(step=step, calls=calls(), modules=[m], opts=[o], extra=lambda: ctx)

    return setup


class Padded(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.lin = nn.Linear(8, 3)

    def forward(self, ids, mask):
        h = self.emb(ids) * mask[..., None]
        return self.lin(h.sum(1) / mask.sum(1, keepdim=True))


def _padded_calls():
    out = []
    for n, length in [(4, 5), (4, 7), (4, 5), (3, 9)]:
        mask = (torch.rand(n, length) > 0.2).float()
        mask[:, 0] = 1
        out.append((torch.randint(1, 20, (n, length)), mask, torch.randint(0, 3, (n,))))
    return out


class TBPTT(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x, ctx):
        out, h = self.rnn(x, ctx.get("h"))
        ctx["h"] = h.detach()
        return self.head(out)


class Proj(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(4, 8, proj_size=3, num_layers=2, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0][:, -1]


class BiGRU(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 6, bidirectional=True, batch_first=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x, h0):
        return self.head(self.rnn(x, h0)[0][:, -1])


def _mlp():
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))


SCENARIOS = {
    "last_batch_smaller": _loop(_mlp, lambda: [(torch.randn(8 if i != 2 else 5, 4), torch.randint(0, 3, (8 if i != 2 else 5,)))
                                               for i in range(4)]),
    "dynamic_padding": _loop(Padded, _padded_calls, opt=lambda m: torch.optim.Adam(m.parameters(), lr=0.01)),
    "tbptt_detached_hidden": _loop(TBPTT, lambda: [(torch.randn(2, 5, 4), torch.randint(0, 3, (2, 5))) for _ in range(3)],
                                   extra=True),
    "lstm_proj_size": _loop(Proj, lambda: [(torch.randn(3, 5, 4), torch.randint(0, 3, (3,))) for _ in range(3)]),
    "bigru_h0": _loop(BiGRU, lambda: [(torch.randn(3, 5, 4), torch.randn(2, 3, 6), torch.randint(0, 3, (3,)))
                                      for _ in range(3)]),
}


@pytest.mark.parametrize("mode", ["full", "thin", "model"])
@pytest.mark.parametrize("name", SCENARIOS)
def test_shapes_a_loop_sees_match_eager(name, mode):
    assert_matches_eager(SCENARIOS[name], mode)


class FirstToken(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x)[:, 0] * 2


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, ids, pad):
        return self.head(self.enc(self.emb(ids), src_key_padding_mask=pad)[:, 0])


def _encoder_calls():
    out = []
    for length in (5, 5, 7, 6):
        pad = torch.zeros(3, length, dtype=torch.bool)
        pad[1, -2:] = True
        out.append((torch.randint(0, 10, (3, length)), pad, torch.randint(0, 3, (3,))))
    return out


@pytest.mark.parametrize("name", ["first_token", "encoder_padding_mask"])
def test_compiled_model_slicing_a_dimension_that_became_symbolic(name):
    if name == "first_token":
        setup = _loop(FirstToken, lambda: [(torch.randn(2, n, 4), torch.randint(0, 3, (2,))) for n in (5, 6, 7)])
    else:
        setup = _loop(Encoder, _encoder_calls)
    assert_matches_eager(setup, "model")


def _lazy_run(compiled: str):
    """Four steps of a model with a lazy first layer never called before (its first forward picks its sizes)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    model = tt.compile(m) if compiled == "model" else m

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    run = tt.compile(step, thin=True) if compiled == "step" else step
    data = torch.Generator().manual_seed(1)
    losses = [run(torch.randn(4, 5, generator=data), torch.randint(0, 3, (4,), generator=data)) for _ in range(4)]
    return losses, m, run if compiled == "step" else model


@pytest.mark.parametrize("compiled", ["step", "model"])
def test_lazy_module_first_called_inside_runs_that_call_eagerly_then_traces(compiled):
    # Eager's first forward initialises the lazy layer (drawing its initial values from the global generator); the
    # compiled function runs that call eagerly and traces the next (refused before, asking for an eager call first).
    want, m_eager, _ = _lazy_run("eager")
    got, m, cf = _lazy_run(compiled)
    torch.testing.assert_close(torch.stack(got), torch.stack(want))
    for (name, a), (_, b) in zip(m.state_dict().items(), m_eager.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)
    assert type(m[0]) is nn.Linear and tt.compile_stats(cf).eager_calls == 1
    assert tt.compile_stats(cf).calls - tt.compile_stats(cf).eager_calls == 3


class Halved(nn.Module):
    def forward(self, w):
        return w * 0.5 + 0.1


def _parametrized(wrap, outer):
    m = _mlp()
    nn.utils.parametrize.register_parametrization(m[0], "weight", Halved())
    cm = wrap(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def inner(x, y):
        loss = F.cross_entropy(cm(x), y) + m[0].weight.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def step(x, y):
        if outer:
            return inner(x, y)
        with nn.utils.parametrize.cached():
            return inner(x, y)

    calls = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(3)]
    return dict(step=step, calls=calls, modules=[m], opts=[opt])


@pytest.mark.parametrize("mode", ["full", "thin", "model"])
def test_parametrize_cached_inside_the_step(mode):
    assert_matches_eager(lambda wrap: _parametrized(wrap, outer=False), mode)


@pytest.mark.parametrize("mode", ["full", "model"])
def test_parametrize_cached_around_the_compiled_call(mode):
    """The caller's cache is set aside while tracing and is back afterwards, with its eager tensors."""
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    ref = _parametrized(lambda m: m, outer=True)
    torch.manual_seed(0)
    s = _parametrized(tt.compile if mode == "model" else (lambda m: m), outer=True)
    step = s["step"] if mode == "model" else tt.compile(s["step"])
    for args in s["calls"]:
        with parametrize.cached():
            want = ref["step"](*args)
            got = step(*args)
            assert all(type(v) is torch.Tensor for v in parametrize._cache.values())
        torch.testing.assert_close(got, want)
    for p, q in zip(ref["modules"][0].parameters(), s["modules"][0].parameters()):
        torch.testing.assert_close(q, p)
    assert parametrize._cache_enabled == 0 and parametrize._cache == {}


def test_nonfinite_clip_inside_try_says_why_the_except_did_not_catch_it():
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(x, y):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        try:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, error_if_nonfinite=True)
            opt.step()
        except RuntimeError:
            pass
        opt.zero_grad()
        return loss

    f = tt.compile(step)
    f(torch.randn(8, 4), torch.randint(0, 3, (8,)))
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(RuntimeError, match="non-finite.*try/except.*changed nothing"):
        f(torch.full((8, 4), float("inf")), torch.randint(0, 3, (8,)))
    for p, b in zip(m.parameters(), before):
        torch.testing.assert_close(p.detach(), b)


def test_embedding_max_norm_with_grad_is_refused_before_anything_changes_and_matches_eager_without():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, max_norm=1.0)
    with torch.no_grad():
        emb.weight.mul_(3)
    before = emb.weight.detach().clone()

    def train(ids):
        loss = emb(ids).sum()
        loss.backward()
        return loss

    with pytest.raises(NotImplementedError, match="max_norm.*requires grad.*embedding_renorm_"):
        tt.compile(train)(torch.tensor([[1, 2], [2, 3]]))
    assert torch.equal(emb.weight, before) and emb.weight.grad is None

    def infer(ids):  # without a gradient torch's own call renormalises in place, as in eager
        with torch.no_grad():
            return emb(ids).sum(1) @ emb.weight.t()

    f = tt.compile(infer)
    calls = [torch.tensor([[1, 2], [2, 3]]), torch.tensor([[4, 2], [5, 3]])]
    got = [f(ids) for ids in calls]
    got_w = emb.weight.detach().clone()
    with torch.no_grad():
        emb.weight.copy_(before)
    want = [infer(ids) for ids in calls]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_w, emb.weight.detach())


def test_a_lazy_module_the_step_never_calls_keeps_every_call_eager_and_says_so():
    torch.manual_seed(0)
    m = nn.ModuleDict({"used": nn.Linear(5, 3), "unused": nn.LazyLinear(2)})

    def step(x):
        return m["used"](x).sum()

    f = tt.compile(step)
    x = torch.randn(4, 5)
    f(x)
    with pytest.warns(UserWarning, match=r"unused.weight.*every call runs eagerly"):
        got = f(x)
    torch.testing.assert_close(got, step(x))
    assert tt.compile_stats(f).eager_calls == 2
