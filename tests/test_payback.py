"""The pay-back rule of background fusion (executors/payback.py): at which call the build starts, and why.

The estimate's inputs (region timings, whether Inductor runs, the on-disk index) are injected, so the rule's
arithmetic is tested without timing anything; the counting is tested on compiled functions against eager.
"""
import math

import pytest
import torch

import thunder_train as tt
from thunder_train.compiler import pipeline
from thunder_train.compiler.executors import inductor_fusion, payback, regions
from thunder_train.compiler.executors.payback import COLD_S, START_S, WARM_S, Decision
from _inductor import cxx_available
from test_fusion import _block


@pytest.fixture(autouse=True)
def default_fusion(monkeypatch):
    monkeypatch.delenv("THUNDER_TRAIN_FUSION", raising=False)


@pytest.fixture
def no_kernels(monkeypatch):
    """A process that has compiled no region yet (kernels compiled by other tests do not count)."""
    monkeypatch.setattr(inductor_fusion, "_kernels", {})
    monkeypatch.setattr(inductor_fusion, "_failed", {})


def _lowered(fn, *args):
    """The lowered trace the background build of ``fn``'s entry would fuse."""
    captured = {}

    def spy(traces, call_s):
        captured["traces"], captured["call_s"] = traces, call_s
        return Decision(0, 0, 0, 0.0, 0.0, None, "not started: test")

    cf = tt.compile(fn)
    orig = payback.decide
    payback.decide = spy
    try:
        cf(*args)
        cf(*args)
    finally:
        payback.decide = orig
    return captured["traces"]


def _two_blocks(x, y):
    return _block(_block(x, y) @ y, y)  # two regions of one structure (the matmul ends the first)


def test_rule_starts_when_the_saving_has_paid_for_the_build(no_kernels):
    traces = _lowered(_block, torch.randn(4, 4), torch.randn(4, 4))
    measure = lambda b, i, o: (3e-4, 2e-4)  # the kernel saves 0.1 ms a call
    cold = payback.decide(traces, measure=measure, started=False, warm=lambda key: False)
    assert (cold.regions, cold.new_regions, cold.warm_regions) == (1, 1, 0)
    assert cold.build_s == pytest.approx(START_S + COLD_S) and cold.saving_s == pytest.approx(1e-4)
    assert cold.start_at == math.ceil(cold.build_s / cold.saving_s) and 29_000 < cold.start_at < 31_000
    warm = payback.decide(traces, measure=measure, started=True, warm=lambda key: True)
    assert warm.build_s == pytest.approx(WARM_S) and warm.warm_regions == 1
    assert warm.start_at == math.ceil(warm.build_s / warm.saving_s) and 900 < warm.start_at < 1100
    assert f"starts at call {warm.start_at}" in warm.line()
    # A large saving never starts before the second call.
    assert payback.decide(traces, measure=lambda *a: (10.0, 0.0), started=True, warm=lambda key: True).start_at == 2


def test_rule_never_starts_when_no_kernel_would_be_faster(no_kernels):
    traces = _lowered(_block, torch.randn(4, 4), torch.randn(4, 4))
    d = payback.decide(traces, measure=lambda *a: (1e-4, 2e-4), started=True, warm=lambda key: True)
    assert d.start_at is None and d.regions == 1 and d.saving_s == 0.0
    assert "not started: no region's kernel would be faster" in d.line()


def test_nothing_to_fuse_never_starts(no_kernels):
    traces = _lowered(lambda x: x.sum(), torch.randn(4))
    d = payback.decide(traces, measure=lambda *a: (1.0, 0.0), started=True, warm=lambda key: True)
    assert d.start_at is None and d.regions == 0 and "nothing to fuse" in d.line()


def test_one_structure_is_built_once_and_a_compiled_one_costs_nothing(monkeypatch, no_kernels):
    traces = _lowered(_two_blocks, torch.randn(4, 4), torch.randn(4, 4))
    found = inductor_fusion.plan_regions(traces[0])
    keys = {regions.structure(b, o)[0] for b, o in found}
    assert len(found) == 2 and len(keys) == 1
    d = payback.decide(traces, measure=lambda *a: (1e-3, 0.0), started=True, warm=lambda key: False)
    assert d.regions == 2 and d.new_regions == 1 and d.build_s == pytest.approx(COLD_S)
    # Compiled in this process already: no build cost, start at the second call.
    monkeypatch.setitem(inductor_fusion._kernels, keys.pop(), inductor_fusion._Kernel(None, 0.0))
    d = payback.decide(traces, measure=lambda *a: (1e-3, 0.0), started=False, warm=lambda key: False)
    assert d.build_s == 0.0 and d.start_at == 2


def test_a_region_that_failed_before_saves_nothing(monkeypatch, no_kernels):
    traces = _lowered(_block, torch.randn(4, 4), torch.randn(4, 4))
    (b, o), = inductor_fusion.plan_regions(traces[0])
    monkeypatch.setitem(inductor_fusion._failed, regions.structure(b, o)[0], "RuntimeError: no")
    d = payback.decide(traces, measure=lambda *a: (1.0, 0.0), started=True, warm=lambda key: True)
    assert d.start_at is None and "nothing to fuse" in d.line()


def _decide_with(monkeypatch, start_at):
    monkeypatch.setattr(payback, "decide", lambda traces, call_s: Decision(1, 1, 0, 1e-3, 1.0, start_at))


@pytest.mark.skipif(not cxx_available(), reason="Inductor's CPU backend needs a C++ compiler (none found)")
def test_the_build_starts_at_the_decided_call_in_thin_mode(monkeypatch):
    _decide_with(monkeypatch, 6)
    cf = tt.compile(_block, thin=True)
    for i in range(1, 6):
        x, y = torch.randn(4, 4), torch.randn(4, 4)
        torch.testing.assert_close(cf(x, y), _block(x, y))
        assert cf._last.fusion_job.state == "new", i  # calls 3-5 run through the thin binding, counted too
    assert cf.is_thin_bound and tt.compile_stats(cf).fusion_decisions == [Decision(1, 1, 0, 1e-3, 1.0, 6).line()]
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(cf(x, y), _block(x, y))
    assert cf._last.fusion_job.state != "new"
    assert tt.wait_for_fusion(cf, timeout=300) and tt.compile_stats(cf).fusion_switches == 1
    torch.testing.assert_close(cf(x, y), _block(x, y))


def test_never_puts_the_uncounted_program_back(monkeypatch):
    _decide_with(monkeypatch, None)
    cf = tt.compile(_block, thin=True)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    counted = None
    for i in range(4):
        torch.testing.assert_close(cf(x, y), _block(x, y))
        if i == 0:
            counted = cf._last.computation
    entry = cf._last
    assert entry.computation is not counted
    assert entry.fusion_job.state == "new" and entry.fusion_job.calls == 2  # not counted after the decision
    assert cf._binding.fn.fn.__globals__["_slot"] is entry.slot and entry.slot.thin is entry.computation
    assert tt.compile_stats(cf).fusion_switches == 0
    assert "not started" in tt.compile_stats(cf).fusion_decisions[0]


def test_a_failing_estimate_builds_from_the_second_call(monkeypatch):
    def broken(traces, call_s):
        raise ValueError("no clock")

    monkeypatch.setattr(payback, "decide", broken)
    monkeypatch.setattr(pipeline, "fuse", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no compiler")))
    cf = tt.compile(_block)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    cf(x, y)
    cf(x, y)
    assert cf._last.fusion_job.state != "new"
    assert "the pay-back estimate failed (ValueError: no clock)" in tt.compile_stats(cf).fusion_decisions[0]
    assert tt.wait_for_fusion(cf, timeout=300)
    torch.testing.assert_close(cf(x, y), _block(x, y))


def test_region_timing_runs_the_torch_ops(monkeypatch):
    traces = _lowered(_block, torch.randn(4, 4), torch.randn(4, 4))
    (b, o), = inductor_fusion.plan_regions(traces[0])
    i = regions.structure(b, o)[1]
    torch_s, fused_s = payback.region_seconds(b, i, o)
    assert 0.0 < fused_s < math.inf and 0.0 < torch_s < math.inf
    # The ops run on stand-ins of the region's inputs, with the trace's callables.
    seen = []
    first = b[0]
    monkeypatch.setattr(first.sym, "fn", lambda *a, **k: seen.append(a) or torch.sin(*a, **k))
    payback.region_seconds(b, i, o)
    assert seen and all(isinstance(a[0], torch.Tensor) and a[0].shape == (4, 4) for a in seen)
    assert len(seen) == 1 + payback.REPEATS
    monkeypatch.setattr(first.sym, "fn", lambda *a, **k: 1 / 0)
    assert payback.region_seconds(b, i, o) == (0.0, 0.0)  # ops that fail on stand-ins save nothing


def test_structures_are_timed_once(no_kernels):
    traces = _lowered(_two_blocks, torch.randn(4, 4), torch.randn(4, 4))
    calls = []
    d = payback.decide(traces, measure=lambda *a: calls.append(a) or (1e-3, 0.0), started=True, warm=lambda key: True)
    assert len(calls) == 1 and d.saving_s == pytest.approx(2e-3)


def test_index_remembers_structures_per_cache_directory(monkeypatch, tmp_path):
    key = (("op", 1.5), ((4,), torch.float32, torch.device("cpu")), (("op", 0),))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "a"))
    assert not payback.in_index(key)
    payback.remember(key, 1.25)
    assert payback.in_index(key)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "b"))
    assert not payback.in_index(key)


def test_cache_directory_is_inductors(monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert payback.inductor_cache_dir() == cache_dir()


def test_regions_beyond_the_timing_budget_save_nothing(monkeypatch, no_kernels):
    traces = _lowered(_block, torch.randn(4, 4), torch.randn(4, 4))
    calls = []
    monkeypatch.setattr(payback, "MEASURE_BUDGET_S", 0.0)
    d = payback.decide(traces, measure=lambda *a: calls.append(a) or (1.0, 0.0), started=True, warm=lambda key: True)
    assert not calls and d.start_at is None and d.regions == 1
    monkeypatch.setattr(payback, "MEASURE_BUDGET_S", 10.0)
    monkeypatch.setattr(payback, "MAX_MEASURED", 0)
    assert payback.decide(traces, measure=lambda *a: calls.append(a) or (1.0, 0.0), started=True,
                          warm=lambda key: True).start_at is None and not calls


def test_timing_is_invisible_to_the_callers_modes():
    """A FLOP counter (a dispatch mode) around the deciding call counts the step's ops, not the timing runs."""
    from torch.utils.flop_counter import FlopCounterMode

    x, y = torch.randn(4, 4), torch.randn(4, 4)
    traces = _lowered(_block, x, y)
    (b, o), = inductor_fusion.plan_regions(traces[0])
    i = regions.structure(b, o)[1]
    seen = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        thunder_train_observes = True  # sees the compiled program's aten calls (acquisition/ambient.py)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Spy():
        torch_s, _ = payback.region_seconds(b, i, o)
    assert torch_s > 0.0 and not seen
    with FlopCounterMode(display=False) as counter:
        payback.region_seconds(b, i, o)
    assert counter.get_total_flops() == 0


def test_the_deciding_call_bounds_the_saving(no_kernels):
    """Isolated timings on a loaded machine can be far off: the saving is at most the deciding call's time
    times the regions' share of the program's lines."""
    traces = _lowered(_two_blocks, torch.randn(4, 4), torch.randn(4, 4))
    regions = inductor_fusion.plan_regions(traces[0])
    share = sum(len(b) for b, _ in regions) / len(traces[0].bound_symbols)
    kw = dict(measure=lambda *a: (1.0, 0.0), started=True, warm=lambda key: True)
    assert payback.decide(traces, **kw).saving_s == pytest.approx(2.0)
    d = payback.decide(traces, call_s=1e-3, **kw)
    assert d.saving_s == pytest.approx(1e-3 * share) and d.start_at == math.ceil(d.build_s / d.saving_s)
    assert payback.decide(traces, call_s=10.0, **kw).saving_s == pytest.approx(2.0)  # a bound, not an estimate


def test_the_deciding_call_is_timed(monkeypatch):
    seen = []
    monkeypatch.setattr(payback, "decide", lambda traces, call_s: seen.append(call_s) or Decision(1, 1, 0, 1e-3, 1.0, None))
    cf = tt.compile(_block)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    for _ in range(3):
        torch.testing.assert_close(cf(x, y), _block(x, y))
    assert len(seen) == 1 and seen[0] > 0.0


def test_the_timing_budget_counts_timing_only(monkeypatch, no_kernels):
    """Planning a large program's regions took the whole budget on a loaded machine (the zoo's Llama step: 16 regions,
    none timed, "saves 0.000 ms a call", the build never started); only the timing runs count against it."""
    import time as _time

    traces = _lowered(_block, torch.randn(4, 4), torch.randn(4, 4))
    plan = inductor_fusion.plan_regions

    def slow_plan(trc):
        _time.sleep(payback.MEASURE_BUDGET_S * 1.2)
        return plan(trc)

    monkeypatch.setattr(inductor_fusion, "plan_regions", slow_plan)
    calls = []
    d = payback.decide(traces, measure=lambda *a: calls.append(a) or (1.0, 0.0), started=True, warm=lambda key: True)
    assert calls and d.saving_s > 0 and d.start_at is not None
