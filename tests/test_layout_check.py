"""The check a fused kernel's tensors pass before it runs (executors/layout_check.py), against Inductor's own rule.

Kernels are compiled without Inductor's per-input ``assert_size_stride`` calls; one C++ metadata check of all their
tensors runs first, and a call it refuses runs the region's torch ops.  What it accepts must be what the kernel's
own assert accepts: nothing laid out otherwise may reach the kernel, and nothing the kernel handles may be sent to
the slow path for good (a parameter at one call site and an activation at another share a kernel).
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import thunder_train as tt
from _inductor import cxx_available
from thunder_train.compiler.executors import layout_check
from thunder_train.compiler import bulk

assert_size_stride = pytest.importorskip("torch._C._dynamo.guards").assert_size_stride
needs_guards = pytest.mark.skipif(layout_check.needs_asserts(), reason="torch's C++ guard library is missing here")


def _inductor_accepts(t, shape, strides) -> bool:
    try:
        assert_size_stride(t, shape, strides, "input")
    except AssertionError:
        return False
    return True


@st.composite
def _layout_and_tensor(draw):
    """A compiled layout and a tensor: the same sizes with some strides redrawn, or other sizes."""
    shape = tuple(draw(st.lists(st.integers(0, 3), min_size=1, max_size=3)))
    strides = tuple(draw(st.lists(st.integers(0, 12), min_size=len(shape), max_size=len(shape))))
    other_shape = draw(st.sampled_from([shape, shape[::-1], shape + (1,)]))
    other_strides = tuple(s if draw(st.booleans()) else draw(st.integers(0, 12)) for s in strides)
    other_strides = (other_strides + (1,))[:len(other_shape)]
    return (shape, strides), torch.empty(256).as_strided(other_shape, other_strides)


@needs_guards
@settings(max_examples=150, deadline=None)
@given(_layout_and_tensor(), st.booleans())
def test_the_check_accepts_what_inductors_assert_accepts(case, requires_grad):
    (shape, strides), t = case
    t.requires_grad_(requires_grad)
    check = layout_check.LayoutCheck([(shape, strides, torch.float32, "cpu")])
    expected = tuple(t.shape) == shape and _inductor_accepts(t, shape, strides)
    assert check([t]) == expected
    assert check([t]) == expected  # again, through the fast path where it was taken
    assert not check([t.double()])  # another dtype: the kernel's code assumes its own


@needs_guards
def test_call_sites_differing_in_what_the_kernel_ignores_share_the_fast_path():
    layout = ((4, 1, 3), (3, 3, 1), torch.float32, "cpu")
    check = layout_check.LayoutCheck([layout, layout])
    a = torch.randn(4, 1, 3)
    param = torch.nn.Parameter(torch.randn(4, 1, 3))
    odd = torch.randn(4, 3).as_strided((4, 1, 3), (3, 7, 1))  # the size-1 dim's stride: the kernel does not read it
    for tensors in ([a, a], [param, a], [a, odd], [param, odd]):
        assert check(tensors)
    assert len(check.more) == 3  # one C++ check per pattern, the first in ``first``
    wrong = torch.randn(3, 1, 4).permute(2, 1, 0)  # (4, 1, 3) with strides (1, 4, 4): another layout
    assert not check([a, wrong]) and not check([wrong, a])
    for _ in range(layout_check.MAX_PATTERNS + 2):  # past the bound: Python's comparison each call, still right
        assert check([torch.randn(12).as_strided((4, 1, 3), (3, 20 + _, 1)), a])
    assert len(check.more) == layout_check.MAX_PATTERNS - 1
    assert not check([a, wrong])


@needs_guards
def test_a_check_holds_no_tensor_it_saw():
    """The C++ checks keep sizes and strides, not the tensors: a kernel's first call does not keep its activations."""
    import gc
    import weakref

    check = layout_check.LayoutCheck([((64, 64), (64, 1), torch.float32, "cpu")])
    t = torch.randn(64, 64)
    seen = weakref.ref(t)
    assert check([t])
    del t
    gc.collect()
    assert seen() is None


@pytest.mark.skipif(not cxx_available(), reason="Inductor's CPU backend needs a C++ compiler (none found)")
@pytest.mark.parametrize("guards", [True, False])
def test_a_kernel_runs_for_a_parameter_and_an_activation_and_falls_back_for_other_strides(guards, monkeypatch):
    """One region structure at two call sites (the weight is a parameter at one, an activation at the other):
    both run the kernel.  An input with other strides (no retrace: strides are not part of this cache entry's
    guards) runs the region's torch ops.  ``guards=False``: a torch without the C++ check keeps Inductor's
    asserts in the generated code."""
    from thunder_train.compiler.executors import inductor_fusion
    import weakref

    monkeypatch.setattr(inductor_fusion, "_kernels", weakref.WeakValueDictionary())  # compiled in this test
    if not guards:
        monkeypatch.setattr(bulk, "ENABLED", False)
        monkeypatch.setattr(bulk, "_support", None)

    w, w2 = torch.nn.Parameter(torch.randn(6, 5)), torch.randn(5, 5)

    def g(a, b):
        return torch.tanh(a * b + 0.25) * 1.5

    def f(x):
        m = g(x, w) @ w2  # region 1 reads the parameter; the product ends it
        return g(m, x)  # region 2: the same structure, reading an activation

    x = torch.randn(6, 5)
    cf = tt.compile(f, fusion="inductor")
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(cf(x), f(x))
    fused = [b for b in tt.last_traces(cf)[-1].bound_symbols if b.sym.module == "inductor"]
    assert len(fused) == 2 and fused[0].sym.owner is fused[1].sym.owner, str(tt.last_traces(cf)[-1])  # one kernel
    assert tt.compile_stats(cf).fusion_fallback_calls == 0
    run = fused[0].sym.runner
    xt = torch.randn(5, 6).t()  # laid out otherwise: the region's torch ops run, and are counted
    with torch.no_grad():
        torch.testing.assert_close(run(xt, w), g(xt, w))
        buffer = torch.empty(5, 6).t()  # an output buffer laid out otherwise
        assert run.out(x, w, out=buffer) is buffer
        torch.testing.assert_close(buffer, g(x, w))
    assert run.fallbacks.calls == 2


def test_compiling_without_asserts_leaves_other_threads_config_as_it_was():
    """Kernels compile on the background worker with ``size_asserts`` patched off; torch's config patches are
    thread-local, so a ``torch.compile`` the user runs meanwhile on another thread keeps Inductor's asserts."""
    import threading

    config = pytest.importorskip("torch._inductor.config")
    inside, release, seen = threading.Event(), threading.Event(), []

    def worker():
        with config.patch(size_asserts=False):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=worker)
    t.start()
    inside.wait(10)
    seen.append(config.size_asserts)
    release.set()
    t.join()
    assert seen == [True]
