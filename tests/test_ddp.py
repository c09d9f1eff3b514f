"""DistributedDataParallel around a compiled module (DDP's hooks reduce) and inside a compiled whole step (the trace reduces)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import run_ranks  # noqa: E402


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """Both scenarios' results, from one pair of ranks forked from this process (tests/_ddp_ranks.py)."""
    out = tmp_path_factory.mktemp("ddp")
    run_ranks("_ddp_ranks", out)
    return out


def test_ddp_allreduces_gradients_of_a_compiled_module(out):
    r0, r1 = (torch.load(out / "compiled" / f"rank{r}.pt") for r in (0, 1))
    for r in (r0, r1):
        # Same losses and parameters as eager DDP on each rank ...
        torch.testing.assert_close(torch.stack(r["compiled"]), torch.stack(r["eager"]))
        for a, b in zip(r["compiled_params"], r["eager_params"]):
            torch.testing.assert_close(a, b)
    # ... different data per rank, yet identical (all-reduced) gradients and parameters on both.
    assert not torch.allclose(torch.stack(r0["compiled"]), torch.stack(r1["compiled"]))
    for g0, g1 in zip(r0["grads"], r1["grads"]):
        for a, b in zip(g0, g1):
            torch.testing.assert_close(a, b)
    for a, b in zip(r0["compiled_params"], r1["compiled_params"]):
        torch.testing.assert_close(a, b)


def test_ddp_inside_a_compiled_whole_step(out):
    r0, r1 = (torch.load(out / "whole_step" / f"rank{r}.pt") for r in (0, 1))
    for case in ("adamw", "sgd", "closure", "accumulate"):
        for r in (r0, r1):
            # The same losses and parameters as eager DDP on each rank (AdamW: float32 rounding of the fused kernel) ...
            torch.testing.assert_close(torch.stack(r[case]["compiled"]), torch.stack(r[case]["eager"]))
            for a, b in zip(r[case]["compiled_params"], r[case]["eager_params"]):
                torch.testing.assert_close(a, b)
        # ... different data per rank, yet gradients averaged: identical parameters on both ranks.
        assert not torch.allclose(torch.stack(r0[case]["compiled"]), torch.stack(r1[case]["compiled"]))
        for a, b in zip(r0[case]["compiled_params"], r1[case]["compiled_params"]):
            torch.testing.assert_close(a, b)
    assert r0["adamw"]["thin_calls"] == 3  # calls 1 and 2 validate (lazy optimizer state), then thin mode
    # no_sync() on the first micro-batch: the averaged gradient is the sum of both, as in eager.
    for r in (r0, r1):
        for ge, gc in zip(r["accumulate"]["eager_grads"], r["accumulate"]["compiled_grads"]):
            for a, b in zip(ge, gc):
                torch.testing.assert_close(b, a)
        torch.testing.assert_close(*r["eval"])
    for r in (r0, r1):
        for a, b in zip(r["thin_no_sync"]["eager_grads"], r["thin_no_sync"]["compiled_grads"]):
            torch.testing.assert_close(b, a)
        assert r["thin_no_sync"]["invalidations"]
    errors = r0["errors"]
    assert "communication hook" in errors["comm_hook"] and "DDP(tt.compile(model))" in errors["comm_hook"]
    assert "backward is not in the same function" in errors["forward_only"]
    assert "unused.weight" in errors["unused"] and "got no gradient" in errors["unused"]
    assert "broadcast_buffers=False" in errors["buffers"]
