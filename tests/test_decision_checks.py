"""Decisions on intermediate values are checked by the program where it computes the value, not recomputed.

``if loss.item() > thr:`` costs what it costs in eager (one read of the value); a call that decides the other
way is abandoned before it writes anything and runs the entry traced for the value observed
(compiler/acquisition/decisions.py, compiled.py).  Every case runs against eager PyTorch on batches whose
decisions flip both ways several times, comparing losses, parameters and optimizer state after every call.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from thunder_train.compiler.errors import DecisionMismatch
from _steps import assert_same_state, mlp, mlp_batches, twin

SCALES = (0.1, 4.0, 4.0, 0.1, 0.1, 4.0, 0.1, 4.0, 0.1)  # big batches give big losses and gradients
MODES = [dict(), dict(thin=True)]
MODE_IDS = ["full", "thin"]
FUSIONS = [None, "inductor"]


def batches(n=len(SCALES), seed=0):
    return [(x * s, y) for (x, y), s in zip(mlp_batches(n, seed), SCALES)]


def adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-2, eps=1e-6)


LOSS_SPIKE = 1.4


def skip_spikes(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    if loss.item() > LOSS_SPIKE:  # a loss spike: skip the step
        opt.zero_grad()
        return loss.detach()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


NORM = 0.8


def damp_big_gradients(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    norm = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
    if norm > NORM:  # a gradient-norm-based branch
        for p in model.parameters():
            p.grad.mul_(0.1)
    opt.step()
    opt.zero_grad()
    return loss.detach()


def decisions_of(step, value, threshold):
    """What eager decides on each batch (the test is only meaningful when it flips both ways, several times)."""
    eager, _ = twin(mlp, adamw)
    out = []
    for x, y in batches():
        out.append(bool(value(eager, x, y) > threshold))
        step(*eager, x, y)
    return out


def _loss(pair, x, y):
    return F.cross_entropy(pair[0](x), y).item()


def _norm(pair, x, y):
    model = pair[0]
    F.cross_entropy(model(x), y).backward()
    norm = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
    model.zero_grad()
    return norm


def _flips(decided):
    return sum(a != b for a, b in zip(decided, decided[1:]))


@pytest.mark.parametrize("fusion", FUSIONS, ids=["unfused", "inductor"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("step,value,threshold", [(skip_spikes, _loss, LOSS_SPIKE), (damp_big_gradients, _norm, NORM)],
                         ids=["loss_spike", "grad_norm"])
def test_whole_adamw_steps_deciding_on_intermediates_train_like_eager_after_every_call(step, value, threshold, mode, fusion):
    decided = decisions_of(step, value, threshold)
    assert set(decided) == {True, False} and _flips(decided) >= 3, decided
    eager, compiled = twin(mlp, adamw)
    cf = tt.compile(step, fusion=fusion, **mode)
    for i, (x, y) in enumerate(batches()):
        want = step(*eager, x, y)
        got = cf(*compiled, x, y)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=lambda m: f"loss of call {i}: {m}")
        assert_same_state(eager, compiled)
    stats = tt.compile_stats(cf)
    assert stats.decision_mismatches >= 3, stats
    assert any("test_decision_checks.py" in r and "was" in r and "now" in r for r in stats.retrace_reasons), stats.retrace_reasons
    assert [n for n in stats.decision_notes if "checked by the program" in n], stats.decision_notes
    if mode:
        assert stats.thin_calls > 0 and stats.thin_binds >= 1, stats


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x)
        if (h > 2.0).any():  # a decision on an activation
            h = h.clamp(max=2.0)
        return self.b(torch.tanh(h))


@pytest.mark.parametrize("fusion", FUSIONS, ids=["unfused", "inductor"])
def test_a_decision_on_an_activation_in_a_compiled_module_gives_eager_outputs_and_gradients(fusion):
    torch.manual_seed(0)
    ref = Gated()
    m = copy.deepcopy(ref)
    cm = tt.compile(m, fusion=fusion)
    decided = []
    for x, _ in batches():
        decided.append(bool((ref.a(x) > 2.0).any()))
        want = ref(x)
        got = cm(x)
        torch.testing.assert_close(got, want)
        got.square().sum().backward()
        want.square().sum().backward()
        for (n, a), b in zip(ref.named_parameters(), m.parameters()):
            torch.testing.assert_close(b.grad, a.grad, msg=n)
    assert _flips(decided) >= 3, decided
    assert tt.compile_stats(cm).decision_mismatches >= 2


def gated_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_decision_on_an_activation_inside_a_whole_step_trains_like_eager(mode):
    eager, compiled = twin(Gated, adamw)
    cf = tt.compile(gated_step, **mode)
    for x, y in batches():
        torch.testing.assert_close(cf(*compiled, x, y), gated_step(*eager, x, y), atol=1e-6, rtol=1e-5)
        assert_same_state(eager, compiled)
    assert tt.compile_stats(cf).decision_mismatches >= 2


class CountLinear(torch.overrides.TorchFunctionMode):
    """Counts the ``F.linear`` calls made while active: the forward's matmuls, wherever they run."""

    thunder_train_observes = True  # counts the compiled program's calls (compiler/acquisition/ambient.py)

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_the_forward_runs_once_per_call_not_again_for_the_decision(mode):
    """The mlp has three linears: eager runs 3 per step. Recomputing the loss in the prologue ran 6."""
    _, compiled = twin(mlp, adamw)
    cf = tt.compile(skip_spikes, **mode)
    x, y = batches()[0]
    for _ in range(4):  # trace, warm up, bind (thin)
        cf(*compiled, x, y)
    counts = []
    for _ in range(3):
        with CountLinear() as count:
            cf(*compiled, x, y)
        counts.append(count.n)
    assert counts == [3, 3, 3]
    if mode:
        assert tt.compile_stats(cf).thin_calls >= 3
    [note] = tt.compile_stats(cf).decision_notes
    assert "if loss.item() > LOSS_SPIKE" in note and "the prologue recomputes none of its" in note, note


def _state(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()},
            [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            torch.random.get_rng_state())


def _assert_same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0)


class Noisy(nn.Module):
    """A dropout runs before the value decided on (which does not depend on it)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.gate = nn.Linear(6, 16), nn.Linear(16, 4), nn.Linear(6, 1)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = self.drop(self.a(x))
        if self.gate(x).mean() > 0:
            h = h * 2
        return self.b(h)


def noisy_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    return loss.detach()


def _gate_batches():
    """A model and two batches its gate decides differently on."""
    torch.manual_seed(0)
    probe = Noisy()
    w = probe.gate.weight.detach().sign()
    x = torch.randn(8, 6)
    return probe, x + 3 * w, x - 3 * w


@pytest.mark.parametrize("fusion", FUSIONS, ids=["unfused", "inductor"])
def test_an_abandoned_call_changes_nothing_parameters_optimizer_state_grads_and_rng(fusion):
    probe, up, down = _gate_batches()
    model = copy.deepcopy(probe)
    opt = adamw(model.parameters())
    y = torch.randint(0, 4, (8,))
    cf = tt.compile(noisy_step, fusion=fusion)
    for _ in range(2):  # the optimizer state exists from the second call on: the steady-state program
        cf(model, opt, up, y)
    computation, inputs = cf.direct_call_parts(model, opt, down, y)  # the program traced for `up`'s decision
    before = _state(model, opt)
    with pytest.raises(DecisionMismatch, match=r"if self.gate\(x\).mean\(\) > 0.*went the other way"):
        computation(*inputs)
    after = _state(model, opt)
    for a, b in zip(before[:2], after[:2]):
        assert a.keys() == b.keys()
        for k in a:
            (_assert_same if isinstance(a[k], torch.Tensor) else lambda p, q: [_assert_same(p[n], q[n]) for n in p])(a[k], b[k])
    for a, b in zip(before[2], after[2]):
        _assert_same(a, b)
    _assert_same(before[3], after[3])  # the dropout's draw was put back
    final = [b for b in tt.last_traces(cf)[-1].bound_symbols]
    at = next(i for i, b in enumerate(final) if "check_decision" in b.sym.name)
    writes = [i for i, b in enumerate(final) if b.sym.has_side_effect and "check_decision" not in b.sym.name]
    assert writes and min(writes) > at, "a write comes before the decision's check"


@pytest.mark.parametrize("decides", [False, True], ids=["no_check", "checked"])
def test_the_rng_state_is_saved_for_a_call_only_when_a_check_can_abandon_it(decides, monkeypatch):
    """A program whose check can abandon the call after a random op saves the generator's state first (to put it
    back); one that checks nothing did too (5 KiB held for every call: a GRU step's peak, and a read each call)."""
    def fn(x):
        h = F.dropout(x, 0.5, training=True)
        if decides and (x @ x.T).sum() > 0:  # checked by the program, after the dropout
            h = h * 2
        return h * 3

    cf = tt.compile(fn)
    x = torch.randn(4, 6).abs()
    cf(x), cf(x)
    reads = []
    read = torch.random.get_rng_state
    monkeypatch.setattr(torch.random, "get_rng_state", lambda: reads.append(1) or read())
    torch.manual_seed(0)
    got = cf(x)
    monkeypatch.undo()
    torch.manual_seed(0)
    _assert_same(got, fn(x))
    assert len(reads) == decides, reads


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_dropout_before_the_decision_draws_what_eager_draws_after_a_flip(mode):
    probe, up, down = _gate_batches()
    eager = (copy.deepcopy(probe), None)
    eager = (eager[0], adamw(eager[0].parameters()))
    model = copy.deepcopy(probe)
    compiled = (model, adamw(model.parameters()))
    cf = tt.compile(noisy_step, **mode)
    y = torch.randint(0, 4, (8,))
    for i, x in enumerate([up, up, up, down, down, up, down, up, up]):
        torch.manual_seed(i)
        want = noisy_step(*eager, x, y)
        torch.manual_seed(i)
        got = cf(*compiled, x, y)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=lambda m: f"call {i}: {m}")
        assert_same_state(eager, compiled)
    assert tt.compile_stats(cf).decision_mismatches >= 3


def masked(x, mask):
    if (mask == 1).all():  # the call's own input, two ops: the prologue
        return x * 2
    return x * mask


def input_matmul(x, mask):
    if (x @ x.T).sum() > 0:  # the call's own input, but a matmul: the program
        return x * 2
    return x * mask


def test_the_rule_cheap_input_decisions_stay_in_the_prologue_the_rest_is_checked_by_the_program():
    x, ones = torch.randn(3, 4), torch.ones(3, 4)
    pad = ones.clone()
    pad[1, 2:] = 0
    cf = tt.compile(masked)
    for mask in (ones, pad, ones, pad):
        torch.testing.assert_close(cf(x, mask), masked(x, mask))
    [note] = tt.compile_stats(cf).decision_notes
    assert "op(s) recomputed by the prologue" in note, note
    assert tt.compile_stats(cf).decision_mismatches == 0
    assert "check_decision" not in str(tt.last_traces(cf)[-1])
    assert "if (mask == 1).all()" in tt.last_prologue_traces(cf)[1].python_source()
    cf = tt.compile(input_matmul)
    for s in (1.0, -1.0, 1.0):
        xs = torch.randn(3, 4).abs() * s + s
        torch.testing.assert_close(cf(xs, ones), input_matmul(xs, ones))
    [note] = tt.compile_stats(cf).decision_notes
    assert "checked by the program" in note, note
    line = [ln for ln in str(tt.last_traces(cf)[-1]).splitlines() if "check_decision" in ln]
    assert len(line) == 1 and "if (x @ x.T).sum() > 0" in line[0], line


def test_a_decision_on_a_random_value_is_still_a_clear_error_naming_the_line():
    from thunder_train.compiler.errors import DataDependentError

    def fn(x):
        h = F.dropout(x, 0.5)
        if h.sum().item() > 0:
            return h
        return -h

    with pytest.raises(DataDependentError, match=r"test_decision_checks.py:\d+ \(if h.sum\(\).item\(\) > 0:\).*random"):
        tt.compile(fn)(torch.randn(4, 4))


def test_thunder_callback_trains_a_module_deciding_on_an_activation_like_the_plain_trainer():
    L = pytest.importorskip("lightning")
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    from thunder_train.callbacks import ThunderCallback

    class GatedBN(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.BatchNorm1d(16), nn.Linear(16, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            h = self.net[2](self.net[1](self.net[0](x)))  # BatchNorm's running statistics: written after the check
            if (h > 1.0).float().mean() > 0.19:
                h = h * 0.5
            return F.cross_entropy(self.net[3](h), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    from _lightning_losses import Losses

    def fit(callbacks):
        torch.manual_seed(0)
        model = GatedBN()
        losses = Losses()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(96, 8, generator=g)
        loader = DataLoader(TensorDataset(x, torch.randint(0, 4, (96,), generator=g)), batch_size=8)
        trainer = L.Trainer(callbacks=[*callbacks, losses], max_steps=12, enable_progress_bar=False, logger=False,
                            enable_checkpointing=False, enable_model_summary=False, accelerator="cpu", devices=1,
                            num_sanity_val_steps=0, limit_val_batches=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, loader)
        return model, torch.stack(losses.losses), trainer

    ref, l_ref, t_ref = fit([])
    cb = ThunderCallback(thin=True, fuse_optimizer=True)
    model, losses, trainer = fit([cb])
    torch.testing.assert_close(losses, l_ref, rtol=1e-5, atol=1e-6)
    for (n, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda s: f"{n}: {s}")
    stats = tt.compile_stats(cb.compiled())
    assert stats.decision_mismatches >= 2 and stats.thin_calls > 0, stats


@pytest.mark.parametrize("options", [dict(thin=True), dict(thin=True, check_every=2)], ids=["thin", "check_every"])
def test_a_thin_compiled_module_deciding_on_an_activation_follows_eager_both_ways(options):
    torch.manual_seed(0)
    ref = Gated()
    m = copy.deepcopy(ref)
    cm = tt.compile(m, **options)
    with torch.no_grad():
        for x, _ in batches() + batches(seed=1):
            torch.testing.assert_close(cm(x), ref(x))
    stats = tt.compile_stats(cm)
    assert stats.decision_mismatches >= 2 and stats.thin_calls > 0, stats


def _lin():
    """h = the mean of x's row, in every column: x = full(v) decides on v."""
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(0.25)
        model.bias.zero_()
    return model


def both(model, x, mask):
    h = model(x) * mask
    if (mask == 1).all():  # the prologue's
        h = h * 2
    if h.sum() > 0:  # the program's
        return h - 1
    return h + 1


def nested(model, x):
    h = model(x)
    if h.mean() > 0:
        if h.max() > 2.0:  # taken only on one side of the first
            return h * 3
        return h * 2
    return h


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_prologue_and_program_decisions_flip_independently(mode):
    model = _lin()
    ones = torch.ones(2, 3)
    pad = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    cf = tt.compile(both, **mode)
    for v, mask in [(1, ones), (1, ones), (-1, ones), (-1, pad), (1, pad), (1, ones), (-1, pad), (-1, ones), (1, pad)]:
        x = torch.full((2, 4), float(v))
        torch.testing.assert_close(cf(model, x, mask), both(model, x, mask))
    stats = tt.compile_stats(cf)
    assert stats.entries == 4 and stats.decision_mismatches >= 2, stats
    kinds = {"prologue" if "recomputed by the prologue" in n else "program" for n in stats.decision_notes}
    assert kinds == {"prologue", "program"}, stats.decision_notes


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_decision_taken_on_one_side_of_another_is_checked_after_it(mode):
    model = _lin()
    cf = tt.compile(nested, **mode)
    for v in (1.0, 1.0, 3.0, -1.0, 3.0, 3.0, 1.0, -1.0, -1.0, 1.0, 3.0, -1.0):
        x = torch.full((2, 4), v)
        torch.testing.assert_close(cf(model, x), nested(model, x))
    stats = tt.compile_stats(cf)
    assert stats.entries == 3 and stats.decision_mismatches >= 6, stats
