"""fusion="background" (the default): the torch program runs while the fused program is built in a worker thread.

Compared with eager PyTorch before, across and after the switch.  The suite runs the default as "off"
(THUNDER_TRAIN_FUSION, tests/conftest.py); these tests turn it back on.  Region structures are shared with tests/test_fusion.py
(``_block``) so that Inductor compiles each once per process.
"""
import threading

import pytest
import torch

import thunder_train as tt
from thunder_train.compiler import pipeline
from thunder_train.compiler.executors import inductor_fusion
from _steps import assert_same_state, cross_entropy_step, fusible_mlp, mlp_batches, twin
from _inductor import cxx_available
from test_fusion import _block, _fused_lines

pytestmark = pytest.mark.skipif(not cxx_available(), reason="Inductor's CPU backend needs a C++ compiler (none found)")


@pytest.fixture(autouse=True)
def default_fusion(monkeypatch):
    monkeypatch.delenv("THUNDER_TRAIN_FUSION", raising=False)


def test_default_runs_torch_program_then_switches_to_fused():
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    cf = tt.compile(_block, thin=True)
    for _ in range(3):
        torch.testing.assert_close(cf(x, y), _block(x, y))
    assert cf.is_thin_bound
    assert tt.wait_for_fusion(cf, timeout=300)
    st = tt.compile_stats(cf)
    assert st.fusion_switches == 1 and any("replaced the torch program" in n for n in st.fusion_notes), st.fusion_notes
    assert len(_fused_lines(cf)) == 1  # last_traces shows the program that runs now
    # Thin mode keeps its binding (same checks); the bound thin call now calls the fused program.
    assert cf.is_thin_bound and st.thin_binds == 1
    assert cf._binding.fn.fn.__globals__["_slot"] is cf._last.slot and cf._last.slot.thin is cf._last.computation
    for _ in range(2):
        x2, y2 = torch.randn(4, 4), torch.randn(4, 4)
        torch.testing.assert_close(cf(x2, y2), _block(x2, y2))
    assert tt.compile_stats(cf).thin_calls >= 3


def test_nothing_is_built_before_the_second_call():
    cf = tt.compile(_block)
    cf(torch.randn(4, 4), torch.randn(4, 4))
    assert cf._last.fusion_job.state == "new" and not _fused_lines(cf)


def test_training_step_across_the_switch_matches_eager():
    (m1, o1), (m2, o2) = twin(fusible_mlp, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    eager, cf = cross_entropy_step(m1, o1), tt.compile(cross_entropy_step(m2, o2), thin=True)
    batches = mlp_batches(8)
    for i, (x, y) in enumerate(batches):
        if i == 3:
            assert tt.wait_for_fusion(cf, timeout=300)
            # Two entries: the first step (empty optimizer state) and the steady one; the steady one switched.
            assert tt.compile_stats(cf).fusion_switches >= 1, tt.compile_stats(cf).fusion_notes
            assert cf._last.fusion_job.switched
        torch.testing.assert_close(cf(x, y), eager(x, y))
        assert_same_state((m1, o1), (m2, o2))
    assert cf.is_thin_bound and _fused_lines(cf)


def test_backward_of_a_forward_from_before_the_switch():
    """The autograd node keeps the program that ran its forward: a switch in between changes nothing."""
    x = torch.randn(4, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    cf = tt.compile(lambda x, w: _block(x, w).sum())
    cf(x, w)
    loss = cf(x, w)  # torch program
    assert tt.wait_for_fusion(cf, timeout=300) and tt.compile_stats(cf).fusion_switches == 1
    loss.backward()
    got = (x.grad, w.grad)
    x.grad = w.grad = None
    _block(x, w).sum().backward()
    torch.testing.assert_close(got, (x.grad, w.grad))
    x.grad = w.grad = None
    cf(x, w).backward()  # the fused forward and backward
    torch.testing.assert_close((x.grad, w.grad), got)
    assert "= inductor_fw_fusion_0(" in str(tt.last_traces(cf)[-1])


def test_failing_build_keeps_the_torch_program(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of C++ compilers")

    monkeypatch.setattr(pipeline, "fuse", broken)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    cf = tt.compile(_block, thin=True)
    cf(x, y)
    cf(x, y)
    assert tt.wait_for_fusion(cf, timeout=300)
    st = tt.compile_stats(cf)
    assert st.fusion_switches == 0 and not _fused_lines(cf)
    assert st.fusion_notes == ["background fusion: background fusion failed, the torch program stays: "
                               "RuntimeError: out of C++ compilers"]
    torch.testing.assert_close(cf(x, y), _block(x, y))


def test_region_inductor_rejects_leaves_the_torch_program(monkeypatch):
    monkeypatch.setattr(inductor_fusion, "_inductor_compile", lambda gm, example, **options: 1 / 0)

    def f(x):
        return torch.cos(torch.exp(x * 2.3456) + 0.25) * 3.0  # a structure no other test compiles

    x = torch.randn(3)
    cf = tt.compile(f)
    cf(x)
    assert tt.wait_for_fusion(cf, timeout=300)
    notes = tt.compile_stats(cf).fusion_notes
    assert "Inductor failed: ZeroDivisionError" in notes[0] and "nothing to fuse, the torch program stays" in notes[-1]
    torch.testing.assert_close(cf(x), f(x))


def test_environment_variable(monkeypatch):
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    for fused_now in ("auto", "inductor"):
        monkeypatch.setenv("THUNDER_TRAIN_FUSION", fused_now)
        cf = tt.compile(_block)
        torch.testing.assert_close(cf(x, y), _block(x, y))
        assert len(_fused_lines(cf)) == 1 and cf._last.fusion_job is None  # fused before the first call
    monkeypatch.setenv("THUNDER_TRAIN_FUSION", "off")
    cf = tt.compile(_block)
    cf(x, y)
    assert cf._last.fusion_job is None and tt.compile_stats(cf).fusion_notes == []
    cf = tt.compile(_block, fusion="inductor")  # other options than the default ignore the variable
    cf(x, y)
    assert len(_fused_lines(cf)) == 1
    monkeypatch.setenv("THUNDER_TRAIN_FUSION", "sometimes")
    with pytest.raises(ValueError, match="THUNDER_TRAIN_FUSION"):
        tt.compile(_block)
    tt.compile(_block, fusion=None)


def test_dynamic_and_cuda_graphs_change_what_the_default_does():
    assert tt.compile(_block, dynamic=True)._fusion_mode is None  # symbolic sizes: nothing would fuse
    assert tt.compile(_block, thin=True, cuda_graphs=True)._fusion_mode == "auto"  # graphs capture the fused program


def test_worker_thread_is_a_daemon():
    cf = tt.compile(_block)
    cf(torch.randn(4, 4), torch.randn(4, 4))
    assert tt.wait_for_fusion(cf, timeout=300)
    workers = [t for t in threading.enumerate() if t.name == "thunder_train-fusion"]
    assert len(workers) == 1 and workers[0].daemon


def test_a_symbolic_entry_says_why_it_is_not_fused_and_equals_eager():
    # Automatic dynamic shapes: the first length is specialised (its build is decided at its second call, which
    # never comes); the second makes dim 0 symbolic, and that entry's decision line says why no build starts.
    cf = tt.compile(_block, thin=True)
    for n in (4, 6, 7, 9, 5):
        x, y = torch.randn(n, 4), torch.randn(n, 4)
        torch.testing.assert_close(cf(x, y), _block(x, y))
    st = tt.compile_stats(cf)
    assert st.cache_misses == 2 and cf._last.fusion_job is None and not _fused_lines(cf)
    assert st.fusion_decisions == [
        "background fusion: not started: the program has symbolic sizes (args[0] (x) dim 0, args[1] (y) dim 0); fused "
        "regions are compiled for static sizes only, so the torch program runs. To get fused programs, pad to a few "
        "bucket lengths and pass dynamic=False (one fused program per length, within cache_limit)"]
    assert tt.wait_for_fusion(cf, timeout=300) and st.fusion_switches == 0
    cf_dyn = tt.compile(_block, dynamic=True)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(cf_dyn(x, y), _block(x, y))
    assert tt.compile_stats(cf_dyn).fusion_decisions[0].startswith(
        "background fusion: not started: the program has symbolic sizes (every argument size (dynamic=True))")


@pytest.mark.parametrize("thin, wait", [(True, True), (True, False), (False, True)],
                         ids=["thin-fused", "thin-before-the-build", "full-fused"])
def test_a_dropped_compiled_step_frees_its_model_and_optimizer(thin, wait):
    """Once the user drops the compiled step, its model and optimizer, nothing of them stays alive: the worker
    thread kept the last job it ran, and through it the entry, the compiled function, the model and the optimizer
    (the whole model and its AdamW state in GPU memory: GPT-2's 1.9 GB in benchmarks/gpu.py, where every mode after
    the default peaked that much higher)."""
    import gc
    import weakref

    def run():
        torch.manual_seed(0)
        model = fusible_mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        cf = tt.compile(cross_entropy_step(model, opt), thin=thin)
        for i, (x, y) in enumerate(mlp_batches(4)):
            cf(x, y)
            if wait and i == 1:
                assert tt.wait_for_fusion(cf, timeout=300)
        if wait:
            assert cf._last.fusion_job.switched
        return weakref.ref(model), weakref.ref(opt), weakref.ref(cf)

    refs = run()
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True]
