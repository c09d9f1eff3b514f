"""Rewrites that call a specific ATen kernel run it only where eager would (issue 25, item 5).

``transforms/saved_statistics.py`` replaces a forward/backward pair by direct calls of the kernels eager runs
for it.  Where eager picks another kernel for the same call (attention on q/k/v whose last dimension is
strided takes the math kernel on the CPU, not flash), the rewrite must not happen: the whole step then
trains exactly as eager.  Each case trains a few steps eagerly and compiled and compares after every step.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import thunder_train as tt


class PackedAttention(torch.nn.Module):
    """A diffusion-style attention block (trained with SGD: the gradient of k's bias is zero up to rounding, which
    Adam would amplify to the learning rate): q, k and v are views of one packed 1x1 projection of a feature map,
    laid out (batch, heads, pixels, head_dim) with head_dim strided (stride = pixels)."""

    def __init__(self, channels=32, heads=2):
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.GroupNorm(4, channels)
        self.qkv = torch.nn.Conv1d(channels, 3 * channels, 1)
        self.out = torch.nn.Conv1d(channels, channels, 1)

    def forward(self, x):
        b, c, n = x.shape
        qkv = self.qkv(self.norm(x)).view(b, 3, self.heads, c // self.heads, n)
        q, k, v = qkv.permute(1, 0, 2, 4, 3).unbind(0)  # last-dim stride n, not 1
        a = F.scaled_dot_product_attention(q, k, v)
        return x + self.out(a.transpose(-1, -2).reshape(b, c, n))


class TransposedAttention(PackedAttention):
    """The same projection viewed (batch, heads, pixels, head_dim) with head_dim contiguous: eager takes flash."""

    def forward(self, x):
        b, c, n = x.shape
        qkv = self.qkv(self.norm(x)).transpose(1, 2).contiguous().view(b, n, 3, self.heads, c // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(a.transpose(1, 2).reshape(b, n, c).transpose(1, 2))


def _step(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _train_both(make, steps=4, **compile_kw):
    torch.manual_seed(0)
    me = make()
    mc = copy.deepcopy(me)
    oe = torch.optim.SGD(me.parameters(), lr=0.1, momentum=0.9)
    oc = torch.optim.SGD(mc.parameters(), lr=0.1, momentum=0.9)
    cf = tt.compile(_step, **compile_kw)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x, y = torch.randn(2, 32, 24, generator=g), torch.randn(2, 32, 24, generator=g)
        torch.testing.assert_close(cf(mc, oc, x, y), _step(me, oe, x, y), rtol=1e-5, atol=1e-6, msg=lambda m: f"loss {i}: {m}")
        for (n, pe), pc in zip(me.named_parameters(), mc.parameters()):
            torch.testing.assert_close(pc, pe, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {i} {n}: {m}")
    return cf


@pytest.mark.parametrize("thin", [False, True])
def test_strided_qkv_whole_step_matches_eager(thin):
    cf = _train_both(PackedAttention, thin=thin)
    assert "sdpa_flash_cpu" not in str(tt.last_traces(cf)[-1])  # eager's math kernel: the call stays SDPA


def test_contiguous_head_dim_keeps_the_flash_rewrite():
    cf = _train_both(TransposedAttention)
    assert "sdpa_flash_cpu" in str(tt.last_traces(cf)[-1])


def _kernels(fn, *args):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn(*args)
    return out, {e.name for e in prof.events()}


def test_backend_switch_after_tracing_is_eagers_choice():
    """A call under ``sdpa_kernel(MATH)`` after the step was traced (with flash) runs eager's math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    me = TransposedAttention()
    mc = copy.deepcopy(me)
    oe, oc = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (me, mc))
    cf = tt.compile(_step)
    g = torch.Generator().manual_seed(1)
    flash = "aten::_scaled_dot_product_flash_attention_for_cpu"
    for i in range(3):
        x, y = torch.randn(2, 32, 24, generator=g), torch.randn(2, 32, 24, generator=g)
        with sdpa_kernel(SDPBackend.MATH) if i == 2 else torch.enable_grad():
            le, eager_ran = _kernels(_step, me, oe, x, y)
            lc, compiled_ran = _kernels(cf, mc, oc, x, y)
        assert (flash in eager_ran) == (flash in compiled_ran) == (i < 2), i
        torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
        for (n, pe), pc in zip(me.named_parameters(), mc.parameters()):
            torch.testing.assert_close(pc, pe, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {i} {n}: {m}")
    assert "sdpa_flash_cpu" in str(tt.last_traces(cf)[-1])


class AttentionUnderSwitches(torch.nn.Module):
    """Attention whose forward picks its SDPA backends itself (``with sdpa_kernel(...)`` inside the model)."""

    def __init__(self, backends, dropout_p=0.0):
        super().__init__()
        self.backends, self.dropout_p = backends, dropout_p
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x):
        from torch.nn.attention import sdpa_kernel
        q, k, v = self.qkv(x).view(2, 64, 3, 2, 16).permute(2, 0, 3, 1, 4).contiguous().unbind(0)
        with sdpa_kernel(self.backends):
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout_p)
        return a.square().mean()


def _attention_step(m, opt, x):
    loss = m(x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize("thin", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_sdpa_kernel_context_inside_the_step_is_replayed_on_every_call(thin, dropout_p):
    """The math kernel the model asks for inside its forward runs on every call (flash, which the caller's
    switches allow, rounds differently and draws its dropout mask differently): bitwise eager's losses,
    parameters and generator state, also when the caller's switches change between calls."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    eager = AttentionUnderSwitches(SDPBackend.MATH, dropout_p)
    compiled = copy.deepcopy(eager)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled)]
    step = tt.compile(_attention_step, thin=thin)
    for i in range(4):
        x = torch.randn(2, 64, 32)
        outside = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH] if i < 2 else [SDPBackend.MATH]
        with sdpa_kernel(outside):
            state = torch.get_rng_state()
            want = _attention_step(eager, opts[0], x)
            eager_state = torch.get_rng_state()
            torch.set_rng_state(state)
            got = step(compiled, opts[1], x)
        assert torch.equal(got, want), i
        assert torch.equal(torch.get_rng_state(), eager_state)
        for a, b in zip(eager.parameters(), compiled.parameters()):
            assert torch.equal(a, b), i
    assert "sdpa_with_math" in str(tt.last_traces(step)[-1])


def test_switches_set_outside_are_not_baked_in():
    """Without a context inside the function the program calls attention under the caller's switches, as eager."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (torch.randn(2, 2, 64, 16) for _ in range(3))
    f = tt.compile(attend)
    for backends in ([SDPBackend.MATH], [SDPBackend.FLASH_ATTENTION], [SDPBackend.MATH]):
        with sdpa_kernel(backends):
            assert torch.equal(f(q, k, v), attend(q, k, v)), backends
    assert "sdpa_with" not in str(tt.last_traces(f)[-1])


def _precision_step(model, opt, x):
    """A model that asks for TF32 ("high") float32 matmul precision around part of its forward, as some training
    code does for speed, and restores the caller's."""
    h = model[0](x)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        h = torch.tanh(model[1](h)) @ h.t()
    finally:
        torch.set_float32_matmul_precision(before)
    loss = h.square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize("thin", [False, True])
def test_matmul_precision_set_inside_the_step_is_replayed_on_every_call(thin, monkeypatch):
    """The matmuls traced under the function's own precision switches set them on every call (on CUDA they would
    otherwise run in the caller's precision: TF32 or not), and put the caller's back; eager's values here."""
    from thunder_train.compiler.torchlang import matmul_precision

    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    compiled = copy.deepcopy(eager)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled)]
    step = tt.compile(_precision_step, thin=thin)
    for i in range(3):
        x = torch.randn(4, 8)
        torch.testing.assert_close(step(compiled, opts[1], x), _precision_step(eager, opts[0], x))
        assert torch.get_float32_matmul_precision() == "highest"
    written = []
    monkeypatch.setattr(matmul_precision, "_write", lambda sw, w=matmul_precision._write: (written.append(sw), w(sw)))
    x = torch.randn(4, 8)
    torch.testing.assert_close(step(compiled, opts[1], x), _precision_step(eager, opts[0], x))  # a call after tracing:
    # the recorded lines set the switches (the eager call after it writes none: monkeypatched module function)
    assert [sw[0] for sw in written[:2]] == ["high", "highest"] and torch.get_float32_matmul_precision() == "highest"
    src = str(tt.last_traces(step)[-1])
    assert "linear_with_precision_high" in src and "matmul_with_precision_high" in src
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(a, b)


def test_matmul_precision_set_outside_is_not_baked_in():
    f = tt.compile(lambda a, b: a @ b)
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    torch.set_float32_matmul_precision("high")
    try:
        torch.testing.assert_close(f(a, b), a @ b)
    finally:
        torch.set_float32_matmul_precision("highest")
    torch.testing.assert_close(f(a, b), a @ b)
    assert "with_precision" not in str(tt.last_traces(f)[-1])


class MaskedAttention(torch.nn.Module):
    """Attention over a padded batch, as transformers' GPT-2 and Llama call it: a key-padding mask (boolean or
    additive, per row or broadcast over the batch) and no ``is_causal``."""

    def __init__(self, mask_kind, channels=16, heads=2):
        super().__init__()
        self.heads, self.kind = heads, mask_kind
        self.qkv = torch.nn.Linear(channels, 3 * channels)
        self.out = torch.nn.Linear(channels, channels)

    def forward(self, x, lengths):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        keep = (torch.arange(n)[None, :] < lengths[:, None])[:, None, None, :] & torch.ones(n, n, dtype=torch.bool).tril()
        if self.kind == "broadcast":
            keep = keep[:1]
        mask = keep if self.kind != "additive" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(a.transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize("kind", ["bool", "additive", "broadcast"])
def test_masked_attention_reads_its_forward_statistics_and_trains_bitwise_as_eager(kind):
    # The flash kernel with the mask eager passes it: the backward reads the forward's log-sum-exp instead of running
    # the forward again under autograd.  Lengths change every step (automatic dynamic shapes: symbolic from the second).
    torch.manual_seed(0)
    me = MaskedAttention(kind)
    mc = copy.deepcopy(me)
    oe, oc = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (me, mc))

    def step(model, opt, x, lengths, y):
        loss = F.mse_loss(model(x, lengths), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    cf = tt.compile(step, thin=True)
    g = torch.Generator().manual_seed(1)
    for i, n in enumerate((9, 12, 7, 10, 12)):
        x, y = torch.randn(3, n, 16, generator=g), torch.randn(3, n, 16, generator=g)
        lengths = torch.randint(1, n + 1, (3,), generator=g)
        lengths[0] = n
        assert torch.equal(cf(mc, oc, x, lengths, y), step(me, oe, x, lengths, y)), i
        for (name, pe), pc in zip(me.named_parameters(), mc.parameters()):
            assert torch.equal(pc, pe), (i, name)
    src = str(tt.last_traces(cf)[-1])
    fwd = {"bool": "sdpa_flash_cpu_bool_masked(", "broadcast": "sdpa_flash_cpu_bool_masked(", "additive": "sdpa_flash_cpu_masked("}
    assert fwd[kind] in src and "sdpa_flash_cpu_backward(" in src and "vjp_scaled_dot_product" not in src
    assert tt.compile_stats(cf).cache_misses == 2


class GroupedQueryAttention(TransposedAttention):
    """Four query heads sharing two key/value heads (``enable_gqa=True``, as Llama, Mistral and Qwen2 call it):
    eager's CPU flash kernels take the two key/value heads as they are, forward and backward."""

    def __init__(self, channels=32):
        super().__init__(channels, heads=4)
        self.qkv = torch.nn.Conv1d(channels, 2 * channels, 1)  # q: 4 heads of 8, k and v: 2 heads of 8

    def forward(self, x):
        b, c, n = x.shape
        h = self.qkv(self.norm(x)).transpose(1, 2).contiguous()  # head_dim contiguous: eager takes flash
        q = h[..., :c].reshape(b, n, 4, c // 4).transpose(1, 2)
        k, v = (h[..., c + i * c // 2:c + (i + 1) * c // 2].reshape(b, n, 2, c // 4).transpose(1, 2) for i in range(2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return x + self.out(a.transpose(1, 2).reshape(b, n, c).transpose(1, 2))


@pytest.mark.parametrize("thin", [False, True])
def test_grouped_query_attention_takes_eagers_flash_kernels(thin):
    cf = _train_both(GroupedQueryAttention, thin=thin)
    src = str(tt.last_traces(cf)[-1])
    assert "sdpa_flash_cpu(" in src and "sdpa_flash_cpu_backward(" in src and "vjp_scaled_dot_product" not in src


class StridedAttention(torch.nn.Module):
    """q, k and v viewed from one projection with the head dimension strided (stride = heads) and a boolean causal
    mask: eager's CPU selector takes the math kernel for them (``_safe_softmax``), not flash."""

    def __init__(self, channels=32, heads=4):
        super().__init__()
        self.heads, self.d = heads, channels // heads
        self.qkv = torch.nn.Linear(channels, 3 * channels, bias=False)
        self.out = torch.nn.Linear(channels, channels)

    def forward(self, x, checkpointed=False):
        b, n, c = x.shape
        h = self.qkv(x).view(b, n, 3, self.d, self.heads)
        q, k, v = (h[:, :, i].permute(0, 3, 1, 2) for i in range(3))  # (b, heads, n, d), d strided
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None].expand(b, 1, n, n)
        attend = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
        a = torch.utils.checkpoint.checkpoint(attend, q, k, v, use_reentrant=False) if checkpointed else attend(q, k, v)
        return x + self.out(a.transpose(1, 2).reshape(b, n, c))


class _AtenCounts(torch.utils._python_dispatch.TorchDispatchMode):
    thunder_train_observes = True  # counts the compiled program's aten calls (thunder_train's acquisition/ambient.py)

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("checkpointed", [False, True])
def test_math_kernel_attention_keeps_eagers_graph_and_trains_bitwise_as_eager(checkpointed):
    # A call eager runs with another kernel than flash: its forward keeps eager's autograd graph and the backward
    # runs it (eager's kernels: bitwise eager's values), instead of running the forward a second time for it.
    torch.manual_seed(0)
    me = StridedAttention()
    mc = copy.deepcopy(me)
    oe, oc = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (me, mc))

    def step(model, opt, x, y):
        loss = F.mse_loss(model(x, checkpointed), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    cf = tt.compile(step, thin=True)
    g = torch.Generator().manual_seed(1)
    for i in range(4):
        x, y = torch.randn(2, 12, 32, generator=g), torch.randn(2, 12, 32, generator=g)
        assert torch.equal(cf(mc, oc, x, y), step(me, oe, x, y)), i
        for (name, pe), pc in zip(me.named_parameters(), mc.parameters()):
            assert torch.equal(pc, pe), (i, name)
    src = str(tt.last_traces(cf)[-1])
    if checkpointed:  # the user asked for memory: no graph (attention probabilities) is kept from forward to backward
        assert "sdpa_keeping_graph(" not in src and "vjp_scaled_dot_product" in src
        return
    assert src.count("sdpa_keeping_graph(") == 1 and "sdpa_graph_backward(" in src and "vjp_scaled_dot_product" not in src
    with _AtenCounts() as seen:
        cf(mc, oc, x, y)
    assert seen.counts[torch.ops.aten._safe_softmax.default] == 1  # the forward runs once


class LearnedBiasAttention(torch.nn.Module):
    """Attention whose additive mask is a learned bias (T5's relative position bias), broadcast over the batch (and
    the heads) or full, plus a padding mask as T5 adds it: eager takes the math kernel (the mask requires grad)."""

    def __init__(self, bias_shape, channels=32, heads=4, n=12):
        super().__init__()
        self.heads, self.d = heads, channels // heads
        self.qkv = torch.nn.Linear(channels, 3 * channels, bias=False)
        self.out = torch.nn.Linear(channels, channels)
        self.bias = torch.nn.Parameter(torch.randn(bias_shape) * 0.5)
        self.register_buffer("padding", torch.zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -1e9))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.d).unbind(2)
        mask = self.bias + self.padding if self.bias.dim() == 4 else self.bias
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=1.0)
        return x + self.out(a.transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize("bias_shape", [(1, 4, 12, 12), (2, 4, 12, 12), (12, 12), (4, 1, 12)])
def test_attention_with_a_learned_mask_trains_as_eager(bias_shape):
    # Eager takes its math kernel (the mask requires grad).  The trace records the call as that kernel (its layout:
    # row-major, where flash's is (batch, seq, heads, dim)), and the program runs it keeping what eager's graph keeps,
    # its backward by eager's formulas, without copies: bitwise eager's losses and parameters (attention_math.py).
    torch.manual_seed(0)
    me = LearnedBiasAttention(bias_shape)
    mc = copy.deepcopy(me)
    oe, oc = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (me, mc))
    cf = tt.compile(_step, thin=True)
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        x, y = torch.randn(2, 12, 32, generator=g), torch.randn(2, 12, 32, generator=g)
        assert torch.equal(cf(mc, oc, x, y), _step(me, oe, x, y)), i
        for (name, pe), pc in zip(me.named_parameters(), mc.parameters()):
            assert torch.equal(pc, pe), (i, name)
    src = str(tt.last_traces(cf)[-1])
    assert "sdpa_math_with_probs(" in src and "sdpa_math_backward(" in src and "laid_out_as(" not in src


def test_attention_with_a_learned_mask_is_eagers_where_no_pair_applies():
    # Under activation checkpointing (no kept probabilities) and through tt.compile(model) (the backward a separate
    # program) the line still runs eager's math kernel and a TorchVJP of it: eager's autograd nodes, bitwise.
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    me = LearnedBiasAttention((1, 4, 12, 12))
    mc = copy.deepcopy(me)
    oe, oc = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (me, mc))

    def step(model, opt, x, y):
        loss = F.mse_loss(checkpoint(model, x, use_reentrant=False), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    cf = tt.compile(step)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 12, 32, generator=g), torch.randn(2, 12, 32, generator=g)
    assert torch.equal(cf(mc, oc, x, y), step(me, oe, x, y))
    assert all(torch.equal(pc, pe) for pc, pe in zip(mc.parameters(), me.parameters()))
    assert "sdpa_math_backward(" not in str(tt.last_traces(cf)[-1])
    mm = copy.deepcopy(me)
    want, got = me(x), tt.compile(mm)(x)
    assert torch.equal(got, want)
    want.square().sum().backward()
    got.square().sum().backward()
    assert all(torch.equal(pc.grad, pe.grad) for pc, pe in zip(mm.parameters(), me.parameters()))


def masked_attention_step(q, k, v, mask, w):
    """q, k, v laid out (batch, seq, heads, dim) and viewed (batch, heads, seq, dim), as models make them; a scale given."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=0.3)
    loss = (out * w).sum()
    loss.backward()
    return loss, out.detach()


@pytest.mark.parametrize("mask_shape", [(2, 3, 5, 7), (1, 3, 5, 7), (5, 7), (3, 1, 7)])
def test_gradients_of_attention_and_its_mask_are_eagers_bitwise(mask_shape):
    f = masked_attention_step
    gen = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    inputs = [make(2, 5, 3, 4), make(2, 7, 3, 4), make(2, 7, 3, 6), make(*mask_shape), make(2, 3, 5, 6)]
    eager, compiled = ([t.clone().requires_grad_(i < 4) for i, t in enumerate(inputs)] for _ in range(2))
    want = f(*eager)
    cf = tt.compile(f)
    got = cf(*compiled)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[1].stride() == want[1].stride()
    for i, (a, b) in enumerate(zip(eager[:4], compiled[:4])):
        assert torch.equal(a.grad, b.grad), i
    src = str(tt.last_traces(cf)[-1])
    assert "sdpa_math_backward(" in src and "vjp_scaled_dot_product" not in src
