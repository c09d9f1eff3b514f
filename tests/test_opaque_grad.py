"""Ops without a native gradient rule train through PyTorch's autograd (compiler/transforms/opaque_grad.py).

nn.LSTM (torch.lstm) is compared with eager: forward, gradients through ``tt.compile(module)``, and three whole
training steps with AdamW (plain and thin mode); so is nn.TransformerEncoder, whose F.multi_head_attention_forward
ran opaquely until it was traced through torch's own body (tests/test_multihead_attention.py).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt


class LSTMNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(5, 8, num_layers=2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return self.head(out[:, -1]) + h.sum() * 0.1 + c.mean()


class EncoderNet(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.enc(x).mean(1))


MODELS = [pytest.param(LSTMNet, id="lstm"), pytest.param(EncoderNet, id="transformer_encoder")]


def _x(model_cls, seed=0):
    g = torch.Generator().manual_seed(seed)
    feat = 5 if model_cls is LSTMNet else 8
    return torch.randn(4, 6, feat, generator=g), torch.randint(0, 3, (4,), generator=g)


@pytest.mark.parametrize("model_cls", MODELS)
def test_module_forward_and_gradients_match_eager(model_cls):
    torch.manual_seed(0)
    eager = model_cls()
    compiled_model = copy.deepcopy(eager)
    cm = tt.compile(compiled_model)
    x, y = _x(model_cls)
    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    out_e, out_c = eager(x), cm(x)
    torch.testing.assert_close(out_c, out_e)
    (out_e * w).sum().backward()
    (out_c * w).sum().backward()
    for (n, a), b in zip(eager.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}.grad: {m}")
    opaque = tt.compile_stats(cm).opaque_ops
    if model_cls is LSTMNet:
        assert any("gradient by torch autograd" in op for op in opaque)
    else:
        assert opaque == []


def _step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
@pytest.mark.parametrize("model_cls", MODELS)
def test_whole_training_step_with_adamw_matches_eager(model_cls, thin):
    torch.manual_seed(0)
    m1 = model_cls()
    m2 = copy.deepcopy(m1)
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    step = tt.compile(_step, thin=thin)
    for i in range(3):
        x, y = _x(model_cls, seed=i)
        le = _step(m1, o1, x, y)
        lc = step(m2, o2, x, y)
        torch.testing.assert_close(lc, le, rtol=1e-4, atol=1e-5)
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(_without_key_bias(n, b), _without_key_bias(n, a), rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    opaque = tt.compile_stats(step).opaque_ops
    assert any("gradient by torch autograd" in op for op in opaque) if model_cls is LSTMNet else opaque == []


def _without_key_bias(name, t):
    """The attention key bias has an exactly-zero gradient; AdamW turns its rounding noise into full steps."""
    if name.endswith("in_proj_bias"):
        d = t.shape[0] // 3
        return torch.cat([t[:d], t[2 * d:]])
    return t


def test_random_opaque_op_backward_uses_the_forward_mask():
    # dropout2d runs opaquely; its backward must use the forward's mask (saved by torch's autograd, not recomputed).
    cf = tt.compile(lambda x: F.dropout2d(x, 0.5, training=True))
    x = (torch.rand(2, 16, 3, 3) + 1).requires_grad_()
    y = cf(x)
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
    torch.testing.assert_close(g, (y != 0).float() * 2.0)


def _grouped_step(w, x, offs, opt):
    h = torch._grouped_mm(x, w, offs=offs)  # run opaquely: its gradient is torch autograd's
    loss = torch.tanh(h).sum()  # tanh saves its result, not h: h is dead after this line
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_an_opaque_ops_graph_does_not_hold_its_outputs():
    """The graph an opaque op keeps for the backward holds its outputs' edges, not the outputs: an output the program
    reads no more is freed as eager frees it (it was held to the backward: DeepSeek-V3's ``_grouped_mm`` outputs).
    Values and updates equal eager's; the peak, in the allocator's order, is at most eager's."""
    from _peak import peak_call_bytes_all_threads

    torch.manual_seed(0)
    w0, x = torch.randn(4, 16, 64), torch.randn(1024, 16)  # h: 256 KiB, the weight 16 KiB
    offs = torch.tensor([256, 512, 768, 1024], dtype=torch.int32)
    peaks, losses, weights = {}, {}, {}
    for mode in ("eager", "tt"):
        w = nn.Parameter(w0.clone())
        opt = torch.optim.SGD([w], lr=0.1)
        fn = _grouped_step if mode == "eager" else tt.compile(_grouped_step, fusion=None, keep_buffers=False)
        losses[mode] = [fn(w, x, offs, opt) for _ in range(2)]
        peaks[mode] = peak_call_bytes_all_threads(lambda: fn(w, x, offs, opt))
        weights[mode] = w.detach().clone()
    torch.testing.assert_close(losses["tt"], losses["eager"])
    torch.testing.assert_close(weights["tt"], weights["eager"])
    assert 0 < peaks["tt"] <= peaks["eager"], peaks  # holding h to the backward: 8 bytes above eager's
    handle = _op_handle(x, w0.clone().requires_grad_(), offs)
    assert not any(isinstance(e, torch.Tensor) for e in handle._tt_autograd_graph[1])


def _op_handle(x, w, offs):
    from thunder_train.compiler.transforms.opaque_grad import AutogradRun

    _, handle = AutogradRun(torch._grouped_mm, (1,), "grouped_mm")(x, w, offs=offs)
    return handle


def test_an_opaque_ops_graph_does_not_hold_its_differentiated_inputs():
    """The graph's entry for a differentiated input is not a leaf (a leaf is held by its ``AccumulateGrad`` node): the
    input's memory is freed once the program and the op's own saved tensors are done with it, as eager frees it
    (the LSTM zoo step held its embedded tokens, 3 KiB, to the backward: 1.013x eager's peak).  ``tanh`` saves its
    result, not its input: after the forward only the result (and the graph) is alive."""
    from _peak import peak_and_net_call_bytes
    from thunder_train.compiler.transforms.opaque_grad import AutogradRun, opaque_vjp

    run, keep = AutogradRun(torch.tanh, (0,), "tanh"), []

    def forward():
        x = torch.randn(64, 64) + 1  # 16 KiB, dead once the op has run
        keep.append(run(x))

    _, net = peak_and_net_call_bytes(forward)
    assert 64 * 64 * 4 <= net < 2 * 64 * 64 * 4, net  # the result only (the input too before)
    (y, handle) = keep.pop()
    (g,) = opaque_vjp(handle, (torch.ones_like(y),), last=True)
    torch.testing.assert_close(g, 1 - y * y)


def test_an_opaque_op_writing_into_a_differentiated_input_raises_before_writing():
    """An op writing into the tensor it differentiates is refused before anything is written (as the leaf was)."""
    from thunder_train.compiler.transforms.opaque_grad import AutogradRun

    x = torch.randn(4)
    before = x.clone()
    with pytest.raises(RuntimeError, match="in-?place"):
        AutogradRun(torch.Tensor.mul_, (0,), "mul_")(x, 2.0)
    torch.testing.assert_close(x, before, rtol=0, atol=0)


def test_an_opaque_ops_differentiated_inputs_enter_its_graph_through_one_node():
    """GRU's input and eight weights enter the graph through one custom Function call (each call costs tens of
    microseconds of Python; there were nine a step), each input at its own output of that node."""
    from thunder_train.compiler.transforms.opaque_grad import AutogradRun, opaque_vjp

    gru = nn.GRU(4, 4, num_layers=2)
    weights = [w.detach() for w in gru._flat_weights]
    x, h0 = torch.randn(3, 2, 4), torch.zeros(2, 2, 4)
    run = AutogradRun(torch.gru, (0, *range(2, 10)), "gru")  # flat positions: x, (h0), the eight weights
    args = (x, h0, weights, True, 2, 0.0, True, False, False)
    (out, _), handle = run(*args)
    inputs = handle._tt_autograd_graph[0]
    assert len({id(i.edge.node) for i in inputs}) == 1
    assert sorted(i.edge.output_nr for i in inputs) == list(range(9))
    g = torch.randn_like(out)
    got = opaque_vjp(handle, (g, None), last=True)
    leaves = [t.clone().requires_grad_() for t in (x, *weights)]
    want_out, _ = torch.gru(leaves[0], h0, leaves[1:], *args[3:])
    want = torch.autograd.grad(want_out, leaves, g)
    torch.testing.assert_close(out, want_out.detach(), rtol=0, atol=0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class GRUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(16, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.gru(x)[0][:, -1])


def test_the_last_backward_through_an_opaque_graph_frees_its_saved_tensors_as_it_goes():
    """A recurrent op's per-step activations are freed as its backward passes them, as eager's backward frees them:
    the program's last backward through an opaque op's graph does not retain it (it did: a GRU step held every
    step's activations to the end of its backward, 1.3x eager's peak).  Losses are eager's bit for bit; the peak, in the allocator's order, is at most eager's."""
    from _peak import peak_call_bytes_all_threads

    torch.manual_seed(0)
    base, x, y = GRUNet(), torch.randn(4, 24, 16), torch.randint(0, 3, (4,))
    peaks, losses, params = {}, {}, {}
    for mode in ("eager", "tt"):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        fn = _step if mode == "eager" else tt.compile(_step, fusion=None, keep_buffers=False)
        losses[mode] = [fn(model, opt, x, y) for _ in range(2)]
        peaks[mode] = peak_call_bytes_all_threads(lambda: fn(model, opt, x, y))
        params[mode] = [p.detach().clone() for p in model.parameters()]
    torch.testing.assert_close(losses["tt"], losses["eager"], rtol=0, atol=0)
    torch.testing.assert_close(params["tt"], params["eager"])  # AdamW's update: a rounding apart (before this too)
    assert 0 < peaks["tt"] <= peaks["eager"], peaks
    assert "last=True" in str(tt.last_traces(fn)[-1])


def _twice(model, x):
    loss = model(x).sum()
    loss.backward(retain_graph=True)  # the first backward through the GRU's graph keeps it for the second
    loss.backward()
    return loss.detach()


def test_a_second_backward_in_the_function_still_reads_the_opaque_graph():
    torch.manual_seed(0)
    m1, x = GRUNet(), torch.randn(2, 5, 16)
    m2 = copy.deepcopy(m1)
    cf = tt.compile(_twice)
    torch.testing.assert_close(cf(m2, x), _twice(m1, x), rtol=0, atol=0)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)
    vjps = [ln for ln in str(tt.last_traces(cf)[-1]).splitlines() if "_op_autograd_vjp(" in ln]
    assert len(vjps) == 2 and "last=True" not in vjps[0] and "last=True" in vjps[1], vjps


def test_a_compiled_modules_backward_asked_to_retain_its_graph_keeps_the_opaque_graph():
    """``tt.compile(module)``: the backward program runs once per torch backward; one asked to retain the graph
    keeps the opaque op's graph for the next, and a backward after one that did not raises eager's error."""
    torch.manual_seed(0)
    m1, x = GRUNet(), torch.randn(2, 5, 16)
    m2 = copy.deepcopy(m1)
    cm = tt.compile(m2)
    out_e, out_c = m1(x).sum(), cm(x).sum()
    for retain in (True, False):
        out_e.backward(retain_graph=retain)
        out_c.backward(retain_graph=retain)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(b.grad, a.grad)
    for out in (out_e, out_c):
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            out.backward()
