"""Thin mode: bind the steady state, run a batch it does not accept through the full path, detect or revalidate changes."""
import pytest
import torch
from torch import nn

import thunder_train as tt
from _thin_twin import forced_checks


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def test_training_loop_matches_eager():
    m_ref, m = _mlp(), _mlp()
    opt_ref = torch.optim.SGD(m_ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    step = tt.compile(loss_fn, thin=True)
    torch.manual_seed(1)
    for _ in range(6):
        x, y = torch.randn(5, 4), torch.randn(5, 2)
        for mod, o, fn in ((m_ref, opt_ref, loss_fn), (m, opt, step)):
            o.zero_grad()
            loss = fn(mod, x, y)
            loss.backward()
            o.step()
        torch.testing.assert_close(loss, loss_fn(m_ref, x, y).new_tensor(0) + loss.detach(), msg="")
    for p_ref, p in zip(m_ref.parameters(), m.parameters()):
        torch.testing.assert_close(p, p_ref)
    st = tt.compile_stats(step)
    assert st.calls == 6 and st.full_calls == 2 and st.thin_calls == 4 and st.thin_binds == 1
    assert st.cache_misses == 1 and st.validations == 2
    assert "def thin_call(*args, **kwargs):" in str(tt.last_prologue_traces(step)[-1])


def test_thin_call_result_equals_eager_each_step():
    m = _mlp()
    step = tt.compile(loss_fn, thin=True)
    for i in range(5):
        x, y = torch.randn(3, 4), torch.randn(3, 2)
        torch.testing.assert_close(step(m, x, y), loss_fn(m, x, y))
    assert step.is_thin_bound


class WarmStart(nn.Module):
    """Lazily created state: call 1 runs a different program from the steady state."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.started = False

    def forward(self, x):
        if not self.started:
            self.started = True
            return self.lin(x) * 0.5
        return self.lin(x)


def test_binds_the_steady_state_not_the_first_program():
    m_ref, m = WarmStart(), WarmStart()
    m.load_state_dict(m_ref.state_dict())
    step = tt.compile(lambda mod, x: mod(x), thin=True)
    for i in range(5):
        x = torch.randn(2, 4)
        torch.testing.assert_close(step(m, x), m_ref(x))
        # Call 1 compiles A, call 2 sees started=True and compiles B, call 3 validates B again: bind.
        assert step.is_thin_bound == (i >= 2)
    st = tt.compile_stats(step)
    assert st.cache_misses == 2 and st.retrace_reasons == ["args[0].started.value: False → True"]
    assert st.thin_calls == 2


@pytest.fixture
def bound():
    m = _mlp()
    step = tt.compile(loss_fn, thin=True)
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    step(m, x, y)
    step(m, x, y)
    assert step.is_thin_bound
    return m, step, x, y


def _same_as_eager(step, fn, *args):
    """The compiled call gives eager's result, or raises the exception type eager raises (never a ThinModeError
    where eager runs: issue 26)."""
    try:
        expected = fn(*args)
    except Exception:  # noqa: BLE001
        with pytest.raises(Exception) as err:  # the full path's own error (a PrimError where eager's RuntimeError)
            step(*args)
        assert not isinstance(err.value, tt.ThinModeError)
        return
    torch.testing.assert_close(step(*args), expected)


def test_new_batch_shape_runs_the_full_path_and_binds_it(bound):
    m, step, x, y = bound
    st = tt.compile_stats(step)
    x3, y3 = torch.randn(3, 4), torch.randn(3, 2)
    for _ in range(3):
        torch.testing.assert_close(step(m, x3, y3), loss_fn(m, x3, y3))
    # The first 3-row call fell back to the full path, which made the batch size symbolic; the second bound it.
    assert st.thin_fallbacks == 1 and st.cache_misses == 2 and step.is_thin_bound and st.thin_calls == 1
    assert st.retrace_reasons[-1].endswith("symbolic from now on: args[1] (x) dim 0, args[2] (y) dim 0")
    torch.testing.assert_close(step(m, x, y), loss_fn(m, x, y))  # 5 rows: the symbolic program, thin
    assert st.thin_calls == 2 and st.cache_misses == 2


def test_wrong_batch_dtype_device_type_or_count_behaves_as_eager(bound):
    m, step, x, y = bound
    for args in ((m, x, y.double()), (m, x.to("meta"), y), (m, [1.0], y), (m, x)):
        _same_as_eager(step, loss_fn, *args)
    # After those calls thin mode still works with proper inputs, with the binding it had.
    binds = tt.compile_stats(step).thin_binds
    torch.testing.assert_close(step(m, x, y), loss_fn(m, x, y))
    torch.testing.assert_close(step(m, x, y), loss_fn(m, x, y))
    assert step.is_thin_bound and tt.compile_stats(step).thin_binds == binds


def test_new_constant_and_container_run_the_full_path():
    def g(model, batch, scale):
        return model(batch["x"]).sum() * scale

    m = _mlp()
    step = tt.compile(g, thin=True)
    b = {"x": torch.randn(2, 4)}
    step(m, b, 2.0)
    step(m, b, 2.0)
    b2 = {"x": torch.randn(2, 4)}
    torch.testing.assert_close(step(m, b2, 2.0), g(m, b2, 2.0))
    assert tt.compile_stats(step).thin_calls == 1
    for args in ((m, b, 3.0), (m, {"x": torch.randn(7, 4)}, 2.0), (m, {"y": torch.randn(2, 4)}, 2.0)):
        _same_as_eager(step, g, *args)
    assert tt.compile_stats(step).thin_fallbacks == 1  # one call left the binding; the others found no binding


def test_a_python_flag_switches_between_bound_programs():
    # Gradient accumulation: a do_step bool argument. One bound program per value, switched by the per-call check.
    def acc_step(model, opt, x, y, do_step):
        loss_fn(model, x, y).backward()
        if do_step:
            opt.step()
            opt.zero_grad(set_to_none=False)

    m_ref, m = _mlp(), _mlp()
    for p in list(m_ref.parameters()) + list(m.parameters()):
        p.grad = torch.zeros_like(p)
    o_ref, o = torch.optim.SGD(m_ref.parameters(), lr=0.1), torch.optim.SGD(m.parameters(), lr=0.1)
    step = tt.compile(acc_step, thin=True)
    g = torch.Generator().manual_seed(0)
    for i in range(12):
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
        acc_step(m_ref, o_ref, x, y, i % 3 == 2)
        step(m, o, x, y, i % 3 == 2)
    for p_ref, p in zip(m_ref.parameters(), m.parameters()):
        torch.testing.assert_close(p, p_ref)
        torch.testing.assert_close(p.grad, p_ref.grad)
    st = tt.compile_stats(step)
    assert st.cache_misses == 2 and st.thin_binds == 2 and not st.thin_invalidations
    # Calls 0, 1 (bind False), 2 (True: seen), 5 (True: bind) and 3 (back to False: switch) ran the full path.
    assert st.full_calls == 5 and st.thin_calls == 7


def test_revalidate_accepts_new_inputs(bound):
    m, step, x, y = bound
    x2, y2 = torch.randn(3, 4), torch.randn(3, 2)
    step.revalidate()
    assert not step.is_thin_bound
    torch.testing.assert_close(step(m, x2, y2), loss_fn(m, x2, y2))
    torch.testing.assert_close(step(m, x2, y2), loss_fn(m, x2, y2))
    assert step.is_thin_bound
    st = tt.compile_stats(step)
    assert st.thin_invalidations == ["revalidate()"] and st.retrace_reasons == [
        "args[1].shape: (5, 4) → (3, 4); args[2].shape: (5, 2) → (3, 2); symbolic from now on: args[1] (x) dim 0, args[2] (y) dim 0"]


def test_replacing_a_parameter_is_detected(bound):
    m, step, x, y = bound
    m[0].weight = nn.Parameter(torch.randn(8, 4))
    torch.testing.assert_close(step(m, x, y), loss_fn(m, x, y))
    st = tt.compile_stats(step)
    assert st.thin_invalidations == ["a bound module changed: Linear.weight was registered or replaced"]
    step(m, x, y)
    assert step.is_thin_bound
    torch.testing.assert_close(step(m, x, y), loss_fn(m, x, y))


def test_load_state_dict_in_place_and_assign(bound):
    m, step, x, y = bound
    other = _mlp(seed=5)
    m.load_state_dict(other.state_dict())  # copies into the bound tensors: binding stays valid
    assert step.is_thin_bound
    torch.testing.assert_close(step(m, x, y), loss_fn(other, x, y))
    assert step.is_thin_bound and tt.compile_stats(step).thin_invalidations == []
    third = _mlp(seed=7)
    m.load_state_dict(third.state_dict(), assign=True)  # new tensor objects: detected
    torch.testing.assert_close(step(m, x, y), loss_fn(third, x, y))
    assert tt.compile_stats(step).thin_invalidations


@pytest.mark.parametrize("checks", ["python", "c++"])
def test_model_to_dtype_revalidates_and_data_assignment_is_named(checks):
    with forced_checks(checks):
        _model_to_dtype_and_data_assignment(checks)


def _model_to_dtype_and_data_assignment(checks):
    m = _mlp()
    step = tt.compile(loss_fn, thin=True, check_every=3)
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    step(m, x, y)
    step(m, x, y)  # validated twice: bound; the full prologue runs again on the 3rd thin call
    validations = tt.compile_stats(step).validations
    for _ in range(3):
        torch.testing.assert_close(step(m, x, y), loss_fn(m, x, y))
    assert tt.compile_stats(step).validations == validations + 1 and step.is_thin_bound
    m.double()  # Module._apply: the epoch tells, the next call validates again and retraces for float64
    xd, yd = x.double(), y.double()
    for _ in range(3):
        torch.testing.assert_close(step(m, xd, yd), loss_fn(m, xd, yd))
    assert "args[0].0.weight.dtype: float32 → float64" in tt.compile_stats(step).thin_invalidations[-1]
    assert step.is_thin_bound
    for p in m.parameters():
        p.data = p.data.float()
    if checks == "python":
        # p.data = ... bypasses every hook: the computation's own error is diagnosed by the full prologue.
        with pytest.raises(tt.ThinModeError, match=r"thin mode: args\[0\] \(model\).0.weight.dtype: float64 → float32;.* since thin mode bound") as err:
            step(m, xd, yd)
        assert not step.is_thin_bound and "revalidate()" in str(err.value)
    else:
        # The C++ metadata check sees the new dtype before the call: the full path runs and raises what it raises
        # for these inputs (eager raises too: float32 weights, float64 batch).
        with pytest.raises(Exception) as full_err:
            tt.compile(loss_fn)(m, xd, yd)
        with pytest.raises(type(full_err.value)):
            step(m, xd, yd)
        with pytest.raises(RuntimeError):
            loss_fn(m, xd, yd)
        assert not step.is_thin_bound and "0.weight.dtype: float64 → float32" in tt.compile_stats(step).thin_invalidations[-1]
    m.double()
    for _ in range(3):  # the next calls validate again and bind again
        torch.testing.assert_close(step(m, xd, yd), loss_fn(m, xd, yd))
    assert step.is_thin_bound


def test_revalidate_after_model_to(bound):
    m, step, x, y = bound
    m.to(torch.float64)
    step.revalidate()
    xd, yd = x.double(), y.double()
    for _ in range(3):
        out = step(m, xd, yd)
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, loss_fn(m, xd, yd))
    assert tt.compile_stats(step).retrace_reasons == ["args[1].dtype: float32 → float64; args[2].dtype: float32 → float64"]


def test_unregistered_replacement_caught_by_check_every():
    m = _mlp()
    step = tt.compile(loss_fn, thin=True, check_every=2)
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    for _ in range(3):
        step(m, x, y)
    m[0]._parameters["weight"] = nn.Parameter(torch.randn(8, 4))  # bypasses registration hooks
    with pytest.raises(tt.ThinModeError, match=r"args\[0\].0.weight is a different tensor object"):
        step(m, x, y)
        step(m, x, y)
    torch.testing.assert_close(step(m, x, y), loss_fn(m, x, y))  # the full path runs again


def test_check_every_names_global_state():
    m = _mlp()
    step = tt.compile(loss_fn, thin=True, check_every=1)
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    step(m, x, y)
    step(m, x, y)
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        with pytest.raises(tt.ThinModeError, match="torch.default_dtype changed torch.float32 → torch.float64"):
            step(m, x, y)
    finally:
        torch.set_default_dtype(old)


class TrainEval(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * (2.0 if self.training else 1.0)


def test_train_eval_and_grad_mode_are_detected():
    m = TrainEval()
    step = tt.compile(lambda mod, x: mod(x), thin=True)
    x = torch.randn(2, 4)
    step(m, x)
    step(m, x)
    m.eval()
    torch.testing.assert_close(step(m, x), m(x))
    with torch.no_grad():
        out = step(m, x)
        assert not out.requires_grad
        torch.testing.assert_close(out, m(x))
    m.train()
    torch.testing.assert_close(step(m, x), m(x))
    assert tt.compile_stats(step).thin_invalidations[0] == "args[0].training: True → False; args[0].lin.training: True → False"


def test_different_model_object_is_detected():
    a, b = _mlp(1), _mlp(2)
    step = tt.compile(loss_fn, thin=True)
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    step(a, x, y)
    step(a, x, y)
    torch.testing.assert_close(step(b, x, y), loss_fn(b, x, y))
    torch.testing.assert_close(step(a, x, y), loss_fn(a, x, y))


def test_static_tensor_replaced_every_step_is_read_per_call():
    class WithBuf(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", torch.zeros(4))

        def forward(self, x):
            return x + self.b

    m = WithBuf()
    step = tt.compile(lambda mod, x: mod(x), thin=True)
    x = torch.randn(4)
    for i in range(5):
        m._buffers["b"] = torch.full((4,), float(i))  # a new object each step, not via registration
        torch.testing.assert_close(step(m, x), x + i)
    assert step.is_thin_bound
    assert "_buffers['b']" in str(tt.last_prologue_traces(step)[-1])


def test_thunder_module_thin():
    m = _mlp()
    tm = tt.compile(m, thin=True)
    for _ in range(4):
        x = torch.randn(3, 4)
        torch.testing.assert_close(tm(x), m(x))
    assert tt.compile_stats(tm).thin_calls == 2
    tm.revalidate()
    assert tt.compile_stats(tm).thin_invalidations == ["revalidate()"]
