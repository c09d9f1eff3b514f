"""``fusion="nvfuser"`` and ``fusion="auto"``.

* Everywhere: without a usable nvFuser the note says why and the torch executor gives eager's values.
* The translation table (which ``nvfuser_direct`` calls a region issues) is checked against
  ``RecordingDefinition``, a stand-in that only records calls.  This tests our lowering, NOT nvFuser:
  nothing here executes a fusion.
* Where ``nvfuser_direct`` imports and a CUDA device is present, fused regions run and match eager.
"""
from __future__ import annotations

import types

import pytest
import torch

import thunder_train as tt
from thunder_train.compiler.executors import nvfuser_fusion as nf

NVF, WHY_NOT = nf.availability()
needs_nvfuser = pytest.mark.skipif(NVF is None, reason=f"nvFuser cannot run here: {WHY_NOT}")


def f_update(w, g):
    w.copy_(w - 0.1 * (g.tanh() * 2))
    return g.exp()


def f_reduce(w, x):
    y = w * 0.9 + x.sin()
    w.copy_(y.cos() * 2)
    return (y * x).sum(1, keepdim=True)


def f_broadcast(x, b):
    return ((x + b).relu() * 3).sigmoid()


# ---------------------------------------------------------------------------
# Everywhere
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("fusion", ["nvfuser", "auto"])
def test_without_nvfuser_on_cpu_values_are_eagers_and_notes_say_why(fusion):
    w, g = torch.randn(4, 4), torch.randn(4, 4)
    w2 = w.clone()
    cf = tt.compile(f_update, fusion=fusion)
    torch.testing.assert_close(cf(w, g), f_update(w2, g))
    torch.testing.assert_close(w, w2)
    notes = tt.compile_stats(cf).fusion_notes
    if fusion == "nvfuser":
        assert len(notes) == 1 and "nvFuser not used" in notes[0] and "not on a CUDA device" in notes[0], notes
        if NVF is None:
            assert WHY_NOT in notes[0]
    else:  # auto on CPU: Inductor
        assert any(n.startswith("inductor_fusion") for n in notes), notes


def test_availability_reason_is_one_line():
    if NVF is None:
        assert WHY_NOT and "\n" not in WHY_NOT
        assert any(k in WHY_NOT for k in ("not installed", "built for", "failed to import", "no CUDA device"))


def test_fusion_option_is_checked():
    with pytest.raises(ValueError, match="'inductor', 'nvfuser', 'auto'"):
        tt.compile(f_update, fusion="nvFuser")


# ---------------------------------------------------------------------------
# The translation table, against a recording stand-in of FusionDefinition
# ---------------------------------------------------------------------------
class _Val:
    def __init__(self, n):
        self.n = n

    def __repr__(self):
        return f"v{self.n}"


class RecordingDefinition:
    """Records the calls ``define_region`` issues; every call returns a fresh placeholder value."""

    def __init__(self):
        self.calls, self._n = [], 0
        outer = self

        class _Ops:
            def __getattr__(self, name):
                def op(*args, **kwargs):
                    return outer._record(name, args, kwargs)
                return op

        self.ops = _Ops()

    def _record(self, name, args, kwargs):
        self._n += 1
        v = _Val(self._n)
        self.calls.append((name, args, kwargs, v))
        return v

    def define_tensor(self, **kwargs):
        return self._record("define_tensor", (), kwargs)

    def add_output(self, v, alias_input=None):
        self.calls.append(("add_output", (v,), {"alias_input": alias_input}, None))

    def names(self):
        return [c[0] for c in self.calls]


DataType = types.SimpleNamespace(**{n: n for n in ("Float", "Double", "Half", "BFloat16", "Int", "Int32", "Bool")})


def lowered_trace(fn, *args):
    """The trace after lowering to the torch executor (what the fusion pass sees), traced on CPU tensors."""
    cf = tt.compile(fn)
    cf(*args)
    return [t for t in tt.last_traces(cf) if t.header.startswith("Lowered to executors")][-1]


def test_write_back_lowers_to_set_and_aliased_output():
    trc = lowered_trace(f_update, torch.randn(4, 4), torch.randn(4, 4))
    (region,) = nf.plan_regions(trc, "cpu")
    assert len(region.compute) == 5 and len(region.writes) == 1
    fd = RecordingDefinition()
    plan = nf.define_region(fd, region, DataType)
    assert [n for n in fd.names() if n != "cast"] == ["define_tensor", "define_tensor", "tanh", "mul", "mul", "sub", "exp",
                                                      "set", "add_output", "add_output"]
    defs = {p.name: c[3] for p, c in zip(region.inputs, [c for c in fd.calls if c[0] == "define_tensor"])}
    by_name = {c[0]: c for c in fd.calls}
    # sub(w, ...) is the new value of w; set() of it is an output aliased to w's definition (not returned) ...
    sub = by_name["sub"]
    assert sub[1][0] is defs["w"]
    (aliased,) = [c for c in fd.calls if c[0] == "add_output" and c[2]["alias_input"] is not None]
    assert aliased[2]["alias_input"] is defs["w"]
    assert aliased[1][0] is by_name["set"][3]
    cast_of_sub = next(c for c in fd.calls if c[0] == "cast" and c[1][0] is sub[3])
    assert by_name["set"][1][0] is cast_of_sub[3]
    # ... and exp(g) is the one returned output.
    (returned,) = [c for c in fd.calls if c[0] == "add_output" and c[2]["alias_input"] is None]
    assert next(c for c in fd.calls if c[0] == "cast" and c[1][0] is by_name["exp"][3])[3] is returned[1][0]
    assert plan == [("fd", 0)]
    # Every op result is cast to eager's dtype; tensors are defined with their sizes, strides and dtype.
    assert [c[2] for c in fd.calls if c[0] == "cast"] == [{"dtype": "Float"}] * 5
    assert all(c[2] == {"sizes": [4, 4], "strides": [4, 1], "dtype": "Float", "static_sizes": True}
               for c in fd.calls if c[0] == "define_tensor")


def test_no_write_back_into_a_region_with_a_reduction():
    trc = lowered_trace(f_reduce, torch.randn(4, 4), torch.randn(4, 4))
    regions = nf.plan_regions(trc, "cpu")
    assert regions and all(not r.writes for r in regions)
    fd = RecordingDefinition()
    nf.define_region(fd, regions[0], DataType)
    sums = [c for c in fd.calls if c[0] == "sum"]
    assert len(sums) == 1 and sums[0][1][1:] == ([1], True), sums


def test_broadcast_operands_are_broadcast_in_dim():
    trc = lowered_trace(f_broadcast, torch.randn(3, 5), torch.randn(5))
    (region,) = nf.plan_regions(trc, "cpu")
    fd = RecordingDefinition()
    nf.define_region(fd, region, DataType)
    (bc,) = [c for c in fd.calls if c[0] == "broadcast_in_dim"]
    assert bc[2] == {"shape": [3, 5], "broadcast_dims": [1]}
    assert [n for n in fd.names() if n not in ("define_tensor", "cast", "broadcast_in_dim")] == ["add", "relu", "mul", "sigmoid", "add_output"]


def test_low_precision_results_round_like_eager():
    trc = lowered_trace(f_broadcast, torch.randn(3, 5, dtype=torch.bfloat16), torch.randn(5, dtype=torch.bfloat16))
    (region,) = nf.plan_regions(trc, "cpu")
    fd = RecordingDefinition()
    nf.define_region(fd, region, DataType)
    casts = [c for c in fd.calls if c[0] == "cast"]
    assert len(casts) == 4 and all(c[2] == {"dtype": "BFloat16"} for c in casts)


def test_translation_table_names():
    """torch's true division is nvFuser's truediv (its div truncates integers); amax is max over the dims."""
    def h(x, y):
        a = torch.where(x / y > 0.5, -x, torch.sigmoid(y))
        return torch.amax(a, 1), (a * 2).to(torch.float64)

    trc = lowered_trace(h, torch.rand(4, 4) + 0.5, torch.rand(4, 4) + 0.5)
    (region,) = nf.plan_regions(trc, "cpu")
    fd = RecordingDefinition()
    nf.define_region(fd, region, DataType)
    assert [n for n in fd.names() if n not in ("define_tensor", "cast", "add_output")] == [
        "truediv", "gt", "neg", "sigmoid", "where", "max", "mul"]
    (mx,) = [c for c in fd.calls if c[0] == "max"]
    assert mx[1][1:] == ([1], False)
    assert [c[2]["dtype"] for c in fd.calls if c[0] == "cast"][-2:] == ["Float", "Double"]  # mul, then .to(float64)


def test_ops_without_a_translation_are_not_claimed():
    def g(x):
        return torch.nn.functional.gelu(x).softmax(-1) * 2

    trc = lowered_trace(g, torch.randn(4, 4))
    assert nf.plan_regions(trc, "cpu") == []


def test_trace_rewrite_absorbs_the_write_back():
    """The rewritten trace (not executed): one fusion line; the write-back is inside it, or after it with a reduction."""
    fake = types.SimpleNamespace(FusionDefinition=RecordingContext, DataType=DataType)
    notes = []
    trc = lowered_trace(f_update, torch.randn(4, 4), torch.randn(4, 4))
    new = nf.fuse_regions(trc, notes, device_type="cpu", nvf=fake)
    assert [b.sym.name for b in new.bound_symbols] == ["nvfuser_fusion_0"]
    assert notes[0].startswith("nvfuser_fusion_0: fused 6 ops (tanh, mul, sub, exp, 1 write-back(s))"), notes
    assert [s.sym.name for s in new.bound_symbols[0].subsymbols][-1] == "ttex.copy_"
    notes = []
    new = nf.fuse_regions(lowered_trace(f_reduce, torch.randn(4, 4), torch.randn(4, 4)), notes, device_type="cpu", nvf=fake)
    assert [b.sym.name for b in new.bound_symbols] == ["nvfuser_fusion_0", "ttex.copy_"]


class RecordingContext(RecordingDefinition):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_runner_runs_torch_lines_for_inputs_laid_out_otherwise():
    """An input whose strides differ from the definition's never reaches ``fd.execute``."""
    trc = lowered_trace(f_update, torch.randn(4, 4), torch.randn(4, 4))
    (region,) = nf.plan_regions(trc, "cpu")

    class MustNotExecute:
        def execute(self, inputs):
            raise AssertionError("fd.execute called with inputs the definition does not describe")

    run = nf._runner(MustNotExecute(), [("fd", 0)], region)
    w, g = torch.randn(4, 4), torch.randn(4, 4).t()
    args = {"w": w, "g": g}
    w_ref = w.clone()
    out = run(*[args[p.name] for p in region.inputs])
    torch.testing.assert_close(out, f_update(w_ref, g))
    torch.testing.assert_close(w, w_ref)


# ---------------------------------------------------------------------------
# With nvFuser
# ---------------------------------------------------------------------------
@needs_nvfuser
@pytest.mark.parametrize("fn,shapes", [(f_update, [(64, 32), (64, 32)]), (f_reduce, [(64, 32), (64, 32)]),
                                       (f_broadcast, [(64, 32), (32,)])])
def test_fused_on_cuda_equals_eager(fn, shapes):
    args = [torch.randn(s, device="cuda") for s in shapes]
    ref_args = [a.clone() for a in args]
    cf = tt.compile(fn, fusion="nvfuser")
    torch.testing.assert_close(cf(*args), fn(*ref_args))
    for a, b in zip(args, ref_args):
        torch.testing.assert_close(a, b)
    notes = tt.compile_stats(cf).fusion_notes
    assert any("into one nvFuser fusion" in n for n in notes), notes
    # Cached by structure: a second compiled function reuses the definition.
    cf2 = tt.compile(fn, fusion="nvfuser")
    cf2(*[a.clone() for a in args])
    assert any("reused a fusion" in n for n in tt.compile_stats(cf2).fusion_notes)


@needs_nvfuser
def test_auto_prefers_nvfuser_on_cuda():
    args = [torch.randn(64, 32, device="cuda"), torch.randn(32, device="cuda")]
    cf = tt.compile(f_broadcast, fusion="auto")
    torch.testing.assert_close(cf(*args), f_broadcast(*args))
    assert any(n.startswith("nvfuser_fusion") for n in tt.compile_stats(cf).fusion_notes)
