"""Thin mode and storage changed between steps (docs/thin_mode.md, "parameters and optimizer state updated in place").

The bound program updates parameters and optimizer state in place from their old values; two of them made one
storage between calls (``q.data = p.data``, ``p.set_(q)``, an optimizer-state tensor given another's storage)
would make the functionalized update silently differ from eager.  Thin mode compares the bound updated tensors'
data pointers every call: a new storage takes the full path, which refuses aliased updates with
``NotImplementedError`` and rebinds when the new storage is the tensor's own.
"""
from __future__ import annotations

import pytest
import torch

import thunder_train as tt
from _thin_twin import Twin, forced_checks


@pytest.fixture(params=["c++", "python"])
def checks(request):
    with forced_checks(request.param):
        yield


def _thin_twin():
    t = Twin(thin=True)
    t.steps(5)
    assert tt.compile_stats(t.compiled).thin_calls >= 1
    return t


def _refused(t):
    e, c = t.step(expect_thin_error=True)
    assert e is None and isinstance(c, NotImplementedError) and "shares its storage" in str(c), (e, c)


def _trains_like_eager_and_binds_again(t, n=4):
    thin_before = tt.compile_stats(t.compiled).thin_calls
    t.steps(n)
    assert tt.compile_stats(t.compiled).thin_calls > thin_before  # bound again after re-validating


def test_parameter_given_another_parameters_storage_is_refused(checks):
    t = _thin_twin()
    t.hazard(lambda m, opt: setattr(m[2].weight, "data", m[0].bias.data))  # both shape (6,)
    _refused(t)


def test_parameter_set_to_another_is_refused(checks):
    t = _thin_twin()

    def hazard(m, opt):
        with torch.no_grad():
            m[2].weight.set_(m[0].bias)

    t.hazard(hazard)
    _refused(t)


def test_optimizer_state_made_to_share_storage_is_refused(checks):
    t = _thin_twin()

    def hazard(m, opt):
        a, b = opt.state[m[2].weight], opt.state[m[0].bias]
        a["exp_avg"].set_(b["exp_avg"])  # the dicts keep their tensors: only the storage changed

    t.hazard(hazard)
    _refused(t)


def test_optimizer_state_replaced_by_another_parameters_tensor_trains_like_eager(checks):
    """The same tensor object in two state dicts is one input of the retraced program (updated twice, as in eager)."""
    t = _thin_twin()

    def hazard(m, opt):
        opt.state[m[2].weight]["exp_avg_sq"] = opt.state[m[0].bias]["exp_avg_sq"]

    t.hazard(hazard)
    t.steps(4)


def test_optimizer_state_replaced_by_a_view_of_another_is_refused(checks):
    t = _thin_twin()

    def hazard(m, opt):
        opt.state[m[2].weight]["exp_avg_sq"] = opt.state[m[0].bias]["exp_avg_sq"][:]

    t.hazard(hazard)
    _refused(t)


def test_parameter_given_a_new_storage_trains_like_eager(checks):
    t = _thin_twin()
    g = torch.Generator().manual_seed(5)
    new = torch.randn(6, 4, generator=g)
    t.hazard(lambda m, opt: setattr(m[0].weight, "data", new.clone()))
    _trains_like_eager_and_binds_again(t)


def test_parameter_set_to_a_fresh_tensor_trains_like_eager(checks):
    t = _thin_twin()
    new = torch.randn(3, 6, generator=torch.Generator().manual_seed(6))

    def hazard(m, opt):
        with torch.no_grad():
            m[3].weight.set_(new.clone())

    t.hazard(hazard)
    _trains_like_eager_and_binds_again(t)


def test_vector_to_parameters_trains_like_eager(checks):
    """``vector_to_parameters`` makes every parameter a slice of one new vector (``p.data = vec[i:j]``): one
    storage, disjoint bytes, so the updates are independent (compiler/memory_overlap.py) and the step is eager's."""
    t = _thin_twin()
    vec = torch.nn.utils.parameters_to_vector(t.model.parameters()).detach() * 0.5
    t.hazard(lambda m, opt: torch.nn.utils.vector_to_parameters(vec.clone(), m.parameters()))
    _trains_like_eager_and_binds_again(t)


def test_model_load_state_dict_copies_and_stays_thin(checks):
    t = _thin_twin()
    other = Twin(thin=False)
    other.eager_model.apply(lambda mod: mod.reset_parameters() if hasattr(mod, "reset_parameters") else None)
    sd = {k: v.clone() for k, v in other.eager_model.state_dict().items()}
    t.hazard(lambda m, opt: m.load_state_dict(sd))
    thin_before = tt.compile_stats(t.compiled).thin_calls
    t.steps(3)
    assert tt.compile_stats(t.compiled).thin_calls == thin_before + 3  # copies in place: the binding holds


def test_aliased_update_is_caught_before_anything_is_written(checks):
    """The refusal leaves every input as it was (Twin.step compares), and the next call after undoing it is thin."""
    t = _thin_twin()
    saved = {}

    def alias(m, opt):
        saved[id(m)] = m[2].weight.data
        m[2].weight.data = m[0].bias.data

    t.hazard(alias)
    _refused(t)
    t.hazard(lambda m, opt: setattr(m[2].weight, "data", saved[id(m)]))
    _trains_like_eager_and_binds_again(t)


def test_disjoint_slices_of_one_storage_updated_in_place_match_eager():
    def fn(a, b):
        a.add_(1)
        b.mul_(a.sum())
        return b.sum()

    v = torch.arange(10.0)
    w = v.clone()
    out = tt.compile(fn)(v[:5], v[5:])
    torch.testing.assert_close(out, fn(w[:5], w[5:]))
    torch.testing.assert_close(v, w)
    with pytest.raises(NotImplementedError, match="shares its storage"):
        tt.compile(fn)(v[:6], v[5:])  # one shared element
