"""DDP on 2 CPU processes (gloo): the plain Trainer, then the same run with ThunderCallback(thin=True), with
fuse_optimizer=True (the program averages the gradients), split at on_after_backward, and with gradient
accumulation.

Run by tests/test_callback.py::test_ddp_two_cpu_processes as ``main(OUT_DIR)`` (tests/_dist.py: run_ranks; or
``python tests/_ddp_callback.py OUT_DIR``): two gloo ranks forked from the calling process, in which Lightning
launches no process and takes the existing group (tests/_lightning_fit.py: in_rank).  Each rank writes
``OUT_DIR/rank{r}.pt`` with the losses and final parameters of every run.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import lightning as L
from lightning.pytorch.strategies import DDPStrategy

from _dist import spawn
from _lightning_fit import fit, in_rank
from thunder_train import ThunderCallback


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class GradProbe(L.Callback):
    """Overrides on_after_backward: a fused step splits there; the hook must see averaged gradients."""

    def __init__(self):
        self.grads = []

    def on_after_backward(self, trainer, pl_module):
        self.grads.append(pl_module.net[0].weight.grad.detach().clone())


def run(callbacks, accumulate=1):
    trainer, model, losses = fit(Net, DDPStrategy(process_group_backend="gloo"), callbacks, samples=128, batch_size=16,
                                 max_steps=12, accumulate=accumulate)
    probes = [cb for cb in callbacks if isinstance(cb, GradProbe)]
    return trainer, {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
                     "logged": float(trainer.callback_metrics["train_loss"]),
                     "grads": torch.stack(probes[0].grads) if probes else None}


def run_rank(rank, world, out_dir):
    results = {}
    with in_rank(rank, world):
        for name, callbacks, accumulate in (
                ("eager", [GradProbe()], 1), ("thunder", [ThunderCallback(thin=True)], 1),
                ("fused_split", [ThunderCallback(thin=True, fuse_optimizer=True), GradProbe()], 1),
                ("fused", [ThunderCallback(thin=True, fuse_optimizer=True)], 1),
                ("eager_acc", [], 2), ("fused_acc", [ThunderCallback(thin=True, fuse_optimizer=True)], 2)):
            trainer, results[name] = run(callbacks, accumulate)
            assert trainer.global_rank == rank and trainer.world_size == world
            if callbacks and isinstance(callbacks[0], ThunderCallback):
                results[name]["thin_calls"] = callbacks[0].compiled().stats.thin_calls
                results[name]["thin_invalidations"] = callbacks[0].compiled().stats.thin_invalidations[:6]
                results[name]["programs"] = sorted(callbacks[0].steps["training_step"].programs)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def main(out_dir):
    spawn(run_rank, out_dir)


if __name__ == "__main__":
    main(sys.argv[1])
