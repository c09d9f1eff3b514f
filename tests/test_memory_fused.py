"""Peak memory of the fused program (``fusion="background"``, the default once its Inductor program runs) against the
torch program (``fusion=None``, what the rest of the suite runs), with activation checkpointing (issue 27 item 6:
users run the default, so the fused program must hold no more than the torch program the targets are tested on).

Two causes had held the fused program higher (docs/memory.md, "The fused program"): an Inductor region computing
GELU's gradient wrote into a new buffer where the torch program writes over the dead incoming gradient
(executors/into_dead_grad.py ``regions_into_dead_inputs``), and the blocked head's scratch memory was unknown to the
kept-buffer plan, whose larger fused arena was full where the head ran (``scratch_bytes``, executors/buffers.py).
"""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

import thunder_train as tt
from _inductor import cxx_available
from _models import train_step as _step
from _peak import peak_call_bytes_all_threads
from thunder_train.compiler.executors.into_dead_grad import _pointwise

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
from gpt import GPT, CheckpointedBlocks, GPTConfig  # noqa: E402


def _gpt(n_layer):
    """A small GPT (d 64, T 32) and a batch of 4 (inputs, next-token targets)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=n_layer, n_head=2, n_embd=64))
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    return model, (x, torch.roll(x, -1, 1))


def _run(model, batch, fusion):
    """(losses of four steps, the compiled function, the peak of a fifth in the allocator's order)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cf = tt.compile(_step, fusion=fusion)
    losses = [cf(model, opt, *batch) for _ in range(2)]
    if fusion == "background":
        assert tt.wait_for_fusion(cf, timeout=600)
    losses += [cf(model, opt, *batch) for _ in range(2)]
    return losses, cf, peak_call_bytes_all_threads(lambda: cf(model, opt, *batch), cf)


@pytest.mark.skipif(not cxx_available(), reason="Inductor's CPU backend needs a C++ compiler (none found)")
def test_fused_checkpointed_step_holds_no_more_than_the_torch_program(monkeypatch):
    monkeypatch.delenv("THUNDER_TRAIN_FUSION", raising=False)  # tests/conftest.py turns the default off
    model, batch = _gpt(n_layer=1)
    eager_model = CheckpointedBlocks(copy.deepcopy(model))
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
    eager = [_step(eager_model, eager_opt, *batch) for _ in range(5)]
    torch_losses, _, torch_peak = _run(CheckpointedBlocks(copy.deepcopy(model)), batch, None)
    fused_model = CheckpointedBlocks(copy.deepcopy(model))
    fused_losses, cf, fused_peak = _run(fused_model, batch, "background")
    assert tt.compile_stats(cf).fusion_switches == 1
    # Values: eager's (the fused kernels' tanh GELU is x * sigmoid(2u), a few ulp from eager's).
    for got, want in zip(fused_losses + torch_losses, eager[:4] * 2):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(fused_model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # AdamW steps of lr 1e-3 on gradients a few ulp apart
    # Regions computing GELU (forward and backward) write over their dead input, as the torch program's kernel does.
    over = [b for b in tt.last_traces(cf)[-1].bound_symbols if "written over its dead input" in (b.comment or "")]
    assert any("gelu_vjp" in b.comment for b in over), [b.comment for b in over]
    # Before: 823,308 bytes against the torch program's 496,652 (1.66x).
    assert fused_peak <= torch_peak, (fused_peak, torch_peak)


def test_pointwise_regions_are_told_from_the_others():
    """Only a region of pointwise ATen ops may write its result over an input: each element then depends on the same
    element of that input alone.  A transpose, a softmax or a reduction reads other elements."""
    def f(h):
        a = torch.sigmoid(h * 2.0) + h
        b = h.t() * 2.0
        c = torch.softmax(h, -1)
        return a, b, c, h.sum(-1, keepdim=True)

    cf = tt.compile(f, fusion=None, keep_buffers=False)
    cf(torch.randn(4, 4))

    def lines(*names):
        found = [b for b in tt.last_traces(cf)[-1].bound_symbols if str(b.sym.name).rsplit(".", 1)[-1] in names]
        assert found, names
        return found

    assert _pointwise(lines("mul", "sigmoid", "add"))
    for name in ("softmax", "sum", "t"):
        assert not _pointwise(lines(name)), name


@pytest.mark.skipif(not cxx_available(), reason="Inductor's CPU backend needs a C++ compiler (none found)")
def test_recomputed_gelu_runs_in_the_kernel_of_its_gradient(monkeypatch):
    """The default step recomputes each MLP's tanh GELU for the backward (its output is not saved).  The recomputation
    ran as an Inductor kernel of its own, and the kernel of GELU's gradient computed the same tanh again: the linear's
    input gradient (``g @ w``) closed the region between them (the GPT benchmark step: 0.9 ms a layer; its cheap-value
    recomputation cost 1.1 % -> 0.2 %).  The region now carries the recomputation into the next one
    (executors/inductor_fusion.py ``_carried``).  Values stay eager's."""
    monkeypatch.delenv("THUNDER_TRAIN_FUSION", raising=False)  # tests/conftest.py turns the default off
    model, batch = _gpt(n_layer=2)
    eager_model = copy.deepcopy(model)
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
    eager = [_step(eager_model, eager_opt, *batch) for _ in range(5)]  # (_run's fifth step measures the peak)
    fused_model = copy.deepcopy(model)
    fused_losses, cf, _ = _run(fused_model, batch, "background")
    for got, want in zip(fused_losses, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(fused_model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert any("gelu" in line for line, _ in tt.compile_stats(cf).memory.recomputed)
    kernels = [b for b in tt.last_traces(cf)[-1].bound_symbols if "fused by Inductor" in (b.comment or "")]
    recomputing = [b.comment for b in kernels
                   if any(getattr(o, "_tt_recomputed_of", None) is not None for o in b.flat_outputs())]
    # Before: "2 ops fused by Inductor (gelu, reshape)", and GELU's gradient in another kernel.
    assert len(recomputing) == 2 and all("gelu_vjp" in c for c in recomputing), [b.comment for b in kernels]
