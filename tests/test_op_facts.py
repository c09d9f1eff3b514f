"""Every fact about an op hangs off its Symbol and is declared where the op is defined (docs/architecture.md)."""
from __future__ import annotations

import inspect
import pathlib

import torch
import torch.nn.functional as F

import thunder_train as tt
from thunder_train.compiler.torchlang import nn as tnn, registry


def _file(obj) -> str:
    return pathlib.Path(inspect.getsourcefile(inspect.unwrap(obj))).as_posix().split("thunder_train/")[-1]


def test_gelus_story_is_in_two_files():
    gelu = registry.lookup(F.gelu)
    assert gelu is tnn.gelu
    facts = [gelu.fn, gelu.grad_rule[0], gelu.torch_direct_vjp]
    assert {_file(f) for f in facts} == {"compiler/torchlang/nn.py", "compiler/executors/torch_impls.py"}
    assert {"fusible", "fused_backward"} <= gelu.tags and gelu.torch_impl is F.gelu and gelu.autocast is None


def test_declared_facts_drive_the_passes():
    # fused_backward: one gelu_vjp line, run by the declared direct kernel; fusible: Inductor takes the call.
    x = torch.randn(8, 8, requires_grad=True)
    cf = tt.compile(lambda x: F.gelu(x * 2 + 1).sum())
    cf(x).backward()
    bw = str(tt.last_backward_traces(cf)[-1])
    assert "ttex.gelu_vjp" in bw
    torch.testing.assert_close(x.grad, torch.autograd.grad(F.gelu(x * 2 + 1).sum(), x)[0])
    cf = tt.compile(lambda x: F.gelu(x * 2 + 1) - x, fusion="inductor")
    with torch.no_grad():
        torch.testing.assert_close(cf(x), F.gelu(x * 2 + 1) - x)
    assert "gelu" in str(tt.last_traces(cf)[-1]).split("fused by Inductor", 1)[-1].splitlines()[0]


def test_lowered_lines_keep_their_symbol():
    cf = tt.compile(lambda x: torch.sin(x) + 1)
    cf(torch.randn(3))
    sources = [b.source for b in tt.last_traces(cf)[-1].bound_symbols if b.source is not None]
    assert registry.lookup(torch.sin) in sources
    assert all(s.module in ("ltorch", "prims") for s in sources)
