"""The memory plan: measured peak memory of whole steps against eager (with and without checkpointing), the
default's cheap rematerialization, ``memory_budget`` and the report (docs/memory.md).

Peak: the bytes allocated during one whole step above what was live before it (torch.profiler's allocator
events), plus the buffers a compiled program keeps between calls, as benchmarks/train_step.py measures it.
On the CPU these are deterministic.
"""
from __future__ import annotations

import copy
import os
import re
import sys

import pytest
import torch
import torch.nn.functional as F
import torch.utils._python_dispatch

import _models
import thunder_train as tt
from thunder_train.compiler.executors.regions import FusionSymbol
# tests/_peak.py, shared with the benchmarks: peaks in the allocator's order (test_peak_in_allocator_order_sees_frees_inside_an_op)
from _peak import peak_call_bytes, peak_call_bytes_all_threads as peak_bytes

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
from gpt import GPT, CheckpointedBlocks as Checkpointed, GPTConfig  # noqa: E402


def step(model, opt, x, y):
    loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _setup(n_layer=2, d=64, T=32, B=4, V=512):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=n_layer, n_head=4, n_embd=d))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (B, T), generator=g)
    return model, (x, torch.roll(x, -1, 1))


def _measure(model, batch, *, ckpt, compile_options=None, steps=3):
    """(peak bytes of the step after ``steps`` steps, losses, compiled function or None).  A compiled run's first step
    is eager's: it creates AdamW's state, so the compiled step is traced once, with it (CI time: the program traced
    without the state, run once, was a second trace of each)."""
    m = Checkpointed(model) if ckpt else model
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    fn = step if compile_options is None else tt.compile(step, **compile_options)
    losses = [step(m, opt, *batch)] + [fn(m, opt, *batch) for _ in range(steps - 1)]
    peak = peak_bytes(lambda: fn(m, opt, *batch), None if compile_options is None else fn)
    return peak, losses, (None if compile_options is None else fn)


@pytest.fixture(scope="module")
def small_gpt():
    model, batch = _setup()
    out = {}
    for name, ckpt, options in (("eager", False, None), ("eager ckpt", True, None),
                                ("tt", False, {"fusion": None}), ("tt ckpt", True, {"fusion": None}),
                                ("tt budget", False, {"fusion": None, "memory_budget": 0.25})):
        out[name] = _measure(copy.deepcopy(model), batch, ckpt=ckpt, compile_options=options)
    return out


def test_values_match_eager(small_gpt):
    for name in ("tt", "tt ckpt", "tt budget"):
        for got, want in zip(small_gpt[name][1], small_gpt["eager"][1]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_checkpointing_lowers_the_compiled_peak(small_gpt):
    # (Against eager's checkpointing: test_gpt_benchmark_step_targets. On this tiny model the compiled step with
    # checkpointing is ~1.1x eager's with it: docs/memory.md, known gaps.)
    peak = {k: v[0] for k, v in small_gpt.items()}
    assert peak["tt ckpt"] < peak["tt"], peak
    assert peak["tt"] <= peak["eager"], peak


def test_budget_saves_at_most_its_fraction_and_lowers_the_peak(small_gpt):
    plan = tt.compile_stats(small_gpt["tt budget"][2]).memory
    default = tt.compile_stats(small_gpt["tt"][2]).memory
    # The reference is what the default saves with every cheap value recomputed: a budget asks for memory, so
    # values the torch program's default keeps as costly to recompute (``MemoryPlan.costly_kept``) count as recomputed.
    assert plan.memory_budget == 0.25 and plan.saved_bytes_default <= default.saved_bytes
    assert (plan.saved_bytes_default == default.saved_bytes) == (default.costly_kept == 0)
    # Met: the head's logits, which cross-entropy's backward pins, run by blocks of rows and are not kept whole
    # (executors/blocked_head.py; the report counted them as kept before and said "NOT reached").
    assert plan.head_logits_bytes > 0 and "of logits by blocks of rows" in plan.summary(), plan.summary()
    assert plan.budget_met and plan.saved_bytes <= 0.25 * plan.saved_bytes_default, plan.summary()
    assert any(reason == "budget" for _, reason in plan.recomputed)
    assert small_gpt["tt budget"][0] < small_gpt["tt"][0]


def test_memory_report(small_gpt):
    plan = tt.compile_stats(small_gpt["tt ckpt"][2]).memory
    default = tt.compile_stats(small_gpt["tt"][2]).memory
    assert plan.checkpoint_regions == 2 and default.checkpoint_regions == 0
    reasons = {r for _, r in plan.recomputed}
    assert "checkpoint region" in reasons
    assert {r for _, r in default.recomputed} == {"cheap"}  # the MLP's GELU
    assert plan.saved_bytes < default.saved_bytes < default.saved_bytes_without_remat
    assert 0 < plan.planned_peak_bytes < default.planned_peak_bytes
    assert "recomputed lines" in plan.summary()
    text = str(tt.last_traces(small_gpt["tt ckpt"][2])[-1])
    assert "# recomputed for the backward" in text


def _module_run(model, batch, ckpt, compile_options=None, steps=2):
    """(peak bytes of the last step, losses, compiled module or None): eager or ``tt.compile(model)``."""
    m = Checkpointed(model) if ckpt else model
    run = m if compile_options is None else tt.compile(m, **compile_options)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    losses = [step(run, opt, *batch).detach() for _ in range(steps)]
    # In the allocator's order, with the buffers the forward and backward programs keep between calls
    peak = peak_bytes(lambda: step(run, opt, *batch))
    if compile_options is not None:
        from thunder_train.compiler.executors.buffers import kept_bytes

        peak += kept_bytes(tt.last_traces(run)[-1]) + kept_bytes(tt.last_backward_traces(run)[-1])
    return peak, losses, (None if compile_options is None else run)


def test_compiled_module_is_planned_like_whole_steps():
    """tt.compile(model): what the forward saves is chosen by the whole step's planner: cheap values by default,
    checkpoint regions recomputed, ``memory_budget`` met; values equal eager's, and the measured peak with
    checkpointing (in the allocator's order, kept buffers included) is at most eager's with the same checkpointing:
    0.99x.  It was 1.14x: the backward node held the logits' gradient to its end (the engine's reference to its
    inputs; ``ThunderFunction`` now takes the gradients over in a pre-hook), and the backward's kept buffers were
    planned as if its saved parameters were freed at their last use."""
    model, batch = _setup(n_layer=2)
    runs = {name: _module_run(copy.deepcopy(model), batch, ckpt, options) for name, ckpt, options in (
        ("eager", False, None), ("eager ckpt", True, None), ("tt", False, {"fusion": None}),
        ("tt ckpt", True, {"fusion": None}), ("tt budget", False, {"fusion": None, "memory_budget": 0.25}))}
    for name, (_, losses, _) in runs.items():
        torch.testing.assert_close(losses, runs["eager ckpt" if "ckpt" in name else "eager"][1], rtol=1e-5, atol=1e-5)
    default, ckpt, budget = (tt.compile_stats(runs[k][2]).memory for k in ("tt", "tt ckpt", "tt budget"))
    assert {r for _, r in default.recomputed} == {"cheap"}, default.summary()  # the MLP's GELU
    assert default.saved_bytes < default.saved_bytes_without_remat
    assert ckpt.checkpoint_regions == 2 and ckpt.recomputed and ckpt.saved_bytes < default.saved_bytes, ckpt.summary()
    assert budget.budget_met and budget.saved_bytes <= 0.25 * budget.saved_bytes_default, budget.summary()
    assert any(r == "budget" for _, r in budget.recomputed)
    assert runs["tt ckpt"][0] <= runs["eager ckpt"][0], (runs["tt ckpt"][0], runs["eager ckpt"][0])
    assert runs["tt budget"][0] < runs["tt"][0] <= runs["eager"][0], (runs["tt budget"][0], runs["tt"][0], runs["eager"][0])


def test_compiled_modules_output_gradients_reach_hooks_and_retain_grad_before_the_backward_takes_them():
    """The backward node's pre-hook takes the gradients of the module's outputs over (so the engine does not hold them
    through the backward) after tensor hooks and ``retain_grad`` ran: those see the gradients eager's see, and the
    parameters' gradients are eager's; twice through a retained graph too."""
    torch.manual_seed(0)
    base, x = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)), torch.randn(5, 8)
    seen = {}
    for mode in ("eager", "tt"):
        model = copy.deepcopy(base)
        run = model if mode == "eager" else tt.compile(model, fusion=None)
        y = run(x)
        y.retain_grad()
        hooked = []
        y.register_hook(lambda g: hooked.append(g.clone()))
        loss = (y * torch.arange(4.0)).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        seen[mode] = (hooked, y.grad, [p.grad for p in model.parameters()])
    torch.testing.assert_close(seen["tt"][:2], seen["eager"][:2], rtol=0, atol=0)
    torch.testing.assert_close(seen["tt"][2], seen["eager"][2])  # (tanh's backward: a rounding apart)


def test_budget_out_of_range_is_refused_clearly():
    with pytest.raises(ValueError, match="memory_budget must be a number between 0 and 1"):
        tt.compile(step, memory_budget=2)


@pytest.mark.parametrize("dims", [(64, 256, 256, 64), (32, 512, 512, 512, 32)])
def test_step_as_traced_holds_gradients_to_the_optimizer_as_eager_does(dims):
    """``MemoryPlan.traced_peak_bytes``, the count of the step as traced that the kept buffers may fill up to, is
    eager's peak: each gradient is held from where the backward makes it to ``opt.step()``, as eager's ``.grad``.
    It was counted as freed where it was made (the program's own plan, whose updates run as soon as a gradient is
    final): 0.75x and 0.52x of these MLP steps' measured eager peaks, 0.96x of ModernBERT's zoo step, so the kept
    buffers held back memory eager uses (ModernBERT's fused step 2-4 % slower for its cheap recomputation).  SGD
    allocates nothing in its step (AdamW's temporaries are a peak of eager's own, after the backward)."""
    layers = []
    for a, b in zip(dims, dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    torch.manual_seed(0)
    base = torch.nn.Sequential(*layers[:-1])
    x, y = torch.randn(16, dims[0]), torch.randint(0, dims[-1], (16,))
    peaks, losses = {}, {}
    for mode in ("eager", "tt"):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        fn = _models.train_step if mode == "eager" else tt.compile(_models.train_step, fusion=None)
        losses[mode] = [fn(model, opt, x, y).detach() for _ in range(2)]
        peaks[mode] = peak_bytes(lambda: fn(model, opt, x, y), None if mode == "eager" else fn)
    traced = tt.compile_stats(fn).memory.traced_peak_bytes
    assert 0.98 * peaks["eager"] <= traced <= peaks["eager"], (traced, peaks)
    assert peaks["tt"] <= peaks["eager"], peaks
    torch.testing.assert_close(losses["tt"], losses["eager"])


def test_gpt_benchmark_step_targets():
    """The issue's GPT step (benchmarks/train_step.py), issue 27's targets: the default at most 0.80x eager's peak
    (measured 0.62x in the allocator's order with its four GELU outputs recomputed, as its fused program plans them;
    this torch program recomputes one, the fewest that keep its planned peak 2 % under the step as traced: 0.73x;
    cross-entropy by blocks of rows, updates as soon as gradients are final); per-block checkpointing at most 0.20x (0.149x, 0.174x op by op; eager's with it 0.47x,
    0.39x op by op: the head by blocks of rows, backward lines sunk to their readers, GELU's gradient in place, the
    attention recomputed again after the MLP's backward; docs/memory.md); ``memory_budget=0.25`` at most 0.35x
    (0.176x, 0.205x op by op)."""
    model, batch = _setup(n_layer=4, d=256, T=128, B=8, V=4096)
    eager = _measure(copy.deepcopy(model), batch, ckpt=False, steps=2)[0]
    eager_ckpt = _measure(copy.deepcopy(model), batch, ckpt=True, steps=2)[0]
    default = _measure(copy.deepcopy(model), batch, ckpt=False, compile_options={"fusion": None}, steps=2)[0]
    ckpt = _measure(copy.deepcopy(model), batch, ckpt=True, compile_options={"fusion": None}, steps=2)[0]
    budget = _measure(copy.deepcopy(model), batch, ckpt=False, compile_options={"fusion": None, "memory_budget": 0.25},
                      steps=2)[0]
    assert default <= 0.75 * eager, (default / eager)
    assert ckpt < 0.5 * default, (ckpt / eager, default / eager)
    assert ckpt <= 0.80 * eager_ckpt and ckpt <= 0.19 * eager, (ckpt / eager, eager_ckpt / eager)
    assert budget <= 0.22 * eager, (budget / eager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_by_blocks_of_rows_is_eagers_bitwise(dtype, reduction, monkeypatch):
    """Cross-entropy's whole-step kernels (executors/saved_statistics.py) run eager's log_softmax and its backward on
    blocks of rows, writing over the logits and then over the log-probabilities: the loss and the logits' gradient
    equal eager autograd's bitwise, blocks that do not divide the rows and ignored rows included."""
    from thunder_train.compiler.executors import saved_statistics as ss

    red = {"none": 0, "mean": 1, "sum": 2}[reduction]
    g = torch.Generator().manual_seed(0)
    for n, v, block_bytes in ((1024, 4096, 1 << 20), (37, 301, 1000), (5, 3, 1), (6, 5, 1 << 20)):  # last: one block
        monkeypatch.setattr(ss, "_ROW_BLOCK_BYTES", block_bytes)
        x = (torch.randn(n, v, generator=g) * 4).to(dtype)
        y = torch.randint(0, v, (n,), generator=g)
        y[::7] = -100
        xe = x.clone().requires_grad_()
        loss = F.cross_entropy(xe, y, reduction=reduction)
        gout = torch.randn(loss.shape, generator=g).to(dtype) if loss.dim() else torch.tensor(0.75, dtype=dtype)
        loss.backward(gout)
        logits = x.clone()
        got, logp, total = ss.cross_entropy_into_logits(logits, y, -100, red)
        assert logp is logits and torch.equal(got, loss.detach())
        assert torch.equal(logp, torch.log_softmax(x, 1))
        (grad,) = ss.cross_entropy_backward_into_logp(gout, logp, y, total, -100, red)
        assert grad is logp and torch.equal(grad, xe.grad), (n, v, (grad - xe.grad).abs().max())


def _optimizers():
    return {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
            "adamw fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
            "adam amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.1),
            "sgd nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
            "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1)}


# Every optimizer kind on the plain model; checkpointing (its regions recomputed in the backward) with one of them: which
# kernel runs the update does not change where it may move (CI time: the other four checkpointed cases added 8 traces).
EARLY_UPDATE_CASES = [(name, False) for name in _optimizers()] + [("adamw", True)]


@pytest.mark.parametrize("opt_name, ckpt", EARLY_UPDATE_CASES,
                         ids=[f"{n}-{'checkpointed' if c else 'plain'}" for n, c in EARLY_UPDATE_CASES])
def test_early_updates_equal_the_update_after_the_backward(opt_name, ckpt, monkeypatch):
    """transforms/early_updates.py: each parameter is updated as soon as its gradient is final, during the backward.
    Parameters, optimizer state and losses are bitwise those of the same program updating after the backward (and
    equal eager's); the trace has one in-place update per parameter, most of them before the backward's last line."""
    from thunder_train.compiler import pipeline
    from thunder_train.compiler.transforms import early_updates

    monkeypatch.setattr(early_updates, "HOLD_BACK_BYTES", 0)  # this model's gradients are all small: move every one
    model, batch = _setup(n_layer=2, d=32, T=16, B=2, V=64)
    make_opt = _optimizers()[opt_name]
    runs = {}
    for early in (True, False):
        if not early:
            monkeypatch.setattr(pipeline, "update_when_final", lambda trc, **_: trc)
        m = copy.deepcopy(model)
        m_run = Checkpointed(m) if ckpt else m
        opt = make_opt(m.parameters())
        cf = tt.compile(step, fusion=None)
        losses = [cf(m_run, opt, *batch) for _ in range(3)]
        runs[early] = (m, opt, losses, tt.last_traces(cf)[-1].python_source())
    (m1, o1, l1, src), (m2, o2, l2, _) = runs[True], runs[False]
    assert all(torch.equal(a, b) for a, b in zip(l1, l2))
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        for k, v in o1.state[p1].items():
            assert torch.equal(v, o2.state[p2][k]), (opt_name, k)
    n = len(list(m1.parameters()))
    kernel = {"adamw": "adam", "adamw fused": "adam", "adam amsgrad": "adam", "sgd nesterov": "sgd", "adagrad": "adagrad"}[opt_name]
    lines = src.splitlines()
    # In-place update lines, each of the parameters whose gradients are final at the same line (one kernel call).
    updated = {i: line.split(f"ttex.{kernel}_update_([")[1].split("]")[0].count(",") + 1
               for i, line in enumerate(lines) if f"ttex.{kernel}_update_(" in line}
    assert sum(updated.values()) == n and len(updated) >= n // 2, src
    # The first layers' gradients are final last: the head's and the last block's updates run before them.
    # (the update of the first block's first weight runs right after its gradient is final)
    first_block_update = next(i for i in updated if "blocks_0_ln1_weight" in lines[i].split(f"ttex.{kernel}_update_([")[1].split("]")[0])
    assert sum(k for i, k in updated.items() if i < first_block_update) >= n // 2, src
    eager = copy.deepcopy(model)
    eager_opt = make_opt(eager.parameters())
    want = [step(Checkpointed(eager) if ckpt else eager, eager_opt, *batch) for _ in range(3)]
    for got, w in zip(l1, want):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)


# (hold_back 0, every update moved, is test_early_updates_equal_the_update_after_the_backward[adamw-plain].)
@pytest.mark.parametrize("hold_back", [1 << 20, 6000])
def test_small_gradients_update_together_after_the_backward(hold_back, monkeypatch):
    """Updates whose gradients add up to at most HOLD_BACK_BYTES stay after the backward as one multi-tensor line
    (a kernel call costs more than a small update saves), the others move; every way, the parameters, state and
    losses are bitwise those of the program updating after the backward."""
    from thunder_train.compiler import pipeline
    from thunder_train.compiler.transforms import early_updates

    model, batch = _setup(n_layer=2, d=32, T=16, B=2, V=64)
    runs = {}
    for early in (True, False):
        monkeypatch.setattr(early_updates, "HOLD_BACK_BYTES", hold_back)
        if not early:
            monkeypatch.setattr(pipeline, "update_when_final", lambda trc, **_: trc)
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        cf = tt.compile(step, fusion=None)
        losses = [cf(m, opt, *batch) for _ in range(3)]
        runs[early] = (m, opt, losses, tt.last_traces(cf)[-1].python_source())
    (m1, o1, l1, src), (m2, o2, l2, _) = runs[True], runs[False]
    assert all(torch.equal(a, b) for a, b in zip(l1, l2))
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert all(torch.equal(v, o2.state[p2][k]) for k, v in o1.state[p1].items())
    params = list(m1.parameters())
    lines = [line for line in src.splitlines() if "ttex.adam_update_(" in line]
    counts = [line.split("ttex.adam_update_([")[1].split("]")[0].count(",") + 1 for line in lines]
    assert sum(counts) == len(params)
    sizes = sorted(p.numel() * p.element_size() for p in params)
    n_held = 0
    while n_held < len(sizes) and sum(sizes[:n_held + 1]) <= hold_back:
        n_held += 1
    if n_held == len(params):
        assert counts == [len(params)], src  # every update together: one kernel call
    else:
        assert 0 < n_held < len(params) and counts[-1] == n_held and len(lines) > 1, src  # the last line: the held ones


def test_moving_updates_run_in_groups_of_consecutive_parameters(monkeypatch):
    """Where a kernel call costs more (CUDA: ``early_updates.CUDA_GROUP_BYTES``), the moving updates of one line run in
    groups of consecutive parameters holding at least ``group_bytes`` of gradients: fewer update calls, each after
    its group's last gradient, and the parameters, state and losses bitwise those of the program updating after the
    backward.  Forced here on the CPU through ``group_bytes``."""
    from thunder_train.compiler import pipeline
    from thunder_train.compiler.transforms import early_updates

    group = 20000
    model, batch = _setup(n_layer=2, d=32, T=16, B=2, V=64)
    monkeypatch.setattr(early_updates, "HOLD_BACK_BYTES", 0)
    runs = {}
    for mode in ("per parameter", "grouped", "after the backward"):
        ufw = {"per parameter": early_updates.update_when_final,
               "grouped": lambda trc, **kw: early_updates.update_when_final(trc, **{**kw, "group_bytes": group}),
               "after the backward": lambda trc, **_: trc}[mode]
        monkeypatch.setattr(pipeline, "update_when_final", ufw)
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        cf = tt.compile(step, fusion=None)
        losses = [cf(m, opt, *batch) for _ in range(3)]
        src = tt.last_traces(cf)[-1].python_source()
        lines = [line.split("ttex.adam_update_([")[1].split("]")[0].split(", ") for line in src.splitlines()
                 if "ttex.adam_update_(" in line]
        runs[mode] = (m, opt, losses, lines, src)
    m3, o3, l3, _, _ = runs["after the backward"]
    for mode in ("per parameter", "grouped"):
        m1, o1, l1, _, _ = runs[mode]
        assert all(torch.equal(a, b) for a, b in zip(l1, l3))
        assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m3.parameters()))
        for p1, p3 in zip(m1.parameters(), m3.parameters()):
            assert all(torch.equal(v, o3.state[p3][k]) for k, v in o1.state[p1].items())
    params = list(model.parameters())
    grouped, per_parameter = runs["grouped"][3], runs["per parameter"][3]
    assert sum(map(len, grouped)) == sum(map(len, per_parameter)) == len(params)
    # as many calls as groups of ``group`` bytes (or fewer: groups whose last gradients are final at the same line
    # run as one call)
    sizes = [p.numel() * p.element_size() for p in params]
    groups, total = 1, 0
    for size in sizes:
        if total >= group:
            groups, total = groups + 1, 0
        total += size
    assert 2 <= len(grouped) <= groups < len(per_parameter), runs["grouped"][4]


def test_early_updates_wait_for_reads_of_the_old_parameters():
    """A step reading the parameters after the backward and before opt.step() sees their old values (eager's), and
    an update never runs before a read of what it overwrites."""
    def reading(model, opt, x, y):
        loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
        loss.backward()
        size = sum(p.detach().abs().sum() for p in model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach(), size

    model, batch = _setup(n_layer=1, d=32, T=16, B=2, V=64)
    m1, m2 = copy.deepcopy(model), copy.deepcopy(model)
    o1, o2 = (torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (m1, m2))
    cf = tt.compile(reading, fusion=None)
    for _ in range(3):
        got, want = cf(m1, o1, *batch), reading(m2, o2, *batch)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_blocked_head_kernels_match_eager(dtype, reduction, monkeypatch):
    """executors/blocked_head.py: the head's linear + cross-entropy by blocks of rows against eager autograd, with a
    bias, ignored rows, ignore_index=0 and blocks that do not divide the rows.  Loss and input gradient are the
    rows of eager's computation (bitwise on the GPT's shapes, within rounding where the BLAS runs small blocks
    otherwise); the weight and bias gradients are sums over blocks (rounding-level differences)."""
    from thunder_train.compiler.executors import blocked_head as bh

    red = {"none": 0, "mean": 1, "sum": 2}[reduction]
    g = torch.Generator().manual_seed(0)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype is torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    tol["equal_nan"] = True  # every row ignored: 0 / 0, as eager
    for lead, d, v, ignore, bias, block_bytes in (((4, 64), 32, 4096, -100, False, 1 << 20), ((37,), 16, 301, 0, True, 1000),
                                                  ((5,), 3, 3, 2, True, 1)):
        monkeypatch.setattr(bh, "_BLOCK_BYTES", block_bytes)
        x = torch.randn(*lead, d, generator=g, dtype=dtype)
        w = torch.randn(v, d, generator=g, dtype=dtype) * 0.3
        b = torch.randn(v, generator=g, dtype=dtype) if bias else None
        y = torch.randint(0, v, (x[..., 0].numel(),), generator=g)
        y[::7] = ignore
        xe, we, be = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_() if bias else None
        loss = F.cross_entropy(F.linear(xe, we, be).flatten(0, -2), y, reduction=reduction, ignore_index=ignore)
        gout = torch.randn(loss.shape, generator=g, dtype=dtype) if loss.dim() else torch.tensor(0.75, dtype=dtype)
        loss.backward(gout)
        got, total = bh.linear_cross_entropy(x, w, b, y, ignore, red)
        grads = bh.linear_cross_entropy_backward(gout, x, w, b, y, total, ignore, red, (0, 1, 2) if bias else (0, 1))
        if lead == (4, 64):  # the GPT's shapes: the rows of eager's matmuls, bitwise
            assert torch.equal(got, loss.detach()) and torch.equal(grads[0].view_as(x), xe.grad)
        torch.testing.assert_close(got, loss.detach(), **tol)
        torch.testing.assert_close(grads[0].view_as(x), xe.grad, **tol)
        torch.testing.assert_close(grads[1], we.grad, **tol)
        if bias:
            torch.testing.assert_close(grads[2], be.grad, **tol)
        # With the incoming gradient known at the forward: the same kernels on the same values in one pass, bitwise.
        which = (0, 1, 2) if bias else (0, 1)
        both = bh.linear_cross_entropy_and_grads(gout, x, w, b, y, ignore, red, which)
        assert len(both) == 2 + len(which)
        for a, e in zip(both, (got, total) + grads):
            torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True)  # bitwise (every row ignored: NaN)
        with pytest.raises(IndexError, match="out of bounds"):  # eager's check and message
            bh.linear_cross_entropy(x, w, b, torch.full_like(y, v), ignore, red)
        with pytest.raises(IndexError, match="out of bounds"):
            bh.linear_cross_entropy_and_grads(gout, x, w, b, torch.full_like(y, v), ignore, red, which)


def _grad_step(model, x, y):
    loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
    loss.backward()
    return loss


@pytest.mark.parametrize("options", [{"ckpt": True}, {"ckpt": False, "memory_budget": 0.5}, {"ckpt": False}],
                         ids=["checkpointing", "budget", "default"])
def test_blocked_head_in_whole_steps(options):
    """With checkpointing or a budget the GPT's head and cross-entropy run by blocks of rows (4 blocks here): the
    loss and every gradient but the head weight's are eager's bitwise, the head weight's within rounding; the
    default keeps eager's one matmul (bitwise)."""
    model, (x, _) = _setup(n_layer=1, d=32, T=32, B=4, V=8192)
    y = torch.roll(x, -1, 1)
    y[0, :5] = -100
    eager = copy.deepcopy(model)
    want = _grad_step(Checkpointed(eager) if options["ckpt"] else eager, x, y)
    m = copy.deepcopy(model)
    cf = tt.compile(_grad_step, fusion=None, **{k: v for k, v in options.items() if k != "ckpt"})
    got = cf(Checkpointed(m) if options["ckpt"] else m, x, y)
    blocked = options != {"ckpt": False}
    text = str(tt.last_traces(cf)[-1])
    assert ("ttex.linear_cross_entropy_and_grads(" in text) == blocked  # loss.backward(): gradients with the loss
    assert ("ttex.gelu_vjp_into_grad(" in text) == blocked  # executors/into_dead_grad.py
    if blocked:  # (the default sinks too where it recomputes cheap values: transforms/memory.py)
        assert any("transforms/sinking.py" in str(t).splitlines()[0] for t in tt.last_traces(cf))
    assert torch.equal(got, want)
    for (name, p), q in zip(m.named_parameters(), eager.parameters()):
        if name == "head.weight" and blocked:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(p.grad, q.grad), name


class _HeadMatmulFlops(torch.utils._python_dispatch.TorchDispatchMode):
    """Multiply-adds of the matmuls that read ``weight``'s memory (``mm``/``addmm``, any layout of it)."""

    thunder_train_observes = True  # counts the compiled program's calls (compiler/acquisition/ambient.py)

    def __init__(self, weight):
        super().__init__()
        self.ptr, self.macs = weight.untyped_storage().data_ptr(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            a, b = args[-2:] if func.overloadpacket is torch.ops.aten.addmm else args[:2]
            if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == self.ptr for t in (a, b)):
                self.macs += a.shape[0] * a.shape[1] * b.shape[1]
        return out


@pytest.mark.parametrize("seed", ["backward()", "backward(g)", "from the loss"])
def test_blocked_head_gradients_with_the_loss(seed):
    """Where the loss's incoming gradient exists before the loss (``loss.backward()``'s constant seed, or a tensor
    the step is given), the blocked head computes its gradients in the forward's pass over the blocks: the head's
    matmuls read its weight as often as eager's (no second logits matmul in the backward), and the values are
    eager's (the weight's gradient within rounding, as the two-line form).  A seed computed from the loss keeps the
    two lines, and eager's values."""
    model, (x, _) = _setup(n_layer=1, d=32, T=32, B=4, V=8192)
    y = torch.roll(x, -1, 1)
    y[0, :5] = -100
    gout = torch.tensor(0.75)

    def grad_step(model, x, y, gout):
        loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
        if seed == "backward()":
            loss.backward()
        elif seed == "backward(g)":
            loss.backward(gout)
        else:
            (loss * loss.detach()).backward()
        return loss

    eager = Checkpointed(copy.deepcopy(model))
    counted = _HeadMatmulFlops(eager.gpt.head.weight)
    with counted:
        want = grad_step(eager, x, y, gout)
    m = Checkpointed(copy.deepcopy(model))
    cf = tt.compile(grad_step, fusion=None)
    got = cf(m, x, y, gout)
    for p in m.parameters():
        p.grad = None
    ours = _HeadMatmulFlops(m.gpt.head.weight)
    with ours:
        got = cf(m, x, y, gout)
    text = str(tt.last_traces(cf)[-1])
    early = seed != "from the loss"
    assert ("ttex.linear_cross_entropy_and_grads(" in text) == early
    assert ("ttex.linear_cross_entropy_backward(" in text) == (not early)
    assert (ours.macs == counted.macs) == early, (ours.macs, counted.macs)
    assert torch.equal(got, want)
    for (name, p), q in zip(m.named_parameters(), eager.parameters()):
        if name == "gpt.head.weight":
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(p.grad, q.grad), name


def test_blocked_head_bad_target_raises_like_eager():
    """A target out of range raises eager's error from the blocked head, and the call changes nothing."""
    model, (x, y) = _setup(n_layer=1, d=32, T=16, B=2, V=64)
    m = Checkpointed(copy.deepcopy(model))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    cf = tt.compile(step, fusion=None)
    cf(m, opt, x, y)
    assert "ttex.linear_cross_entropy_and_grads(" in str(tt.last_traces(cf)[-1])
    before = [p.detach().clone() for p in m.parameters()]
    bad = y.clone()
    bad[1, 3] = 64
    with pytest.raises(IndexError, match="Target 64 is out of bounds"):
        cf(m, opt, x, bad)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


# At or below eager's once the final (fused) program runs; the others are above it (docs/memory.md, known gaps).
# Each case builds its fused program (tens of seconds on a loaded 2-core machine; Inductor's disk cache helps).
def _moe_step(w, x, route, opt):
    """A mixture-of-experts layer as transformers writes Mixtral's: one stacked weight, ``w[e]`` per expert hit."""
    out = torch.zeros_like(x)
    for e in route.unique():
        rows = (route == e).nonzero()[:, 0]
        out = out.index_add(0, rows, F.linear(x[rows], w[e]))
    loss = (out * out).sum()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def test_expert_weights_are_views_and_their_gradient_sums_in_place():
    """``w[e]`` with a 0-d index tensor stays eager's select (a view: no weight copy saved for the backward), each
    expert's gradient is scattered into the running sum, written in place (executors/sums_in_place.py): values and
    updates equal eager's, and the peak is at most eager's."""
    torch.manual_seed(0)
    w0, x = torch.randn(4, 32, 32), torch.randn(16, 32)
    route = torch.tensor([0, 2, 3, 2, 0, 0, 3, 2, 2, 3, 0, 2, 3, 3, 0, 2])
    peaks, losses, weights = {}, {}, {}
    for mode in ("eager", "tt"):
        w = torch.nn.Parameter(w0.clone())
        opt = torch.optim.SGD([w], lr=0.1)
        fn = _moe_step if mode == "eager" else tt.compile(_moe_step)
        losses[mode] = [fn(w, x, route, opt) for _ in range(2)]
        peaks[mode] = peak_bytes(lambda: fn(w, x, route, opt), None if mode == "eager" else fn)
        weights[mode] = w.detach().clone()
        if mode == "tt":
            src = str(tt.last_traces(fn)[-1])
            assert "index_select" not in src and "ttex.scatter_add_into_first" in src, src
    torch.testing.assert_close(losses["tt"], losses["eager"])
    torch.testing.assert_close(weights["tt"], weights["eager"])
    assert 0 < peaks["tt"] <= peaks["eager"], peaks


def test_writes_to_a_band_are_cats_without_positions():
    """``a[..., i:j] = v`` and a copy into such a view (DeepSeek-V3's attention) are traced as a ``cat`` of the parts
    around the band (clang.with_band), not an index_put over int64 positions: values and gradients are eager's."""

    def f(x, v):
        a = x.new_empty(3, 6)
        a[..., :2].copy_(v[:, :2])
        a[..., 2:].copy_(x[:, 2:] * 3)
        b = torch.zeros(4, 3, 6)
        b[1:3] = torch.stack([a, a])
        b[:, :, -1:] = 0.5
        return (a * b).sum()

    def step(x, v):
        loss = f(x, v)
        loss.backward()
        return loss

    x, v = torch.randn(3, 6, requires_grad=True), torch.randn(3, 6, requires_grad=True)
    x2, v2 = (t.detach().clone().requires_grad_() for t in (x, v))
    expected = step(x, v)
    cf = tt.compile(step)
    torch.testing.assert_close(cf(x2, v2), expected, rtol=0, atol=0)
    torch.testing.assert_close((x2.grad, v2.grad), (x.grad, v.grad), rtol=0, atol=0)
    assert "index_put" not in str(tt.last_traces(cf)[-1])


class _TemporariesInside(torch.autograd.Function):
    """An autograd function whose forward frees temporaries inside its own op, as BLOOM's ``GeLUFunction`` does."""

    @staticmethod
    def forward(ctx, x):
        a = x * 2
        b = a * 3
        del a
        c = b + 1
        del b
        return c

    @staticmethod
    def backward(ctx, g):
        return g * 6


def test_peak_in_allocator_order_sees_frees_inside_an_op():
    """Two of the function's three results are alive at once (``a`` and ``b``, then ``b`` and ``c``): the count in
    the allocator's order says so; the op-by-op reading (frees counted at the start of their op) says one."""
    from _peak import peak_call_bytes_all_threads

    x = torch.randn(64, 1024)
    one = x.nbytes
    in_order = peak_call_bytes_all_threads(lambda: _TemporariesInside.apply(x))
    assert 2 * one <= in_order < 3 * one, in_order
    assert peak_call_bytes(lambda: _TemporariesInside.apply(x)) < 2 * one  # why peaks are read in order


def _conv_step(model, opt, x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def test_first_convolutions_backward_computes_no_gradient_for_the_batch():
    """A network's first convolution reads the batch, which needs no gradient: its backward computes the weight's
    gradient alone (``output_mask`` (False, True): dead-code elimination narrows the line, ``Symbol.narrowed``), as
    eager's autograd asks the kernel.  Computing the batch's gradient too was a batch-sized temporary no one read
    (ResNet's compiled step: 2.5x eager's peak, ViT's 1.46x).  Values, parameters and the peak in the allocator's order against
    eager's; a second convolution, whose input needs a gradient, computes both."""
    from _peak import peak_call_bytes_all_threads

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Conv2d(16, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3, padding=1))
    x = torch.randn(8, 16, 8, 8)  # 0.86x eager's peak; 1.10x computing the batch's gradient
    peaks, models = {}, {}
    for mode in ("eager", "tt"):
        model = models[mode] = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fn = _conv_step if mode == "eager" else tt.compile(_conv_step, fusion=None)
        losses = [fn(model, opt, x) for _ in range(2)]
        peaks[mode] = peak_call_bytes_all_threads(lambda: fn(model, opt, x), None if mode == "eager" else fn)
        models[mode] = (model, losses)
    torch.testing.assert_close(models["tt"][1], models["eager"][1])
    for p, q in zip(models["tt"][0].parameters(), models["eager"][0].parameters()):
        torch.testing.assert_close(p, q)
    # the second convolution's backward (its input needs a gradient), then the first's (the batch needs none)
    masks = re.findall(r"convolution_backward\(.*, \((True|False), (True|False), (True|False)\)\)", str(tt.last_traces(fn)[-1]))
    assert masks == [("True", "True", "True"), ("False", "True", "True")], masks
    assert 0 < peaks["tt"] <= peaks["eager"], peaks


_KEPT_GRAPH_CASES = [  # attention the CPU runs with the math kernel, where the line keeps its graph there: value
    # heads narrower than the key's, operands strided in their last dim; (query, key, value shapes, keyword arguments)
    ((2, 4, 12, 16), (2, 4, 12, 16), (2, 4, 12, 8), {"is_causal": True, "scale": 0.25}),  # DeepSeek-V3's zoo layer
    ((4, 8, 64, 32), (4, 8, 64, 32), (4, 8, 64, 16), {"is_causal": True}),
    ((2, 4, 64, 32), (2, 4, 64, 32), (2, 4, 64, 32), {"strided": True}),
    ((2, 4, 128, 64), (2, 4, 128, 64), (2, 4, 128, 64), {"strided": True, "attn_mask": "additive"}),
]


@pytest.mark.parametrize("case", range(len(_KEPT_GRAPH_CASES)))
def test_kept_attention_graph_holds_what_the_plan_counts(case):
    """An attention line that keeps eager's autograd graph to its backward line (``kept_graphs.sdpa_keeping_graph``)
    holds what eager's call saved, which no proxy shows.  The kept buffers' plan counts ``held_bytes`` alive with the
    result, and as many bytes again inside the backward's line (executors/buffers.py): uncounted, DeepSeek-V3's
    torch program peaked at 1.07x eager's once its arena had room (test_zoo_compiled_step_peak_is_not_above_eagers).
    Here, measured in the allocator's order: the memory the forward's line leaves held is its result and exactly
    ``held_bytes``, and the backward's line allocates at most that again beyond the gradients it returns."""
    from _peak import peak_and_net_call_bytes, peak_call_bytes_all_threads
    from thunder_train.compiler.executors.kept_graphs import sdpa_graph_backward, sdpa_keeping_graph
    from thunder_train.compiler.proxies import TensorProxy

    qs, ks, vs, kwargs = _KEPT_GRAPH_CASES[case]
    kwargs = dict(kwargs)
    g = torch.Generator().manual_seed(case)
    q, k, v = (torch.randn(s, generator=g) for s in (qs, ks, vs))
    if kwargs.pop("strided", False):
        q, k, v = (torch.randn(*t.shape[:-2], t.shape[-1], t.shape[-2], generator=g).transpose(-2, -1) for t in (q, k, v))
    if kwargs.get("attn_mask") == "additive":
        kwargs = dict(kwargs, attn_mask=torch.randn(qs[-2], ks[-2], generator=g))

    def proxy(t):
        return TensorProxy(shape=t.shape, dtype=t.dtype, device=t.device, strides=t.stride()) if isinstance(t, torch.Tensor) else t

    which = (0, 1, 2)
    held = sdpa_keeping_graph.held_bytes(proxy(q), proxy(k), proxy(v), which, **{n: proxy(a) for n, a in kwargs.items()})
    results = []
    _, net = peak_and_net_call_bytes(lambda: results.append(sdpa_keeping_graph(q, k, v, which, **kwargs)))
    out = results.pop()
    assert held > 0 and net == out.untyped_storage().nbytes() + held, (net, held)
    grads = []
    peak = peak_call_bytes_all_threads(lambda: grads.append(sdpa_graph_backward(torch.ones_like(out), out, q, k, v)),
                                       kept_ok=True)
    assert 0 <= peak - sum(t.untyped_storage().nbytes() for t in grads[0]) <= held, (peak, held)


def test_kept_buffers_add_nothing_where_a_convolutions_backward_peaks():
    """The CPU convolution backward's kernel allocates scratch memory the plan cannot size (oneDNN's: tens of times its
    activations), so a call may peak inside it; the kept arena is held for the whole call, so there it may hold no
    byte beyond what the kept values alive at that line need (``Symbol.torch_unknown_scratch``, executors/buffers.py;
    it held up to ``PEAK_SLACK`` more: ResNet's and DeepSeek-V3's zoo steps, whose peaks are in a convolution's and in
    ``GroupedMmBackward0``'s backward, were 1.011x and 1.002x eager's).  Here the arena's values are dead at the
    first convolution's backward: 1.03x eager's peak with them, 0.95x now."""
    from _peak import peak_call_bytes_all_threads

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Conv2d(16, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3, padding=1))
    x = torch.randn(8, 16, 16, 16)
    peaks = {}
    for mode in ("eager", "tt"):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fn = _conv_step if mode == "eager" else tt.compile(_conv_step, fusion=None)
        for _ in range(2):
            fn(model, opt, x)
        peaks[mode] = peak_call_bytes_all_threads(lambda: fn(model, opt, x), None if mode == "eager" else fn)
    assert 0 < peaks["tt"] <= peaks["eager"], peaks


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_convolution_bias_gradient_is_the_kernels(nd):
    """A convolution's bias is added inside its kernel, as eager's conv does, so its gradient is the convolution
    backward's own (``output_mask``'s third entry), made after the kernel's scratch memory is freed: a sum of the
    output's gradient made before that line was held through it (16 bytes above eager's peak in
    ``test_kept_buffers_add_nothing_where_a_convolutions_backward_peaks`` on an AVX-512 CPU) and rounded otherwise
    than eager's (the bias gradients differed in the last bits).  Gradients are eager's bitwise."""
    conv = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)[nd - 1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(conv(3, 8, 3, padding=1), torch.nn.ReLU(), conv(8, 4, 3, stride=2, bias=False), conv(4, 2, 1))
    eager = copy.deepcopy(model)
    x = torch.randn((2, 3) + (9,) * nd)

    def step(m, x):
        loss = m(x).square().mean()
        loss.backward()
        return loss

    cf = tt.compile(step, fusion=None)
    assert torch.equal(cf(model, x), step(eager, x))
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad), name
    masks = re.findall(r"convolution_backward\(.*, \((True|False), (True|False), (True|False)\)\)", str(tt.last_traces(cf)[-1]))
    # (a 3-d convolution runs through torch, differentiated by torch's autograd: no line of ours)
    assert [m[2] for m in masks] == ([] if nd == 3 else ["True", "False", "True"]), masks


def _attention_step(q, k, v, log):
    s = q @ k.transpose(-1, -2)  # the scores: dead once the (log-)softmax has read them
    p = F.log_softmax(s, dim=-1) if log else F.softmax(s, dim=-1)
    loss = (p @ v).sum()
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("log", [False, True])
def test_softmax_backward_does_not_hold_its_input(log):
    """(Log-)softmax's backward kernel reads the result and the input's dtype: the compiled backward line is given the
    result in the input's place, so the scores are freed after the forward reads them, as eager frees them
    (``SoftmaxBackward0`` saves the result only).  They were held to the backward: BLOOM's torch program 1.006x
    eager's peak, 0.98x now.  Gradients are eager's bitwise."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 64, 16, requires_grad=True) for _ in range(3))
    want = _attention_step(q, k, v, log), [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    cf = tt.compile(_attention_step, fusion=None, keep_buffers=False)
    got = cf(q, k, v, log), [t.grad for t in (q, k, v)]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    text = str(tt.last_traces(cf)[-1])
    (line,) = [ln for ln in text.splitlines() if "softmax_vjp" in ln]
    scores = re.search(r"= torch\.nn\.functional\.(?:log_)?softmax\((\w+),", text).group(1)
    assert not re.search(rf"\b{scores}\b", line.split("#")[0]), line


# llama_padded and roberta_cls are left out for CI time: the same models as llama and bert_cls (0.81x and 0.93x).
ZOO_PEAK_MODELS = ("gpt2", "mistral", "llama", "qwen2", "bloom", "mixtral", "deepseek_v3", "qwen2_moe", "falcon", "bert_cls",
                   "modernbert_mlm", "t5", "vit", "wav2vec2_ctc", "transformer_encoder", "lstm", "gru", "resnet")


@pytest.mark.parametrize("name", ZOO_PEAK_MODELS)
def test_zoo_compiled_step_peak_is_not_above_eagers(name):
    """The default compiled whole step's torch program (what the default runs until its fused program takes over;
    the suite runs the default so, tests/conftest.py), kept buffers included: its peak is at most eager's.  (Any zoo
    model's is measured by benchmarks/memory.py --workloads <name>; docs/memory.md lists the ones above eager's.)

    Measured in the allocator's order (``peak_call_bytes_all_threads``), not op by op: the op-by-op reading moves
    the frees inside eager's Python autograd functions and autograd's release of saved tensors to the start of
    their op, so it read BLOOM's eager step as 136 KiB when eager held 196 KiB at once, and it hid kernels'
    own temporaries (test_peak_in_allocator_order_sees_frees_inside_an_op)."""
    peaks = _zoo_peaks(name)
    assert 0 < peaks["tt"] <= peaks["eager"], peaks


def test_zoo_deepseek_step_at_batch_32_peaks_at_most_eagers(monkeypatch):
    """DeepSeek-V3's attention (value heads narrower than the key's) runs eager's math kernel on the CPU, whose graph
    the program keeps for the backward line.  That graph saves the value and scaled copies of the query and key; the
    backward line had listed all three as its reads, so the query and key (the rotary embedding's ``cat`` results)
    were held to the backward for nothing: at batch 32 and 128 tokens 4 MiB where the step peaks, its torch program
    at 1.02x eager's peak (0.99x at the zoo's own size).  The backward line now reads what the graph saved: 0.96x
    (0.85x at the zoo's size), values as eager's."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _zoo

    monkeypatch.setattr(_zoo, "BATCH", 32)
    monkeypatch.setattr(_zoo, "SEQ", 128)
    peaks = _zoo_peaks("deepseek_v3")
    assert 0 < peaks["tt"] <= peaks["eager"], peaks
    lines = tt.last_traces(peaks["compiled"])[-1].bound_symbols
    forward = {id(b.output): b.args[:2] for b in lines if b.sym.name == "ttex.sdpa_keeping_graph"}  # (its query and key)
    backward = [b for b in lines if b.sym.name == "ttex.sdpa_graph_backward"]
    assert len(backward) == len(forward) == 2
    for b in backward:  # (g, out, what the graph saved of the operands)
        assert not {id(a) for a in b.args[2:]} & {id(a) for a in forward[id(b.args[1])]}, b
    torch.testing.assert_close(peaks["losses"]["tt"], peaks["losses"]["eager"], rtol=1e-5, atol=1e-5)


def _cxx_available() -> bool:
    from _inductor import cxx_available

    return cxx_available()


@pytest.mark.skipif(not _cxx_available(), reason="Inductor's CPU backend needs a C++ compiler (none found)")
@pytest.mark.parametrize("name", ["falcon", "gpt2", "lstm", "gru", "modernbert_mlm"])
def test_zoo_fused_step_peak_is_not_above_eagers(name, monkeypatch):
    """The default's fused program (background fusion, built and switched to), kept buffers included: its peak is at
    most eager's.  Falcon's was 1.05x: the kept buffers' plan counted its transposed weights (views of the program's
    inputs) as new memory and let the arena grow into a peak that was not there (tests/test_kept_buffers.py).
    The LSTM's and GRU's were 1.025x and 1.018x: the head's bias gradient (a lone sum, no region) was moved after
    the lines the region walk hoisted past it, the recurrent layer's opaque backward among them, and held the
    logits' gradient across it (executors/inductor_fusion.py ``_State.flush``).  ModernBERT's fused program was never
    built before session 48 (its background fusion failed: tests/test_fusion_forms.py)."""
    monkeypatch.setenv("THUNDER_TRAIN_FUSION", "background")
    peaks = _zoo_peaks(name)
    assert peaks["fused regions"] > 0, "the fused program was measured"
    assert 0 < peaks["tt"] <= peaks["eager"], peaks
    # The fused program is planned for itself: a costly value is kept only where no kernel takes it (ModernBERT's
    # head's exact GELU, over a data-dependent number of tokens: a torch call of its own in the fused program too).
    plan = tt.compile_stats(peaks["compiled"]).memory
    assert plan.costly_kept == (1 if name == "modernbert_mlm" else 0), plan.summary()


@pytest.mark.skipif(not _cxx_available(), reason="Inductor's CPU backend needs a C++ compiler (none found)")
def test_lines_moved_after_regions_raise_no_checkpointed_fused_peak(monkeypatch):
    """A checkpointed GPT step (many tokens, small weights), fused: the fusion walk moves a line reading a recomputed
    value after the region (executors/inductor_fusion.py ``_walk``) only where that holds no more bytes, so its peak
    is no higher than with no line moved.  Moved whatever its inputs' bytes, the MLP's second weight gradient held
    the recomputed GELU output (tokens x 4d) across the rest of its region: the benchmark's GPT step peaked at 0.18x
    eager's instead of 0.15x."""
    from thunder_train.compiler.executors import inductor_fusion

    model, batch = _setup(n_layer=2, d=64, T=128, B=8, V=512)
    eager = _measure(copy.deepcopy(model), batch, ckpt=True, steps=2)
    fused = _measure(copy.deepcopy(model), batch, ckpt=True, compile_options={"fusion": "inductor"}, steps=2)
    monkeypatch.setattr(inductor_fusion, "_deferrable", lambda bsym, held: False)
    unmoved = _measure(copy.deepcopy(model), batch, ckpt=True, compile_options={"fusion": "inductor"}, steps=2)
    assert tt.compile_stats(fused[2]).fusion_fallback_calls == 0
    assert any(b.sym.module == "inductor" for b in tt.last_traces(fused[2])[-1].bound_symbols)
    torch.testing.assert_close(fused[1], eager[1], rtol=1e-4, atol=1e-5)
    assert fused[0] <= unmoved[0] and fused[0] <= eager[0], (fused[0], unmoved[0], eager[0])


@pytest.mark.skipif(not _cxx_available(), reason="Inductor's CPU backend needs a C++ compiler (none found)")
def test_checkpointed_step_fused_up_front_peaks_as_its_torch_program():
    """A checkpointed step with ``fusion="inductor"`` chosen up front updates each parameter once its gradient is
    final, as its torch program does (transforms/early_updates.py; fusion chosen up front has no early updates
    otherwise): without them a checkpointed GPT's fused step held every gradient to the end, 1.48x its torch
    program's peak."""
    model, batch = _setup(n_layer=2, d=64, T=128, B=8, V=512)
    torch_program = _measure(copy.deepcopy(model), batch, ckpt=True, compile_options={"fusion": None}, steps=2)
    fused = _measure(copy.deepcopy(model), batch, ckpt=True, compile_options={"fusion": "inductor"}, steps=2)
    assert any(b.sym.module == "inductor" for b in tt.last_traces(fused[2])[-1].bound_symbols)
    torch.testing.assert_close(fused[1], torch_program[1], rtol=1e-4, atol=1e-5)
    assert fused[0] <= torch_program[0], (fused[0], torch_program[0])


def _zoo_peaks(name) -> dict:
    """{"eager": peak, "tt": peak} of a zoo model's whole step (the compiled one's kept buffers included), and the
    fused regions of the compiled program measured."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _zoo
    from _peak import peak_call_bytes_all_threads

    base, bs = _zoo.build(name), _zoo.batches(name, 3)
    peaks, losses = {}, {}
    for mode in ("eager", "tt"):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fn = _zoo.train_step if mode == "eager" else tt.compile(_zoo.train_step)
        # The first step eager's (AdamW's state created): the compiled step is traced once, with the state (CI time).
        _zoo.train_step(model, opt, bs[0])
        losses[mode] = [fn(model, opt, b).detach() for b in bs[1:]]
        if mode == "tt":
            tt.wait_for_fusion(fn)
            fn(model, opt, bs[0])
        peaks[mode] = peak_call_bytes_all_threads(lambda: fn(model, opt, bs[1]), None if mode == "eager" else fn)
    peaks["fused regions"] = sum(isinstance(b.sym, FusionSymbol) for b in tt.last_traces(fn)[-1].bound_symbols)
    peaks["compiled"], peaks["losses"] = fn, losses
    return peaks


def test_cheap_values_are_recomputed_only_where_that_lowers_the_peak(monkeypatch):
    """ViT's two GELU outputs are cheap to recompute, but only the first layer's is alive where its step peaks: the
    second layer's is read (and its copy would be made) before that.  Recomputing it cost a cold kernel a step (2 %
    of the fused step, 7 % of the torch program) for no memory.  The default now recomputes only the first; its
    peak is at most eager's and no higher than recomputing both (within the plan's resolution), values alike."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _zoo
    from _peak import peak_call_bytes_all_threads
    from thunder_train.compiler.transforms import memory

    base, bs = _zoo.build("vit"), _zoo.batches("vit", 3)
    runs = {}
    for mode in ("eager", "default", "every cheap value"):
        if mode == "every cheap value":
            monkeypatch.setattr(memory, "where_recomputing_lowers_the_peak", lambda trc, chosen, probes: chosen)
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fn = _zoo.train_step if mode == "eager" else tt.compile(_zoo.train_step)
        _zoo.train_step(model, opt, bs[0])
        losses = [fn(model, opt, b) for b in bs[1:]]
        peak = peak_call_bytes_all_threads(lambda: fn(model, opt, bs[1]), None if mode == "eager" else fn)
        cheap = 0 if mode == "eager" else sum(r == "cheap" for _, r in tt.compile_stats(fn).memory.recomputed)
        runs[mode] = (peak, cheap, losses, [p.detach().clone() for p in model.parameters()])
    (eager, _, eager_losses, eager_params), (default, cheap, losses, params), (every, every_cheap, every_losses,
                                                                             every_params) = runs.values()
    assert 0 < cheap < every_cheap, (cheap, every_cheap)
    assert 0 < default <= eager, (default, eager)
    assert default <= every * (1 + memory.PLAN_RESOLUTION), (default, every)
    # A recomputed value is the value kept: the two plans' steps are bitwise alike, and like eager's to rounding.
    assert all(torch.equal(a, b) for a, b in zip(losses + params, every_losses + every_params))
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-5)
    for a, b in zip(params, eager_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_zoo_budget_is_met_and_trains_like_eager(name):
    """memory_budget=0.25 on the zoo's GPT-2 and Llama steps: what is kept is at most a quarter of the default's.
    Before, GPT-2 stopped at 0.48 (GELU's tanh and mul each needed the value before them kept: recomputed one at a
    time they freed nothing) and Llama at 0.60 (its head did not run by blocks of rows once the budget recomputed
    the head's input).  Values stay eager's."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _zoo

    base, bs = _zoo.build(name), _zoo.batches(name, 2)
    want_m, got_m = copy.deepcopy(base), copy.deepcopy(base)
    want_o, got_o = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (want_m, got_m))
    cf = tt.compile(_zoo.train_step, memory_budget=0.25, fusion=None)
    for b in bs:
        torch.testing.assert_close(cf(got_m, got_o, b), _zoo.train_step(want_m, want_o, b))
    for a, b in zip(got_m.parameters(), want_m.parameters()):
        torch.testing.assert_close(a, b)
    plan = tt.compile_stats(cf).memory
    assert plan.budget_met and plan.saved_bytes <= 0.25 * plan.saved_bytes_default, plan.summary()
    assert plan.head_logits_bytes > 0, plan.summary()


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])
def test_memory_budget_on_mixture_of_experts_trains_like_eager(name):
    """A budget over a step whose expert weights are views of a parameter (``w[e]``): the planner reads such a view
    as free (its memory is the input's) instead of failing with a KeyError; values stay eager's."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _zoo

    base, bs = _zoo.build(name), _zoo.batches(name, 3)
    want_m, got_m = copy.deepcopy(base), copy.deepcopy(base)
    want_o, got_o = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (want_m, got_m))
    fn = tt.compile(_zoo.train_step, memory_budget=0.25, fusion=None)
    for m, o in ((want_m, want_o), (got_m, got_o)):  # AdamW's state created: one trace, with it (CI time)
        _zoo.train_step(m, o, bs[0])
    for b in bs[1:]:
        torch.testing.assert_close(fn(got_m, got_o, b), _zoo.train_step(want_m, want_o, b))
    for (n, p), q in zip(want_m.named_parameters(), got_m.parameters()):
        torch.testing.assert_close(q, p, msg=n)
    plan = tt.compile_stats(fn).memory
    assert plan.saved_bytes < plan.saved_bytes_default and any(why == "budget" for _, why in plan.recomputed), plan


def test_torch_program_recomputes_costly_values_only_as_far_as_its_peak_needs(monkeypatch):
    """In a program of torch kernels (``fusion=None``) a recomputed transcendental over many elements is a kernel
    run again at 1-4 ns an element (the GPT benchmark step's four tanh GELUs cost it 3.2 %): such values are
    recomputed only as far as keeping the planned peak ``COSTLY_MARGIN`` under the step as traced needs.  Here a
    small GPT's two GELU outputs (32 Ki elements each): one is kept.  The peak stays at most eager's, the values are
    bitwise those of recomputing both."""
    from thunder_train.compiler.transforms import memory

    model, batch = _setup()
    runs = {}
    for mode in ("eager", "default", "every cheap value"):
        if mode == "every cheap value":
            monkeypatch.setattr(memory, "fewest_costly", lambda trc, chosen, *rest: (chosen, 0))
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        fn = step if mode == "eager" else tt.compile(step, fusion=None)
        step(m, opt, *batch)
        losses = [fn(m, opt, *batch) for _ in range(2)]
        peak = peak_bytes(lambda: fn(m, opt, *batch), None if mode == "eager" else fn)
        plan = None if mode == "eager" else tt.compile_stats(fn).memory
        runs[mode] = (peak, plan, losses, [p.detach().clone() for p in m.parameters()])
    (eager, _, eager_losses, eager_params), (default, plan, losses, params) = runs["eager"], runs["default"]
    every, every_plan, every_losses, every_params = runs["every cheap value"]
    cheap = lambda p: sum(r == "cheap" for _, r in p.recomputed)  # noqa: E731
    assert plan.costly_kept == 1 and cheap(plan) == cheap(every_plan) - 1, plan.summary()
    assert "1 costly to recompute kept" in plan.summary()
    assert plan.planned_peak_bytes <= (1 - memory.COSTLY_MARGIN) * plan.traced_peak_bytes, plan.summary()
    assert every < default <= eager, (every, default, eager)
    assert all(torch.equal(a, b) for a, b in zip(losses + params, every_losses + every_params))
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-5)
    for a, b in zip(params, eager_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not _cxx_available(), reason="Inductor's CPU backend needs a C++ compiler (none found)")
@pytest.mark.parametrize("thin", [False, True])
def test_default_plans_its_torch_program_and_its_fused_program_each_for_itself(thin, monkeypatch):
    """The default runs its torch program until the fused one is built (tens of thousands of calls on a small step),
    so that program is planned as ``fusion=None``'s is: the small GPT's second GELU output, costly to recompute as a
    kernel of its own, is kept, and the program's losses are ``fusion=None``'s, bitwise.  Its fused program, whose
    kernels recompute the GELU for free, is planned again when it is built: both GELU outputs recomputed, as
    ``fusion="inductor"`` plans them, and the report follows the program that runs.  Losses and parameters over the
    switch equal eager's; the fused program's peak is at most eager's.  Thin mode calls the swapped program."""
    monkeypatch.setenv("THUNDER_TRAIN_FUSION", "background")
    model, batch = _setup()
    cheap = lambda p: sum(r == "cheap" for _, r in p.recomputed)  # noqa: E731
    runs = {}
    for mode in ("eager", "torch program", "fused up front", "default"):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        options = {"torch program": {"fusion": None}, "fused up front": {"fusion": "inductor"}}.get(mode, {})
        fn = step if mode == "eager" else tt.compile(step, thin=thin, **options)
        step(m, opt, *batch)
        losses = [fn(m, opt, *batch) for _ in range(2)]
        if mode == "default":  # the fused program is due at a later call: the torch program ran both
            torch_program_plan = copy.copy(tt.compile_stats(fn).memory)
            assert not any("replaced" in n for n in tt.compile_stats(fn).fusion_notes)
            tt.wait_for_fusion(fn)
            assert any("replaced the torch program" in n for n in tt.compile_stats(fn).fusion_notes)
        losses += [fn(m, opt, *batch) for _ in range(2)]
        if mode == "default":  # the calls ran the fused program
            assert any(isinstance(b.sym, FusionSymbol) for b in tt.last_traces(fn)[-1].bound_symbols)
        peak = peak_bytes(lambda: fn(m, opt, *batch), None if mode == "eager" else fn)
        plan = None if mode == "eager" else tt.compile_stats(fn).memory
        runs[mode] = (losses, [p.detach().clone() for p in m.parameters()], plan, peak)
    torch_plan, fused_plan, plan = runs["torch program"][2], runs["fused up front"][2], runs["default"][2]
    assert torch_program_plan.costly_kept == 1 and cheap(torch_program_plan) == cheap(torch_plan), torch_program_plan.summary()
    assert plan.costly_kept == 0 and cheap(plan) == cheap(fused_plan) == cheap(torch_plan) + 1, plan.summary()
    assert all(torch.equal(a, b) for a, b in zip(runs["default"][0][:2], runs["torch program"][0][:2]))
    eager_losses, eager_params = runs["eager"][:2]
    torch.testing.assert_close(runs["default"][0], eager_losses, rtol=1e-5, atol=1e-5)
    for a, b in zip(runs["default"][1], eager_params):  # (AdamW's small second moments amplify fused rounding)
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    assert runs["default"][3] <= runs["eager"][3], (runs["default"][3], runs["eager"][3])


@pytest.mark.parametrize("name, kept", [("transformer_encoder", 2), ("bert_cls", 0), ("vit", 0)])
def test_small_transcendental_values_are_costly_in_a_torch_program(name, kept, monkeypatch):
    """A small value's recomputation costs a torch program its kernel's call: 10 us in a loop and 20-30 us inside a
    step for an exact GELU over 1.5 Ki elements (oneDNN's kernel), 1-2 % of a zoo model's step each.  So a
    transcendental of any size is recomputed there only as far as the peak needs: nn.TransformerEncoder keeps both
    its GELU outputs (it recomputed both until session 49, +2.0 to +2.9 % a step, then one, +1.7 to +2.3 %: see the
    next test), BERT recomputes its one (its peak needs it).  Not where a line's kernel scratch is unknown
    (ViT's patch embedding's convolution backward): the plan cannot bound its peak, and with its GELU kept ViT peaked
    at 1.002x eager's, so it recomputes it as before.  Peaks at most eager's; values bitwise those of recomputing
    every cheap value, and eager's."""
    from thunder_train.compiler.transforms import memory

    every = lambda: monkeypatch.setattr(memory, "fewest_costly", lambda trc, chosen, *rest: (chosen, 0))  # noqa: E731
    runs = _zoo_torch_program_runs(name, {"eager": None, "default": None, "every cheap value": every})
    plan, every = runs["default"][2], runs["every cheap value"][2]
    cheap = lambda p: sum(r == "cheap" for _, r in p.recomputed)  # noqa: E731
    assert plan.costly_kept == kept and cheap(plan) == cheap(every) - kept, plan.summary()
    assert runs["default"][3] <= runs["eager"][3], (runs["default"][3], runs["eager"][3])
    got, want = runs["default"][0] + runs["default"][1], runs["every cheap value"][0] + runs["every cheap value"][1]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    torch.testing.assert_close(runs["default"][0], runs["eager"][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(runs["default"][1], runs["eager"][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_costly_values_are_recomputed_only_where_that_lowers_the_peak_as_the_program_holds_its_gradients(monkeypatch):
    """The count the costly values' choice bisects over lets each gradient go where it is made; the program holds the
    smallest, a small model's every one, for the update after the backward (transforms/early_updates.py).
    nn.TransformerEncoder's torch program peaks there: recomputing one of its GELU outputs lowered the count 6 %
    under the step as traced but not the peak as held (``memory._held_curve``), and it measured 640 bytes above
    keeping both, its step 1.7-2.3 % slower.  Now it keeps both: measured at most that peak and eager's, values
    bitwise those of recomputing one."""
    from thunder_train.compiler.transforms import memory

    as_counted = lambda: monkeypatch.setattr(memory, "_held_curve", memory._curve)  # noqa: E731  (before session 51)
    runs = _zoo_torch_program_runs("transformer_encoder", {"eager": None, "default": None, "as counted": as_counted})
    assert runs["default"][2].costly_kept == 2 and runs["as counted"][2].costly_kept == 1, runs["default"][2].summary()
    assert runs["default"][3] <= runs["as counted"][3] and runs["default"][3] <= runs["eager"][3], \
        {k: v[3] for k, v in runs.items()}
    got, want = runs["default"][0] + runs["default"][1], runs["as counted"][0] + runs["as counted"][1]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    torch.testing.assert_close(runs["default"][0], runs["eager"][0], rtol=1e-5, atol=1e-5)


def _zoo_torch_program_runs(name, modes):
    """{mode: (losses, parameters after the steps, MemoryPlan, measured peak)} of the zoo model's step run eagerly
    ("eager") and compiled as a torch program (``fusion=None``) for each other mode, in order; ``modes``: mode -> a
    function patching the planner before that mode's compile (the patch stays for the later modes), or None."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _zoo
    from _peak import peak_call_bytes_all_threads

    base, bs = _zoo.build(name), _zoo.batches(name, 3)
    runs = {}
    for mode, patch in modes.items():
        if patch is not None:
            patch()
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)  # (the zoo's: tests/test_model_zoo.py)
        fn = _zoo.train_step if mode == "eager" else tt.compile(_zoo.train_step, fusion=None)
        _zoo.train_step(model, opt, bs[0])
        losses = [fn(model, opt, b).detach() for b in bs[1:]]
        peak = peak_call_bytes_all_threads(lambda: fn(model, opt, bs[1]), None if mode == "eager" else fn)
        plan = None if mode == "eager" else tt.compile_stats(fn).memory
        runs[mode] = (losses, [p.detach().clone() for p in model.parameters()], plan, peak)
    return runs
