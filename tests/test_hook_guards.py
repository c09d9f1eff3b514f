"""Hooks added or removed after the first call (issue 25, item 3): every mode retraces or refuses clearly.

Each test runs the same loop eagerly and compiled (full path, thin mode, ``tt.compile(model)``), adding and
removing hooks between calls, and compares results and parameters after every call.
"""
import copy
import warnings

import pytest
import torch

import thunder_train as tt
from thunder_train.compiler.errors import TracingError

MODES = [pytest.param(dict(thin=False), id="full"), pytest.param(dict(thin=True), id="thin")]


def step(m, opt, x):
    loss = m(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _pair():
    torch.manual_seed(0)
    me = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    mc = copy.deepcopy(me)
    return me, torch.optim.SGD(me.parameters(), lr=0.1), mc, torch.optim.SGD(mc.parameters(), lr=0.1)


def _same(me, mc, le, lc, i):
    torch.testing.assert_close(lc, le, msg=lambda m: f"call {i}: {m}")
    for pe, pc in zip(me.parameters(), mc.parameters()):
        torch.testing.assert_close(pc, pe, msg=lambda m: f"call {i}: {m}")


def _register(kind, m):
    if kind == "forward":
        return m[0].register_forward_hook(lambda mod, a, out: out * 2)
    if kind == "pre_forward":
        return m[0].register_forward_pre_hook(lambda mod, a: (a[0] + 1,))
    if kind == "forward_kwargs":
        return m[2].register_forward_hook(lambda mod, a, kw, out: out - 1, with_kwargs=True)
    raise AssertionError(kind)


@pytest.mark.filterwarnings("ignore:forward hooks")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["forward", "pre_forward", "forward_kwargs"])
def test_module_hook_added_and_removed_retraces(mode, kind):
    me, oe, mc, oc = _pair()
    cf = tt.compile(step, **mode)
    x = torch.randn(8, 4)
    handles = []
    for i in range(7):
        if i == 3:
            handles = [_register(kind, m) for m in (me, mc)]
        if i == 5:
            for h in handles:
                h.remove()
        _same(me, mc, step(me, oe, x), cf(mc, oc, x), i)
    assert len(tt.compile_stats(cf).retrace_reasons) == 2


@pytest.mark.filterwarnings("ignore:forward hooks")
@pytest.mark.parametrize("mode", MODES)
def test_global_forward_hook_retraces(mode):
    me, oe, mc, oc = _pair()
    cf = tt.compile(step, **mode)
    x = torch.randn(8, 4)
    h = None
    try:
        for i in range(6):
            if i == 3:
                h = torch.nn.modules.module.register_module_forward_hook(
                    lambda mod, a, out: out * 0.5 if isinstance(mod, torch.nn.Tanh) else None)
            le = step(me, oe, x)
            lc = cf(mc, oc, x)
            _same(me, mc, le, lc, i)
    finally:
        if h is not None:
            h.remove()
    assert any("global" in r for r in tt.compile_stats(cf).retrace_reasons)


@pytest.mark.filterwarnings("ignore:forward hooks")
@pytest.mark.parametrize("thin", [False, True])
def test_compiled_module_hook_added_later(thin):
    torch.manual_seed(0)
    me = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    mc = copy.deepcopy(me)
    cm = tt.compile(mc, thin=thin)
    x = torch.randn(8, 4)
    for i in range(6):
        if i == 3:
            for m in (me, mc):
                m[2].register_forward_pre_hook(lambda mod, a: (a[0] * 3,))
        ye, yc = me(x), cm(x)
        torch.testing.assert_close(yc, ye, msg=lambda m: f"call {i}: {m}")
        ye.sum().backward()
        yc.sum().backward()
        for pe, pc in zip(me.parameters(), mc.parameters()):
            torch.testing.assert_close(pc.grad, pe.grad)


def _after_three_calls(mode):
    """A compiled step (``mode``) called three times on the compiled twin of ``_pair()``."""
    me, oe, mc, oc = _pair()
    cf = tt.compile(step, **mode)
    x = torch.randn(8, 4)
    for _ in range(3):
        cf(mc, oc, x)
    return me, oe, mc, oc, cf, x


@pytest.mark.parametrize("mode", MODES)
def test_tensor_hook_added_later_is_refused_clearly(mode):
    """A gradient hook on a parameter, added after the first calls: the whole step would not run it."""
    me, oe, mc, oc, cf, x = _after_three_calls(mode)
    mc[0].weight.register_hook(lambda g: g * 0)
    before = [p.detach().clone() for p in mc.parameters()]
    with pytest.raises(TracingError, match="gradient hooks"):
        cf(mc, oc, x)
    assert all(torch.equal(a, b) for a, b in zip(before, mc.parameters()))


@pytest.mark.parametrize("mode", MODES)
def test_full_backward_hook_added_later_is_refused_clearly(mode):
    me, oe, mc, oc, cf, x = _after_three_calls(mode)
    mc[2].register_full_backward_hook(lambda mod, gi, go: None)
    with pytest.raises(TracingError, match="backward hooks"):
        cf(mc, oc, x)


@pytest.mark.parametrize("mode", MODES)
def test_optimizer_hook_added_later_is_refused_clearly(mode):
    me, oe, mc, oc, cf, x = _after_three_calls(mode)
    h = oc.register_step_post_hook(lambda opt, a, k: None)
    with pytest.raises(TracingError, match="step hooks"):
        cf(mc, oc, x)
    h.remove()
    for i in range(3):  # the eager twin catches up on the three steps; with the hook removed the step runs again
        step(me, oe, x)
    for i in range(2):
        _same(me, mc, step(me, oe, x), cf(mc, oc, x), i)


@pytest.mark.filterwarnings("ignore:forward hooks")
def test_revalidate_rereads_hooks_edited_directly():
    """A hook put straight into the dict (no handle): thin mode sees it after revalidate(), the full path at once."""
    me, oe, mc, oc = _pair()
    cf = tt.compile(step, thin=True)
    x = torch.randn(8, 4)
    for i in range(3):
        _same(me, mc, step(me, oe, x), cf(mc, oc, x), i)
    assert cf.is_thin_bound
    for m in (me, mc):
        m[0]._forward_hooks[10**9] = lambda mod, a, out: out + 1
    cf.revalidate()
    for i in range(3, 5):
        _same(me, mc, step(me, oe, x), cf(mc, oc, x), i)
    assert len(tt.compile_stats(cf).retrace_reasons) == 1


def test_forward_hook_side_effect_warns():
    """A hook with a Python side effect runs once per trace: said in a warning."""
    m = torch.nn.Linear(3, 3)
    log = []
    m.register_forward_hook(lambda mod, a, out: log.append(1))
    cf = tt.compile(m)
    with pytest.warns(UserWarning, match="once per trace"):
        cf(torch.randn(2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cf(torch.randn(2, 3))  # said once
