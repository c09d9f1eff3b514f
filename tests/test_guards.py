"""Full-path prologue: extraction + guard key, O(1) lookup, retrace reasons, global state."""
import math

import pytest
import torch
from torch import nn

import thunder_train as tt


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def f(model, x, d, s=2.0):
    return model(x) * s + d["a"].sum()


def test_full_path_matches_eager_and_hits_cache():
    m = _mlp()
    cf = tt.compile(f)
    for _ in range(3):
        x, d = torch.randn(5, 4), {"a": torch.randn(3)}
        torch.testing.assert_close(cf(m, x, d), f(m, x, d))
    st = tt.compile_stats(cf)
    assert (st.calls, st.cache_misses, st.cache_hits, st.validations, st.thin_calls) == (3, 1, 2, 3, 0)
    assert not cf.is_thin_bound


def test_prologue_is_extraction_plus_checks_as_generated_code():
    m = _mlp()
    cf = tt.compile(f)
    cf(m, torch.randn(5, 4), {"a": torch.randn(3)})
    extract, guard_key = tt.last_prologue_traces(cf)
    src = str(extract)
    assert "def extract(*args, **kwargs):" in src
    assert "model_0_weight = model_0._parameters['weight']" in src
    gsrc = str(guard_key)
    assert "def guard_key(" in gsrc and "x.shape,  # args[1]: shape" in gsrc
    # Both are real functions compiled from that source.
    vals = extract.python_callable()(m, torch.randn(5, 4), {"a": torch.randn(3)})
    # ... d['a'] (shape, strides, dtype, device, requires_grad), then the default s=2.0 the call used (type, value),
    # then ``f`` as its module gives it (a module-level function that ran torch ops: acquisition/called_functions.py).
    assert guard_key.python_callable()(*vals)[-8:] == (torch.Size([3]), (1,), torch.float32, torch.device("cpu"), False,
                                                       float, 2.0, f)
    assert "defaults['s']: value" in gsrc and f"{__name__}: function f" in gsrc


def test_retrace_reason_names_input_and_change():
    m = _mlp()
    cf = tt.compile(f)
    d = {"a": torch.randn(3)}
    cf(m, torch.randn(5, 4), d)
    x = torch.randn(2, 4)
    torch.testing.assert_close(cf(m, x, d), f(m, x, d))
    assert tt.compile_stats(cf).retrace_reasons == ["args[1].shape: (5, 4) → (2, 4); symbolic from now on: args[1] (x) dim 0"]
    cf(m, x, {"a": torch.randn(3, dtype=torch.float64)})
    assert tt.compile_stats(cf).retrace_reasons[-1] == "args[2]['a'].dtype: float32 → float64"
    cf(m, x, d, 3.0)
    assert tt.compile_stats(cf).retrace_reasons[-1] == "number of positional arguments: 3 → 4"
    cf(m, x, d, 4.0)
    assert tt.compile_stats(cf).retrace_reasons[-1] == "args[3].value: 3.0 → 4.0"


def test_retrace_reason_inside_module():
    m = _mlp()
    cf = tt.compile(f)
    x, d = torch.randn(5, 4), {"a": torch.randn(3)}
    cf(m, x, d)
    m[2].weight.requires_grad_(False)
    torch.testing.assert_close(cf(m, x, d), f(m, x, d))
    assert tt.compile_stats(cf).retrace_reasons[-1] == "args[0].2.weight.requires_grad: True → False"
    m.eval()
    cf(m, x, d)
    assert tt.compile_stats(cf).retrace_reasons[-1].startswith("args[0].training: True → False")


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = 1.0

    def forward(self, x):
        return self.lin(x) * self.scale


def test_module_scalar_attribute_is_guarded():
    m = Scaled()
    cf = tt.compile(lambda mod, x: mod(x))
    x = torch.randn(2, 4)
    torch.testing.assert_close(cf(m, x), m(x))
    m.scale = 3.0
    torch.testing.assert_close(cf(m, x), m(x))
    assert tt.compile_stats(cf).retrace_reasons == ["args[0].scale.value: 1.0 → 3.0"]


def test_lookup_runs_one_prologue_however_many_entries():
    m = Scaled()
    cf = tt.compile(lambda mod, x: mod(x))
    x = torch.randn(2, 4)
    for s in range(8):
        m.scale = float(s)
        cf(m, x)
    assert tt.compile_stats(cf).entries == 8
    [probes] = cf._cache.values()
    assert len(probes) == 1 and len(probes[0].entries) == 8  # one shared prologue for all entries
    pro = probes[0].prologue
    calls = []
    orig = pro.extract.fn
    pro.extract.fn = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        m.scale = 0.0  # the oldest entry
        torch.testing.assert_close(cf(m, x), m(x))
    finally:
        pro.extract.fn = orig
    assert len(calls) == 1
    assert tt.compile_stats(cf).entries == 8


def test_global_state_is_part_of_the_key():
    m = _mlp()
    cf = tt.compile(f)
    x, d = torch.randn(5, 4), {"a": torch.randn(3)}
    out = cf(m, x, d)
    assert out.requires_grad
    with torch.no_grad():
        out2 = cf(m, x, d)
    assert not out2.requires_grad
    torch.testing.assert_close(out2, out.detach())
    assert tt.compile_stats(cf).retrace_reasons == ["torch.grad_enabled: True → False"]
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        cf(m, x, d)
    finally:
        torch.set_default_dtype(old)
    assert tt.compile_stats(cf).retrace_reasons[-1] == "torch.default_dtype: float32 → float64"


def test_nan_constant_hits_cache_and_kwargs():
    def g(x, *, s):
        return x * 2 if math.isnan(s) else x * s

    cf = tt.compile(g)
    x = torch.randn(3)
    cf(x, s=float("nan"))
    torch.testing.assert_close(cf(x, s=float("nan")), x * 2)
    torch.testing.assert_close(cf(x, s=3.0), x * 3)
    assert tt.compile_stats(cf).cache_misses == 2
    assert tt.compile_stats(cf).retrace_reasons == ["kwargs['s'].value: 'nan' → 3.0"]


def test_int_and_bool_constants_are_distinct():
    cf = tt.compile(lambda x, k: x * k)
    x = torch.randn(3)
    torch.testing.assert_close(cf(x, 1), x * 1)
    out = cf(x, True)
    torch.testing.assert_close(out, x * True)
    assert tt.compile_stats(cf).cache_misses == 2


def test_structure_change_in_module_retraces():
    m = _mlp()
    cf = tt.compile(f)
    x, d = torch.randn(5, 4), {"a": torch.randn(3)}
    cf(m, x, d)
    m[0].register_buffer("extra", torch.zeros(1))
    torch.testing.assert_close(cf(m, x, d), f(m, x, d))
    assert "args[0].0.structure" in tt.compile_stats(cf).retrace_reasons[-1]


def test_aliased_inputs_are_guarded():
    cf = tt.compile(lambda a, b: a + b * 2)
    x, y = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(cf(x, x), x + x * 2)
    torch.testing.assert_close(cf(x, y), x + y * 2)
    assert tt.compile_stats(cf).cache_misses == 2
    assert "no longer the same tensor" in tt.compile_stats(cf).retrace_reasons[-1]


def test_check_every_requires_thin():
    with pytest.raises(ValueError, match="thin"):
        tt.compile(f, check_every=3)
    with pytest.raises(ValueError, match="positive"):
        tt.compile(f, thin=True, check_every=0)
