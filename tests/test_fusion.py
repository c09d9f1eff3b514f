"""fusion="inductor": regions of elementwise ops and reductions compiled by Inductor, compared with eager.

Inductor's C++ compiles are slow (seconds each, cached on disk across runs), so the tests share region
structures: ``_block`` is compiled once and reused by several tests.
"""
import pytest
import torch

import thunder_train as tt
from _steps import squared_output_step
from _inductor import cxx_available

pytestmark = pytest.mark.skipif(not cxx_available(), reason="Inductor's CPU backend needs a C++ compiler (none found)")

from thunder_train.compiler.executors import inductor_fusion  # noqa: E402
from thunder_train.compiler.proxies import TensorProxy  # noqa: E402


def _block(x, y):
    a = torch.sin(x) * y + 1.0
    b = torch.tanh(a) - x / 3.0
    return torch.sigmoid(b * a)


def _fused_lines(cf):
    return [ln for ln in str(tt.last_traces(cf)[-1]).splitlines() if "= inductor_" in ln]


def test_elementwise_chain_matches_eager_and_prints_one_call():
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    cf = tt.compile(_block, fusion="inductor")
    torch.testing.assert_close(cf(x, y), _block(x, y))
    trace = str(tt.last_traces(cf)[-1])
    assert len(_fused_lines(cf)) == 1 and "inductor_fusion_0(x, y)" in trace
    assert "# t0 = torch.sin(x)" in trace  # the region's original lines stay as comments
    # "reused": another test in this process (test_fusion_auto, test_payback) compiled the same region first.
    notes = tt.compile_stats(cf).fusion_notes
    assert any("fused 8 ops" in n or "1 region(s) reused a kernel" in n for n in notes), notes
    x2, y2 = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(cf(x2, y2), _block(x2, y2))


def test_fusion_none_is_unfused_and_option_is_checked():
    cf = tt.compile(_block, fusion=None)
    for _ in range(3):
        cf(torch.randn(4, 4), torch.randn(4, 4))
    assert cf._last.fusion_job is None
    assert not _fused_lines(cf) and tt.compile_stats(cf).fusion_notes == []
    with pytest.raises(ValueError, match="fusion"):
        tt.compile(_block, fusion="nvfuser-please")


def test_identical_regions_compile_once():
    def two_layers(x, y, z):
        h = _block(x, y) @ z  # the matmul (not fusible) reads the first region and separates the two
        return _block(h, z)  # the second region has the same structure as the first

    x, y, z = (torch.randn(4, 4) for _ in range(3))
    cf = tt.compile(two_layers, fusion="inductor", thin=True)
    for _ in range(4):
        torch.testing.assert_close(cf(x, y, z), two_layers(x, y, z))
    assert cf.is_thin_bound
    notes = tt.compile_stats(cf).fusion_notes
    assert len(_fused_lines(cf)) == 2
    assert sum("reused a kernel" in n for n in notes) >= 1, notes
    before = len(inductor_fusion._kernels)
    cf2 = tt.compile(_block, fusion="inductor")  # another compiled function, same structure
    cf2(x, y)
    assert len(inductor_fusion._kernels) == before
    assert "reused a kernel" in tt.compile_stats(cf2).fusion_notes[0]


def test_broadcasting_reductions_and_several_outputs():
    def f(x, b, s):
        h = torch.relu(x * s + b)        # [4, 8] * [4, 1] + [8]
        m = h.sum(-1, keepdim=True)
        p = torch.softmax(h - m / 8.0, dim=-1)
        return p, h.amax(0), m.mean()

    x, b, s = torch.randn(4, 8), torch.randn(8), torch.randn(4, 1)
    cf = tt.compile(f, fusion="inductor")
    for got, want in zip(cf(x, b, s), f(x, b, s)):
        torch.testing.assert_close(got, want)
    assert len(_fused_lines(cf)) == 1


def test_in_place_update_is_written_back():
    def step(w, x):
        w.mul_(0.9).add_(torch.sin(x) * 0.1)
        return torch.cos(w).sum()

    w_ref, x = torch.randn(4, 4), torch.randn(4, 4)
    w = w_ref.clone()
    cf = tt.compile(step, fusion="inductor")
    for _ in range(3):
        torch.testing.assert_close(cf(w, x), step(w_ref, x))
        torch.testing.assert_close(w, w_ref)
    trace = str(tt.last_traces(cf)[-1])
    assert _fused_lines(cf)
    assert trace.index("= inductor_fusion_0") < trace.index("ttex.copy_(")


def test_backward_through_fused_regions():
    x = torch.randn(4, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)

    def f(x, w):
        return (torch.tanh(x * w + 1.0) * torch.sigmoid(w)).sum()

    cf = tt.compile(f, fusion="inductor")
    loss = cf(x, w)
    loss.backward()
    got = (x.grad, w.grad)
    x.grad = w.grad = None
    f(x, w).backward()
    torch.testing.assert_close(loss, f(x, w))
    torch.testing.assert_close(got, (x.grad, w.grad))
    assert "= inductor_fw_fusion_0(" in str(tt.last_traces(cf)[-1])
    assert "= inductor_bw_fusion_0(" in str(tt.last_backward_traces(cf)[-1])


def test_non_contiguous_input_falls_back_per_call():
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    cf = tt.compile(_block, fusion="inductor")
    cf(x, y)
    xt = torch.randn(4, 4).t()  # same shape, other strides: no retrace, the kernel's stride check fails
    torch.testing.assert_close(cf(xt, y), _block(xt, y))


def test_compile_failure_falls_back_to_torch(monkeypatch):
    def broken(gm, example, **options):
        raise RuntimeError("no C++ compiler today")

    monkeypatch.setattr(inductor_fusion, "_inductor_compile", broken)

    def f(x):
        return torch.cos(torch.exp(x * 1.2345) + 0.5) * 7.0  # a structure no other test compiles

    x = torch.randn(3)
    cf = tt.compile(f, fusion="inductor")
    torch.testing.assert_close(cf(x), f(x))
    assert not _fused_lines(cf)
    note = tt.compile_stats(cf).fusion_notes[0]
    assert "left to torch: Inductor failed: RuntimeError: no C++ compiler today" in note


def test_unfusible_candidates_are_explained():
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    cf = tt.compile(_block, fusion="inductor", dynamic=True)  # symbolic sizes: nothing to compile
    torch.testing.assert_close(cf(x, y), _block(x, y))
    assert not _fused_lines(cf)
    assert any("left to torch: symbolic sizes" in n for n in tt.compile_stats(cf).fusion_notes), tt.compile_stats(cf).fusion_notes


def test_power_operators_are_fused():
    """``x ** 2`` reaches the trace as ``Tensor.__pow__``: it used to make its whole region fail."""
    def f(x):
        return (x ** 2 + x.pow(3) * 2.0 + 2.0 ** x).sqrt() - torch.square(x) + x ** 0.5

    x = torch.rand(4, 4) + 0.1
    cf = tt.compile(f, fusion="inductor")
    torch.testing.assert_close(cf(x), f(x))
    assert len(_fused_lines(cf)) == 1, tt.compile_stats(cf).fusion_notes
    assert "fused 11 ops" in tt.compile_stats(cf).fusion_notes[0], tt.compile_stats(cf).fusion_notes


def test_broadcasts_inside_a_decomposition_have_eagers_strides_and_run_compiled(monkeypatch):
    """An RMS norm's ``x * rsqrt(...)`` broadcasts the (n, 1) statistic with an ``expand`` inside the ``mul``'s
    decomposition, which autograd expands; the value has stride 0 on the broadcast dim (eager's), so the fused
    regions reading it are compiled for that layout and run their kernel: none falls back to its torch ops (which
    held every intermediate and copied the results on every call)."""
    fallbacks = []
    runner = inductor_fusion._runner

    def recording(call, fallback, outputs, fits=None, check=None):
        def counted(*args):  # the region's torch ops: run where the kernel did not
            fallbacks.append([tuple(a.stride()) for a in args])
            return fallback(*args)
        return runner(call, counted, outputs, fits, check)

    monkeypatch.setattr(inductor_fusion, "_runner", recording)

    class RMSNormLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.rand(16) + 0.5)
            self.inp, self.lin = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x):
            x = self.inp(x)  # on the gradient's path: autograd expands the ``mul`` into its broadcast and product
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            return self.lin(self.weight * h)

    step = squared_output_step

    torch.manual_seed(0)
    eager = RMSNormLinear()
    compiled = RMSNormLinear()
    compiled.load_state_dict(eager.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled)]
    cf = tt.compile(step, fusion="inductor")
    for _ in range(2):
        x = torch.randn(3, 5, 16)
        torch.testing.assert_close(cf(compiled, opts[1], x), step(eager, opts[0], x))
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(a, b)
    broadcast = [a for b in tt.last_traces(cf)[-1].bound_symbols if b.sym.module == "inductor" for a in b.flat_args()
                 if isinstance(a, TensorProxy) and tuple(a._tt_shape) == (3, 5, 16) and 0 in a._tt_strides]
    assert broadcast, str(tt.last_traces(cf)[-1])  # the statistic expanded, read by a region with its stride 0
    assert not fallbacks, fallbacks


def _attention_step(x, wq, wk, wv, cos, sin):
    # Llama's shape of attention: heads from a (batch, seq, heads, dim) view, rotary products around sdpa.  The CPU
    # flash backward gives q's and k's gradients laid out as (batch, seq, heads, dim); the rotary backward's
    # region reads them.  One key/value head (Falcon's multi-query attention): eager's math kernel, whose
    # gradients are laid out otherwise, and the program's flash kernels.
    b, t, _ = x.shape
    kv = wk.shape[1] // 8
    q = (x @ wq).view(b, t, 4, 8).transpose(1, 2)
    k = (x @ wk).view(b, t, kv, 8).transpose(1, 2)
    v = (x @ wv).view(b, t, kv, 8).transpose(1, 2)
    q = q * cos + q.flip(-1) * sin
    k = k * cos + k.flip(-1) * sin
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv > 1)
    loss = o.square().mean()
    loss.backward()
    return loss


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_regions_reading_flash_attention_gradients_run_their_kernel(kv_heads):
    """The fused backward's gradients carry the layout the program's kernel gives them (for one key/value head the
    flash kernel's, where eager runs its math kernel: recorded so at trace time, no copy into another layout): a region
    compiled for a wrong layout failed its stride check and ran its torch ops on every call (fusion_fallback_calls)."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 32)
    cos, sin = torch.randn(6, 8), torch.randn(6, 8)
    ws = [torch.randn(32, 32, requires_grad=True)] + [torch.randn(32, 8 * kv_heads, requires_grad=True) for _ in range(2)]
    mine = [w.detach().clone().requires_grad_() for w in ws]
    cf = tt.compile(_attention_step, fusion="inductor")
    for _ in range(2):
        torch.testing.assert_close(cf(x, *mine, cos, sin), _attention_step(x, *ws, cos, sin), rtol=1e-4, atol=1e-5)
        for a, b in zip(mine, ws):  # fused sums round differently
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)
    assert any("= inductor_" in ln for ln in str(tt.last_traces(cf)[-1]).splitlines())
    assert tt.compile_stats(cf).fusion_fallback_calls == 0


def _norm_and_rotary_step(x, w, cos, sin):
    # Llama's RMSNorm and rotary embedding: expands, slices and a cat between the elementwise ops.
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    r = torch.cat((-h[..., 4:], h[..., :4]), dim=-1)
    loss = (h * cos + r * sin).square().mean()
    loss.backward()
    return loss


def _fused_like_eager(step):
    """``step`` compiled with Inductor fusion, checked against eager over two calls (loss and gradient)."""
    torch.manual_seed(0)
    x, cos, sin = torch.randn(2, 6, 8), torch.randn(6, 8), torch.randn(6, 8)
    w = torch.randn(8, requires_grad=True)
    mine = w.detach().clone().requires_grad_()
    cf = tt.compile(step, fusion="inductor")
    for _ in range(2):
        torch.testing.assert_close(cf(x, mine, cos, sin), step(x, w, cos, sin), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(mine.grad, w.grad, rtol=1e-4, atol=1e-4)
    return cf


def test_views_and_cat_join_a_region():
    """RMSNorm and rotary embedding fuse into one kernel with the slices and the cat between their ops (they split
    it into kernels too small to fuse)."""
    cf = _fused_like_eager(_norm_and_rotary_step)
    notes = tt.compile_stats(cf).fusion_notes
    assert not any("failed" in n for n in notes), notes
    regions = [" ".join(str(s) for s in b.subsymbols) for b in tt.last_traces(cf)[-1].bound_symbols if b.sym.module == "inductor"]
    assert any("rsqrt" in r and "torch.cat" in r and "__getitem__" in r for r in regions), regions
    assert tt.compile_stats(cf).fusion_fallback_calls == 0


def _unfused_calls(cf) -> list:
    """The names of the torch calls the fused program makes outside its kernels."""
    return [getattr(b.sym, "name", "") for b in tt.last_traces(cf)[-1].bound_symbols if b.sym.module == "torch_executor"]


def test_slice_gradients_and_clones_join_a_region():
    """The gradient of a slice (a constant pad: rotary embedding's halves in the backward) and a clone of a region's
    value (Falcon's key, concatenated to an empty cache) are written by the kernel with their neighbours; they ran
    on torch between two kernels."""
    def step(x, w, cos, sin):
        h = x * w
        r = torch.cat((-h[..., 4:], h[..., :4]), dim=-1)
        k = (h * cos + r * sin).clone()
        loss = (k * k.sigmoid()).sum()
        loss.backward()
        return loss

    cf = _fused_like_eager(step)
    regions = [" ".join(str(s) for s in b.subsymbols) for b in tt.last_traces(cf)[-1].bound_symbols if b.sym.module == "inductor"]
    assert any("ttex.pad" in r for r in regions) and any(".clone(" in r for r in regions), regions
    assert not {"pad", "clone"} & set(_unfused_calls(cf)), _unfused_calls(cf)
    assert tt.compile_stats(cf).fusion_fallback_calls == 0


def test_constants_are_computed_once_not_fused():
    """A mask built from sizes alone is computed at the first call (executors/constants.py), not in a kernel with
    the ops that read the inputs: Falcon's first region computed its causal mask on every call."""
    def fn(x):
        i = torch.arange(x.shape[-1])
        mask = (i[None, :] <= i[:, None]).float() * 2.0 - 1.0
        return torch.sin(x) * mask + 1.0

    x = torch.randn(6, 6)
    cf = tt.compile(fn, fusion="inductor")
    for _ in range(2):
        torch.testing.assert_close(cf(x), fn(x))
    trace = tt.last_traces(cf)[-1]
    regions = [" ".join(str(s) for s in b.subsymbols) for b in trace.bound_symbols if b.sym.module == "inductor"]
    assert len(regions) == 1 and "sin" in regions[0] and " le(" not in regions[0] and ".le(" not in regions[0], regions
    assert "ttex.folded_constants" in str(trace)
