"""DDP on 2 CPU processes (gloo) around ``tt.compile(model)``: gradients still all-reduced.

Run by tests/test_ddp.py through tests/_ddp_ranks.py (or alone: ``python tests/_ddp_compiled.py OUT_DIR``).  Each rank trains
eager ``DDP(model)`` and ``DDP(tt.compile(model_copy))`` on its own shard of the data for a
few steps and saves losses, gradients and parameters to ``OUT_DIR/rank{r}.pt``.
"""
from __future__ import annotations

import copy
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import thunder_train as tt
from _dist import spawn


def run(rank, world, out_dir):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
    eager = DDP(copy.deepcopy(base))
    compiled = DDP(tt.compile(copy.deepcopy(base)))
    o1 = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    o2 = torch.optim.SGD(compiled.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    result = {"eager": [], "compiled": [], "grads": []}
    for _ in range(4):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        for name, model, opt in (("eager", eager, o1), ("compiled", compiled, o2)):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if name == "compiled":
                result["grads"].append([p.grad.clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
            result[name].append(loss.detach())
    result["eager_params"] = [p.detach().clone() for p in eager.parameters()]
    result["compiled_params"] = [p.detach().clone() for p in compiled.parameters()]
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    spawn(run, sys.argv[1])
