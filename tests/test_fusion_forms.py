"""Fusion forms (``Symbol.fusion_form``): what a fused program compiles for an op's line instead of its torch call.

tanh GELU is fused as x * sigmoid(2u), and a small exact GELU by Inductor's own lowering (torchlang/activations.py:
eager's CPU kernels cost tens of microseconds a call on small tensors): the same function, rounded differently.  These
tests compare the compiled kernels with eager PyTorch (values, gradients, infinities and NaNs, the error against
float64) and check how a one-line region is formed, keeps its output in a kept buffer, and falls back to the torch
call for other layouts.  The kernels are compiled by Inductor (seconds each when cold); the tests share shapes.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import thunder_train as tt
from _inductor import cxx_available
from _models import train_step
from _steps import GPT, GPTConfig

pytestmark = pytest.mark.skipif(not cxx_available(), reason="Inductor's CPU backend needs a C++ compiler (none found)")

from thunder_train.compiler.executors import inductor_fusion, payback  # noqa: E402
from thunder_train.compiler.executors.regions import FusionSymbol  # noqa: E402

SPECIAL = [0.0, -0.0, 1e-30, -1e-30, 1e-4, -1e-4, 3.0, -3.0, 7.5, -7.5, 20.0, -20.0, 1e10, -1e10,
           float("inf"), float("-inf"), float("nan")]


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 100, generator=g) * 4
    x.view(-1)[:len(SPECIAL)] = torch.tensor(SPECIAL)
    return x.to(dtype), torch.randn(64, 100, generator=g).to(dtype)


def _gelu(x):
    return F.gelu(x, approximate="tanh")


def _eager(fn, x):
    """Eager's result, with the special values' entries from eager's kernel run on one element at a time where its
    vectorized loop gives NaN instead: on an AVX-512 CPU eager's exact GELU returns NaN for +-inf in float32 (-inf in
    float64) in its vectorized loop and +-inf / 0 in its one-element loop, as Inductor's kernel does."""
    want = fn(x).clone()
    head = want.view(-1)[:len(SPECIAL)]
    alone = torch.stack([fn(v.reshape(1))[0] for v in x.reshape(-1)[:len(SPECIAL)]])
    head[head.isnan() & ~alone.isnan()] = alone[head.isnan() & ~alone.isnan()]
    return want


def _fused_syms(cf):
    return [b.sym for b in tt.last_traces(cf)[-1].bound_symbols if isinstance(b.sym, FusionSymbol)]


def _max_error(got, x64_result):
    finite = x64_result.isfinite()
    return (got.double() - x64_result).abs()[finite].max().item()


def _exact_gelu(x):
    return F.gelu(x)


GELUS = {"tanh": _gelu, "none": _exact_gelu}


@pytest.mark.parametrize("approximate", list(GELUS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gelu_alone_is_fused_and_matches_eager(dtype, approximate):
    x, _ = _inputs(dtype)
    fn = GELUS[approximate]
    cf = tt.compile(fn, fusion="inductor")
    got, want = cf(x), _eager(fn, x)
    assert len(_fused_syms(cf)) == 1, "a lone GELU forms a region of its own"
    torch.testing.assert_close(got, want, equal_nan=True)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    exact = fn(x.double())
    # as close to the float64 value as eager's kernel is (a few ulp; 1e-7 spare for one rounding more)
    assert _max_error(got, exact) <= 2 * _max_error(want, exact) + (1e-7 if dtype == torch.float32 else 1e-15)


@pytest.mark.parametrize("approximate", list(GELUS))
def test_gelu_gradient_is_fused_and_matches_eager(approximate):
    x, g = _inputs()
    fn = GELUS[approximate]
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    cf = tt.compile(fn, fusion="inductor")
    cf(xt).backward(g)
    fn(xr).backward(g)
    notes = "\n".join(tt.compile_stats(cf).fusion_notes)
    assert "gelu_vjp" in notes, notes
    torch.testing.assert_close(xt.grad, xr.grad, equal_nan=True)
    assert torch.equal(xt.grad.isnan(), xr.grad.isnan())
    exact = torch.ops.aten.gelu_backward(g.double(), x.double(), approximate=approximate)
    assert _max_error(xt.grad, exact) <= 3 * _max_error(xr.grad, exact) + 1e-6


@pytest.mark.parametrize("approximate", list(GELUS))
def test_low_precision_is_computed_in_float32_like_eager(approximate):
    x, _ = _inputs(torch.bfloat16)
    fn = GELUS[approximate]
    cf = tt.compile(fn, fusion="inductor")
    got, want = cf(x), _eager(fn, x)
    assert got.dtype == torch.bfloat16 and _fused_syms(cf)
    torch.testing.assert_close(got, want, equal_nan=True)  # bf16 tolerances: at most one bf16 rounding apart


def test_large_exact_gelu_stays_a_torch_call():
    """Above ``_GELU_EXACT_FORM_MAX`` elements eager's exact GELU is as fast as Inductor's (faster from ~64 Ki): no
    form is declared, and a lone GELU stays eager's kernel (bitwise)."""
    from thunder_train.compiler.torchlang.activations import _GELU_EXACT_FORM_MAX

    x = torch.randn(2, _GELU_EXACT_FORM_MAX // 2 + 1, generator=torch.Generator().manual_seed(0))
    cf = tt.compile(F.gelu, fusion="inductor")
    assert torch.equal(cf(x), F.gelu(x))
    assert not _fused_syms(cf)


def test_pay_back_rule_counts_a_lone_fusion_form(monkeypatch):
    """The default (background fusion) estimates what the one-line region saves, and schedules its build."""
    monkeypatch.delenv("THUNDER_TRAIN_FUSION", raising=False)  # the suite runs the default as "off" (conftest.py)
    x, _ = _inputs()
    cf = tt.compile(_gelu)
    cf(x)
    cf(x)
    decision, = tt.compile_stats(cf).fusion_decisions
    assert "starts at call" in decision and "1 region(s) save an estimated" in decision, decision


def _two_gelus(x, w):
    return _gelu(_gelu(x) @ w) @ w


def test_fused_region_writes_into_a_kept_buffer():
    x, _ = _inputs()
    w = torch.randn(100, 100, generator=torch.Generator().manual_seed(1)) / 10
    kept = tt.compile(_two_gelus, fusion="inductor")
    plain = tt.compile(_two_gelus, fusion="inductor", keep_buffers=False)
    results = [kept(x * k, w) for k in (1.0, 0.5, 2.0)]
    trace = str(tt.last_traces(kept)[-1])
    assert ".out(" in trace and "_pool.take()" in trace, trace
    for k, got in zip((1.0, 0.5, 2.0), results):  # earlier results are not overwritten by later calls
        torch.testing.assert_close(got, plain(x * k, w), rtol=0, atol=0, equal_nan=True)  # the same kernels
        torch.testing.assert_close(got, _two_gelus(x * k, w), equal_nan=True)


def test_region_falls_back_to_torch_for_other_layouts():
    x, _ = _inputs()
    cf = tt.compile(_gelu, fusion="inductor")
    cf(x)
    runner = _fused_syms(cf)[0].runner
    other = x.t().contiguous().t()  # same values and shape, column-major: not the layout the kernel was compiled for
    exact = dict(rtol=0, atol=0, equal_nan=True)
    assert not torch.equal(runner(x).nan_to_num(), _gelu(x).nan_to_num()), "the kernel rounds differently from eager"
    torch.testing.assert_close(runner(other), _gelu(x), **exact)  # the region's torch call: eager's kernel
    buffer = torch.empty(100, 64).t()  # a buffer of another layout, too
    assert runner.out(x, out=buffer) is buffer
    torch.testing.assert_close(buffer, _gelu(x), **exact)
    fresh = runner.out(x, out=None)
    torch.testing.assert_close(fresh, _gelu(x), equal_nan=True)
    assert fresh.stride() == (100, 1)


def _gpt_and_data():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16))
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        x = torch.randint(0, 16, (4, 8), generator=g)
        batches.append((x, torch.roll(x, -1, 1)))
    return model, batches


def test_whole_training_step_with_fused_gelu_matches_eager():
    """The recipe GPT (tanh GELU) trained three SGD steps by the fused whole-step program, against eager."""
    model, batches = _gpt_and_data()
    twin = copy.deepcopy(model)

    def make(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return lambda x, y: train_step(m, opt, x, y)  # the closure style: model and optimizer captured

    eager, fused = make(model), tt.compile(make(twin), thin=True, fusion="inductor")
    for x, y in batches:
        torch.testing.assert_close(fused(x, y), eager(x, y))
    notes = "\n".join(tt.compile_stats(fused).fusion_notes)
    assert "(gelu)" in notes and "gelu_vjp" in notes, notes
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


def test_region_out_form_fills_given_buffers_and_allocates_the_rest():
    """Any region's out form (what kept buffers call): given buffers are written, None entries allocated."""
    def two(x, y):
        return torch.sin(x) * y + 1.0, torch.cos(x) * y - 1.0

    x, y = _inputs()
    cf = tt.compile(two, fusion="inductor")
    cf(x, y)
    runner, = [s.runner for s in _fused_syms(cf)]
    buffer = torch.full((64, 100), 7.0)
    first, second = runner.out(x, y, out=(None, buffer))
    assert second is buffer and first is not buffer
    # The reference in float64: after Inductor's CPU kernels ran in a process, eager's float32 sin was seen to
    # come out ~5e-4 off in half of a tensor's rows (about 1 process in 12, torch.compile alone too; docs/fusion.md).
    for got, want in zip((first, second), two(x.double(), y.double())):
        torch.testing.assert_close(got, want.float(), equal_nan=True)


def test_exact_gelu_of_a_data_dependent_size_is_fused_like_the_rest():
    # ``x[mask]``: its row count is a size the trace keeps symbolic (``u0``; ModernBERT unpads its tokens so).  The
    # fusion pass asked such a GELU how many elements it has, which for a symbolic size records a product line: with
    # no trace to record it in, the call recursed until Python's limit (a RecursionError from ``fusion="inductor"``;
    # under the default the background fusion failed and the torch program stayed for good).
    def step(x, w):
        h = x[x[:, 0] > 0] @ w
        return F.gelu(h).sum()

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 16, generator=g), torch.randn(16, 8, generator=g, requires_grad=True)
    cf = tt.compile(step, fusion="inductor")
    got = cf(x, w)
    want = step(x, w.detach().requires_grad_())
    torch.testing.assert_close(got, want)
    (gw,) = torch.autograd.grad(got, w)
    w2 = w.detach().requires_grad_()
    (ew,) = torch.autograd.grad(step(x, w2), w2)
    torch.testing.assert_close(gw, ew)
