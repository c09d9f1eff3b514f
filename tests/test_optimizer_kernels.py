"""Optimizer updates on torch's fused kernels inside a compiled step (the default ``optimizer_kernels``), against eager."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from thunder_train.compiler.proxies import TensorProxy
from _models import train_step
from _steps import assert_same_state, mlp, mlp_batches, twin


def test_fused_update_runs_in_place_on_parameters_and_state():
    eager, compiled = twin(mlp, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    m, opt = compiled
    step = tt.compile(train_step, thin=True)
    data = mlp_batches(4)
    for x, y in data[:2]:
        step(*compiled, x, y)
        train_step(*eager, x, y)
    ptrs = [t.data_ptr() for t in [*m.parameters(), *(v for st in opt.state.values() for v in st.values())]]
    for x, y in data[2:]:
        step(*compiled, x, y)
        train_step(*eager, x, y)
    assert_same_state(eager, compiled)
    assert [t.data_ptr() for t in [*m.parameters(), *(v for st in opt.state.values() for v in st.values())]] == ptrs
    n_params = len(list(m.parameters()))
    # The functional trace writes every parameter and state tensor back exactly once ...
    functional = tt.last_traces(step)[-2]
    dsts = [b.args[1] for b in functional.bound_symbols if "copy_" in b.sym.name]
    assert len(dsts) == len({id(d) for d in dsts}) == n_params * 4
    # ... and the executed program runs the fused AdamW kernel in place instead, on every parameter exactly once (one
    # call for the parameters whose gradients are final at the same line: transforms/early_updates.py), and the step
    # counters' add likewise.
    src = tt.last_traces(step)[-1].python_source()
    assert "copy_" not in src
    assert sorted(_updated(src, "ttex.adam_update_(")) == sorted(p._tt_name for p in functional.args if _is_param_name(p))
    # (the counters' add in its form for CPU float tensors where the traced dtypes decide it: executors/decided_layouts.py)
    assert len(_updated(src, "ttex.foreach_add_(") + _updated(src, "ttex.foreach_add_same_(")) == n_params


def _updated(src, call) -> list:
    """The names in the first list argument of every ``call`` line of ``src``."""
    return [name.strip() for line in src.splitlines() if call in line
            for name in line.split(call + "[")[1].split("]")[0].split(",")]


def _is_param_name(p) -> bool:
    return type(p).__name__ == "TensorProxy" and p._tt_name.startswith("arg0_")


def test_returning_a_parameter_after_a_fused_update_returns_the_updated_object():
    def step_fn(model, opt, x, y):
        loss = train_step(model, opt, x, y)
        return loss, model[0].weight

    eager, compiled = twin(mlp, lambda ps: torch.optim.Adam(ps, lr=1e-2))
    step = tt.compile(step_fn)
    for x, y in mlp_batches(3):
        l1, w1 = step_fn(*eager, x, y)
        l2, w2 = step(*compiled, x, y)
        torch.testing.assert_close(l2, l1.detach())
        assert w2 is compiled[0][0].weight  # eager returns the parameter object itself
        torch.testing.assert_close(w2, w1)
    assert_same_state(eager, compiled)
    assert "ttex.adam_update_(" in tt.last_traces(step)[-1].python_source()


FUSED_ROUTES = {
    "adam-amsgrad-maximize": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd-dampening-maximize": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.5, dampening=0.1, maximize=True),
    "sgd-plain": lambda ps: torch.optim.SGD(ps, lr=1e-2),
    "adam-fused-true": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw-fused-true": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd-fused-true": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    "adagrad-decay-maximize": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, lr_decay=0.01, weight_decay=0.1, maximize=True),
    "adagrad-fused-true": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, initial_accumulator_value=0.1, fused=True),
}


@pytest.mark.parametrize("decompose", [False, True], ids=["kernel", "decomposed"])
@pytest.mark.parametrize("name", list(FUSED_ROUTES))
def test_fused_optimizer_updates_match_eager(name, decompose):
    # decompose=True runs the update formulas of torchlang/optim.py instead of torch's kernel.
    eager, compiled = twin(mlp, FUSED_ROUTES[name])
    step = tt.compile(train_step, thin=True, decompose=decompose)
    for x, y in mlp_batches(6):
        torch.testing.assert_close(step(*compiled, x, y), train_step(*eager, x, y).detach())
    assert_same_state(eager, compiled, atol=1e-6 if not decompose else 1e-5)
    src = tt.last_traces(step)[-1].python_source()
    assert ("_update" in src) != decompose


@pytest.mark.parametrize("decompose", [False, True], ids=["kernel", "decomposed"])
@pytest.mark.parametrize("name", ["adam-amsgrad-maximize", "sgd-nesterov", "adagrad-decay-maximize"])
def test_updates_are_recorded_without_their_decomposition_unless_it_runs(name, decompose):
    """The torch executor runs a multi-tensor update whole: its per-parameter formulas are traced only for
    ``decompose=True``, which runs them (Symbol.results_without_decomposition)."""
    eager, compiled = twin(mlp, FUSED_ROUTES[name])
    step = tt.compile(train_step, decompose=decompose)
    for x, y in mlp_batches(3):
        torch.testing.assert_close(step(*compiled, x, y), train_step(*eager, x, y).detach())
    assert_same_state(eager, compiled, atol=1e-6 if not decompose else 1e-5)
    acquired = tt.last_traces(step)[0]
    (update,) = [b for b in acquired.bound_symbols if b.sym.name.endswith("_update")]
    assert bool(update.subsymbols) == decompose
    made, read = update.output, update.args[0]
    assert [(o._tt_shape, o._tt_dtype, o._tt_strides) for o in made[0]] == [(p._tt_shape, p._tt_dtype, p._tt_strides) for p in read]


@pytest.mark.parametrize("make_opt", [torch.optim.AdamW, lambda groups: torch.optim.SGD(groups, momentum=0.9)], ids=["adamw", "sgd"])
def test_fused_updates_with_several_param_groups_and_an_unused_parameter(make_opt):
    def groups(ps):
        ps = list(ps)
        return [{"params": ps[:2], "lr": 1e-2, "weight_decay": 0.1}, {"params": ps[2:], "lr": 3e-3, "weight_decay": 0.0}]

    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.unused = nn.Parameter(torch.ones(3))  # never gets a gradient: not in any update list

        def forward(self, x):
            return self.net(x)

    eager, compiled = twin(WithUnused, lambda ps: make_opt(groups(ps)))
    step = tt.compile(train_step, thin=True)
    sched = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (eager[1], compiled[1])]
    for x, y in mlp_batches(6):
        torch.testing.assert_close(step(*compiled, x, y), train_step(*eager, x, y).detach())
        for s_ in sched:
            s_.step()
    assert_same_state(eager, compiled)
    # Each group's kernel updates its own parameters (the unused one is in no list), each exactly once.
    src = tt.last_traces(step)[-1].python_source()
    updated = _updated(src, "ttex.sgd_update_(") + _updated(src, "ttex.adam_update_(")
    assert len(updated) == len(set(updated)) == len(list(compiled[0].net.parameters())), src
    assert tt.compile_stats(step).cache_misses == 2


@pytest.mark.parametrize("decompose", [False, True], ids=["kernel", "decomposed"])
def test_fused_sgd_momentum_buffer_is_not_the_gradient(decompose):
    # zero_grad(set_to_none=False) keeps .grad alive and zeroes it in place: a first momentum buffer
    # that were the gradient tensor itself would be zeroed with it.
    def step_fn(model, opt, x, y):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    eager, compiled = twin(mlp, lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9))
    step = tt.compile(step_fn, decompose=decompose)
    for x, y in mlp_batches(4):
        step(*compiled, x, y)
        step_fn(*eager, x, y)
    assert_same_state(eager, compiled)
    grads = {id(p.grad) for p in compiled[0].parameters()}
    assert not grads & {id(st["momentum_buffer"]) for st in compiled[1].state.values()}


def test_default_implementation_is_chosen_as_in_eager(monkeypatch):
    # torch picks foreach for tensors on devices with foreach kernels (CUDA); pretend the CPU is one,
    # so this CPU test sees the choice eager makes there: the proxies must not fall back to the for-loop.
    from torch.optim import optimizer

    monkeypatch.setattr(optimizer, "_get_foreach_kernels_supported_devices", lambda: ["cpu", "cuda"])
    eager, compiled = twin(mlp, lambda ps: torch.optim.Adam(ps, lr=1e-2))
    step = tt.compile(train_step, optimizer_kernels="traced")
    for x, y in mlp_batches(3):
        torch.testing.assert_close(step(*compiled, x, y), train_step(*eager, x, y).detach())
    assert_same_state(eager, compiled)
    assert "torch._foreach_lerp" in tt.last_traces(step)[-1].python_source()
    assert TensorProxy not in optimizer._foreach_supported_types  # restored after tracing


def test_updates_the_fused_kernels_cannot_compute_run_the_optimizers_code():
    # A tensor learning rate is not one of the fused routes' arguments here.
    eager, compiled = twin(mlp, lambda ps: torch.optim.Adam(ps, lr=torch.tensor(1e-2), foreach=False))
    step = tt.compile(train_step)
    for x, y in mlp_batches(3):
        torch.testing.assert_close(step(*compiled, x, y), train_step(*eager, x, y).detach())
    assert_same_state(eager, compiled)
    assert "adam_update" not in tt.last_traces(step)[-1].python_source()


def test_float64_models_use_the_fused_kernels_too():
    eager, compiled = twin(lambda: mlp().double(), lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    step = tt.compile(train_step)
    for x, y in mlp_batches(3):
        torch.testing.assert_close(step(*compiled, x.double(), y), train_step(*eager, x.double(), y).detach())
    assert_same_state(eager, compiled, atol=1e-12, rtol=1e-10)
    assert "ttex.adam_update_(" in tt.last_traces(step)[-1].python_source()
