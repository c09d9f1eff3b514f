"""``cuda_graphs=True``: option checks, the reasons a step is not captured, and (on CUDA) capture and replay.

The CPU cases run everywhere; the captured cases need a CUDA device and skip without one.  Every case
compares against eager PyTorch: losses, parameters and optimizer state after several steps.
"""
from __future__ import annotations

import copy
import unittest.mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from _models import train_step
from thunder_train.runtime import cuda_graphs as cg
from thunder_train.compiler.proxies import TensorProxy

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")


def mlp(device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8)).to(device)


def batch(device="cpu", n=16, seed=None):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.randn(n, 32, generator=g).to(device), torch.randint(0, 8, (n,), generator=g).to(device)


def run_both(step, make_opt, device, steps=6, scheduler=None, n=16):
    """(compiled losses, eager losses, compiled model, eager model, compiled opt, eager opt)."""
    m1 = mlp(device)
    m2 = copy.deepcopy(m1)
    o1, o2 = make_opt(m1.parameters()), make_opt(m2.parameters())
    s1 = scheduler(o1) if scheduler else None
    s2 = scheduler(o2) if scheduler else None
    got, want = [], []
    for i in range(steps):
        x, y = batch(device, n, seed=i)
        want.append(train_step(m1, o1, x, y).detach())
        got.append(step(m2, o2, x, y))
        if scheduler:
            s1.step()
            s2.step()
    return got, want, m2, m1, o2, o1


def assert_same(got, want, m2, m1, o2, o1, **tol):
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, msg=lambda s: f"loss of step {i}: {s}", **tol)
    for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(q, p, msg=lambda s: f"{n}: {s}", **tol)
    for k, st in o1.state_dict()["state"].items():
        for key, v in st.items():
            torch.testing.assert_close(o2.state_dict()["state"][k][key], v, msg=lambda s: f"state {k} {key}: {s}", **tol)


# ---------------------------------------------------------------------------
# Everywhere
# ---------------------------------------------------------------------------
def test_options_are_checked():
    with pytest.raises(ValueError, match="pass thin=True"):
        tt.compile(train_step, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be a bool"):
        tt.compile(train_step, thin=True, cuda_graphs="yes")
    with pytest.raises(ValueError, match="cuda_graphs must be a bool"):
        tt.compile(nn.Linear(2, 2), thin=True, cuda_graphs=1)


def test_cpu_step_runs_uncaptured_with_one_note():
    step = tt.compile(train_step, thin=True, cuda_graphs=True)
    got, *rest = run_both(step, lambda ps: torch.optim.AdamW(ps, lr=1e-2), "cpu")
    assert_same(got, *rest)
    st = tt.compile_stats(step)
    assert st.thin_calls > 0 and st.cuda_graph_captures == 0 and st.cuda_graph_replays == 0
    assert len(st.cuda_graph_notes) == 1, st.cuda_graph_notes
    assert "not captured" in st.cuda_graph_notes[0] and "runs uncaptured" in st.cuda_graph_notes[0]
    if not torch.cuda.is_available():
        assert "no CUDA device" in st.cuda_graph_notes[0]


def _bound_entry(fn, *args):
    cf = tt.compile(fn, thin=True)
    for _ in range(3):
        cf(*args)
    return tt.compile_stats(cf), cf._last


def test_obstacles_name_the_reason():
    """What ``obstacle`` reports on programs that cannot be captured (as if a CUDA device were present)."""
    m = mlp()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x, y = batch()
    _, whole_step = _bound_entry(train_step, m, opt, x, y)

    def with_item(model, x, y):
        with torch.no_grad():
            loss = F.cross_entropy(model(x), y)
        return loss, loss.item()

    _, synced = _bound_entry(with_item, m, x, y)
    fwd = tt.compile(m)
    fwd(x).sum().backward()
    with unittest.mock.patch("torch.cuda.is_available", lambda: True):
        assert "is a cpu tensor" in cg.obstacle(whole_step)
        # CPU inputs are named before the host sync that reads them (the cause users can act on: a CPU step counter)
        assert "is a cpu tensor" in cg.obstacle(synced)
        for p in synced.traces[-1].args:  # as if every input were on the device: the host sync is what is left
            if isinstance(p, TensorProxy):
                p._tt_device = torch.device("cuda")
        assert "host sync" in cg.obstacle(synced)
        assert "connects to PyTorch autograd" in cg.obstacle(fwd._tt_compiled._last)


@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                                      lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)], ids=["adamw", "sgd"])
def test_lr_of_fused_updates_becomes_a_device_tensor(make_opt):
    """Only ``lr=`` of the fused update kernels is replaced by a device tensor (the other numbers are baked in)."""
    m = mlp()
    opt = make_opt(m.parameters())
    _, entry = _bound_entry(train_step, m, opt, *batch())
    trc = entry.traces[-1]
    assert [trc.args[j].name for j in cg.tensor_lr_positions(trc)] == ["lr"]


def test_a_number_used_elsewhere_is_not_a_device_tensor():
    """``lr`` also read by another line (here: as a positional argument, or as another keyword of the update)
    stays a number baked into the graph: only ``lr=`` of the fused kernels accepts a device tensor."""
    from thunder_train.compiler.symbols import BoundSymbol

    m = mlp()
    _, entry = _bound_entry(train_step, m, torch.optim.AdamW(m.parameters(), lr=1e-2), *batch())
    trc = entry.traces[-1]
    (j,) = cg.tensor_lr_positions(trc)
    lr = trc.args[j]
    update = next(b for b in trc.bound_symbols if b.kwargs.get("lr") is lr)
    for extra in (BoundSymbol(update.sym, (lr,), {}, None, (), ""),
                  BoundSymbol(update.sym, (), {"lr": lr, "weight_decay": lr}, None, (), "")):
        other = trc.derive("with another use of lr")
        other.bound_symbols = list(trc.bound_symbols) + [extra]
        assert cg.tensor_lr_positions(other) == set()


# ---------------------------------------------------------------------------
# On a CUDA device
# ---------------------------------------------------------------------------
FUSED_ADAMW = lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)  # noqa: E731  step counters on the device


@needs_cuda
@pytest.mark.parametrize("fusion", [None, "inductor"])
def test_whole_step_is_captured_and_replayed(fusion):
    step = tt.compile(train_step, thin=True, cuda_graphs=True, fusion=fusion)
    got, *rest = run_both(step, FUSED_ADAMW, "cuda", steps=8)
    assert_same(got, *rest, atol=1e-5, rtol=1e-4)
    st = tt.compile_stats(step)
    assert st.cuda_graph_captures == 1, st.cuda_graph_notes
    assert st.cuda_graph_replays >= 4, st.cuda_graph_notes
    # Losses kept from earlier steps are not overwritten by later replays.
    assert len({a.data_ptr() for a in got}) == len(got)


@needs_cuda
def test_scheduler_changes_lr_without_recapture():
    step = tt.compile(train_step, thin=True, cuda_graphs=True)
    got, *rest = run_both(step, FUSED_ADAMW, "cuda", steps=8,
                          scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.7))
    assert_same(got, *rest, atol=1e-5, rtol=1e-4)
    assert tt.compile_stats(step).cuda_graph_captures == 1, tt.compile_stats(step).cuda_graph_notes


@needs_cuda
def test_new_batch_sizes_get_a_graph_each_and_revalidate_recaptures():
    """A new batch size never raises (issue 26): the call takes the full path, the batch dimension becomes
    symbolic, and the symbolic entry's binding captures one graph per size (graphs_per_size.py)."""
    step = tt.compile(train_step, thin=True, cuda_graphs=True)
    m1 = mlp("cuda")
    m2 = copy.deepcopy(m1)
    o1, o2 = FUSED_ADAMW(m1.parameters()), FUSED_ADAMW(m2.parameters())
    sizes = [16] * 4 + [8] * 4 + [16, 16, 8, 12, 12, 12, 16, 8]
    for i, n in enumerate(sizes):
        x, y = batch("cuda", n, seed=i)
        torch.testing.assert_close(step(m2, o2, x, y), train_step(m1, o1, x, y).detach(), atol=1e-5, rtol=1e-4)
    st = tt.compile_stats(step)
    assert st.thin_fallbacks >= 1, st  # the first size change took the full path instead of raising
    assert st.cuda_graph_captures >= 3, st.cuda_graph_notes  # the first binding's graph and graphs for 8 and 16 at least
    assert st.cuda_graph_replays >= 4, st.cuda_graph_notes
    captures = st.cuda_graph_captures
    step.revalidate()
    for i in range(4):
        x, y = batch("cuda", 8, seed=40 + i)
        torch.testing.assert_close(step(m2, o2, x, y), train_step(m1, o1, x, y).detach(), atol=1e-5, rtol=1e-4)
    st = tt.compile_stats(step)
    assert st.cuda_graph_captures > captures, st.cuda_graph_notes
    assert any("graph dropped" in n for n in st.cuda_graph_notes), st.cuda_graph_notes
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(q, p, atol=1e-5, rtol=1e-4)


@needs_cuda
def test_cpu_step_counters_run_uncaptured():
    """Default AdamW on CUDA keeps ``step`` on the CPU: not capturable; the note says so, values stay eager's."""
    step = tt.compile(train_step, thin=True, cuda_graphs=True)
    got, *rest = run_both(step, lambda ps: torch.optim.AdamW(ps, lr=1e-2), "cuda")
    assert_same(got, *rest, atol=1e-5, rtol=1e-4)
    st = tt.compile_stats(step)
    assert st.cuda_graph_captures == 0 and any("cpu" in n for n in st.cuda_graph_notes), st.cuda_graph_notes


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_epilogue_side_effects_after_replay(device):
    """The epilogue's Python side effects (new ``.grad`` tensors each step) see each step's own values; a gradient
    kept from an earlier step is not overwritten by a later replay.  On the CPU the same checks run uncaptured."""
    def step_keeps_grads(model, opt, x, y):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    m1 = mlp(device)
    m2 = copy.deepcopy(m1)
    make = FUSED_ADAMW if device == "cuda" else (lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    o1, o2 = make(m1.parameters()), make(m2.parameters())
    step = tt.compile(step_keeps_grads, thin=True, cuda_graphs=True)
    kept = []
    for i in range(7):
        x, y = batch(device, 16, seed=i)
        want = step_keeps_grads(m1, o1, x, y).detach()
        torch.testing.assert_close(step(m2, o2, x, y), want, atol=1e-5, rtol=1e-4)
        for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
            torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=lambda s: f"grad of {n}, step {i}: {s}")
        kept.append([(q.grad, p.grad.clone()) for p, q in zip(m1.parameters(), m2.parameters())])
    for grads in kept:
        for a, b in grads:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    st = tt.compile_stats(step)
    assert st.thin_calls > 0
    if device == "cuda":
        assert st.cuda_graph_replays > 0, st.cuda_graph_notes
