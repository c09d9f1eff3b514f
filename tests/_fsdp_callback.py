"""FSDP2 under Lightning: ``ModelParallelStrategy`` (fully_shard in ``configure_model``) on 2 CPU ranks (gloo),
the plain Trainer against ``ThunderCallback(thin=True, fuse_optimizer=True)`` (the whole step compiled: forward,
backward with its reduce-scatters, AdamW) and against ``ThunderCallback(thin=True)`` (the training_step alone, its
backward outside the program: refused with a clear error).

``run(rank, world)`` runs in a rank forked by tests/_fsdp_whole_step.py (tests/_dist.py), after its other FSDP2
scenarios: Lightning launches no process and takes the gloo group that exists (tests/_lightning_fit.py: in_rank),
so the scenario costs no interpreter start, no second import of lightning and no rendezvous of its own.
"""
from __future__ import annotations

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from _dist import refused
from _lightning_fit import fit, in_rank
from thunder_train import ThunderCallback


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 33), nn.GELU(), nn.Linear(33, 4))

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def train(callbacks, **trainer_kw):
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo")
    trainer, model, losses = fit(Net, strategy, callbacks, samples=96, batch_size=8, max_steps=6, **trainer_kw)
    local = lambda p: (p._local_tensor if isinstance(p, DTensor) else p).detach().clone()  # noqa: E731
    return {"losses": losses, "params": [local(p) for p in model.parameters()],
            "param_types": sorted({type(p).__name__ for p in model.parameters()})}


def run(rank, world):
    """The results of this rank (``rank`` of ``world`` in the current gloo process group)."""
    with in_rank(rank, world):
        results = {"eager": train([])}
        cb = ThunderCallback(thin=True, fuse_optimizer=True)
        results["fused"] = train([cb])
        results["fused"]["programs"] = sorted(cb.steps["training_step"].programs)
        results["fused"]["thin_calls"] = cb.compiled().stats.thin_calls
        results["split"] = refused(lambda: train([ThunderCallback(thin=True)]))
        # clipping by total norm would need every rank's shards of the gradients: refused at setup
        results["clip_norm"] = refused(lambda: train([ThunderCallback(thin=True, fuse_optimizer=True)], gradient_clip_val=0.05))
        return results
