"""Peak memory of whole training steps with dropout, against eager PyTorch (docs/memory.md).

Dropout draws its noise with ``ttex.bernoulli``: a new tensor of its input's shape.  The kept-buffer plan
(executors/buffers.py) had taken the draws for their input's memory and counted none of their bytes, so the arena
it sized for the backward sat on top of the forward's draws: an MLP's step peaked 1.16x eager's."""
from __future__ import annotations

import os
import sys

import torch

import thunder_train as tt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _models import train_step as _step  # noqa: E402
from _peak import peak_call_bytes_all_threads as peak_bytes  # noqa: E402


def _mlp(p):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Dropout(p), torch.nn.Linear(128, 32),
                            torch.nn.ReLU(), torch.nn.Linear(32, 10))
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def test_dropout_mlp_step_peaks_at_most_eagers_with_eagers_values(p=0.1):
    torch.manual_seed(1)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    runs = {}
    for mode in ("eager", "tt"):
        m, opt = _mlp(p)
        fn = _step if mode == "eager" else tt.compile(_step, thin=True, fusion=None)
        torch.manual_seed(2)  # the same draws in both runs
        losses = [fn(m, opt, x, y).item() for _ in range(2)]  # the compiled program traced, then run
        peak = peak_bytes(lambda: fn(m, opt, x, y), None if mode == "eager" else fn)
        runs[mode] = (peak, losses, [t.detach().clone() for t in m.parameters()], torch.get_rng_state())
    (eager_peak, eager_losses, eager_params, eager_rng), (tt_peak, tt_losses, tt_params, tt_rng) = runs["eager"], runs["tt"]
    assert tt_losses == eager_losses
    for a, b in zip(tt_params, eager_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert torch.equal(tt_rng, eager_rng)  # the generator ends where eager's does
    assert 0 < tt_peak <= eager_peak, (tt_peak, eager_peak)
