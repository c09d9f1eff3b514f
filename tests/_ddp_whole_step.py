"""A whole training step with DistributedDataParallel *inside* the compiled function, on 2 CPU processes.

Run by tests/test_ddp.py through tests/_ddp_ranks.py (or alone: ``python tests/_ddp_whole_step.py OUT_DIR``).  Each rank trains eager
DDP and the same step compiled (thin mode) on its own shard of the data, saves losses, gradients and
parameters to ``OUT_DIR/rank{r}.pt``, plus the messages of the configurations that must be refused.
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
from _dist import refused, spawn
from _models import train_step


def make_model():
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))


class OneHeadUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x):
        return self.used(x)


def accumulate_step(model, opt, x1, y1, x2, y2):
    """Two micro-batches: the first without synchronisation (no_sync), the second averages the sum."""
    with model.no_sync():
        F.cross_entropy(model(x1), y1).backward()
    loss = F.cross_entropy(model(x2), y2)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    return loss, grads


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
}


def run(rank, world, out_dir):
    torch.manual_seed(0)
    base = make_model()
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    data = [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(6)]
    result = {}
    for name, make_opt in OPTIMIZERS.items():
        eager, compiled = DDP(copy.deepcopy(base)), DDP(copy.deepcopy(base))
        o1, o2 = make_opt(eager.parameters()), make_opt(compiled.parameters())
        step = tt.compile(train_step, thin=True)
        r = result[name] = {"eager": [], "compiled": []}
        for x, y in data:
            r["eager"].append(train_step(eager, o1, x, y).detach())
            r["compiled"].append(step(compiled, o2, x, y))
        r["eager_params"] = [p.detach().clone() for p in eager.parameters()]
        r["compiled_params"] = [p.detach().clone() for p in compiled.parameters()]
        r["thin_calls"] = tt.compile_stats(step).thin_calls

    # The DDP model read from a closure, not passed in (the optimizer must be an argument).
    eager, compiled = DDP(copy.deepcopy(base)), DDP(copy.deepcopy(base))
    o1, o2 = torch.optim.SGD(eager.parameters(), lr=0.1), torch.optim.SGD(compiled.parameters(), lr=0.1)
    step = tt.compile(lambda opt, x, y: train_step(compiled, opt, x, y))
    r = result["closure"] = {"eager": [], "compiled": []}
    for x, y in data:
        r["eager"].append(train_step(eager, o1, x, y).detach())
        r["compiled"].append(step(o2, x, y))
    r["eager_params"] = [p.detach().clone() for p in eager.parameters()]
    r["compiled_params"] = [p.detach().clone() for p in compiled.parameters()]

    eager, compiled = DDP(copy.deepcopy(base)), DDP(copy.deepcopy(base))
    o1, o2 = torch.optim.SGD(eager.parameters(), lr=0.1), torch.optim.SGD(compiled.parameters(), lr=0.1)
    step = tt.compile(accumulate_step)
    r = result["accumulate"] = {"eager": [], "compiled": [], "eager_grads": [], "compiled_grads": []}
    for (x1, y1), (x2, y2) in zip(data[::2], data[1::2]):
        loss, grads = accumulate_step(eager, o1, x1, y1, x2, y2)
        r["eager"].append(loss.detach())
        r["eager_grads"].append(grads)
        loss, grads = step(compiled, o2, x1, y1, x2, y2)
        r["compiled"].append(loss)
        r["compiled_grads"].append(grads)
    r["eager_params"] = [p.detach().clone() for p in eager.parameters()]
    r["compiled_params"] = [p.detach().clone() for p in compiled.parameters()]

    # Thin mode notices no_sync() around a call: a synchronising call after two that were not re-validates.
    def forward_backward(model, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    eager, compiled = DDP(copy.deepcopy(base)), DDP(copy.deepcopy(base))
    step = tt.compile(forward_backward, thin=True)
    for i, (x, y) in enumerate(data[:4]):
        sync = i == 3
        for m, fn in ((eager, forward_backward), (compiled, step)):
            if sync:
                fn(m, x, y)
            else:
                with m.no_sync():
                    fn(m, x, y)
    result["thin_no_sync"] = {"eager_grads": [p.grad.clone() for p in eager.parameters()],
                              "compiled_grads": [p.grad.clone() for p in compiled.parameters()],
                              "invalidations": tt.compile_stats(step).thin_invalidations}

    # Evaluation through DDP under no_grad needs no backward.
    x, y = data[0]
    with torch.no_grad():
        result["eval"] = (tt.compile(lambda m, x: m(x))(compiled, x), compiled(x))

    # Refused, with a clear error, before any collective runs.
    x, y = data[0]
    hooked = DDP(copy.deepcopy(base))
    hooked.register_comm_hook(None, lambda state, bucket: bucket.buffer())
    forward_only = DDP(copy.deepcopy(base))
    with_unused = DDP(OneHeadUnused())
    with_buffers = DDP(nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4)))
    result["errors"] = {
        "comm_hook": refused(tt.compile(train_step), hooked, torch.optim.SGD(hooked.parameters(), lr=0.1), x, y),
        "forward_only": refused(tt.compile(lambda m, x, y: F.cross_entropy(m(x), y)), forward_only, x, y),
        "unused": refused(tt.compile(lambda m, x: m(x).sum().backward()), with_unused, x),
        "buffers": refused(tt.compile(train_step), with_buffers, torch.optim.SGD(with_buffers.parameters(), lr=0.1), x, y),
    }
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    spawn(run, sys.argv[1])
