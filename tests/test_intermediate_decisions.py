"""Python decisions on intermediate values (a loss, an activation) are specialised on and checked by the program where
it computes the value (compiler/acquisition/decisions.py). Every case is compared with eager PyTorch on inputs that
decide both ways; tests/test_decision_checks.py has the training steps, the abandoned calls and the op counts.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from thunder_train.compiler.torchlang.tensor_methods import DataDependentError
from _steps import assert_same_state, mlp, mlp_batches, twin

MODES = [dict(), dict(thin=True)]
MODE_IDS = ["full", "thin"]


def batches(n, seed=0):
    """MLP batches whose loss is small and large in turn (the decisions below go both ways)."""
    out = []
    for i, (x, y) in enumerate(mlp_batches(n, seed)):
        out.append((x * (4.0 if i % 3 == 1 else 0.1), y))
    return out


def gated(model, x):
    h = model[0](x)
    if (h > 2.5).any():  # a decision on an activation
        h = h.clamp(max=2.5)
    out = model[2](model[1](h))
    if out.abs().max().item() > 1.0:  # .item() of an intermediate
        out = out / 2
    return out


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_decisions_on_activations_follow_eager_and_retrace_on_the_decision(mode):
    torch.manual_seed(0)
    model = mlp()
    cf = tt.compile(gated, **mode)
    for x, _ in batches(9):
        torch.testing.assert_close(cf(model, x), gated(model, x))
    stats = tt.compile_stats(cf)
    assert stats.entries >= 2
    assert any("test_intermediate_decisions.py" in r and "was" in r for r in stats.retrace_reasons), stats.retrace_reasons
    assert len(stats.decision_notes) >= 2, stats.decision_notes  # one per decision and op count (the branches differ)
    assert all("checked by the program where it computes the value" in n for n in stats.decision_notes), stats.decision_notes
    assert stats.decision_mismatches >= 1


def gated_loss_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if loss.item() > 1.4:  # large loss: clip hard
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("kernels", ["fused", "traced"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_whole_training_step_deciding_on_its_loss_trains_like_eager(mode, kernels):
    eager, compiled = twin(mlp, lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-6))
    cf = tt.compile(gated_loss_step, optimizer_kernels=kernels, **mode)
    decided = set()
    for x, y in batches(9):
        le = gated_loss_step(*eager, x, y)
        decided.add(bool(le > 1.4))
        torch.testing.assert_close(cf(*compiled, x, y), le, atol=1e-6, rtol=1e-5)
    assert decided == {True, False}
    assert_same_state(eager, compiled)
    if mode:
        assert tt.compile_stats(cf).thin_binds >= 1


THRESHOLD = 0.41


def decide_after_update(model, opt, x, y, decided=None):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    w = model[0].weight
    if w.abs().max() > THRESHOLD:  # reads the parameter as the optimizer left it (updated in place before)
        if decided is not None:
            decided.add(True)
        with torch.no_grad():
            w.mul_(0.9)
    elif decided is not None:
        decided.add(False)
    return loss.detach()


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_decision_on_a_parameter_updated_in_place_before_it_reads_the_updated_value(mode):
    eager, compiled = twin(mlp, lambda ps: torch.optim.SGD(ps, lr=0.5))
    cf = tt.compile(decide_after_update, **mode)
    decided = set()
    for x, y in mlp_batches(8):
        le = decide_after_update(*eager, x, y, decided)
        torch.testing.assert_close(cf(*compiled, x, y), le)
    assert decided == {True, False}
    assert_same_state(eager, compiled)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_thin_mode_checks_each_entrys_own_decision(mode):
    """Two entries share one prologue; a thin call whose program finds the other decision runs the other entry."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)

    def fn(x):
        loss = model(x).mean()
        if loss > 0:
            return loss * 2
        return loss - 1

    cf = tt.compile(fn, **mode)
    pos, neg = torch.full((3, 4), 3.0), torch.full((3, 4), -3.0)
    sign = 1 if fn(pos) > 0 else -1
    for x in [pos, pos, pos, neg, neg, neg, pos, neg, pos]:
        torch.testing.assert_close(cf(x * sign), fn(x * sign))
    stats = tt.compile_stats(cf)
    assert stats.entries == 2
    if mode:
        assert stats.thin_binds >= 2 and any("if loss > 0" in r for r in stats.thin_invalidations), stats.thin_invalidations
    # The weights the decision reads change: the program decides with the new ones.
    with torch.no_grad():
        model.weight.neg_()
        model.bias.neg_()
    torch.testing.assert_close(cf(pos), fn(pos))
    torch.testing.assert_close(cf(neg), fn(neg))


def test_a_decision_inside_a_compiled_module_gives_eager_gradients():
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

        def forward(self, x):
            h = self.a(x)
            if h.mean() > 0:
                h = h * 2
            return self.b(h.tanh())

    torch.manual_seed(0)
    ref = Gate()
    m = copy.deepcopy(ref)
    cm = tt.compile(m)
    for x in (torch.randn(3, 4) + 2, torch.randn(3, 4) - 2, torch.randn(3, 4) + 2):
        cm(x).square().sum().backward()
        ref(x).square().sum().backward()
    for (n, a), b in zip(ref.named_parameters(), m.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=n)


def test_a_decision_on_a_value_after_dropout_is_a_clear_error_naming_the_line():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))

    def fn(x):
        h = model(x)
        if h.sum() > 0:
            return h * 2
        return h

    with pytest.raises(DataDependentError, match=r"bool\(tensor\) at test_intermediate_decisions.py:\d+ \(if h.sum\(\) > 0:\).*random"):
        tt.compile(fn)(torch.randn(3, 4))
    model.eval()  # no dropout: the decision is recomputed
    cf = tt.compile(fn)
    x = torch.randn(3, 4)
    torch.testing.assert_close(cf(x), fn(x))


def float_of_item(x):
    return x * float(x.sum().item())  # was silently the NaN placeholder of item()


def int_of_item(x):
    n = int(x.sum().item())
    return x[:n] * 2


@pytest.mark.parametrize("fn", [float_of_item, int_of_item])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_python_numbers_made_from_item_of_an_input_are_recomputed_by_the_prologue(fn, mode):
    cf = tt.compile(fn, **mode)
    for s in (0.5, 0.5, 0.5, 0.75, 0.75, 0.75, 0.5):
        x = torch.full((4,), s)
        torch.testing.assert_close(cf(x), fn(x))


def test_decisions_on_values_with_symbolic_sizes_are_checked_by_the_program_and_stay_dynamic():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)

    def on_loss(x):
        loss = model(x).mean()
        return loss * 2 if loss > 0 else loss

    cf = tt.compile(on_loss, dynamic=True)
    for n, s in ((3, 3), (5, 3), (5, -3), (7, -3)):
        x = torch.randn(n, 4) + s
        torch.testing.assert_close(cf(x), on_loss(x))
    assert tt.compile_stats(cf).entries == 2

    def on_view(x):
        h = x.view(x.shape[0], -1)  # the decision's value needs this call's size: only the program has it
        return h * 2 if h.sum() > 0 else h

    cf = tt.compile(on_view, dynamic=True)
    for n, s in ((3, 1.0), (5, 1.0), (5, -1.0), (7, -1.0), (4, 1.0)):
        x = torch.rand(n, 4, 2) * s
        torch.testing.assert_close(cf(x), on_view(x))
    stats = tt.compile_stats(cf)
    assert stats.entries == 2, stats.retrace_reasons
    assert all("checked by the program" in n for n in stats.decision_notes), stats.decision_notes
