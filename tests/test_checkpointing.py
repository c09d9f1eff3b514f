"""Activation checkpointing inside compiled functions: every form torch and transformers offer gives eager's
values, and the backward recomputes the checkpointed values instead of keeping them (transforms/remat.py).

Whole steps (``loss.backward()`` and ``optimizer.step()`` inside) and ``tt.compile(model)`` are both checked
against eager PyTorch running the same checkpointed code.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, checkpoint_sequential,
                                    create_selective_checkpoint_contexts)

import thunder_train as tt


class Blocks(nn.Module):
    """Residual MLP blocks, each run by ``run(block, x)`` (a checkpoint form, or a plain call)."""

    def __init__(self, n=3, d=16, p=0.0):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(p), nn.Linear(2 * d, d))
                                    for _ in range(n))
        self.inp = nn.Linear(d, d)  # reentrant checkpoint differentiates only through inputs that require grad
        self.head = nn.Linear(d, 4)
        self.run = lambda block, x: block(x)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + self.run(b, x)
        return self.head(x)


def _step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _batch(seed=1, rows=8, d=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, d, generator=g), torch.randint(0, 4, (rows,), generator=g)


def _recomputed_lines(trc) -> list:
    return [b for b in trc.bound_symbols if b.comment == "recomputed for the backward"]


def _whole_step_matches(run, p=0.0, steps=2, d=16, rows=8, **options):
    torch.manual_seed(0)
    m = Blocks(d=d, p=p)
    m.run = run
    m2 = copy.deepcopy(m)
    o, o2 = torch.optim.AdamW(m.parameters(), lr=1e-2), torch.optim.AdamW(m2.parameters(), lr=1e-2)
    cf = tt.compile(_step, **options)
    for i in range(steps):
        x, y = _batch(i, rows, d)
        torch.manual_seed(10 + i)
        got = cf(m, o, x, y)
        got_state = torch.get_rng_state()
        torch.manual_seed(10 + i)
        want = _step(m2, o2, x, y)
        torch.testing.assert_close(got, want)
        for a, b in zip(m.parameters(), m2.parameters()):
            torch.testing.assert_close(a, b)
        # The generator ends where eager's does (a region's draws drawn again in the backward set it back).
        assert torch.equal(got_state, torch.get_rng_state())
    return cf


FORMS = {
    "non_reentrant": lambda b, x: checkpoint(b, x, use_reentrant=False),
    "reentrant": lambda b, x: checkpoint(b, x, use_reentrant=True),
    "reentrant_no_rng": lambda b, x: checkpoint(b, x, use_reentrant=True, preserve_rng_state=False),
    "non_reentrant_no_rng": lambda b, x: checkpoint(b, x, use_reentrant=False, preserve_rng_state=False),
    "sequential": lambda b, x: checkpoint_sequential(b, 2, x, use_reentrant=False),
    "sequential_reentrant": lambda b, x: checkpoint_sequential(b, 2, x, use_reentrant=True),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_whole_step_checkpoint_forms_match_eager_and_recompute(form):
    cf = _whole_step_matches(FORMS[form])
    rec = _recomputed_lines(tt.last_traces(cf)[-1])
    assert rec, "checkpointed values were kept, not recomputed"
    # Each block's hidden activation is recomputed once, from the block's input; checkpoint_sequential leaves
    # its last segment (GELU's output onwards) uncheckpointed, as eager does.
    names = " ".join(str(b.sym.name) for b in rec)
    assert ("linear" in names) and (("gelu" in names) != form.startswith("sequential")), names


def test_whole_step_without_checkpoint_recomputes_no_region():
    # Without checkpointing only the default's cheap values (the blocks' GELU) are recomputed, never a linear.
    cf = _whole_step_matches(lambda b, x: b(x))
    plan = tt.compile_stats(cf).memory
    assert plan.checkpoint_regions == 0 and {r for _, r in plan.recomputed} <= {"cheap"}, plan.summary()
    assert not any("linear" in str(b.sym.name) for b in _recomputed_lines(tt.last_traces(cf)[-1]))


DROPOUT_FORMS = dict(FORMS, sequential=lambda b, x: checkpoint_sequential(b, 4, x, use_reentrant=False))  # dropout alone


@pytest.mark.parametrize("thin", [False, True])
@pytest.mark.parametrize("form", ["non_reentrant", "reentrant", "sequential"])
def test_dropout_inside_a_region_is_drawn_again_from_the_forwards_state(form, thin):
    # preserve_rng_state (the default): eager recomputes the same mask in the backward from the generator state it
    # took before the region, inside fork_rng.  The compiled backward does the same: the mask is drawn again (not
    # kept from the forward), the values are eager's and the generator ends where eager's does.
    # Masks of 32 x 64 floats (8 KB): more than the generator state (5 KB) a replay keeps instead.
    cf = _whole_step_matches(DROPOUT_FORMS[form], p=0.5, steps=3, d=32, rows=32, thin=thin)
    final = tt.last_traces(cf)[-1]
    rec = _recomputed_lines(final)
    assert any(b.draws_random for b in rec), "the dropout masks were kept, not drawn again"
    sets = [b for b in final.bound_symbols if str(b.sym.name).endswith("set_rng_state")]
    assert len(sets) == 2 * sum(b.draws_random for b in rec), [str(b.sym.name) for b in final.bound_symbols]
    plan = tt.compile_stats(cf).memory
    assert sum("bernoulli" in text for text, _ in plan.recomputed) == 3, plan.recomputed
    # Without the masks held, the program saves less than with them.
    assert plan.saved_bytes < plan.saved_bytes_without_remat


def _compiled_module_matches(run):
    """``tt.compile(model)`` of ``Blocks`` run by ``run``: input and parameter gradients equal eager's; the module."""
    torch.manual_seed(0)
    m = Blocks()
    m.run = run
    m2 = copy.deepcopy(m)
    cm = tt.compile(m)
    x, y = _batch()
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    F.cross_entropy(cm(x1), y).backward()
    F.cross_entropy(m2(x2), y).backward()
    torch.testing.assert_close(x1.grad, x2.grad)
    for a, b in zip(m.parameters(), m2.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    return cm


@pytest.mark.parametrize("form", ["non_reentrant", "reentrant", "sequential"])
def test_compiled_module_checkpoint_forms_match_eager(form):
    cm = _compiled_module_matches(FORMS[form])
    assert _recomputed_lines(tt.last_backward_traces(cm)[-1])


@pytest.mark.parametrize("form", ["non_reentrant", "sequential"])  # reentrant: tests/test_checkpoint_reentrant.py
def test_compiled_module_dropout_inside_a_region_matches_eager(form):
    # tt.compile(model) keeps a region's draws for its backward (docs/memory.md): the gradients are those of the
    # forward's masks, as eager's recomputation from the saved generator state gives, and the generator ends where
    # eager's does (eager's backward draws inside fork_rng).
    torch.manual_seed(0)
    m = Blocks(d=32, p=0.5)
    m.run = DROPOUT_FORMS[form]
    m2 = copy.deepcopy(m)
    cm = tt.compile(m)
    for i in range(2):
        x, y = _batch(i, 32, 32)
        torch.manual_seed(10 + i)
        F.cross_entropy(cm(x), y).backward()
        got_state = torch.get_rng_state()
        torch.manual_seed(10 + i)
        F.cross_entropy(m2(x), y).backward()
        assert torch.equal(got_state, torch.get_rng_state())
        for a, b in zip(m.parameters(), m2.parameters()):
            torch.testing.assert_close(a.grad, b.grad)
            a.grad = b.grad = None


@pytest.mark.parametrize("how", ["step", "module"])
def test_no_preserved_rng_state_around_dropout_is_refused(how):
    # checkpoint(use_reentrant=False, preserve_rng_state=False): eager's backward draws new masks (its gradients belong
    # to other values than its outputs, and the generator moves on); the compiled program drew nothing new and gave
    # other gradients and another generator state, silently.  Refused, as the reentrant form is
    # (tests/test_checkpoint_reentrant.py); without random ops the form is eager's (FORMS["non_reentrant_no_rng"]).
    from thunder_train.compiler.errors import TracingError

    torch.manual_seed(0)
    m = Blocks(p=0.5)
    m.run = lambda b, x: checkpoint(b, x, use_reentrant=False, preserve_rng_state=False)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    before = copy.deepcopy(m.state_dict())
    x, y = _batch()
    state = torch.get_rng_state()
    with pytest.raises(TracingError, match="preserve_rng_state=True"):
        if how == "step":
            tt.compile(_step)(m, opt, x, y)
        else:
            tt.compile(m)(x)
    assert torch.equal(torch.get_rng_state(), state) and not opt.state
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k


def _a_product(name) -> bool:
    """A line computing a matrix product (a matmul of two matrices is called as ``torch.mm``: executors/mm_calls.py)."""
    return "linear" in name or "matmul" in name or name.endswith(".mm")


def _policy(ctx, op, *args, **kwargs):
    save = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE


def test_selective_checkpoint_policy_saves_what_it_says():
    run = lambda b, x: checkpoint(b, x, use_reentrant=False,  # noqa: E731
                                  context_fn=functools.partial(create_selective_checkpoint_contexts, _policy))
    cf = _whole_step_matches(run)
    rec = _recomputed_lines(tt.last_traces(cf)[-1])
    kinds = {b.sym.name for b in rec}
    assert rec and not any(_a_product(k) for k in kinds), kinds
    # Without a policy, the linear layers are recomputed too.
    cf = _whole_step_matches(FORMS["non_reentrant"])
    assert any("linear" in b.sym.name for b in _recomputed_lines(tt.last_traces(cf)[-1]))


def test_compiled_module_selective_policy_saves_what_it_says():
    # tt.compile(model) (PyTorch's backward) honours the policy too: its matmuls are saved, the rest recomputed.
    cm = _compiled_module_matches(lambda b, x: checkpoint(
        b, x, use_reentrant=False, context_fn=functools.partial(create_selective_checkpoint_contexts, _policy)))
    kinds = {b.sym.name for b in _recomputed_lines(tt.last_backward_traces(cm)[-1])}
    assert kinds and not any(_a_product(k) for k in kinds), kinds


def test_selective_policy_list_form():
    ops = [torch.ops.aten.gelu.default]
    run = lambda b, x: checkpoint(b, x, use_reentrant=False,  # noqa: E731
                                  context_fn=functools.partial(create_selective_checkpoint_contexts, ops))
    cf = _whole_step_matches(run)
    assert not any("gelu" in b.sym.name for b in _recomputed_lines(tt.last_traces(cf)[-1]))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_transformers_gradient_checkpointing_matches_eager(use_reentrant):
    import _zoo

    model = _zoo.build("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    m2 = copy.deepcopy(model)
    o, o2 = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(m2.parameters(), lr=1e-3)
    cf = tt.compile(_zoo.train_step)
    for b in _zoo.batches("llama", 2):
        torch.testing.assert_close(cf(model, o, b), _zoo.train_step(m2, o2, b))
    for a, b in zip(model.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b)
    assert _recomputed_lines(tt.last_traces(cf)[-1])
