"""Batch norm and group norm run eager's own kernels: whole steps equal eager bitwise on the CPU.

The forward runs ``native_batch_norm`` / ``native_group_norm`` (keeping the statistics), the backward their
backward kernels, and a training-mode batch norm's running statistics are updated by eager's own kernel, so
parameters, running statistics and the loss come out bitwise equal to eager's.  Where the
kernels' preconditions do not hold (a channels_last input to group norm) the op's own gradient rule runs
instead, equal to eager within float32 rounding.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import thunder_train as tt


def step(model, opt, x):
    out = model(x)
    w = torch.linspace(-1.0, 1.0, out.shape[1]).view(1, -1, *([1] * (out.ndim - 2)))
    loss = (out * w).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def conv_net():
    return nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 6, 1), nn.GroupNorm(2, 6), nn.ReLU())


CASES = {
    "bn2d": (lambda: nn.BatchNorm2d(6), (4, 6, 5, 5)),
    "bn1d": (lambda: nn.BatchNorm1d(6), (8, 6)),
    "bn1d_seq": (lambda: nn.BatchNorm1d(6), (4, 6, 7)),
    "bn3d_cumulative": (lambda: nn.Sequential(nn.Conv3d(2, 6, 1), nn.BatchNorm3d(6, momentum=None)), (2, 2, 3, 3, 3)),
    "bn_no_affine": (lambda: nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6, affine=False)), (8, 5)),
    "bn_no_stats": (lambda: nn.Sequential(nn.Conv2d(3, 6, 1), nn.BatchNorm2d(6, track_running_stats=False)), (4, 3, 5, 5)),
    "gn": (lambda: nn.GroupNorm(3, 6), (4, 6, 5, 5)),
    "gn_no_affine": (lambda: nn.Sequential(nn.Conv1d(4, 6, 1), nn.GroupNorm(2, 6, affine=False)), (4, 4, 9)),
    "conv_bn_gn": (conv_net, (4, 3, 7, 7)),
}


def _pair(make, shape, mode):
    torch.manual_seed(0)
    eager = make()
    for p in eager.parameters():
        nn.init.normal_(p)
    if mode == "eval":
        eager(torch.randn(shape))  # running statistics that are not the initial ones
        eager.eval()
    return eager, copy.deepcopy(eager)


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
@pytest.mark.parametrize("name", list(CASES))
def test_whole_step_equals_eager_bitwise(name, thin, mode):
    make, shape = CASES[name]
    eager, compiled = _pair(make, shape, mode)
    # Plain SGD: its update is one exact op, so what is compared is the normalization layers' work.
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    opt_c = torch.optim.SGD(compiled.parameters(), lr=0.05)
    cf = tt.compile(step, thin=thin)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(shape, generator=g) * 3 + 1
        assert torch.equal(cf(compiled, opt_c, x), step(eager, opt_e, x))
        for (k, a), b in zip(compiled.state_dict().items(), eager.state_dict().values()):
            assert torch.equal(a, b), k
    src = tt.last_traces(cf)[-1].python_source()
    uses_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in eager.modules())
    uses_gn = any(isinstance(m, nn.GroupNorm) for m in eager.modules())
    assert ("ttex.batch_norm_with_stats(" in src) == uses_bn and ("ttex.batch_norm_backward(" in src) == uses_bn
    assert ("ttex.group_norm_with_stats(" in src) == uses_gn and ("ttex.group_norm_backward(" in src) == uses_gn
    tracks = any(getattr(m, "running_mean", None) is not None for m in eager.modules())
    assert ("ttex.batch_norm_running_stats(" in src) == (tracks and mode == "train")


def test_group_norm_on_channels_last_input_uses_the_rule():
    """The kernels want the input row-major: a channels_last activation keeps the op's own gradient rule."""
    make, shape = CASES["conv_bn_gn"]
    eager, compiled = _pair(make, shape, "train")
    eager, compiled = eager.to(memory_format=torch.channels_last), compiled.to(memory_format=torch.channels_last)
    opt_e, opt_c = torch.optim.SGD(eager.parameters(), lr=0.1), torch.optim.SGD(compiled.parameters(), lr=0.1)
    cf = tt.compile(step)
    for i in range(3):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(memory_format=torch.channels_last)
        torch.testing.assert_close(cf(compiled, opt_c, x), step(eager, opt_e, x))
    for (k, a), b in zip(compiled.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)
    assert "ttex.group_norm_with_stats(" not in tt.last_traces(cf)[-1].python_source()


@pytest.mark.parametrize("name", ["bn2d", "gn", "conv_bn_gn"])
def test_compiled_module_backward_through_torch_autograd(name):
    """Forward compiled, backward by torch's autograd (no whole step): the ops' gradients equal eager's."""
    make, shape = CASES[name]
    eager, compiled = _pair(make, shape, "train")
    cm = tt.compile(compiled)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    ge = torch.randn(eager(xe).shape, generator=torch.Generator().manual_seed(4))
    eager.load_state_dict(compiled.state_dict())  # undo the running-stat update of the shape probe
    eager(xe).backward(ge)
    cm(xc).backward(ge)
    torch.testing.assert_close(xc.grad, xe.grad)
    for (n, a), b in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=n)
    for (k, a), b in zip(compiled.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(a, b, msg=k)


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", ["bn2d", "bn1d_seq", "bn_no_affine", "gn", "gn_no_affine", "conv_bn_gn"])
def test_gradient_rules_decomposed_match_eager(name, mode):
    """``decompose=True`` runs the ops' own gradient rules as prims (what fusing executors run): the input's and
    parameters' gradients and the running statistics equal eager's within float32 rounding."""
    make, shape = CASES[name]
    eager, compiled = _pair(make, shape, mode)
    cm = tt.compile(compiled, decompose=True)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 3 + 1
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_e, out_c = eager(xe), cm(xc)
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
    g = torch.randn(out_e.shape, generator=torch.Generator().manual_seed(3))
    out_e.backward(g)
    out_c.backward(g)
    torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-5, atol=1e-5)
    for (n, a), b in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5, msg=n)
    for (k, a), b in zip(compiled.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("norm", ["LayerNorm", "layer_norm with keywords"])
def test_layer_norm_of_a_recomputed_value_reads_its_forward_statistics(norm, monkeypatch):
    # GELU -> LayerNorm (a BERT or ModernBERT head, any GELU MLP with a norm after it): the default recomputes the
    # GELU output for the backward, and the recomputing rebuilt the backward line's arguments, so its ``(32,)`` was
    # another tuple than the forward line's and the two no longer paired: the norm's backward ran its generic
    # eager-autograd form (``_op_torch_vjp_layer_norm``; ModernBERT's torch program +15 % for it).
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.norm, self.out = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)

        def forward(self, x):
            h = torch.nn.functional.gelu(self.inp(x))
            if norm == "LayerNorm":
                return self.out(self.norm(h))
            return self.out(torch.nn.functional.layer_norm(h, normalized_shape=(32,), weight=self.norm.weight,
                                                           bias=self.norm.bias, eps=1e-5))

    # The GELU output recomputed as the plan's count alone chooses: this head's step peaks where the program holds its
    # gradients for the update, which no recomputation lowers, so the default keeps it there (transforms/memory.py
    # ``_held_curve``); a recomputed norm input is what is tested here.
    from thunder_train.compiler.transforms import memory

    monkeypatch.setattr(memory, "_held_curve", memory._curve)
    eager, compiled = _pair(Head, (4, 16), "train")
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    opt_c = torch.optim.SGD(compiled.parameters(), lr=0.05)
    cf = tt.compile(step, fusion=None)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn((4, 16), generator=g)
        assert torch.equal(cf(compiled, opt_c, x), step(eager, opt_e, x))
        for a, b in zip(compiled.parameters(), eager.parameters()):
            assert torch.equal(a, b)
    assert [r for r, _ in tt.compile_stats(cf).memory.recomputed], "the GELU output is no longer recomputed"
    src = tt.last_traces(cf)[-1].python_source()
    assert "ttex.layer_norm_backward(" in src and "_op_torch_vjp_layer_norm" not in src
