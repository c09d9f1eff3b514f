"""Attention with value heads narrower than the query and key heads (DeepSeek-V3's latent attention).

Eager runs its math kernel for such a call.  The torch program keeps that kernel's autograd graph (eager's bits);
a fused program runs the CPU flash pair on the value padded with zero columns (executors/narrow_value_attention.py),
which rounds as flash rounds, or for small attention the pair's lines compiled whole as products
(executors/attention_products.py).  Each case trains a few steps eagerly and compiled and compares after every step.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import thunder_train as tt
from _inductor import cxx_available
from thunder_train.compiler.executors import attention_products

needs_inductor = pytest.mark.skipif(not cxx_available(), reason="Inductor's CPU backend needs a C++ compiler (none found)")


class NarrowValueAttention(torch.nn.Module):
    """q and k of head width 16, v of width 8 (made by one projection, split as DeepSeek-V3 splits it: v is a
    strided view); ``frozen_query``: q from the input alone (no gradient asked for it)."""

    def __init__(self, is_causal=True, scale=0.25, frozen_query=False, heads=4, qk=16, v=8, channels=32):
        super().__init__()
        self.is_causal, self.scale, self.frozen_query = is_causal, scale, frozen_query
        self.heads, self.qk, self.v = heads, qk, v
        self.q = torch.nn.Linear(channels, heads * qk, bias=False)
        self.kv = torch.nn.Linear(channels, heads * (qk + v), bias=False)
        self.out = torch.nn.Linear(heads * v, channels, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q = (self.q(x).detach() if self.frozen_query else self.q(x)).view(b, n, self.heads, self.qk).transpose(1, 2)
        k, v = self.kv(x).view(b, n, self.heads, self.qk + self.v).transpose(1, 2).split([self.qk, self.v], dim=-1)
        a = F.scaled_dot_product_attention(q, k.contiguous(), v, is_causal=self.is_causal, scale=self.scale)
        return x + self.out(a.transpose(1, 2).reshape(b, n, self.heads * self.v)), a


def _step(model, opt, x, y):
    out, a = model(x)
    loss = F.mse_loss(out, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss, a


def _train_both(model, steps=3, exact=False, switch=None, keep=None, **compile_kw):
    torch.manual_seed(0)
    me, mc = model, copy.deepcopy(model)
    oe, oc = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (me, mc))
    cf = tt.compile(_step, thin=True, **compile_kw)
    if keep is not None:
        keep.append(cf)
    g = torch.Generator().manual_seed(1)
    close = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    for i in range(steps):
        x, y = torch.randn(2, 12, 32, generator=g), torch.randn(2, 12, 32, generator=g)
        with switch() if switch is not None and i == steps - 1 else torch.enable_grad():
            (le, ae), (lc, ac) = _step(me, oe, x, y), cf(mc, oc, x, y)
        assert close(lc, le) and close(ac, ae), i
        assert ac.stride() == ae.stride(), (ac.stride(), ae.stride())  # the traced (eager's) layout
        for (n, pe), pc in zip(me.named_parameters(), mc.parameters()):
            assert close(pc, pe), (i, n, (pc - pe).abs().max())
    return str(tt.last_traces(cf)[-1])


def _lines(src) -> str:
    """The trace's lines that run (not the comments, which show a fused kernel's original lines)."""
    return "\n".join(ln for ln in src.splitlines() if not ln.lstrip().startswith("#"))


@needs_inductor
@pytest.mark.parametrize("is_causal,scale,frozen_query", [(True, 0.25, False), (False, None, False), (True, None, True)])
def test_fused_program_runs_flash_on_the_padded_value_and_trains_as_eager(is_causal, scale, frozen_query, monkeypatch):
    monkeypatch.setattr(attention_products, "SMALL_SCORES", 0)  # no attention small enough for the products
    src = _lines(_train_both(NarrowValueAttention(is_causal, scale, frozen_query), fusion="inductor"))
    assert "= ttex.sdpa_flash_cpu_narrow_value(" in src and "= ttex.sdpa_flash_cpu_narrow_value_backward(" in src, src
    assert "sdpa_keeping_graph(" not in src


@needs_inductor
@pytest.mark.parametrize("is_causal,scale,frozen_query", [(True, 0.25, False), (False, None, False), (True, None, True)])
def test_small_attention_in_a_fused_program_runs_as_products_and_trains_as_eager(is_causal, scale, frozen_query):
    # executors/attention_products.py: the pair's two lines compiled whole, no padding; values within tolerance.
    cf = []
    src = _train_both(NarrowValueAttention(is_causal, scale, frozen_query), fusion="inductor", keep=cf)
    assert "sdpa_flash_cpu_narrow_value compiled whole" in src and "sdpa_flash_cpu_narrow_value_backward compiled whole" in src
    assert "narrow_value" not in _lines(src) and "sdpa_keeping_graph(" not in src
    assert tt.compile_stats(cf[0]).fusion_fallback_calls == 0


@needs_inductor
@pytest.mark.parametrize("small", [True, False])
def test_fused_program_with_the_math_kernel_switched_off_raises_eagers_error(small, monkeypatch):
    # Flash takes one width for q, k and v, so eager's only kernel for this call is the math one: switched off after
    # tracing, eager raises, and so does the compiled step (its checks see the switch changed; tracing again meets
    # eager's error), instead of computing what eager refuses with the products or flash on the padded value.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not small:
        monkeypatch.setattr(attention_products, "SMALL_SCORES", 0)
    cf = []
    _train_both(NarrowValueAttention(), fusion="inductor", keep=cf)
    model = NarrowValueAttention()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(2, 12, 32), torch.randn(2, 12, 32)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        with pytest.raises(RuntimeError, match="No available kernel"):
            _step(copy.deepcopy(model), opt, x, y)
        with pytest.raises(RuntimeError, match="No available kernel"):
            cf[0](model, opt, x, y)


def test_torch_program_keeps_eagers_math_kernel_bitwise():
    src = _train_both(NarrowValueAttention(), exact=True, fusion=None)
    assert "sdpa_keeping_graph(" in src and "narrow_value" not in src


@needs_inductor
def test_fused_program_under_a_math_only_switch_runs_eagers_call(monkeypatch):
    # The backend switches are process state: flash switched off after tracing, the pair runs eager's call (and its
    # gradients by autograd), as eager does.  (Small attention runs as products, which call no flash kernel either.)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    monkeypatch.setattr(attention_products, "SMALL_SCORES", 0)

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    calls = []

    class Seen(torch.utils._python_dispatch.TorchDispatchMode):
        thunder_train_observes = True  # sees the compiled program's aten calls (acquisition/ambient.py)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))

    def math_only_and_watched():
        import contextlib
        stack = contextlib.ExitStack()
        stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        stack.enter_context(Seen())
        return stack

    src = _train_both(NarrowValueAttention(), switch=math_only_and_watched, fusion="inductor")
    assert "sdpa_flash_cpu_narrow_value(" in src
    assert calls and flash not in calls


@needs_inductor
def test_checkpointed_attention_keeps_no_padded_output():
    # A program that asks for memory keeps neither eager's graph nor the pair's padded output across the step.
    class Checkpointed(NarrowValueAttention):
        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=False)

    src = _train_both(Checkpointed(), fusion="inductor")
    assert "narrow_value" not in src and "sdpa_keeping_graph(" not in src


@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("which", [(0, 1, 2), (1, 2), (0,)])
@pytest.mark.parametrize("n,s", [(12, 12), (5, 9), (9, 5)])
def test_products_compute_what_the_flash_pair_computes(is_causal, scale, which, n, s):
    # The product forms (executors/attention_products.py) against the pair's own functions, in float64 where both
    # round far below the comparison: same results, same shapes, for queries and keys of other counts too.
    from thunder_train.compiler.executors.narrow_value_attention import sdpa_flash_cpu_narrow_value, \
        sdpa_flash_cpu_narrow_value_backward

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, n, 3, 16, generator=gen, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(2, s, 3, 16, generator=gen, dtype=torch.float64).transpose(1, 2)
    v = torch.randn(2, s, 3, 8, generator=gen, dtype=torch.float64).transpose(1, 2)
    strides = q.new_empty(2, n, 3, 8).transpose(1, 2).stride()
    want = sdpa_flash_cpu_narrow_value(q, k, v, strides, is_causal, scale)
    got = attention_products.narrow_value_by_products(q, k, v, strides, is_causal, scale)
    assert [t.shape for t in got] == [t.shape for t in want] and got[2].dtype == want[2].dtype
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g = torch.randn(want[0].shape, generator=gen, dtype=torch.float64)
    args = (g, q, k, v, want[1], want[2], is_causal, scale, which)
    want_grads = sdpa_flash_cpu_narrow_value_backward(*args, tuple((q, k, v)[i].stride() for i in which))
    got_grads = attention_products.narrow_value_backward_by_products(*args, None)
    torch.testing.assert_close(got_grads, want_grads, rtol=1e-12, atol=1e-12)


def test_only_small_float_attention_takes_the_products():
    from thunder_train.compiler.proxies import TensorProxy
    from thunder_train.compiler import dtypes

    def proxy(shape, dtype=dtypes.float32):
        return TensorProxy(f"t{len(shape)}", shape=shape, dtype=dtype, device="cpu")

    limit = attention_products.SMALL_SCORES
    assert attention_products.small(proxy((1, 1, limit // 16, 16)), proxy((1, 1, 16, 16)))
    assert not attention_products.small(proxy((1, 1, limit // 16 + 1, 16)), proxy((1, 1, 16, 16)))
    assert not attention_products.small(proxy((1, 1, 8, 16), dtypes.bfloat16), proxy((1, 1, 8, 16), dtypes.bfloat16))
