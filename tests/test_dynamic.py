"""Symbolic sizes (``tt.compile(fn, dynamic=True)``): a new batch size or sequence length reuses the program."""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import thunder_train as tt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
from gpt import GPT, GPTConfig  # noqa: E402
from _models import train_step, without_key_bias  # noqa: E402


def shape_queries(trc):
    return [b for b in trc.bound_symbols if b.sym.name == "shape" or getattr(b.sym, "print_name", "") == "ttex.shape"]


def test_reshape_with_size_arithmetic_reuses_the_program_and_queries_once():
    def f(t, w):
        y = t.reshape(t.size(0), -1) @ w
        return torch.relu(y).sum(1) / t.shape[0]

    cf = tt.compile(f, dynamic=True)
    w = torch.randn(12, 5)
    for b in (4, 7, 9, 2):
        t = torch.randn(b, 3, 4)
        torch.testing.assert_close(cf(t, w), f(t, w))
    stats = tt.compile_stats(cf)
    assert stats.cache_misses == 1 and stats.cache_hits == 3
    final = tt.last_traces(cf)[-1]
    queries = shape_queries(final)
    # One shape query for t, first line of the program; sizes are names, not numbers.
    assert len(queries) == 1 and queries[0].args[0].name == "t" and final.bound_symbols[0] is queries[0]
    src = final.python_source()
    assert "reshape(t, t_size0, -1)" in src and "div(t3, t_size0)" in src


def test_unused_shape_queries_are_removed():
    cf = tt.compile(lambda x: x.sin() * 2, dynamic=True)
    for b in (3, 5):
        x = torch.randn(b, 4)
        torch.testing.assert_close(cf(x), x.sin() * 2)
    assert not shape_queries(tt.last_traces(cf)[-1]) and tt.compile_stats(cf).cache_misses == 1


def test_python_decisions_on_sizes_become_checks():
    def f(x):
        if x.shape[0] > 4:
            return x * 2
        return x * 3

    cf = tt.compile(f, dynamic=True)
    for b in (6, 8, 3, 2, 7, 4):
        x = torch.randn(b, 2)
        torch.testing.assert_close(cf(x), f(x))
    stats = tt.compile_stats(cf)
    # Two programs (sizes > 4 and ≤ 4); the retrace names the decision.
    assert stats.cache_misses == 2 and "x.shape[0] > 4 was True, now False" in stats.retrace_reasons[0]


def test_size_one_is_specialised():
    cf = tt.compile(lambda x, y: x + y, dynamic=True)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    cf(x, y)
    x1 = torch.randn(1, 4)
    torch.testing.assert_close(cf(x1, y), x1 + y)
    assert tt.compile_stats(cf).cache_misses == 2  # size 1 broadcasts: its own program


def gpt():
    return GPT(GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=16))


def test_gpt_training_step_in_thin_mode_across_batch_sizes_and_lengths():
    torch.manual_seed(0)
    m1 = gpt()
    m2 = copy.deepcopy(m1)
    o1, o2 = torch.optim.AdamW(m1.parameters(), lr=1e-2), torch.optim.AdamW(m2.parameters(), lr=1e-2)
    step = tt.compile(train_step, dynamic=True, thin=True)
    g = torch.Generator().manual_seed(0)
    for B, T in [(4, 8), (4, 8), (3, 8), (5, 6), (2, 7), (6, 8), (4, 5)]:
        x = torch.randint(0, 13, (B, T), generator=g)
        y = torch.roll(x, -1, 1)
        torch.testing.assert_close(step(m2, o2, x, y), train_step(m1, o1, x, y).detach())
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(without_key_bias(n, b), without_key_bias(n, a), atol=1e-5, rtol=1e-4)
    stats = tt.compile_stats(step)
    # Call 1 creates the optimizer state (a second program); then every size reuses the bound program.
    assert stats.cache_misses == 2 and stats.thin_calls == 4 and not stats.thin_invalidations


def test_compiled_module_backward_across_sizes():
    torch.manual_seed(0)
    m1 = gpt()
    m2 = copy.deepcopy(m1)
    cm = tt.compile(m2, dynamic=True)
    g = torch.Generator().manual_seed(0)
    for B, T in [(4, 8), (3, 8), (5, 6), (2, 7)]:
        x = torch.randint(0, 13, (B, T), generator=g)
        F.cross_entropy(m1(x).flatten(0, 1), x.flatten()).backward()
        F.cross_entropy(cm(x).flatten(0, 1), x.flatten()).backward()
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4)
    assert tt.compile_stats(cm).cache_misses == 1


def test_thin_mode_runs_a_new_rank_or_dtype_through_the_full_path():
    # Issue 26: a call the bound program does not accept takes the full path (never a ThinModeError where eager
    # runs), which traces the entry for it and binds it; the first binding comes back with its inputs.
    cf = tt.compile(lambda x: x * 2, dynamic=True, thin=True)
    for b in (3, 4, 5):
        cf(torch.randn(b, 2))
    assert cf.is_thin_bound
    stats = tt.compile_stats(cf)
    for x in (torch.randn(3, 2, dtype=torch.float64), torch.randn(3, 2, 2)):
        for _ in range(2):
            torch.testing.assert_close(cf(x), x * 2)
    assert stats.cache_misses == 3 and stats.thin_fallbacks == 2 and stats.thin_binds == 3
    calls = stats.full_calls
    x = torch.randn(6, 2)
    torch.testing.assert_close(cf(x), x * 2)  # the float32 rank-2 binding accepts it: switched to, thin
    torch.testing.assert_close(cf(x), x * 2)
    assert stats.full_calls == calls and stats.thin_binds == 3 and stats.cache_misses == 3
