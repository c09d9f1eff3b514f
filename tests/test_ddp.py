"""DistributedDataParallel around a compiled module: DDP's gradient reduction still runs."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ddp_allreduces_gradients_of_a_compiled_module(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "_ddp_compiled.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
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
