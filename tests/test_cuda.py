"""The CUDA path through the torch executor. Skipped where no GPU is present."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from _models import train_step  # noqa: E402
from _steps import squared_output_step  # noqa: E402
from test_recorded_layouts import audit, norm_and_gelu_strides_are_recorded  # noqa: E402,F401  (audit: a fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def f(x, w):
    y = F.gelu(x @ w)
    return y.reshape(y.size(0), -1).softmax(-1)


@pytest.mark.parametrize("decompose", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_function_on_cuda(decompose, dtype):
    x = torch.randn(64, 128, device="cuda", dtype=dtype)
    w = torch.randn(128, 32, device="cuda", dtype=dtype)
    cf = tt.compile(f, decompose=decompose)
    out = cf(x, w)
    assert out.device.type == "cuda" and out.dtype == dtype
    tol = {} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, f(x, w), **tol)
    assert '"cuda:0 ' in str(tt.last_traces(cf)[-1])


def test_module_on_cuda_and_device_change_retraces():
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8))
    cm = tt.compile(m)
    x = torch.randn(16, 32)
    torch.testing.assert_close(cm(x), m(x))
    m.cuda()
    xc = x.cuda()
    out = cm(xc)
    assert out.device.type == "cuda"
    torch.testing.assert_close(out, m(xc))
    assert any("cuda" in r for r in tt.compile_stats(cm).retrace_reasons)


def test_factories_follow_the_device():
    def g(x):
        return x + torch.arange(x.shape[-1], device=x.device) + torch.ones_like(x)

    x = torch.randn(4, 8, device="cuda")
    for decompose in (False, True):
        torch.testing.assert_close(tt.compile(g, decompose=decompose)(x), g(x))


def test_recipe_runs_on_cuda():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, os.path.join(root, "recipes", "train_gpt.py"), "--device", "cuda", "--steps", "30", "--no-progress"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": root},
    )
    assert out.returncode == 0, out.stderr
    assert "device=cuda" in out.stdout and "final_loss=" in out.stdout


@pytest.mark.parametrize("thin", [False, True])
def test_gradients_and_thin_mode_on_cuda(thin):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8)).cuda()
    ref = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8)).cuda()
    ref.load_state_dict(m.state_dict())
    cm = tt.compile(m, thin=thin)
    for step in range(4):
        x = torch.randn(16, 32, device="cuda")
        y = torch.randint(0, 8, (16,), device="cuda")
        F.cross_entropy(cm(x), y).backward()
        F.cross_entropy(ref(x), y).backward()
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda s: f"{n} at step {step}: {s}")
    assert tt.last_backward_traces(cm), "the gradients should come from thunder_train's backward trace"


CUDA_OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),  # step counters on the CPU: the optimizer's own code
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),  # torch._fused_adamw_ on the GPU
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01),  # routed to _fused_sgd_
}


@pytest.mark.parametrize("name", list(CUDA_OPTIMIZERS))
def test_whole_training_step_on_cuda(name):
    step_fn = train_step
    torch.manual_seed(0)
    m1 = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8)).cuda()
    m2 = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8)).cuda()
    m2.load_state_dict(m1.state_dict())
    o1, o2 = CUDA_OPTIMIZERS[name](m1.parameters()), CUDA_OPTIMIZERS[name](m2.parameters())
    step = tt.compile(step_fn, thin=True)
    for _ in range(5):
        x = torch.randn(16, 32, device="cuda")
        y = torch.randint(0, 8, (16,), device="cuda")
        torch.testing.assert_close(step(m2, o2, x, y), step_fn(m1, o1, x, y).detach())
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(q, p, atol=1e-5, rtol=1e-4)
    src = tt.last_traces(step)[-1].python_source()
    assert ("_update" in src) == (name != "adamw")
    if name == "adamw":  # eager's default on CUDA tensors is foreach; so is the traced update
        assert "torch._foreach_lerp" in src


# ---------------------------------------------------------------------------
# Inductor fusion on CUDA (Triton kernels through the same region executor as on the CPU)
# ---------------------------------------------------------------------------
def g_elementwise(x, y):
    z = (x * 0.5 + y.sin()).tanh()
    return z * y - z.exp(), (z * x).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_fusion_on_cuda(dtype):
    x = torch.randn(64, 128, device="cuda", dtype=dtype)
    y = torch.randn(64, 128, device="cuda", dtype=dtype)
    cf = tt.compile(g_elementwise, fusion="inductor")
    tol = {} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(cf(x, y), g_elementwise(x, y), **tol)
    notes = tt.compile_stats(cf).fusion_notes
    assert any("into one Inductor kernel" in n for n in notes), notes
    assert "inductor_fusion_0" in str(tt.last_traces(cf)[-1])
    # Same structure, another compiled function: the kernel is reused, not compiled again.
    cf2 = tt.compile(g_elementwise, fusion="inductor")
    cf2(x, y)
    assert any("reused a kernel" in n for n in tt.compile_stats(cf2).fusion_notes)


def test_inductor_fusion_keeps_devices_apart():
    """A CPU region and a CUDA region in one program are two kernels, each on its own device."""
    def h(a, b):
        return (a * 2 + 1).cos().sum(), (b * 2 + 1).cos().sum()

    a, b = torch.randn(32), torch.randn(32, device="cuda")
    cf = tt.compile(h, fusion="inductor")
    ra, rb = cf(a, b)
    ea, eb = h(a, b)
    torch.testing.assert_close(ra, ea)
    torch.testing.assert_close(rb, eb)
    assert ra.device.type == "cpu" and rb.device.type == "cuda"


@pytest.mark.parametrize("autocast", [False, True])
def test_whole_step_with_inductor_fusion_on_cuda(autocast):
    def step_fn(model, opt, x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    torch.manual_seed(0)
    m1 = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8)).cuda()
    m2 = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8)).cuda()
    m2.load_state_dict(m1.state_dict())
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-2, fused=True)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, fused=True)
    step = tt.compile(step_fn, thin=True, fusion="inductor")
    tol = dict(atol=2e-2, rtol=2e-2) if autocast else dict(atol=1e-5, rtol=1e-4)
    for _ in range(5):
        x = torch.randn(16, 32, device="cuda")
        y = torch.randint(0, 8, (16,), device="cuda")
        torch.testing.assert_close(step(m2, o2, x, y), step_fn(m1, o1, x, y).detach(), **tol)
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(q, p, **tol)
    assert tt.compile_stats(step).thin_calls > 0


class _Attention(nn.Module):
    def __init__(self, d=64, heads=4):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


@pytest.mark.parametrize("autocast", [False, True])
def test_attention_backward_does_not_run_its_forward_again_on_cuda(autocast):
    """On CUDA the attention's forward keeps eager's autograd graph (cuDNN's or flash's kernel, their log-sum-exp) and
    the backward runs it: one forward kernel per attention, not a second one inside the vjp; values are eager's."""
    def step_fn(model, opt, x):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    torch.manual_seed(0)
    m1 = _Attention().cuda()
    m2 = _Attention().cuda()
    m2.load_state_dict(m1.state_dict())
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-2, fused=True)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, fused=True)
    step = tt.compile(step_fn, thin=True, fusion=None)
    tol = dict(atol=2e-2, rtol=2e-2) if autocast else dict(atol=1e-5, rtol=1e-4)
    for i in range(4):
        x = torch.randn(4, 128, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
        torch.testing.assert_close(step(m2, o2, x), step_fn(m1, o1, x).detach(), **tol)
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(q, p, **tol)
    src = str(tt.last_traces(step)[-1])
    assert src.count("sdpa_keeping_graph(") == 1 and "sdpa_graph_backward(" in src, src
    assert "vjp_scaled_dot_product" not in src, src


def test_language_model_loss_is_one_fused_region_on_cuda():
    """A language model's loss under bf16 autocast (logits cast to float32, cross-entropy over class indices, some
    rows ignored): the fused program computes the loss and its gradient by the fusion forms (a log-sum-exp, one pass
    for the gradient) in Inductor's kernels, and trains as eager does."""
    def step_fn(model, opt, x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, -2).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    torch.manual_seed(0)
    m1 = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1000)).cuda()
    m2 = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1000)).cuda()
    m2.load_state_dict(m1.state_dict())
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-3, fused=True)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-3, fused=True)
    step = tt.compile(step_fn, thin=True, fusion="inductor")
    g = torch.Generator("cuda").manual_seed(0)
    for _ in range(4):
        x = torch.randint(0, 1000, (8, 64), device="cuda", generator=g)
        y = torch.randint(0, 1000, (8, 64), device="cuda", generator=g)
        y[:, :5] = -100
        torch.testing.assert_close(step(m2, o2, x, y), step_fn(m1, o1, x, y).detach(), atol=2e-2, rtol=2e-2)
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(q, p, atol=2e-2, rtol=2e-2)
    notes = "\n".join(tt.compile_stats(step).fusion_notes)
    assert "cross_entropy_vjp" in notes, notes
    assert "cross_entropy_with_stats" not in str(tt.last_traces(step)[-1])


def test_norm_and_gelu_backward_strides_are_recorded_on_cuda(audit):
    norm_and_gelu_strides_are_recorded("cuda", audit)


def test_early_updates_run_in_groups_on_cuda():
    """On CUDA the moving optimizer updates run in groups of consecutive parameters (transforms/early_updates.py
    ``CUDA_GROUP_BYTES``): this model's ~1 MiB of gradients make one group, one update call besides the small
    gradients' call, where the CPU makes one per moving parameter; values equal eager's."""
    step_fn = squared_output_step

    def make():
        return nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])

    torch.manual_seed(0)
    m1, m2 = make().cuda(), make().cuda()
    m2.load_state_dict(m1.state_dict())
    o1, o2 = (torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in (m1, m2))
    step = tt.compile(step_fn, thin=True, fusion=None)
    for i in range(3):
        x = torch.randn(32, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
        torch.testing.assert_close(step(m2, o2, x), step_fn(m1, o1, x).detach(), atol=1e-5, rtol=1e-4)
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(q, p, atol=1e-5, rtol=1e-4)
    src = str(tt.last_traces(step)[-1])
    assert src.count("ttex.adam_update_(") <= 2, src
