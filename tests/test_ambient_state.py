"""Modes, saved-tensor hooks, anomaly detection, torch.func transforms and forward-mode AD set up around a compiled
call or inside the step (compiler/acquisition/ambient.py): each gave silently different results from eager (a
user's TorchDispatchMode or TorchFunctionMode half-applied, a compressing pack hook skipped, a NaN passing anomaly
detection, a dual input's tangent dropped by the fused program) or torch's internal errors, and is now refused with
what to do, in thin mode, on the full path and in ``tt.compile(model)``; what gives eager's values under them (the
default device's mode, checkpoint's own hooks, a TorchFunctionMode entered inside the step, a mode that declares it
only observes, anomaly detection without its NaN check or with the backward outside) still runs."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import thunder_train as tt
from _steps import squared_output_step as _step


class _HalveGelu(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 0.5 if func is torch.ops.aten.gelu.default else out


class _GeluAsTanh(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.gelu:
            return torch.tanh(args[0])
        return func(*args, **(kwargs or {}))


def _compressing_hooks():
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.to(torch.bfloat16), lambda t: t.float())


def _flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False)


_AROUND = {
    "dispatch mode": (_HalveGelu, "_HalveGelu"),
    "function mode": (_GeluAsTanh, "_GeluAsTanh"),
    "flop counter": (_flop_counter, "FlopCounterMode"),
    "compressing hooks": (_compressing_hooks, "saved-tensor hooks"),
    "save_on_cpu": (torch.autograd.graph.save_on_cpu, "saved-tensor hooks .save_on_cpu"),
}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 1))


def _step_with(make):
    """The squared-output step with its forward under ``make()``."""
    def step(model, opt, x):
        with make():
            y = model(x)
        loss = y.square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def _compiled(how, model):
    """(the step to call with the model, the model to pass it) for thin, full or ``tt.compile(model)``."""
    if how == "module":
        cmod = tt.compile(model)
        return (lambda m, o, x: _step(cmod, o, x)), model
    return tt.compile(_step, thin=how == "thin"), model


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("how", ["thin", "full", "module"])
@pytest.mark.parametrize("what", sorted(_AROUND))
def test_around_the_call_is_refused_and_changes_nothing(what, how):
    make, named = _AROUND[what]
    eager, compiled = _model(), _model()
    eopt, copt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled))
    cf, cm = _compiled(how, compiled)
    x = torch.randn(3, 4)
    for _ in range(3):  # thin mode binds on the second call
        assert torch.equal(cf(cm, copt, x), _step(eager, eopt, x))
    before = _params(compiled)
    with make():
        _step(eager, eopt, x)  # eager runs under it
    with pytest.raises(tt.TracingError, match=named):
        with make():
            cf(cm, copt, x)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(compiled)))
    # Without them the compiled function goes on as eager does (thin mode still bound: no new trace, no rebinding).
    # (FlopCounterMode registers global module hooks while it is on: a change thin mode sees and binds again after)
    stats = tt.compile_stats(cf) if how != "module" and what != "flop counter" else None
    counts = (stats.cache_misses, stats.thin_binds) if stats is not None else None
    with torch.no_grad():
        for p, q in zip(eager.parameters(), compiled.parameters()):
            q.copy_(p)
    assert torch.allclose(cf(cm, copt, x), _step(eager, eopt, x))
    if stats is not None:
        assert (stats.cache_misses, stats.thin_binds) == counts
        assert stats.thin_invalidations == []


@pytest.mark.parametrize("how", ["thin", "full"])
@pytest.mark.parametrize("what", ["dispatch mode", "flop counter", "compressing hooks", "save_on_cpu"])
def test_entered_inside_the_step_is_refused(what, how):
    make, named = _AROUND[what]
    step = _step_with(make)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _params(model)
    with pytest.raises(tt.TracingError, match=f"{named}.*(was|were) entered inside a compiled function"):
        tt.compile(step, thin=how == "thin")(model, opt, torch.randn(3, 4))
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model)))


def test_hooks_inside_the_step_where_nothing_is_saved_run():
    """Hooks around code that saves nothing for a backward change nothing in eager: not refused."""
    def step(model, opt, x):
        with _compressing_hooks():
            scale = (x.detach() * 2).sum()
        loss = model(x).square().mean() * scale
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    eager, compiled = _model(), _model()
    eopt, copt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled))
    cf = tt.compile(step, thin=True)
    x = torch.randn(3, 4)
    for _ in range(3):
        assert torch.allclose(cf(compiled, copt, x), step(eager, eopt, x))
    for p, q in zip(eager.parameters(), compiled.parameters()):
        assert torch.allclose(p, q)


@pytest.mark.parametrize("how", ["thin", "full"])
def test_a_function_mode_entered_inside_the_step_is_traced_through(how):
    step = _step_with(_GeluAsTanh)
    eager, compiled = _model(), _model()
    eopt, copt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled))
    cf = tt.compile(step, thin=how == "thin")
    x = torch.randn(3, 4)
    for _ in range(3):
        assert torch.allclose(cf(compiled, copt, x), step(eager, eopt, x))
    for p, q in zip(eager.parameters(), compiled.parameters()):
        assert torch.allclose(p, q)


@contextlib.contextmanager
def _anomaly(check_nan=True):
    torch.autograd.set_detect_anomaly(True, check_nan=check_nan)
    try:
        yield
    finally:
        torch.autograd.set_detect_anomaly(False)


@pytest.mark.parametrize("how", ["thin", "full"])
def test_anomaly_detection_around_a_step_with_its_backward_is_refused(how):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cf = tt.compile(_step, thin=how == "thin")
    x = torch.randn(3, 4)
    for _ in range(3):
        cf(model, opt, x)
    x[0, 0] = float("inf")
    with _anomaly(), pytest.raises(RuntimeError, match="returned nan"):
        _step(copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.1), x)  # eager's check
    before = _params(model)
    with _anomaly(), pytest.raises(tt.TracingError, match="anomaly detection with its NaN check"):
        cf(model, opt, x)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model)))
    with _anomaly(check_nan=False):  # records forward tracebacks only: nothing the program would skip
        cf(model, opt, torch.randn(3, 4))


def test_anomaly_detection_around_the_backward_inside_the_step_is_refused():
    def step(model, opt, x):
        loss = model(x).square().mean()
        with torch.autograd.detect_anomaly():
            loss.backward()
        opt.step()
        return loss

    model = _model()
    with pytest.raises(tt.TracingError, match="anomaly detection"):
        tt.compile(step)(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(3, 4))


def test_anomaly_detection_checks_a_compiled_modules_backward_as_one_node():
    model = _model()
    cmod = tt.compile(model)
    x = torch.randn(3, 4)
    cmod(x).sum().backward()
    x[0, 0] = float("inf")
    with _anomaly(), pytest.raises(RuntimeError, match="returned nan"):
        cmod(x).square().sum().backward()


def test_the_default_devices_mode_runs_and_thin_mode_says_it_rebound():
    eager, compiled = _model(), _model()
    eopt, copt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled))
    cf = tt.compile(_step, thin=True)
    x = torch.randn(3, 4)
    for _ in range(3):
        cf(compiled, copt, x), _step(eager, eopt, x)
    torch.set_default_device("cpu")
    try:
        for _ in range(3):
            assert torch.equal(cf(compiled, copt, x), _step(eager, eopt, x))
    finally:
        torch.set_default_device(None)
    assert any("modes around the call changed" in r for r in tt.compile_stats(cf).thin_invalidations)
    assert tt.compile_stats(cf).thin_binds == 2


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_compiled_module_inside_an_eager_checkpoint_region_runs(use_reentrant):
    """checkpoint's own saved-tensor hooks around a compiled module's call: one autograd node to them."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    compiled = copy.deepcopy(eager)
    inner = tt.compile(compiled[0])
    x = torch.randn(5, 4, requires_grad=True)  # (reentrant checkpoint gives the parameters no gradient otherwise)
    for _ in range(3):
        e = eager[2](eager[1](checkpoint(eager[0], x, use_reentrant=use_reentrant))).sum()
        c = compiled[2](compiled[1](checkpoint(inner, x, use_reentrant=use_reentrant))).sum()
        e.backward()
        c.backward()
        assert torch.equal(e, c)
    for p, q in zip(eager.parameters(), compiled.parameters()):
        assert torch.allclose(p.grad, q.grad)


class _CountingMode(TorchDispatchMode):
    thunder_train_observes = True  # counts the kernels the compiled program runs: allowed around the call

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("how", ["thin", "full", "module"])
def test_a_mode_that_says_it_only_observes_runs_and_sees_the_programs_kernels(how):
    eager, compiled = _model(), _model()
    eopt, copt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled))
    cf, cm = _compiled(how, compiled)
    x = torch.randn(3, 4)
    for _ in range(3):
        counting = _CountingMode()
        with counting:
            assert torch.equal(cf(cm, copt, x), _step(eager, eopt, x))
        assert counting.calls > 0
    for p, q in zip(eager.parameters(), compiled.parameters()):
        assert torch.equal(p, q)


def _features(x, w):
    return ((x * w).sin() * 2 + 1).tanh().sum(-1)


@pytest.mark.parametrize("thin", [False, True])
@pytest.mark.parametrize("keep_buffers", [False, True])
def test_forward_ad_and_transforms_around_the_call_are_refused(thin, keep_buffers):
    """A dual level around the call (the fused program returned no tangent for a dual input) and a torch.func
    transform of the compiled function (torch's internal batching errors on kept buffers' out= kernels)."""
    import torch.autograd.forward_ad as fwAD

    cf = tt.compile(_features, thin=thin, keep_buffers=keep_buffers)
    x, w = torch.randn(3), torch.randn(3)
    for _ in range(3):
        assert torch.equal(cf(x, w), _features(x, w))
    with fwAD.dual_level():
        dual = fwAD.make_dual(w, torch.ones(3))
        assert fwAD.unpack_dual(_features(x, dual)).tangent is not None  # eager carries the tangent
        with pytest.raises(tt.TracingError, match="forward-mode AD level is active around the call"):
            cf(x, dual)
    batch = torch.randn(4, 3)
    with pytest.raises(tt.TracingError, match="torch.func transform .* is active around the call"):
        torch.func.vmap(cf, in_dims=(0, None))(batch, w)
    with pytest.raises(tt.TracingError, match="torch.func transform .* is active around the call"):
        torch.func.grad(lambda w: cf(x, w))(w)
    assert torch.equal(cf(x, w), _features(x, w))  # and afterwards as before


def test_forward_ad_inside_the_step_is_refused():
    import torch.autograd.forward_ad as fwAD

    def f(x, w):
        with fwAD.dual_level():
            out = (x * fwAD.make_dual(w, torch.ones_like(w))).sin().sum()
            tangent = fwAD.unpack_dual(out).tangent
        return out + 0, tangent

    with pytest.raises(tt.TracingError, match="forward-mode AD .* inside a compiled function"):
        tt.compile(f)(torch.randn(4, 3), torch.randn(3))
