"""Whole training steps (forward, loss.backward(), optimizer, zero_grad) compiled, compared with eager.

Eager PyTorch is the reference: same losses, same parameters, same optimizer
state, the same tensor objects updated in place, ``.grad`` with PyTorch's
accumulation semantics.
"""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from thunder_train.compiler.prims import copy_ as prims_copy_
from _models import train_step
from _steps import assert_same_state, gpt, gpt_batches, mlp, mlp_batches, twin


def clipped_step(model, opt, x, y):
    loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    opt.zero_grad()
    return loss


OPTIMIZERS = {
    "sgd-momentum": lambda foreach: lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, foreach=foreach),
    "sgd-nesterov": lambda foreach: lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, foreach=foreach),
    "adam": lambda foreach: lambda ps: torch.optim.Adam(ps, lr=3e-3, weight_decay=0.01, foreach=foreach),
    "adamw": lambda foreach: lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1, foreach=foreach),
}


@pytest.mark.parametrize("kernels", ["fused", "traced"])
@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
def test_training_matches_eager_for_20_steps(model_name, opt_name, foreach, kernels):
    # kernels="fused": the update runs torch's fused kernel; "traced": the optimizer's own per-op code.
    make_model, data = (mlp, mlp_batches(20)) if model_name == "mlp" else (gpt, gpt_batches(20))
    eager, compiled = twin(make_model, OPTIMIZERS[opt_name](foreach))
    params_before = [id(p) for p in compiled[0].parameters()]
    step = tt.compile(train_step, thin=True, optimizer_kernels=kernels)
    for x, y in data:
        expected = train_step(*eager, x, y)
        actual = step(*compiled, x, y)
        torch.testing.assert_close(actual, expected.detach(), atol=1e-5, rtol=1e-5)
    assert_same_state(eager, compiled, atol=2e-5, rtol=1e-4)
    # Updated in place: the same parameter objects; no .grad left behind (zero_grad(set_to_none=True)).
    assert [id(p) for p in compiled[0].parameters()] == params_before
    assert all(p.grad is None for p in compiled[0].parameters())
    stats = tt.compile_stats(step)
    # Call 1 creates the optimizer state lazily: a second program, then thin mode binds the steady state.
    assert stats.cache_misses == 2 and stats.thin_binds == 1 and stats.thin_calls == 17


def test_optimizer_state_objects_are_updated_in_place():
    eager, compiled = twin(mlp, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    step = tt.compile(train_step)
    data = mlp_batches(4)
    step(*compiled, *data[0])
    train_step(*eager, *data[0])
    state_ids = {k: id(v) for p in compiled[1].state.values() for k, v in p.items()}
    ptrs = [p.data_ptr() for p in compiled[0].parameters()]
    for x, y in data[1:]:
        step(*compiled, x, y)
        train_step(*eager, x, y)
    assert {k: id(v) for p in compiled[1].state.values() for k, v in p.items()} == state_ids
    assert [p.data_ptr() for p in compiled[0].parameters()] == ptrs
    assert_same_state(eager, compiled)


def test_one_copy_per_updated_buffer():
    (_, _), (m, opt) = twin(mlp, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    step = tt.compile(train_step, optimizer_kernels="traced")
    for x, y in mlp_batches(2):
        step(m, opt, x, y)
    functional = tt.last_traces(step)[-2]
    copies = [b for b in functional.bound_symbols if "copy_" in b.sym.name]
    dsts = [b.args[1] for b in copies]
    # Every parameter and every state tensor (step, exp_avg, exp_avg_sq) is written exactly once.
    n_params = len(list(m.parameters()))
    assert len(dsts) == len({id(d) for d in dsts}) == n_params * 4
    # The acquisition trace of the same step records no mutation before the write-backs: it is functional.
    assert not any(b.sym is prims_copy_ for b in tt.last_traces(step)[1].bound_symbols[:-len(copies)])
    # The executed program runs each update chain in place, as eager does (p.mul_(...); p.addcdiv_(...)).
    final = tt.last_traces(step)[-1]
    assert not any("copy_" in b.sym.name for b in final.bound_symbols)
    src = final.python_source()
    assert src.count("torch.Tensor.addcdiv_(") == n_params and src.count("torch.Tensor.lerp_(") == n_params


def test_lr_scheduler_changes_lr_without_retrace_and_thin_mode_reads_it():
    eager, compiled = twin(mlp, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    s1 = torch.optim.lr_scheduler.CosineAnnealingLR(eager[1], T_max=10)
    s2 = torch.optim.lr_scheduler.CosineAnnealingLR(compiled[1], T_max=10)
    step = tt.compile(train_step, thin=True)
    for x, y in mlp_batches(12):
        train_step(*eager, x, y)
        step(*compiled, x, y)
        s1.step()
        s2.step()
    assert_same_state(eager, compiled)
    stats = tt.compile_stats(step)
    assert stats.cache_misses == 2 and stats.thin_calls == 9 and not stats.thin_invalidations
    # The lr is an input of the computation, not a constant.
    assert "lr" in tt.last_traces(step)[-1].python_source().splitlines()[2]


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
def test_clip_grad_norm_inside_the_step(foreach):
    def step_fn(model, opt, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, foreach=foreach)
        opt.step()
        opt.zero_grad()
        return loss, norm

    eager, compiled = twin(mlp, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    step = tt.compile(step_fn, thin=True)
    for x, y in mlp_batches(6):
        le, ne = step_fn(*eager, x, y)
        lc, nc = step(*compiled, x, y)
        torch.testing.assert_close(nc, ne)
        assert ne > 0.05  # the clipping is active
    assert_same_state(eager, compiled)


def test_clip_grad_norm_error_if_nonfinite_checks_when_the_program_runs():
    # Its decision is on the norm's value: a check inside the program, every call (thin mode too).
    def step_fn(model, opt, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, error_if_nonfinite=True)
        opt.step()
        opt.zero_grad()
        return loss

    eager, compiled = twin(mlp, lambda ps: torch.optim.AdamW(ps, lr=0.1))
    step = tt.compile(step_fn, thin=True)
    for x, y in mlp_batches(4):
        torch.testing.assert_close(step(*compiled, x, y), step_fn(*eager, x, y).detach())
    assert tt.compile_stats(step).thin_calls
    x, y = mlp_batches(1)[0]
    x[0, 0] = float("inf")
    before = [p.detach().clone() for p in compiled[0].parameters()]
    for fn, (m, o) in ((step_fn, eager), (step, compiled)):
        with pytest.raises(RuntimeError, match="non-finite, so it cannot be clipped"):
            fn(m, o, x, y)
    # The program stopped before its updates, as eager stops before opt.step().
    assert all(torch.equal(a, b) for a, b in zip(before, compiled[0].parameters()))
    assert_same_state(eager, compiled)


# ---------------------------------------------------------------------------
# .grad semantics of loss.backward() inside a compiled function
# ---------------------------------------------------------------------------
def backward_only(model, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss


def test_backward_creates_then_accumulates_grads_like_eager():
    torch.manual_seed(0)
    m1 = mlp()
    m1[2].weight.requires_grad_(False)  # frozen: its .grad stays None
    m2 = copy.deepcopy(m1)
    cf = tt.compile(backward_only)
    data = mlp_batches(3)
    backward_only(m1, *data[0])
    cf(m2, *data[0])
    grad_objects = [p.grad for p in m2.parameters()]
    assert m2[2].weight.grad is None
    for x, y in data[1:]:
        backward_only(m1, x, y)
        cf(m2, x, y)
    for (n, a), b, g0 in zip(m1.named_parameters(), m2.parameters(), grad_objects):
        if a.grad is None:
            assert b.grad is None, n
            continue
        torch.testing.assert_close(b.grad, a.grad, msg=lambda m: f"{n}: {m}")
        assert b.grad is g0, f"{n}: accumulation must happen in place into the existing .grad"
    # Call 1 saw .grad None, call 2 existing grads: two programs, then a cache hit.
    assert tt.compile_stats(cf).cache_misses == 2 and tt.compile_stats(cf).cache_hits == 1


def test_unused_parameters_keep_grad_none():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 2)
            self.b = nn.Linear(3, 2)

        def forward(self, x):
            return self.a(x)

    m = TwoHeads()
    cf = tt.compile(lambda m, x: m(x).sum().backward())
    cf(m, torch.randn(4, 3))
    assert m.a.weight.grad is not None and m.b.weight.grad is None and m.b.bias.grad is None


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_both_ways(set_to_none):
    def step_fn(model, opt, x, y):
        opt.zero_grad(set_to_none=set_to_none)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    eager, compiled = twin(mlp, lambda ps: torch.optim.SGD(ps, lr=0.1))
    step = tt.compile(step_fn, thin=True)
    for x, y in mlp_batches(5):
        step_fn(*eager, x, y)
        step(*compiled, x, y)
        for a, b in zip(eager[0].parameters(), compiled[0].parameters()):
            torch.testing.assert_close(b.grad, a.grad)
    assert_same_state(eager, compiled)


def test_gradient_accumulation_over_micro_batches():
    def step_fn(model, opt, batches):
        total = 0.0
        for x, y in batches:
            loss = F.cross_entropy(model(x), y) / len(batches)
            loss.backward()
            total = total + loss.detach()
        opt.step()
        opt.zero_grad()
        return total

    eager, compiled = twin(mlp, lambda ps: torch.optim.Adam(ps, lr=1e-2))
    step = tt.compile(step_fn)
    data = mlp_batches(6)
    for i in range(0, 6, 2):
        torch.testing.assert_close(step(*compiled, data[i:i + 2]), step_fn(*eager, data[i:i + 2]))
    assert_same_state(eager, compiled)


def test_autograd_grad_inside_returns_grads_and_leaves_dot_grad_alone():
    def fn(model, x):
        loss = model(x).pow(2).mean()
        return torch.autograd.grad(loss, list(model.parameters()))

    torch.manual_seed(0)
    m = mlp()
    x = torch.randn(5, 6)
    expected = fn(m, x)
    actual = tt.compile(fn)(m, x)
    assert all(p.grad is None for p in m.parameters())
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
def test_gradients_are_constants_to_a_later_backward(how):
    # Without create_graph eager gradients have no grad_fn: a second backward through a loss built
    # from them must not differentiate the first backward (silently 3g instead of 2g before).
    def fn(w, x):
        loss = (w * x).pow(2).sum()
        if how == "backward":
            loss.backward()
            g = w.grad
        else:
            (g,) = torch.autograd.grad(loss, [w])
        (g * w).sum().backward()
        return g

    w1 = torch.randn(5, requires_grad=True)
    w2 = w1.detach().clone().requires_grad_()
    x = torch.randn(5)
    expected = fn(w1, x)
    torch.testing.assert_close(tt.compile(fn)(w2, x), expected.detach())
    torch.testing.assert_close(w2.grad, w1.grad)


def _gradient_penalty_step(model, opt, x):
    # WGAN-GP style: the penalty differentiates a gradient (create_graph=True).
    x = x.clone().requires_grad_()
    out = model(x).sum()
    (gx,) = torch.autograd.grad(out, [x], create_graph=True)
    loss = out / x.shape[0] + 10 * ((gx.norm(dim=1) - 1) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _grad_norm_penalty_step(model, opt, x):
    loss = model(x).pow(2).mean()
    loss.backward(create_graph=True)
    penalty = sum((p.grad ** 2).sum() for p in model.parameters())
    penalty.backward()
    opt.step()
    opt.zero_grad()
    return penalty


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")  # eager's, about its own .grad cycle
@pytest.mark.parametrize("decompose", [False, True], ids=["whole", "decomposed"])
@pytest.mark.parametrize("step_fn", [_gradient_penalty_step, _grad_norm_penalty_step], ids=["autograd.grad", "backward"])
def test_double_backward_with_create_graph_matches_eager(step_fn, decompose):
    def make():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 1))
        return m, torch.optim.Adam(m.parameters(), lr=1e-3)

    eager, compiled = make(), make()
    step = tt.compile(step_fn, thin=True, decompose=decompose)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(8, 6, generator=g)
        torch.testing.assert_close(step(*compiled, x), step_fn(*eager, x).detach())
    for a, b in zip(eager[0].parameters(), compiled[0].parameters()):
        torch.testing.assert_close(b, a)


def test_backward_with_gradient_argument_and_errors():
    w = torch.randn(3, requires_grad=True)

    def fn(w, v):
        y = w * 2
        y.backward(v)
        return y

    w_e = w.detach().clone().requires_grad_()
    v = torch.randn(3)
    fn(w_e, v)
    tt.compile(fn)(w, v)
    torch.testing.assert_close(w.grad, w_e.grad)

    with pytest.raises(RuntimeError, match="does not require grad"):
        tt.compile(lambda x: x.sum().backward())(torch.randn(3))
    with pytest.raises(RuntimeError, match="implicitly created only for scalar"):
        tt.compile(lambda w: (w * 2).backward())(torch.randn(3, requires_grad=True))
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        tt.compile(lambda w: w.add_(1))(torch.randn(3, requires_grad=True))


# ---------------------------------------------------------------------------
# Functionalization and returned values
# ---------------------------------------------------------------------------
def test_returned_destination_is_the_input_and_source_is_fresh():
    def fn(x, y):
        out = x.add_(1)
        z = y * 2
        x.mul_(z)
        return out, z

    x, y = torch.randn(4), torch.randn(4)
    xe = x.clone()
    ptr = x.data_ptr()
    out, z = tt.compile(fn)(x, y)
    oe, ze = fn(xe, y)
    assert out is x and x.data_ptr() == ptr
    torch.testing.assert_close(x, xe)
    torch.testing.assert_close(z, ze)
    assert z.data_ptr() not in (x.data_ptr(), y.data_ptr())


def test_later_reads_see_the_new_value_and_views_write_through():
    def fn(x):
        a = x.sum()
        x.mul_(2)
        b = x.sum()  # reads the updated x
        v = x[1:3]
        v.add_(10)  # writes into x
        t = x.t()
        x[0, 0] = -1.0  # t follows x
        x.view(-1)[5] = 7.0
        return a, b, v.clone(), t.sum(), x.detach().clone()

    x = torch.randn(4, 3)
    xe = x.clone()
    actual = tt.compile(fn)(x)
    expected = fn(xe)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)
    torch.testing.assert_close(x, xe)


def test_setitem_and_foreach_inplace():
    def fn(ts, s):
        ts[0][1:] = 0.5
        torch._foreach_mul_(ts, s)
        torch._foreach_add_(ts, [t.sum() for t in ts], alpha=2)
        return ts[1].sum()

    ts = [torch.randn(3), torch.randn(2, 2)]
    te = [t.clone() for t in ts]
    torch.testing.assert_close(tt.compile(fn)(ts, 3.0), fn(te, 3.0))
    for a, e in zip(ts, te):
        torch.testing.assert_close(a, e)


def test_aliased_inputs_are_rejected_when_one_is_updated():
    x = torch.randn(6)
    with pytest.raises(NotImplementedError, match="shares its storage"):
        tt.compile(lambda a, b: a.add_(b.sum()))(x, x[2:])
    # Reading both is fine.
    torch.testing.assert_close(tt.compile(lambda a, b: a.sum() + b.sum())(x, x[2:]), x.sum() + x[2:].sum())


def test_aliasing_is_part_of_the_guard():
    def fn(a, b):
        a.add_(b)
        return a

    cf = tt.compile(fn)
    base = torch.zeros(4)
    cf(base, torch.ones(4))
    with pytest.raises(NotImplementedError, match="shares its storage"):
        cf(base, base[:])  # same shapes as before, but b is now a view of a: not the cached program


def test_parameters_made_to_share_storage_after_the_first_call_are_seen():
    """``q.data = p.data`` between steps makes two parameters the optimizer updates one storage: the full path's
    key sees it and the new trace refuses the aliased in-place updates, as a first call with them would."""
    def step(m, opt, x):
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    cf = tt.compile(step)
    for _ in range(2):
        cf(m, opt, torch.randn(3, 4))
    m[2].weight.data = m[0].weight.data
    with pytest.raises(NotImplementedError, match="shares its storage"):
        cf(m, opt, torch.randn(3, 4))


# ---------------------------------------------------------------------------
# Buffers and checkpoints
# ---------------------------------------------------------------------------
class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(F.relu(self.bn(self.conv(x))).mean((2, 3)))


def test_batchnorm_running_stats_match_eager():
    eager, compiled = twin(ConvBN, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    step = tt.compile(train_step, thin=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        x, y = torch.randn(4, 2, 5, 5, generator=g), torch.randint(0, 3, (4,), generator=g)
        torch.testing.assert_close(step(*compiled, x, y), train_step(*eager, x, y).detach())
    assert_same_state(eager, compiled)
    assert int(compiled[0].bn.num_batches_tracked) == 5
    functional = tt.last_traces(step)[-2]  # before update chains run in place
    written = [b.args[1]._tt_name for b in functional.bound_symbols if "copy_" in b.sym.name]
    assert sum("running_mean" in n for n in written) == 1 and sum("running_var" in n for n in written) == 1



@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
def test_batchnorm_running_stats_are_written_back_before_the_backward(thin):
    """Eager updates the running statistics in the forward; the program computes the new values aside and writes them
    back after the last line that may raise (the cross-entropy's class check), not at the end: the new values are
    freed before the backward (they were held to the end of the step).  A call that raises still changes nothing
    (tests/test_thin_transactional.py)."""
    eager, compiled = twin(ConvBN, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    step = tt.compile(train_step, thin=thin)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = torch.randn(4, 2, 5, 5, generator=g), torch.randint(0, 3, (4,), generator=g)
        torch.testing.assert_close(step(*compiled, x, y), train_step(*eager, x, y).detach(), rtol=0, atol=0)
    assert_same_state(eager, compiled)
    lines = [b.sym.name for b in tt.last_traces(step)[-1].bound_symbols]
    backward = next(i for i, n in enumerate(lines) if "cross_entropy_backward" in n)
    written = [i for i, n in enumerate(lines) if n.endswith("copy_")]
    assert len(written) == 3 and max(written) < backward, (written, backward)

def test_checkpoint_round_trip_matches_eager(tmp_path):
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    eager, compiled = twin(mlp, make_opt)
    step = tt.compile(train_step, thin=True)
    data = mlp_batches(8)
    for x, y in data[:4]:
        train_step(*eager, x, y)
        step(*compiled, x, y)
    torch.save({"model": compiled[0].state_dict(), "opt": compiled[1].state_dict()}, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt")
    m3 = mlp()
    m3.load_state_dict(ckpt["model"])
    o3 = make_opt(m3.parameters())
    o3.load_state_dict(ckpt["opt"])
    step2 = tt.compile(train_step, thin=True)
    for x, y in data[4:]:
        torch.testing.assert_close(step2(m3, o3, x, y), train_step(*eager, x, y).detach())
    assert_same_state(eager, (m3, o3))


def test_add_param_group_rebinds_thin_mode():
    def step_fn(a, b, opt, x, y):
        loss = F.cross_entropy(b(a(x)), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def make():
        torch.manual_seed(0)
        a, b = nn.Linear(6, 4), nn.Linear(4, 4)
        return a, b, torch.optim.SGD(a.parameters(), lr=0.1)

    (a1, b1, o1), (a2, b2, o2) = make(), make()
    step = tt.compile(step_fn, thin=True)
    for i, (x, y) in enumerate(mlp_batches(6)):
        if i == 3:  # the same param_groups list, one group longer: thin mode must not keep the old program
            o1.add_param_group({"params": b1.parameters()})
            o2.add_param_group({"params": b2.parameters()})
        torch.testing.assert_close(step(a2, b2, o2, x, y), step_fn(a1, b1, o1, x, y).detach())
    torch.testing.assert_close(b2.weight, b1.weight)
    assert tt.compile_stats(step).thin_invalidations


@pytest.mark.parametrize("whole_step", [True, False], ids=["whole-step", "autograd-path"])
def test_freezing_and_unfreezing_parameters_rebinds_thin_mode(whole_step):
    # Fine-tuning schedules freeze or unfreeze layers mid-training: the bound program computed the
    # gradients (and updates) of the parameters that required grad when it was traced.
    def make():
        torch.manual_seed(0)
        m = mlp()
        m[0].requires_grad_(whole_step)  # whole step: freeze later; autograd path: unfreeze later
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    (m1, o1), (m2, o2) = make(), make()
    if whole_step:
        step = tt.compile(train_step, thin=True)
        run = [lambda x, y: train_step(m1, o1, x, y), lambda x, y: step(m2, o2, x, y)]
    else:
        cm = tt.compile(m2, thin=True)

        def autograd_step(model, opt, x, y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        run = [lambda x, y: autograd_step(m1, o1, x, y), lambda x, y: autograd_step(cm, o2, x, y)]
    for i, (x, y) in enumerate(mlp_batches(6)):
        if i == 3:
            m1[0].requires_grad_(not whole_step)
            m2[0].requires_grad_(not whole_step)
        expected, actual = (f(x, y) for f in run)
        torch.testing.assert_close(actual.detach(), expected.detach())
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(b, a)
    stats = tt.compile_stats(step if whole_step else cm)
    assert any("requires_grad" in r for r in stats.thin_invalidations)


def test_optimizer_load_state_dict_rebinds_thin_mode():
    eager, compiled = twin(mlp, lambda ps: torch.optim.Adam(ps, lr=1e-2))
    step = tt.compile(train_step, thin=True)
    data = mlp_batches(8)
    for x, y in data[:4]:
        train_step(*eager, x, y)
        step(*compiled, x, y)
    assert step.is_thin_bound
    # Restore the eager optimizer's state into the compiled one: new state tensors, new param_groups.
    compiled[1].load_state_dict(copy.deepcopy(eager[1].state_dict()))
    for x, y in data[4:]:
        train_step(*eager, x, y)
        step(*compiled, x, y)
    assert_same_state(eager, compiled)
    assert tt.compile_stats(step).thin_invalidations  # the binding noticed and re-validated


MORE_OPTIMIZERS = {
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "adamw-maximize-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, maximize=True, foreach=True),
    "sgd-dampening": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.5, dampening=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
}


@pytest.mark.parametrize("name", list(MORE_OPTIMIZERS))
def test_more_optimizers_match_eager(name):
    eager, compiled = twin(mlp, MORE_OPTIMIZERS[name])
    step = tt.compile(train_step)
    for x, y in mlp_batches(4):
        torch.testing.assert_close(step(*compiled, x, y), train_step(*eager, x, y).detach())
    assert_same_state(eager, compiled, atol=1e-5)


def test_out_argument_is_functionalized():
    def fn(a, b, buf):
        torch.maximum(a, b, out=buf)
        return buf * 2

    a, b = torch.randn(5), torch.randn(5)
    buf1, buf2 = torch.zeros(5), torch.zeros(5)
    torch.testing.assert_close(tt.compile(fn)(a, b, buf1), fn(a, b, buf2))
    torch.testing.assert_close(buf1, buf2)


def test_in_place_ops_in_a_forward_have_correct_gradients():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)

        def forward(self, x):
            h = self.fc(x)
            h += x  # in place on an intermediate that autograd needs
            h[:, 0] = 0.0
            h.relu_()
            return (h * h).sum()

    torch.manual_seed(0)
    m1 = Block()
    m2 = copy.deepcopy(m1)
    x = torch.randn(4, 6)
    m1(x).backward()
    cm = tt.compile(m2)
    cm(x).backward()  # through our backward (torch.autograd.Function)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(b.grad, a.grad)
    m3 = copy.deepcopy(m1)
    m3.zero_grad()
    m1.zero_grad()
    tt.compile(lambda m, x: m(x).backward())(m3, x)  # backward inside the trace
    m1(x).backward()
    for a, b in zip(m1.parameters(), m3.parameters()):
        torch.testing.assert_close(b.grad, a.grad)


@pytest.mark.parametrize("decompose", [False, True], ids=["whole", "decomposed"])
def test_dropout_draws_the_same_numbers_as_eager_on_cpu(decompose):
    """Training with dropout is comparable to eager step by step: same mask, same gradients."""
    def step_fn(model, opt, x, y):
        loss = F.cross_entropy(F.dropout(model(x), 0.3), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    eager, compiled = twin(mlp, lambda ps: torch.optim.SGD(ps, lr=0.1))
    step = tt.compile(step_fn, decompose=decompose)
    for i, (x, y) in enumerate(mlp_batches(4)):
        torch.manual_seed(i)
        expected = step_fn(*eager, x, y)
        torch.manual_seed(i)
        torch.testing.assert_close(step(*compiled, x, y), expected.detach())
    assert_same_state(eager, compiled)


def test_update_chains_run_in_place_only_when_no_one_reads_the_old_value():
    def later_read(p):
        p2 = p * 2
        r = p.sum()  # reads the old value after the update is computed
        p.copy_(p2)
        return r

    def chain(p, s):
        p.mul_(s)
        p.add_(1)
        return p.sum()

    for fn, args in ((later_read, ()), (chain, (3.0,))):
        p = torch.randn(5)
        q = p.clone()
        cf = tt.compile(fn)
        for _ in range(2):
            torch.testing.assert_close(cf(p, *args), fn(q, *args))
            torch.testing.assert_close(p, q)
    # later_read keeps its copy; chain runs in place.
    cf = tt.compile(later_read)
    cf(torch.randn(5))
    assert "ttex.copy_" in tt.last_traces(cf)[-1].python_source()
    cf = tt.compile(chain)
    cf(torch.randn(5), 2.0)
    src = tt.last_traces(cf)[-1].python_source()
    assert "ttex.copy_" not in src and "torch.Tensor.mul_(p, 2.0)" in src and "torch.Tensor.add_(" in src


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps, lr=0.01),
    lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, weight_decay=0.01),
    lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=True),
], ids=["adamw", "sgd", "adam-foreach"])
def test_one_cycle_schedule_changes_betas_and_momentum_without_retrace(make_opt):
    """Every float hyper-parameter is a runtime input; decisions on them (weight_decay != 0) are checks."""
    eager, compiled = twin(mlp, make_opt)
    s1 = torch.optim.lr_scheduler.OneCycleLR(eager[1], max_lr=0.05, total_steps=12)
    s2 = torch.optim.lr_scheduler.OneCycleLR(compiled[1], max_lr=0.05, total_steps=12)
    step = tt.compile(train_step, thin=True)
    for x, y in mlp_batches(10):
        torch.testing.assert_close(step(*compiled, x, y), train_step(*eager, x, y).detach())
        s1.step()
        s2.step()
    assert_same_state(eager, compiled)
    stats = tt.compile_stats(step)
    assert stats.entries == 2 and stats.thin_calls == 7 and not stats.thin_invalidations


@pytest.mark.parametrize("kernels", ["traced", "fused"])
def test_changing_a_decided_hyper_parameter_retraces_with_the_reason(kernels):
    eager, compiled = twin(mlp, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01))
    step = tt.compile(train_step, thin=True, optimizer_kernels=kernels)
    data = mlp_batches(6)
    for i, (x, y) in enumerate(data):
        if i == 3:
            for o in (eager[1], compiled[1]):
                o.param_groups[0]["weight_decay"] = 0.0  # the optimizer's code branches on it
        torch.testing.assert_close(step(*compiled, x, y), train_step(*eager, x, y).detach())
    assert_same_state(eager, compiled)
    reasons = tt.compile_stats(step).retrace_reasons
    if kernels == "traced":
        assert any("weight_decay != 0 was True, now False" in r for r in reasons)
    else:  # the fused kernel takes weight_decay as a number: no branch, no retrace
        assert not any("weight_decay" in r for r in reasons)


def test_optimizer_step_hooks_are_refused_and_requires_grad_toggles_work():
    m = nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    opt.register_step_post_hook(lambda o, a, k: None)

    def step_fn(m, opt, x):
        loss = m(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    with pytest.raises(Exception, match="optimizer step hooks"):
        tt.compile(step_fn)(m, opt, torch.randn(3, 2))

    def frozen_bias(m, x):
        m.bias.requires_grad = False
        loss = m(x).sum()
        loss.backward()
        m.bias.requires_grad = True
        return loss

    m1, m2 = nn.Linear(2, 2), nn.Linear(2, 2)
    m2.load_state_dict(m1.state_dict())
    x = torch.randn(3, 2)
    tt.compile(frozen_bias)(m1, x)
    frozen_bias(m2, x)
    assert m1.bias.grad is None and m2.bias.grad is None and m1.bias.requires_grad
    torch.testing.assert_close(m1.weight.grad, m2.weight.grad)
    m3 = nn.Linear(2, 2)
    def freeze(m, x):
        m.bias.requires_grad_(False)
        return m(x).sum()

    tt.compile(freeze)(m3, x)
    assert not m3.bias.requires_grad  # the epilogue applies a flag the function left changed


@pytest.mark.parametrize("reduction,ignore_index,all_ignored", [("mean", -100, False), ("sum", 3, False), ("mean", 2, True)])
def test_cross_entropy_backward_in_place_matches_eager(reduction, ignore_index, all_ignored):
    """The whole-step cross-entropy backward writes its result into the log-probabilities it kept."""
    def step(model, opt, x, y):
        loss = F.cross_entropy(model(x), y, reduction=reduction, ignore_index=ignore_index)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    eager, compiled = twin(mlp, lambda ps: torch.optim.SGD(ps, lr=0.1))
    cf = tt.compile(step)
    for x, y in mlp_batches(3):
        y = torch.full_like(y, ignore_index) if all_ignored else y
        torch.testing.assert_close(cf(*compiled, x, y), step(*eager, x, y), equal_nan=True)
        assert_same_state(eager, compiled)
    assert "ttex.cross_entropy_backward_into_logp(" in tt.last_traces(cf)[-1].python_source()


@pytest.mark.parametrize("loss_of", ["sum", "transposed", "strided"])
def test_attention_backward_takes_the_gradient_in_any_layout(loss_of):
    """The whole-step attention backward passes the incoming gradient as it comes (broadcast from a sum,
    transposed, strided): equal to eager bitwise, the attention's own kernels run."""
    def step(proj, x):
        q, k, v = proj(x).view(2, 16, 3, 2, 8).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if loss_of == "sum":
            loss = out.sum()
        elif loss_of == "transposed":
            loss = (out.transpose(-1, -2) * torch.arange(16.0)).pow(2).mean()
        else:
            loss = out[..., ::2].pow(2).sum()
        loss.backward()
        return loss.detach()

    torch.manual_seed(0)
    p1 = nn.Linear(8, 48)
    p2 = copy.deepcopy(p1)
    cf = tt.compile(step)
    for _ in range(2):
        x = torch.randn(2, 16, 8)
        assert torch.equal(cf(p1, x), step(p2, x))
        for a, b in zip(p1.parameters(), p2.parameters()):
            assert torch.equal(a.grad, b.grad)
            a.grad = b.grad = None
    assert "ttex.sdpa_flash_cpu_backward(" in tt.last_traces(cf)[-1].python_source()


def test_thin_mode_notices_gradients_created_between_steps():
    """The bound step assumed .grad is None; an eager backward() in between makes it re-validate."""
    eager, compiled = twin(mlp, lambda ps: torch.optim.SGD(ps, lr=0.1))
    step = tt.compile(train_step, thin=True)
    for i, (x, y) in enumerate(mlp_batches(6)):
        if i == 4:
            for m, _ in (eager, compiled):
                F.cross_entropy(m(x), y).backward()
        torch.testing.assert_close(step(*compiled, x, y), train_step(*eager, x, y).detach())
    assert_same_state(eager, compiled)
    assert any(".grad: None → set" in r for r in tt.compile_stats(step).thin_invalidations)


def test_backward_kernels_reuse_forward_statistics_in_a_whole_step():
    """SDPA (CPU flash) and cross-entropy keep the values their backward kernels read; results equal eager."""
    eager, compiled = twin(gpt, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    step = tt.compile(train_step)
    for x, y in gpt_batches(4):
        torch.testing.assert_close(step(*compiled, x, y), train_step(*eager, x, y).detach())
    assert_same_state(eager, compiled)
    src = tt.last_traces(step)[-1].python_source()
    n_layer = len(compiled[0].blocks)
    assert src.count("ttex.sdpa_flash_cpu(") == n_layer and src.count("ttex.sdpa_flash_cpu_backward(") == n_layer
    # (the forward line is its out form when its log-probabilities are in kept buffers, executors/buffers.py)
    # (over the logits, executors/saved_statistics.py, when nothing reads them afterwards)
    assert len(re.findall(r"ttex\.cross_entropy_(with_stats(_out)?|into_logits)\(", src)) == 1
    assert src.count("ttex.cross_entropy_backward_into_logp(") == 1
    n_ln = 2 * n_layer + 1
    assert src.count("ttex.layer_norm_with_stats(") == n_ln and src.count("ttex.layer_norm_backward(") == n_ln
    # Not applicable (label smoothing): the generic backward runs instead, still equal to eager.
    def smoothed(model, opt, x, y):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), label_smoothing=0.1)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    eager, compiled = twin(gpt, lambda ps: torch.optim.SGD(ps, lr=0.1))
    step = tt.compile(smoothed)
    for x, y in gpt_batches(3):
        torch.testing.assert_close(step(*compiled, x, y), smoothed(*eager, x, y).detach())
    assert_same_state(eager, compiled)
    assert "cross_entropy_with_stats" not in tt.last_traces(step)[-1].python_source()
