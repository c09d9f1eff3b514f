"""Every value a compiled step's program computes has the strides its trace recorded (issue #25).

Decisions are taken from the recorded layouts (kept buffers' out forms, fused regions' stride checks, the layouts
of ``.grad`` and of the optimizer's kernels: docs/layout_and_outputs.md), so a value whose real layout differs can
make them wrong silently.  ``codegen.layout_audit``, a debugging hook off by default, makes programs compiled while
it is set report, after each line, every tensor the line made with its recorded shape and strides; here they are
compared with the real tensors' over a few zoo models' training steps.  Strides of dimensions of size one (and of
empty tensors) address nothing and are not compared.

Falcon's multi-query attention runs the CPU flash kernels where eager runs the math kernel: their output is copied
into the recorded layout (eager's, row-major), their gradients are recorded in the flash kernels' layout.  Mixtral's
``expert_mask[e]`` at a 0-d index tensor of a permuted mask is a view with the mask's strides (recorded row-major
before: the meta run took the index as advanced indexing).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import thunder_train as tt
from thunder_train.compiler import codegen

import _zoo
from _steps import squared_output_step


@pytest.fixture
def audit(monkeypatch):
    found = {}

    def check(name, t, shape, strides):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and codegen.layout_differs(t, shape, strides):
            found.setdefault(name, (shape, strides, tuple(t.shape), t.stride()))

    monkeypatch.setattr(codegen, "layout_audit", check)
    return found


def _steps(name, thin, fusion=None):
    model = _zoo.build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = tt.compile(_zoo.train_step, thin=thin, fusion=fusion)
    for b in _zoo.batches(name, 2):
        step(model, opt, b)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert_cls", "vit", "resnet", "lstm", "falcon", "mixtral", "wav2vec2_ctc"])
def test_a_zoo_steps_values_have_their_recorded_strides(name, audit):
    _steps(name, thin=name in ("gpt2", "mixtral"))
    assert not audit, f"name: (recorded shape, recorded strides, real shape, real strides): {audit}"


def test_falcons_fused_step_values_have_their_recorded_strides(audit):
    """The fused program (regions compiled for the recorded layouts) too."""
    _steps("falcon", thin=True, fusion="inductor")
    assert not audit, audit


def test_an_index_tensor_view_of_a_permuted_tensor_has_its_recorded_strides(audit):
    """``w[e]`` at a 0-d index tensor (an argument and a value computed inside) of a non-row-major ``w``, in a step
    with a backward inside and in a forward, values and strides as eager's."""
    def f(w, e, x):
        m = w.permute(2, 1, 0)
        y = (m[e] * x).sum() + (m[x.argmax() % 3] * 2).sum()
        return y, m[e] + 0, m[e].t() * 1

    w = torch.randn(4, 5, 3)
    x = torch.randn(5, 4)
    e = torch.tensor(1)
    cf = tt.compile(f, fusion=None)
    for _ in range(2):
        got, exp = cf(w, e, x), f(w, e, x)
        for a, b in zip(got, exp):
            torch.testing.assert_close(a, b)
            assert a.stride() == b.stride()
    assert not audit, audit


def test_compiled_module_forward_and_backward_values_have_their_recorded_strides(audit):
    model = tt.compile(_zoo.build("resnet"))
    for b in _zoo.batches("resnet", 2):
        model(**b).loss.backward()
    assert not audit, audit


def test_channels_last_module_backward_values_have_their_recorded_strides(audit):
    """Batch and group norm's backward kernels give a channels_last input's gradient channels_last (recorded
    row-major before)."""
    model = tt.compile(_zoo.build("resnet").to(memory_format=torch.channels_last))
    for b in _zoo.batches("resnet", 2):
        b["pixel_values"] = b["pixel_values"].to(memory_format=torch.channels_last)
        model(**b).loss.backward()
    assert not audit, audit


def test_the_audit_sees_a_wrong_record(audit, monkeypatch):
    """The check can fail: a line recorded row-major whose kernel gives another layout."""
    from thunder_train.compiler.executors import saved_statistics

    monkeypatch.setattr(saved_statistics, "_flash_lse_strides", lambda *a: None)  # the log-sum-exp as recorded before
    _steps("gpt2", thin=False)
    assert any(name.startswith("lse") for name in audit), audit


def test_opaque_ops_record_the_layout_their_inputs_give(audit):
    """An op run opaquely (``Tensor.index_put`` has no torch-language symbol) is asked its result's metadata on meta
    tensors; they were made row-major whatever the inputs' layout, so ``index_put`` of a transposed tensor (which
    keeps its strides in eager) was recorded row-major."""
    def f(x, idx, v):
        return (x.transpose(0, 2).index_put((idx,), v) * 2).sum(0)

    for shape in ((5, 4, 3), (3, 5, 20)):
        x, idx, v = torch.randn(*shape), torch.tensor([0]), torch.randn(1, shape[1], shape[0])
        assert torch.equal(tt.compile(f)(x, idx, v), f(x, idx, v))
    assert not audit, audit


class _NormsAndGelu(torch.nn.Module):
    """Conv, group norm, GELU on a transposed view, batch norm (1-d and 2-d: cuDNN's kernels on CUDA); the output
    mixed by fixed weights (a loss not made flat by the last norm)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 8, 3, padding=1)
        self.gn = torch.nn.GroupNorm(2, 8)
        self.bn1 = torch.nn.BatchNorm1d(8)
        self.conv2 = torch.nn.Conv2d(1, 3, 3, padding=1)
        self.bn2 = torch.nn.BatchNorm2d(3)
        self.register_buffer("mix", torch.randn(3, 8, 16))

    def forward(self, x):
        h = self.gn(self.conv(x))
        h = F.gelu(h.transpose(1, 2)).transpose(1, 2)  # GELU's gradient line on non-row-major operands
        h = self.bn1(F.gelu(h))  # and on row-major ones
        return self.bn2(self.conv2(h.unsqueeze(1))) * self.mix


def norm_and_gelu_strides_are_recorded(device, audit):
    """Values equal eager's, and every value of the compiled step (forward, backward, update) has the strides its
    trace recorded (``audit``): the layout rules of GELU's, group norm's and batch norm's backward lines
    (executors/layout_rules.py) say what the device's kernels do.  tests/test_cuda.py runs it on CUDA."""
    torch.manual_seed(0)
    m1 = _NormsAndGelu().to(device)
    m2 = _NormsAndGelu().to(device)
    m2.load_state_dict(m1.state_dict())
    o1, o2 = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (m1, m2))
    step = tt.compile(squared_output_step, thin=True, fusion=None)
    for i in range(3):
        x = torch.randn(4, 4, 16, device=device, generator=torch.Generator(device).manual_seed(i))
        torch.testing.assert_close(step(m2, o2, x), squared_output_step(m1, o1, x).detach(), atol=1e-5, rtol=1e-4)
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(q, p, atol=1e-5, rtol=1e-4)
    assert not audit, f"name: (recorded shape, recorded strides, real shape, real strides): {audit}"
    src = str(tt.last_traces(step)[-1])
    assert "group_norm" in src and "batch_norm" in src and "gelu" in src, src


def test_norm_and_gelu_backward_strides_are_recorded(audit):
    norm_and_gelu_strides_are_recorded("cpu", audit)


def _strided(shape, every=1):
    """A leaf of ``shape``; with ``every`` > 1 a view taking every ``every``-th element of its last dimension."""
    base = torch.randn(*shape[:-1], shape[-1] * every, generator=torch.Generator().manual_seed(sum(shape)))
    return base[..., ::every].detach().requires_grad_() if every == 1 else base.requires_grad_()


# Attention calls eager's selector sends to its math kernel on the CPU: (q, k, v shapes, q/k/v taken transposed from
# (batch, seq, heads, dim) as transformers' models make them, every-other-element last dimension, mask, keywords).
_MATH_ATTENTION = {
    "narrow values, causal": ((2, 4, 16, 24), (2, 4, 16, 24), (2, 4, 16, 16), True, 1, None, {"is_causal": True}),
    "strided last dimension": ((2, 4, 16, 24), (2, 4, 16, 24), (2, 4, 16, 24), False, 2, None, {}),
    "narrow values, float mask": ((2, 4, 16, 24), (2, 4, 12, 24), (2, 4, 12, 8), True, 1, "float", {}),
    "narrow values, bool mask, scale": ((2, 4, 16, 24), (2, 4, 16, 24), (2, 4, 16, 16), False, 1, "bool", {"scale": 0.3}),
    "narrow values, grouped heads": ((2, 4, 16, 24), (2, 2, 16, 24), (2, 2, 16, 16), True, 1, None, {"enable_gqa": True}),
    "three dimensions": ((8, 16, 24), (8, 16, 24), (8, 16, 24), False, 1, None, {}),
}


@pytest.mark.parametrize("case", list(_MATH_ATTENTION))
def test_math_kernel_attention_layouts_come_from_meta_and_are_eagers(case, audit, monkeypatch):
    """A CPU attention eager runs by its math kernel, and its backward, take their layouts from plain meta tensors
    (layout_rules._cpu_attention_on_meta; the fake run cost DeepSeek-V3's first call ~70 ms): the output and the
    gradients equal eager's, values and strides, and every value the program makes has its recorded strides."""
    from torch.nn.attention import SDPBackend

    from thunder_train.compiler.executors import layout_rules
    from thunder_train.compiler.torchlang import attention

    qs, ks, vs, transposed, every, mask_kind, kw = _MATH_ATTENTION[case]
    used = []
    rule = attention.scaled_dot_product_attention.layout_rule

    def spy(bsym, tensors, outs):
        used.append((bsym.sym.module, rule(bsym, tensors, outs)))
        return used[-1][1]

    monkeypatch.setattr(attention.scaled_dot_product_attention, "layout_rule", spy)
    monkeypatch.setattr(attention.scaled_dot_product_attention, "vjp_layout_rule", spy)
    monkeypatch.setattr(layout_rules, "_layouts", {})  # found now, not from an earlier test's run

    def leaf(shape):
        if transposed:  # made (batch, seq, heads, dim), used (batch, heads, seq, dim)
            return _strided((shape[0], shape[2], shape[1], shape[3]), every)
        return _strided(shape, every)

    def f(xq, xk, xv, mask, w):
        q, k, v = ((x[..., ::every] if every > 1 else x) for x in (xq, xk, xv))
        if transposed:
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
        (out * w).sum().backward()
        return out

    mask = None
    if mask_kind == "float":
        mask = torch.randn(qs[-2], ks[-2])
    elif mask_kind == "bool":
        mask = torch.rand(qs[0], 1, qs[-2], ks[-2]) > 0.3
    w = torch.randn(*qs[:-1], vs[-1])
    eager_in = [leaf(s) for s in (qs, ks, vs)]
    tt_in = [x.detach().clone().requires_grad_() for x in eager_in]
    expected = f(*eager_in, mask, w)
    got = tt.compile(f, fusion=None)(*tt_in, mask, w)
    torch.testing.assert_close(got, expected)
    assert got.stride() == expected.stride()
    for a, b in zip(tt_in, eager_in):
        torch.testing.assert_close(a.grad, b.grad)
        assert a.grad.stride() == b.grad.stride()
    assert not audit, f"name: (recorded shape, recorded strides, real shape, real strides): {audit}"
    assert ("ltorch", True) in used and ("vjp", True) in used, used  # both lines found on meta
    # the cases are what they claim: eager's math kernel on the CPU
    q, k, v = ((x[..., ::every] if every > 1 else x) for x in eager_in)
    if transposed:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    m = None if mask is None else mask
    assert torch._fused_sdp_choice(q, k, v, m, 0.0, kw.get("is_causal", False), scale=kw.get("scale"),
                                   enable_gqa=kw.get("enable_gqa", False)) == SDPBackend.MATH.value


# Attention calls eager's CPU selector sends to its flash kernel: (q, k, v shapes as (batch, heads, seq, dim), made
# (batch, seq, heads, dim) and transposed as transformers' models make them, mask, keywords).
_FLASH_ATTENTION = {
    "causal": ((2, 4, 16, 24), (2, 4, 16, 24), (2, 4, 16, 24), True, None, {"is_causal": True}),
    "float mask, scale": ((2, 4, 12, 8), (2, 4, 12, 8), (2, 4, 12, 8), True, "float", {"scale": 1.0}),
    "broadcast float mask, cross": ((2, 4, 6, 8), (2, 4, 12, 8), (2, 4, 12, 8), True, "float1", {}),
    "bool mask": ((2, 4, 16, 24), (2, 4, 16, 24), (2, 4, 16, 24), True, "bool", {}),
    "grouped heads": ((2, 4, 16, 24), (2, 2, 16, 24), (2, 2, 16, 24), True, None, {"enable_gqa": True, "is_causal": True}),
    "row-major operands": ((2, 4, 16, 24), (2, 4, 16, 24), (2, 4, 16, 24), False, None, {}),
    "one query position": ((2, 4, 1, 8), (2, 4, 6, 8), (2, 4, 6, 8), True, "float", {}),
}


@pytest.mark.parametrize("case", list(_FLASH_ATTENTION))
def test_flash_kernel_attention_layout_comes_from_its_meta_kernel_and_is_eagers(case, audit, monkeypatch):
    """Where eager runs the CPU flash kernel (its output laid out as (batch, seq, heads, dim)), the forward line's
    layout comes from that kernel's meta function (layout_rules._cpu_attention_on_meta; the fake run cost T5's first
    call ~15 ms): values, output and gradient strides are eager's, every value has its recorded strides, and the
    recorded layout is the fake run's (strides of dimensions of size one included)."""
    from torch.nn.attention import SDPBackend

    from thunder_train.compiler.executors import layout_rules
    from thunder_train.compiler.torchlang import attention

    qs, ks, vs, transposed, mask_kind, kw = _FLASH_ATTENTION[case]
    used, recorded = [], []
    rule = attention.scaled_dot_product_attention.layout_rule

    def spy(bsym, tensors, outs):
        used.append(rule(bsym, tensors, outs))
        recorded.append(outs[0]._tt_strides)
        return used[-1]

    monkeypatch.setattr(attention.scaled_dot_product_attention, "layout_rule", spy)
    monkeypatch.setattr(layout_rules, "_layouts", {})

    def leaf(shape, seed):
        x = torch.randn(shape[0], shape[2], shape[1], shape[3], generator=torch.Generator().manual_seed(seed))
        return (x if transposed else x.transpose(1, 2).contiguous()).requires_grad_()

    def operands(xq, xk, xv):
        return [x.transpose(1, 2) if transposed else x for x in (xq, xk, xv)]

    def f(xq, xk, xv, mask, w):
        out = F.scaled_dot_product_attention(*operands(xq, xk, xv), attn_mask=mask, **kw)
        (out * w).sum().backward()
        return out

    mask = {None: None, "float": torch.randn(qs[0], qs[1], qs[2], ks[2]), "float1": torch.randn(1, qs[1], qs[2], ks[2]),
            "bool": torch.rand(qs[0], 1, qs[2], ks[2]) > 0.3}[mask_kind]
    w = torch.randn(*qs[:-1], vs[-1])
    eager_in = [leaf(s, i) for i, s in enumerate((qs, ks, vs))]
    tt_in = [x.detach().clone().requires_grad_() for x in eager_in]
    expected = f(*eager_in, mask, w)
    got = tt.compile(f, fusion=None)(*tt_in, mask, w)
    torch.testing.assert_close(got, expected)
    assert not codegen.layout_differs(got, tuple(expected.shape), expected.stride())
    for a, b in zip(tt_in, eager_in):
        torch.testing.assert_close(a.grad, b.grad)
        assert a.grad.stride() == b.grad.stride()
    assert not audit, f"name: (recorded shape, recorded strides, real shape, real strides): {audit}"
    assert used == [True], used
    # the cases are what they claim: eager's flash kernel; and the layout recorded is the fake run's
    q, k, v = operands(*eager_in)
    assert torch._fused_sdp_choice(q, k, v, mask, 0.0, kw.get("is_causal", False), scale=kw.get("scale"),
                                   enable_gqa=kw.get("enable_gqa", False)) == SDPBackend.FLASH_ATTENTION.value
    with layout_rules._mode():
        fake = F.scaled_dot_product_attention(*(torch.empty_strided(t.shape, t.stride()) for t in (q, k, v)),
                                              attn_mask=None if mask is None else torch.empty_strided(
                                                  mask.shape, mask.stride(), dtype=mask.dtype), **kw)
    assert recorded == [fake.stride()], (recorded, fake.stride())


def test_attention_with_dropout_stays_with_the_fake_run(monkeypatch):
    """Dropout's random mask: the rule leaves the layout to the fake run; values (the same random stream) and
    strides are eager's."""
    from thunder_train.compiler.torchlang import attention

    used = []
    rule = attention.scaled_dot_product_attention.layout_rule

    def spy(bsym, tensors, outs):
        used.append(rule(bsym, tensors, outs))
        return used[-1]

    monkeypatch.setattr(attention.scaled_dot_product_attention, "layout_rule", spy)

    def f(x):
        q = x.transpose(1, 2)
        return F.scaled_dot_product_attention(q, q * 2, q + 1, dropout_p=0.5) * 1

    x = torch.randn(2, 16, 4, 24)
    torch.manual_seed(3)
    expected = f(x)
    torch.manual_seed(3)
    got = tt.compile(f, fusion=None)(x)
    torch.testing.assert_close(got, expected)
    assert got.stride() == expected.stride()
    assert used == [False], used


class _TransposedNorms(torch.nn.Module):
    """BatchNorm1d on a transposed (batch, seq, channels) activation, as convolution blocks of speech models apply it,
    and BatchNorm2d on a permuted one: eager's CPU kernels give row-major outputs and input gradients for both, where
    the meta kernels follow the input's strides."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 6)
        self.bn1 = torch.nn.BatchNorm1d(6)
        self.bn2 = torch.nn.BatchNorm2d(3)

    def forward(self, x):  # x: (batch, seq, 6)
        h = self.bn1(self.proj(x).transpose(1, 2))  # (batch, 6, seq), the input column-major
        h = h.transpose(1, 2).reshape(x.shape[0], x.shape[1], 2, 3).permute(0, 3, 1, 2)  # (batch, 3, seq, 2), permuted
        return self.bn2(h * 2)


def test_batch_norm_of_transposed_inputs_records_the_kernels_layout(audit):
    """Values and gradients as eager's; the norms' outputs and input gradients recorded as the kernels lay them out."""
    torch.manual_seed(0)
    m1, m2 = _TransposedNorms(), _TransposedNorms()
    m2.load_state_dict(m1.state_dict())
    o1, o2 = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (m1, m2))
    step = tt.compile(squared_output_step, thin=True, fusion=None)
    for i in range(3):
        x = torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(step(m2, o2, x), squared_output_step(m1, o1, x).detach())
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(q, p)
    for p, q in zip(m1.buffers(), m2.buffers()):
        torch.testing.assert_close(q, p)
    assert not audit, f"name: (recorded shape, recorded strides, real shape, real strides): {audit}"
    # the norms' outputs and input gradients (the first result of each forward and backward line)
    norms = [b.flat_outputs()[0] for b in tt.last_traces(step)[-1].bound_symbols
             if b.sym.name in ("ttex.batch_norm_with_stats", "ttex.batch_norm_backward")]
    assert len(norms) == 4 and all(o._tt_rowmajor for o in norms), [(o.name, o._tt_strides) for o in norms]


def test_binary_ops_whose_meta_kernels_lie_record_the_kernels_layout(audit):
    """``copysign``, ``floor_divide`` and ``xlogy`` of a transposed tensor with a broadcast or differently ordered
    one: torch's meta kernels (Python decompositions) lay the result out otherwise than the CPU kernel; the trace
    records the kernel's layout (layout_rules._binary_tensor_iterator), and what reads the results inherits it."""
    def f(a, b):
        return (torch.copysign(a, b) * 2, torch.floor_divide(a, b) + 1, (a // b).sum(1), torch.xlogy(a, b) * 1,
                torch.copysign(a, 2.0) * 1, torch.xlogy(2.0, a) + 0)

    t = (torch.rand(2, 4, 5, 6) + 0.5).transpose(1, 2)
    for b in (torch.rand(1, 5, 1, 6) + 0.5, torch.rand(2, 5, 4, 6) + 0.5):
        for got, exp in zip(tt.compile(f, fusion=None)(t, b), f(t, b)):
            assert torch.equal(got, exp) and got.stride() == exp.stride()
    assert not audit, f"name: (recorded shape, recorded strides, real shape, real strides): {audit}"


def test_channels_last_transposed_convolution_records_the_kernels_layout(audit):
    """``F.conv_transpose2d`` runs opaquely; its meta kernel lays the result out row-major where the CPU kernel keeps a
    channels_last input's format (torch's convolution memory-format choice, asked on empty tensors:
    ``torchlang/nn.py`` ``_conv_transpose_layout``).  A channels_last decoder block's training step: losses, parameters
    and their layouts as eager's, every value with its recorded strides."""
    torch.manual_seed(0)
    m1 = torch.nn.Sequential(torch.nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1), torch.nn.ReLU(),
                             torch.nn.ConvTranspose2d(3, 2, 2)).to(memory_format=torch.channels_last)
    m2 = copy.deepcopy(m1)
    o1, o2 = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (m1, m2))
    step = tt.compile(squared_output_step, fusion=None)
    for i in range(3):
        x = torch.randn(2, 4, 6, 5, generator=torch.Generator().manual_seed(i)).to(memory_format=torch.channels_last)
        torch.testing.assert_close(step(m2, o2, x), squared_output_step(m1, o1, x).detach())
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(q, p)
        assert q.stride() == p.stride()
    f = lambda x, w: (torch.nn.functional.conv_transpose2d(x, w, stride=2) * 2, torch.nn.functional.conv_transpose2d(x, w))  # noqa: E731
    x, w = torch.randn(2, 4, 6, 5).to(memory_format=torch.channels_last), torch.randn(4, 3, 3, 3)
    for got, exp in zip(tt.compile(f, fusion=None)(x, w), f(x, w)):
        torch.testing.assert_close(got, exp)
        assert got.stride() == exp.stride()
    assert not audit, f"name: (recorded shape, recorded strides, real shape, real strides): {audit}"


def _last_two_transposed(t):
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


# (dims, batched, input layout, weight layout): transposed convolutions whose CPU kernel lays the result out other than
# the meta kernel: a 1-d one runs as a 2-d one of height 1 on its input made contiguous, in the format the weight's
# layout picks there; an unbatched one as a batch of one.
_TRANSPOSED_CONVOLUTIONS = [
    (1, True, "row-major", "last two transposed"), (1, True, "last two transposed", "last two transposed"),
    (1, True, "channels first", "last two transposed"), (1, True, "last two transposed", "row-major"),
    (1, False, "row-major", "last two transposed"), (2, False, "row-major", "channels_last"),
    (2, False, "last two transposed", "channels_last"), (2, False, "row-major", "row-major"), (3, False, "row-major", "channels_last_3d"),
]
_LAYOUTS = {"row-major": lambda t: t, "last two transposed": _last_two_transposed,
            "channels first": lambda t: t.transpose(0, 1).contiguous().transpose(0, 1),
            "channels_last": lambda t: t.contiguous(memory_format=torch.channels_last),
            "channels_last_3d": lambda t: t.contiguous(memory_format=torch.channels_last_3d)}


@pytest.mark.parametrize("nd, batched, x_layout, w_layout", _TRANSPOSED_CONVOLUTIONS)
def test_transposed_convolutions_of_every_rank_record_the_kernels_layout(nd, batched, x_layout, w_layout, audit):
    """``torchlang/nn.py`` ``_conv_transpose_layout`` asks torch's memory-format choice the way eager's convolution
    does for 1-d and unbatched calls too (the meta kernel's row-major result was recorded where the CPU kernel's is
    the weight's channels_last one): values, output and gradient strides are eager's, every value has its recorded
    strides."""
    fn = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[nd]
    x = _LAYOUTS[x_layout](torch.randn(((2,) if batched else ()) + (4,) + (5,) * nd)).requires_grad_()
    w = _LAYOUTS[w_layout](torch.randn((4, 3) + (3,) * nd)).requires_grad_()
    b = torch.randn(3, requires_grad=True)

    def f(x, w, b):
        out = fn(x, w, b, stride=2, padding=1, output_padding=1) * 2
        out.sum().backward()
        return out

    ins = [t.detach().clone(memory_format=torch.preserve_format).requires_grad_() for t in (x, w, b)]
    expected, got = f(x, w, b), tt.compile(f, fusion=None)(*ins)
    torch.testing.assert_close(got, expected)
    assert not codegen.layout_differs(got, tuple(expected.shape), expected.stride())
    for a, e in zip(ins, (x, w, b)):
        torch.testing.assert_close(a.grad, e.grad)
        assert not codegen.layout_differs(a.grad, tuple(e.grad.shape), e.grad.stride())
    assert not audit, f"name: (recorded shape, recorded strides, real shape, real strides): {audit}"


def test_attention_whose_mask_requires_grad_records_the_math_kernels_layout(audit):
    """A float mask that requires grad (T5's learned position bias) sends eager to its math kernel although its
    selector would pick flash for the same operands without grad: the line's layout is the math kernel's (asked
    again once the call's kernel is known), so the program runs the math kernel's pair with no layout copies;
    values, strides and gradients are eager's."""
    def f(x, bias, w):
        q = x.transpose(1, 2)  # (batch, heads, seq, dim) from (batch, seq, heads, dim), laid out as flash lays out
        out = F.scaled_dot_product_attention(q, q * 2, q + 1, attn_mask=bias, scale=1.0)
        (out * w).sum().backward()
        return out

    x = torch.randn(2, 12, 4, 8, requires_grad=True)
    bias = torch.randn(1, 4, 12, 12, requires_grad=True)
    w = torch.randn(2, 4, 12, 8)
    x2, bias2 = x.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    expected = f(x, bias, w)
    cf = tt.compile(f, fusion=None)
    got = cf(x2, bias2, w)
    torch.testing.assert_close(got, expected)
    assert got.stride() == expected.stride()
    for a, b in ((x2, x), (bias2, bias)):
        torch.testing.assert_close(a.grad, b.grad)
        assert a.grad.stride() == b.grad.stride()
    assert not audit, f"name: (recorded shape, recorded strides, real shape, real strides): {audit}"
    src = str(tt.last_traces(cf)[-1])
    assert "sdpa_math_with_probs" in src and "_op_torch" not in src, src


@pytest.mark.parametrize("case", ["second broadcast", "first broadcast", "both broadcast", "atleast_2d"])
def test_results_beside_a_returned_input_keep_their_layout(case, audit):
    """``broadcast_tensors(x, b)`` returns ``x`` itself where it already has the broadcast shape; the line records only
    the others (``_`` in the trace), whose layouts are the run's results at their own places (they were none: an
    expanded ``b`` was recorded row-major, so ``y.stride()`` and ``y.is_contiguous()`` inside the function were not
    eager's)."""
    def f(a, b):
        outs = torch.atleast_2d(a, b) if case == "atleast_2d" else torch.broadcast_tensors(a, b)
        return [(o.stride(), o.is_contiguous()) for o in outs], [o * 2 for o in outs]

    a, b = {"second broadcast": (torch.randn(3, 4), torch.randn(4)), "first broadcast": (torch.randn(4), torch.randn(3, 4)),
            "both broadcast": (torch.randn(3, 1), torch.randn(4)), "atleast_2d": (torch.randn(3, 4).t(), torch.randn(4))}[case]
    (facts, values), (expected_facts, expected) = tt.compile(f, fusion=None)(a, b), f(a, b)
    assert facts == expected_facts
    for g, e in zip(values, expected):
        torch.testing.assert_close(g, e)
    assert not audit, f"name: (recorded shape, recorded strides, real shape, real strides): {audit}"


def _output_and_gradient_as_eagers(fn, x, audit):
    """``fn(x)`` compiled, its output and ``x``'s gradient (of a weighted sum of the output) equal to eager's, values
    and strides; every value the program makes has its recorded strides."""
    x.requires_grad_()
    x2 = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()

    def f(x):
        out = fn(x)
        (out * torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
        return out

    expected, got = f(x), tt.compile(f, fusion=None)(x2)
    torch.testing.assert_close(got, expected)
    assert not codegen.layout_differs(got, tuple(expected.shape), expected.stride())
    torch.testing.assert_close(x2.grad, x.grad)
    assert x2.grad.stride() == x.grad.stride()
    assert not audit, f"name: (recorded shape, recorded strides, real shape, real strides): {audit}"


@pytest.mark.parametrize("layout", ["row-major", "channels_last", "last two transposed", "channels first"])
@pytest.mark.parametrize("fn, shape, size", [
    (F.adaptive_avg_pool2d, (2, 3, 8, 10), (3, 4)), (F.adaptive_avg_pool2d, (2, 3, 8, 10), (8, 10)),
    (F.adaptive_avg_pool2d, (3, 8, 10), (5, 5)), (F.adaptive_avg_pool1d, (2, 3, 10), 4),
    (F.adaptive_avg_pool1d, (2, 3, 10), 10)], ids=["2d", "2d same size", "2d unbatched", "1d", "1d same size"])
def test_adaptive_average_pooling_lays_its_result_out_as_eager(fn, shape, size, layout, audit):
    """Eager's adaptive average pooling writes a new tensor in its input's suggested memory format (a 1-d call as a
    2-d one of height 1): a channels_last batch gives a channels_last result, any other layout a row-major one
    (torchlang/pooling.py; the separable means gave row-major results for channels_last inputs, and kept the input's
    layout where the size does not change).  Values, output and gradient strides are eager's."""
    x = _LAYOUTS[layout](torch.randn(shape)) if len(shape) == 4 or layout != "channels_last" else \
        torch.randn(shape).transpose(-1, -2).contiguous().transpose(-1, -2)  # 3-d: channels last of (N, C, L)
    _output_and_gradient_as_eagers(lambda x: fn(x, size), x, audit)


def _unpool2d(x):
    out, idx = F.max_pool2d(x, 2, return_indices=True)
    return F.max_unpool2d(out, idx, 2)


@pytest.mark.parametrize("layout", ["channels_last", "row-major", "channels first"])
@pytest.mark.parametrize("fn, shape", [
    (lambda x: F.channel_shuffle(x, 2), (2, 4, 6, 8)), (lambda x: F.channel_shuffle(x, 2), (2, 4, 4, 6, 8)),
    (lambda x: F.pad(x, (1, 2, 2, 1), mode="replicate"), (2, 4, 6, 8)),
    (lambda x: F.pad(x, (-1, 1, 1, -1), mode="replicate"), (2, 4, 6, 8)),
    (lambda x: F.pad(x, (1, 1, 1, 1, 1, 1), mode="reflect"), (2, 4, 4, 6, 8)),
    (lambda x: F.pad(x, (1, 1, 1, 1), mode="circular"), (2, 4, 6, 8)), (_unpool2d, (2, 4, 6, 8))],
    ids=["shuffle 2d", "shuffle 3d", "replicate", "replicate negative", "reflect 3d", "circular", "max_unpool2d"])
def test_composed_ops_lay_a_channels_last_batch_out_as_eager(fn, shape, layout, audit):
    """Channel shuffles, reflect and replicate padding and 2-d max unpooling are composed of torch calls whose results
    were row-major; eager's kernels write a channels_last batch's result channels_last (``helpers.as_eager_allocates``;
    circular padding's stays row-major, as eager's): values and output strides are eager's."""
    x = torch.randn(shape)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
    elif layout == "channels first":
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    f = lambda x: fn(x) * 1  # noqa: E731
    expected, got = f(x), tt.compile(f, fusion=None)(x)
    torch.testing.assert_close(got, expected)
    assert not codegen.layout_differs(got, tuple(expected.shape), expected.stride())
    assert not audit, f"name: (recorded shape, recorded strides, real shape, real strides): {audit}"


def _addr(beta):
    return lambda x: torch.addr(x, torch.arange(4.0), torch.arange(5.0), beta=beta)


_LAID_OUT_AS_EAGER = {"roll by zero": (lambda x: torch.roll(x, 0, 0), (2, 3, 4, 5)),
                      "roll by zeros": (lambda x: torch.roll(x, (0, 0), (0, 1)), (2, 3, 4, 5)),
                      "renorm": (lambda x: torch.renorm(x, 2, 0, 1.0), (2, 3, 4, 5)),
                      "addr": (_addr(1), (4, 5)), "addr beta": (_addr(0.5), (4, 5))}


@pytest.mark.parametrize("case, layout", [(c, lay) for c, (_, shape) in _LAID_OUT_AS_EAGER.items()
                                          for lay in ("row-major", "last two transposed", "channels_last")
                                          if lay != "channels_last" or len(shape) == 4])
def test_composed_ops_lay_their_result_out_as_eager(case, layout, audit):
    """Ops composed of other calls end as eager's kernel lays its result out: ``roll`` by nothing and ``renorm`` write
    a new row-major tensor (the program returned a clone in the input's layout), ``addr`` follows its input's layout
    (the program's sum put the row-major outer product first).  Values, output and gradient strides are eager's."""
    fn, shape = _LAID_OUT_AS_EAGER[case]
    x = _LAYOUTS[layout](torch.randn(shape))
    _output_and_gradient_as_eagers(fn, x, audit)
