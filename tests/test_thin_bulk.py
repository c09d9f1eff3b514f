"""Thin mode's per-parameter checks (compiler/bulk.py): torch's C++ guards and the Python comparisons catch the same
changes, including ones that bypass the module epoch, and give eager's result (compiled vs eager)."""
import pytest
import torch
from torch import nn

import thunder_train as tt
from thunder_train.compiler import bulk
from _thin_twin import Twin, forced_checks

CHECKS = ["python", "c++"]


def _p(m, i):
    return list(m.parameters())[i]


def _set_data(i, make):
    def f(m, o):
        p = _p(m, i)
        p.data = make(p.data)
    return f


def _replace_in_group(i):
    def f(m, o):  # the optimizer now updates a parameter outside the model; its state moves with it
        params = o.param_groups[0]["params"]
        new = nn.Parameter(torch.ones_like(params[i]))
        o.state[new] = o.state.pop(params[i])
        params[i] = new
    return f


def _state_item(i, key, make):
    def f(m, o):
        d = o.state[_p(m, i)]
        d[key] = make(d[key])
    return f


BYPASSING = [
    # Same values, another memory layout: the program assumed the bound strides.
    pytest.param(_set_data(0, lambda t: t.t().contiguous().t()), id="p.data=transposed layout"),
    pytest.param(_set_data(0, lambda t: t + 1), id="p.data=new values same layout"),
    pytest.param(_set_data(1, lambda t: t.double()), id="p.data=float64 (eager raises)"),
    pytest.param(_replace_in_group(2), id="param_groups[0]['params'][i]=new"),
    pytest.param(lambda m, o: setattr(_p(m, 3), "grad", torch.full_like(_p(m, 3), 0.25)), id="p.grad=t"),
    pytest.param(lambda m, o: m(torch.ones(8, 4)).sum().backward(), id="eager backward"),
    pytest.param(lambda m, o: _p(m, 4).requires_grad_(False), id="requires_grad_(False)"),
    pytest.param(lambda m, o: setattr(_p(m, 5), "requires_grad", False), id="p.requires_grad=False"),
    # A one-element tensor with the same value: equal by ==, a different object.
    pytest.param(_state_item(0, "step", lambda t: t.clone()), id="state['step']=equal clone"),
    pytest.param(_state_item(2, "exp_avg", lambda t: t.clone()), id="state['exp_avg']=equal clone"),
    pytest.param(lambda m, o: o.state.__setitem__(_p(m, 1), dict(o.state[_p(m, 1)])), id="state[p]=equal copy"),
    pytest.param(lambda m, o: o.state[_p(m, 3)].pop("exp_avg_sq"), id="del state[p]['exp_avg_sq'] (eager raises)"),
    pytest.param(lambda m, o: o.state.pop(_p(m, 5)), id="state.pop(p)"),
]


@pytest.mark.parametrize("hazard", BYPASSING)
@pytest.mark.parametrize("checks", CHECKS)
def test_changes_between_thin_steps_match_eager(checks, hazard):
    with forced_checks(checks):
        t = Twin(thin=True)
        t.steps(3)
        assert t.compiled.is_thin_bound
        t.hazard(hazard)
        for _ in range(3):
            t.step()


def test_float64_data_is_seen_before_batchnorm_statistics_change():
    """With the C++ pass, ``p.data = t`` with another dtype is seen before the call runs, so BatchNorm's running
    statistics stay as they were (the Python path finds it only when the computation raises, after BatchNorm
    ran: docs/thin_mode.md)."""
    with forced_checks("c++"):
        t = Twin(thin=True)
        t.steps(3)
        t.hazard(_set_data(4, lambda d: d.double()))  # 3.weight, after the BatchNorm
        eager_err, compiled_err = t.step()  # Twin: both raise, the compiled call leaves every input unchanged
        assert eager_err is not None and compiled_err is not None


@pytest.mark.parametrize("checks", CHECKS)
def test_another_layout_revalidates(checks):
    """``p.data = t`` with the same values in another layout: the binding assumed the bound strides."""
    with forced_checks(checks):
        t = Twin(thin=True)
        t.steps(3)
        before = len(tt.compile_stats(t.compiled).thin_invalidations)
        t.hazard(_set_data(0, lambda d: d.t().contiguous().t()))
        t.step()
        assert len(tt.compile_stats(t.compiled).thin_invalidations) == before + 1


def deep(n_linear=35, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n_linear - 1)], nn.Linear(4, 3))


def _thin_source(cf):
    return tt.last_prologue_traces(cf)[-1].source


@pytest.mark.parametrize("checks", CHECKS)
def test_thin_call_uses_the_chosen_checks(checks):
    with forced_checks(checks):
        t = Twin(thin=True)
        t.steps(3)
    src = _thin_source(t.compiled)
    assert ("_meta_check(" in src and "_dict_version" in src) == (checks == "c++")
    assert ("_list(map(_stride" in src and "_list(map(_rg" in src) == (checks == "python")
    assert "_list(map(_grad" in src


@pytest.mark.parametrize("hazard", [BYPASSING[0], BYPASSING[4], BYPASSING[6], BYPASSING[8], BYPASSING[10]])
def test_large_model_default_checks_match_eager(hazard):
    t = Twin(make_model=deep, thin=True)
    t.steps(3)
    assert t.compiled.is_thin_bound
    t.hazard(hazard)
    for _ in range(2):
        t.step()


def test_self_test_finds_each_kind():
    g = pytest.importorskip("torch._C._dynamo.guards")
    if not (hasattr(g, "TensorGuards") and hasattr(g, "dict_version")):
        pytest.skip("this torch has no TensorGuards/dict_version")
    assert bulk.supported() == {"meta", "dict"}


def test_tensor_meta_check_catches_each_change():
    if "meta" not in bulk.supported():
        pytest.skip("this torch has no usable TensorGuards")
    ps = [nn.Parameter(torch.randn(3, 2)) for _ in range(4)]
    check = bulk.tensor_meta_check(ps)
    assert check(*ps) and check(*ps)
    ps[2].requires_grad_(False)
    assert not check(*ps)
    ps[2].requires_grad_(True)
    old = ps[3].data
    for other in (torch.zeros(2, 3).t(), torch.zeros(3, 2, dtype=torch.float64), torch.zeros(6)):
        ps[3].data = other
        assert not check(*ps)
    ps[3].data = old
    assert check(*ps)


def test_dict_version_changes_on_every_modification():
    if "dict" not in bulk.supported():
        pytest.skip("dict versions are not available here")
    version = bulk.dict_version()
    t = torch.tensor(1.0)
    d = {"step": t, "exp_avg": torch.zeros(3)}
    v = version(d)
    d["step"] = t  # the value it holds
    assert version(d) == v
    d["step"] = torch.tensor(1.0)  # an equal value, another object
    assert version(d) != v
